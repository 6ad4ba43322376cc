"""Named architectures of published models, as frozen configs; `preset()` builds one.

Every number carries its source. Only the architecture is reproduced: no weights, no tokenizer.
Overrides replace config fields verbatim (`preset("gpt3-175b", num_layers=2)`); derived sizes are
not recomputed, so overriding `hidden_size` keeps the preset's `ffn_hidden_size`: pass both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autoplan.models._common import ModelSpecError, build
from autoplan.models.gpt import GPT, GPTConfig
from autoplan.models.llama import Llama, LlamaConfig
from autoplan.models.moe import MoE, MoEConfig
from cost_model.messages import shown

__all__ = ["list_presets", "preset", "preset_config"]

ModelConfig = GPTConfig | LlamaConfig | MoEConfig

# GPT-2: Radford et al. 2019, Table 2 (layers, d_model) and the released Hugging Face configs
# (openai-community/gpt2{,-medium,-large,-xl}: n_head, n_positions = 1024, vocab_size = 50257).
_GPT2_VOCAB = 50257
_GPT2_SEQ_LEN = 1024
# GPT-3: Brown et al. 2020, Table 2.1 (n_layers, d_model, n_heads, d_head), n_ctx = 2048 for all
# sizes (section 2.1), GPT-2's architecture and BPE vocabulary of 50257 (section 2.1: "We use the
# same model and architecture as GPT-2"). Not modelled: GPT-3 alternates dense and locally banded
# sparse attention layers; we use dense causal attention in every layer (same parameters).
# The vocabulary is padded to 51200 as Megatron-LM trains GPT-3-style models (Narayanan et al.
# 2021, section 5.1: "vocabulary size ... 51,200 (multiple of 1024)"; Megatron's
# --make-vocab-size-divisible-by pads the embedding so tensor parallelism splits it evenly).
# It adds (51200 - 50257) * d_model parameters, under 0.15% for every size.
_GPT3_VOCAB = 51200
_GPT3_SEQ_LEN = 2048
# Llama 2: Touvron et al. 2023, Table 1 (context 4096; GQA for 34B/70B) and Meta's released
# params.json / HF configs (dim, n_layers, n_heads, n_kv_heads, vocab 32000, norm_eps 1e-5,
# rope_theta 10000; the FFN size is HF's intermediate_size, which params.json derives from dim,
# multiple_of and ffn_dim_multiplier).
_LLAMA2_VOCAB = 32000
_LLAMA2_SEQ_LEN = 4096
# Llama 3: Llama Team 2024, "The Llama 3 Herd of Models", Table 3 (layers, model dim, FFN dim,
# heads, 8 kv heads, RoPE theta 500000; vocab "128K") and Meta's released configs (exact vocab
# 128256). Pre-training sequence length 8192 (section 3.4.1); the 128K context of Llama 3.1 came
# from a final long-context stage: plan it with the `-128k` presets (or `seq_len=131072`).
_LLAMA3_VOCAB = 128256
_LLAMA3_SEQ_LEN = 8192
_LLAMA3_ROPE_THETA = 500000.0
# Llama 3 long context: Sec. 3.4.2 (long-context pre-training raises the context in stages from
# 8K to 128K tokens; 128K = 131072) and Table 4 (the 405B trained at sequence length 131,072 with
# 16-way context parallelism). The `-32k`/`-64k`/`-128k` presets are the same architectures at
# those sequence lengths (RoPE scaling of Llama 3.1 changes no shape: see `autoplan.models.llama`).
_LONG_CONTEXT = {"32k": 32768, "64k": 65536, "128k": 131072}


def _mixtral_8x7b() -> MoEConfig:
    # Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088), Table 1 (dim 4096, 32 layers,
    # head_dim 128, hidden_dim 14336, 32 heads, 8 kv heads, context 32768, vocab 32000, 8
    # experts, top-2) and section 2.1 (SwiGLU experts, softmax over the top-2 logits, i.e. the
    # renormalised top-2 probabilities). The released config.json of mistralai/Mixtral-8x7B-v0.1
    # (read from its verbatim copy MIXTRAL_8X7B_CONFIG in NVIDIA/TensorRT-LLM
    # tests/unittest/_torch/modeling/test_modeling_mixtral.py; the Hub was not reachable):
    # num_local_experts 8, num_experts_per_tok 2, intermediate_size 14336,
    # max_position_embeddings 32768, rms_norm_eps 1e-05, rope_theta 1e6,
    # router_aux_loss_coef 0.02, tie_word_embeddings false. Not modelled: no difference that
    # changes a shape (Mixtral has no sliding window: sliding_window null).
    return MoEConfig(
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        seq_len=32768,
        vocab_size=32000,
        ffn_hidden_size=14336,  # unused: no dense layer (intermediate_size of the config)
        num_experts=8,
        top_k=2,
        moe_ffn_hidden_size=14336,
        num_shared_experts=0,
        num_dense_layers=0,
        router_aux_loss_coef=0.02,
        norm_topk_prob=True,
        rope_theta=1000000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
    )


def _deepseek_moe_16b() -> MoEConfig:
    # DeepSeekMoE 16B (Dai et al. 2024, arXiv:2401.06066; github.com/deepseek-ai/DeepSeek-MoE
    # README: 16.4B parameters, sequence length 4096). The released config.json of
    # deepseek-ai/deepseek-moe-16b-base (read from a verbatim copy in public code; the Hub was not
    # reachable): num_hidden_layers 28, hidden_size 2048, num_attention_heads 16,
    # num_key_value_heads 16, intermediate_size 10944 (the dense first layer:
    # first_k_dense_replace 1), n_routed_experts 64, num_experts_per_tok 6, n_shared_experts 2,
    # moe_intermediate_size 1408, norm_topk_prob false, scoring_func softmax, vocab_size 102400,
    # max_position_embeddings 4096, rms_norm_eps 1e-06, rope_theta 10000, tie_word_embeddings
    # false. The aux loss coefficient is the remote code's default (configuration_deepseek.py:
    # aux_loss_alpha = 0.001, seq_aux = True); DeepSeek computes it per sequence, we per
    # micro-batch (same value for one sequence; no shape or FLOP changes).
    return MoEConfig(
        num_layers=28,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=16,
        seq_len=4096,
        vocab_size=102400,
        ffn_hidden_size=10944,
        num_experts=64,
        top_k=6,
        moe_ffn_hidden_size=1408,
        num_shared_experts=2,
        num_dense_layers=1,
        router_aux_loss_coef=0.001,
        norm_topk_prob=False,
        rope_theta=10000.0,
        norm_eps=1e-6,
        tie_embeddings=False,
    )


def _gpt2(num_layers: int, hidden_size: int, num_heads: int) -> GPTConfig:
    return GPTConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        seq_len=_GPT2_SEQ_LEN,
        vocab_size=_GPT2_VOCAB,
        ffn_hidden_size=4 * hidden_size,  # GPT-2 n_inner = 4 * n_embd
    )


def _gpt3(num_layers: int, hidden_size: int, num_heads: int) -> GPTConfig:
    return GPTConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        seq_len=_GPT3_SEQ_LEN,
        vocab_size=_GPT3_VOCAB,
        ffn_hidden_size=4 * hidden_size,  # Brown et al. 2020, section 2.1: d_ff = 4 * d_model
    )


def _llama(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    ffn_hidden_size: int,
    *,
    llama3: bool,
) -> LlamaConfig:
    return LlamaConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        seq_len=_LLAMA3_SEQ_LEN if llama3 else _LLAMA2_SEQ_LEN,
        vocab_size=_LLAMA3_VOCAB if llama3 else _LLAMA2_VOCAB,
        ffn_hidden_size=ffn_hidden_size,
        rope_theta=_LLAMA3_ROPE_THETA if llama3 else 10000.0,
        norm_eps=1e-5,  # params.json norm_eps / HF rms_norm_eps, Llama 2 and 3
        tie_embeddings=False,  # HF tie_word_embeddings = false for all of these
    )


_PRESETS: dict[str, ModelConfig] = {
    # name: (layers, hidden, heads[, kv heads, ffn])
    "gpt2-small": _gpt2(12, 768, 12),  # 124M
    "gpt2-medium": _gpt2(24, 1024, 16),  # 355M
    "gpt2-large": _gpt2(36, 1280, 20),  # 774M
    "gpt2-xl": _gpt2(48, 1600, 25),  # 1558M
    # Table 2.1 lists 24 heads of d_head 128 for GPT-3 XL, but 24 * 128 != 2048: we keep
    # d_model = 2048 and d_head = 128, hence 16 heads (the head count changes no parameter count).
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),  # d_head 80
    "gpt3-6.7b": _gpt3(32, 4096, 32),  # d_head 128
    # Table 2.1 prints d_model = 5140, not divisible by its 40 heads of d_head 128: evidently a
    # typo for 40 * 128 = 5120, which we use (12.85B parameters; 5140 would give 12.95B).
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),  # d_head 128
    # Llama 2 7B/13B: multi-head attention; 70B: GQA with 8 kv heads (Touvron et al. Table 1).
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, llama3=False),  # 6.74B
    "llama2-13b": _llama(40, 5120, 40, 40, 13824, llama3=False),  # 13.0B
    "llama2-70b": _llama(80, 8192, 64, 8, 28672, llama3=False),  # 69.0B
    # Llama 3 Herd of Models, Table 3: every size has 8 kv heads.
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, llama3=True),  # 8.03B
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, llama3=True),  # 70.6B
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, llama3=True),  # 405.85B
    # Long-context variants (see _LONG_CONTEXT): the base architecture at 32K-128K tokens.
    "llama3-8b-32k": dataclasses.replace(
        _llama(32, 4096, 32, 8, 14336, llama3=True), seq_len=_LONG_CONTEXT["32k"]
    ),
    "llama3-8b-64k": dataclasses.replace(
        _llama(32, 4096, 32, 8, 14336, llama3=True), seq_len=_LONG_CONTEXT["64k"]
    ),
    "llama3-8b-128k": dataclasses.replace(
        _llama(32, 4096, 32, 8, 14336, llama3=True), seq_len=_LONG_CONTEXT["128k"]
    ),
    "llama3-70b-128k": dataclasses.replace(
        _llama(80, 8192, 64, 8, 28672, llama3=True), seq_len=_LONG_CONTEXT["128k"]
    ),
    "llama3-405b-128k": dataclasses.replace(
        _llama(126, 16384, 128, 8, 53248, llama3=True), seq_len=_LONG_CONTEXT["128k"]
    ),
    # Mixture of experts (see _mixtral_8x7b and _deepseek_moe_16b for the sources).
    "mixtral-8x7b": _mixtral_8x7b(),  # 46.70B, 8 experts, top-2
    "deepseek-moe-16b": _deepseek_moe_16b(),  # 16.38B, 64 routed + 2 shared experts, top-6
}


def list_presets() -> list[str]:
    """Names accepted by `preset()` and `preset_config()`, in registry order."""
    return list(_PRESETS)


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    """The config of preset `name`, with `overrides` replacing fields (validated again)."""
    return _resolve(name, overrides, extra_keys=())


def _resolve(name: str, overrides: dict[str, Any], extra_keys: tuple[str, ...]) -> ModelConfig:
    try:
        config = _PRESETS[name]
    except KeyError:
        raise ModelSpecError(
            f"unknown model preset {shown(name)}; valid presets: {', '.join(_PRESETS)}"
        ) from None
    fields = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ModelSpecError(
            f"unknown override key(s) {shown(unknown)} for preset {shown(name)} "
            f"({type(config).__name__}); valid keys: {', '.join([*fields, *extra_keys])}"
        )
    if (
        "head_dim" in fields
        and "head_dim" not in overrides
        and {"hidden_size", "num_heads"} & set(overrides)
        and config.head_dim == config.hidden_size // config.num_heads
    ):
        # a preset whose heads are hidden / num_heads wide keeps that rule under new sizes
        overrides = {**overrides, "head_dim": None}
    return dataclasses.replace(config, **overrides)


def preset(
    name: str,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> GPT | Llama | MoE:
    """Build preset `name` on `device` (meta by default), with config field `overrides`."""
    config = _resolve(name, overrides, extra_keys=("device", "dtype"))
    if isinstance(config, GPTConfig):
        gpt_config = config
        return build(lambda: GPT(gpt_config), device, dtype)
    if isinstance(config, MoEConfig):
        moe_config = config
        return build(lambda: MoE(moe_config), device, dtype)
    llama_config = config
    return build(lambda: Llama(llama_config), device, dtype)
