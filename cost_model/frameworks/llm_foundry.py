"""MosaicML llm-foundry on Composer/FSDP (its 2023 throughput tables)."""

from __future__ import annotations

from cost_model.frameworks.profile import FrameworkProfile, Pricing

LLM_FOUNDRY = FrameworkProfile(
    name="llm-foundry",
    version="MosaicML llm-foundry with Composer, torch 2.0 (its 2023 throughput tables)",
    summary=(
        "llm-foundry's MPT on Composer/FSDP: flash attention, torch 2.0's "
        "checkpointing (no early stop), flash-attn's fused cross-entropy, overlapped FSDP"
    ),
    pricing=Pricing(
        attention="fused",
        # Its benchmark sweep pins mosaicml/pytorch:2.0.1 (scripts/train/benchmarking/
        # sweep.sh): torch's non-reentrant checkpoint re-ran the whole forward before 2.1
        # (the early stop is pytorch PR #96866).
        full_recompute_early_stop=0.0,
        # MPT's loss_fn defaults to flash-attn's CrossEntropyLoss, which saves the bf16
        # logits (and a log-sum-exp per row) for its backward
        # (llmfoundry/models/mpt/modeling_mpt.py; flash_attn/ops/triton/cross_entropy.py).
        loss_saved_bytes_per_logit=2.0,
    ),
    # Composer's FSDP overlaps gradient reduce-scatter with the backward.
    dp_overlap=1.0,
    # activation_checkpointing: one setting for every MPT block
    recompute_scope="global",
    # Composer's FSDP (fsdp_config is train.py's only parallelism setting: no pipeline,
    # tensor or context parallelism; scripts/train/train.py, 00b4bae4, 2023) maps
    # sharding_strategy NO_SHARD, SHARD_GRAD_OP, FULL_SHARD: ZeRO 0, 2, 3 (HYBRID_SHARD
    # only from torch 2.1; composer/trainer/mosaic_fsdp_utils.py, SHARDING_MAP)
    pipeline_parallel=False,
    tensor_parallel=False,
    context_parallel=False,
    zero_stages=(0, 2, 3),
    # torch FSDP (FSDP1) keeps fp32 flat parameters (the master) and fp32 Adam states; its
    # mixed_precision DEFAULT reduces in fp32, PURE in bf16 (composer/trainer/
    # mosaic_fsdp_utils.py get_mixed_precision)
    grad_reduce_dtypes=("fp32", "bf16", "fp16"),
    master_and_states=(("fp32", "fp32", 0),),
    sources=(
        "mosaicml/llm-foundry scripts/train/benchmarking/sweep.sh (torch 2.0.1 image)",
        "mosaicml/llm-foundry scripts/train/train.py (fsdp_config, 2023)",
        "mosaicml/composer composer/trainer/mosaic_fsdp_utils.py (SHARDING_MAP)",
        "mosaicml/llm-foundry llmfoundry/models/mpt/modeling_mpt.py (loss_fn)",
        "Dao-AILab/flash-attention flash_attn/ops/triton/cross_entropy.py",
    ),
)
