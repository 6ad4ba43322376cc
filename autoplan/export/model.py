"""The sizes of a plan's model, read from the zoo config its ``model.name`` spec names.

Launch configs restate the architecture (Megatron-LM's ``--num-layers``, ``--hidden-size``, ...;
torchtitan's model flavor), so an export needs the model, not only the plan. A plan made by
`autoplan plan` or `manual_plan` on a zoo model records its spec (``llama3-8b``,
``gpt:num_layers=2,...``); any other name raises `ModelSpecError` asking for ``--model``.
"""

from __future__ import annotations

import importlib
from typing import Any

from autoplan.contract.errors import ModelSpecError
from autoplan.contract.plan import Plan
from autoplan.export._common import ModelDims, MoEDims
from cost_model.messages import shown


def plan_model_spec(plan: Plan, model: str | None) -> str:
    """The model spec to export with: ``model`` if given, else the plan's ``model.name``."""
    if model is not None:
        return model
    if plan.model is None:
        raise ModelSpecError(
            "the plan has no model section, and a launch config restates the model's sizes; "
            "pass the model it was made for (--model NAME[:key=value,...])"
        )
    return plan.model.name


def model_dims(spec: str) -> ModelDims:
    """The architecture of zoo model ``spec`` (a preset or builder spec)."""
    # autoplan.models imports torch (seconds): only when an export runs, so the CLI starts fast.
    models_spec = importlib.import_module("autoplan.models.spec")
    models = importlib.import_module("autoplan.models")
    parsed = models_spec.parse_model_spec(spec)
    if parsed.is_hf:
        raise ModelSpecError(
            f"model {shown(spec)} is a Hugging Face config.json, and a launch config restates "
            "the sizes of a zoo model; pass --model with the zoo builder of the same sizes "
            "(e.g. llama:num_layers=32,hidden_size=4096,...; a bad key lists the valid ones)"
        )
    overrides = {k: v for k, v in parsed.overrides.items() if k != "dtype"}
    config: Any
    if parsed.is_builder:
        # a builder fills in derived sizes (ffn = 4 x hidden, ...): build it on meta, read back
        config = models_spec.build_model(parsed).config
    else:
        config = models.preset_config(parsed.name, **overrides)
    # a MoE decoder is Llama's attention and norms with routed SwiGLU experts
    is_moe = isinstance(config, models.MoEConfig)
    is_llama = is_moe or isinstance(config, models.LlamaConfig)
    moe = (
        MoEDims(
            num_experts=config.num_experts,
            top_k=config.top_k,
            moe_ffn_hidden_size=config.moe_ffn_hidden_size,
            shared_ffn_hidden_size=config.shared_ffn_hidden_size,
            num_dense_layers=config.num_dense_layers,
            norm_topk_prob=config.norm_topk_prob,
            aux_loss_coef=float(config.router_aux_loss_coef),
        )
        if is_moe
        else None
    )
    return ModelDims(
        spec=spec,
        family="llama" if is_llama else "gpt",
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads if is_llama else config.num_heads,
        ffn_hidden_size=config.ffn_hidden_size,
        seq_len=config.seq_len,
        vocab_size=config.vocab_size,
        tie_embeddings=config.tie_embeddings,
        dropout=0.0 if is_llama else float(config.dropout),
        rope_theta=float(config.rope_theta) if is_llama else None,
        norm_eps=float(config.norm_eps) if is_llama else 1e-5,
        moe=moe,
        head_dim=int(config.head_dim) if is_llama else None,
    )
