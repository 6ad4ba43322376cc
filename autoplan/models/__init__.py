"""Model zoo: GPT-2/GPT-3, Llama 2/3 and mixture-of-experts decoders (Mixtral, DeepSeekMoE)
built on the meta device, with published presets.

from autoplan.models import preset
model = preset("llama3-8b")                    # meta device: free, for planning
model = preset("gpt2-small", num_layers=2, device="cpu")  # real, initialised weights
"""

from autoplan.models._common import ModelSpecError
from autoplan.models.gpt import GPT, GPTConfig, gpt
from autoplan.models.llama import Llama, LlamaConfig, llama
from autoplan.models.moe import GroupedExperts, MoE, MoEConfig, MoEFeedForward, moe
from autoplan.models.presets import ModelConfig, list_presets, preset, preset_config

__all__ = [
    "GPT",
    "GPTConfig",
    "GroupedExperts",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "MoEFeedForward",
    "ModelConfig",
    "ModelSpecError",
    "gpt",
    "list_presets",
    "llama",
    "moe",
    "preset",
    "preset_config",
]
