"""Model zoo: GPT-2/GPT-3 and Llama 2/3 built on the meta device, with published presets.

from autoplan.models import preset
model = preset("llama3-8b")                    # meta device: free, for planning
model = preset("gpt2-small", num_layers=2, device="cpu")  # real, initialised weights
"""

from autoplan.models._common import ModelSpecError
from autoplan.models.gpt import GPT, GPTConfig, gpt
from autoplan.models.llama import Llama, LlamaConfig, llama
from autoplan.models.presets import ModelConfig, list_presets, preset, preset_config

__all__ = [
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "ModelSpecError",
    "gpt",
    "list_presets",
    "llama",
    "preset",
    "preset_config",
]
