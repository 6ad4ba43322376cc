"""flash-attention's GPT training code (training/, 2022-11), priced as llm-foundry."""

from __future__ import annotations

import dataclasses

from cost_model.frameworks.llm_foundry import LLM_FOUNDRY

FLASH_ATTN_TRAINING = dataclasses.replace(
    # Priced as llm-foundry's profile, whose every pricing setting this stack shares
    # (bench/data/validation_assumptions_more.yaml, family fa-training2211): flash
    # attention, 16-bit logits kept for the loss's backward (apex xentropy,
    # inplace_backward), DDP overlapping the all-reduce; its own limits below.
    LLM_FOUNDRY,
    name="flash-attn-training",
    version="Dao-AILab/flash-attention training/ (4a6eaa9f, 2022-11), as its configs run",
    summary=(
        "flash-attention's GPT training code on PyTorch Lightning: flash attention, "
        "apex's in-place cross-entropy, DDP or DDP with torch's ZeroRedundancyOptimizer"
    ),
    # its experiment configs: trainer strategy ddp, or src.utils.ddp_zero1.DDPStrategyZero1
    # with optimizer adamw-zero (torch.distributed.optim.ZeroRedundancyOptimizer: ZeRO-1;
    # training/configs/experiment/owt/gpt2l-flash.yaml, pile/gpt3l-flash.yaml); its
    # flash_attn/models/gpt.py of then has no process group (no tensor parallelism)
    expert_parallel=False,
    zero_stages=(0, 1),
    # torch DDP (+ ZeroRedundancyOptimizer) under Lightning's bf16 autocast: fp32 parameters
    # (the master), Adam states and gradient all-reduce
    grad_reduce_dtypes=("fp32", "fp16"),
    sources=(
        "Dao-AILab/flash-attention 4a6eaa9f training/configs/experiment/",
        "Dao-AILab/flash-attention 4a6eaa9f training/src/utils/ddp_zero1.py",
        "Dao-AILab/flash-attention 4a6eaa9f flash_attn/models/gpt.py",
    ),
)
