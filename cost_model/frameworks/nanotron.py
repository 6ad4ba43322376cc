"""Hugging Face nanotron, as the Ultra-Scale Playbook's runs used it."""

from __future__ import annotations

from cost_model.frameworks.profile import FrameworkProfile, Pricing

NANOTRON = FrameworkProfile(
    name="nanotron",
    version="Hugging Face nanotron (2024-25), as the Ultra-Scale Playbook's runs used it",
    summary=(
        "nanotron: Megatron-style column/row-parallel linears with sequence parallelism, "
        "flash-attn 2 kernels, torch DDP overlapping the gradient all-reduce with the "
        "backward"
    ),
    pricing=Pricing(
        # flash-attn 2 (the flash_attn package), not Transformer Engine: the presets' rate
        attention="fused",
        # Its loss: the logits cast to fp32 (the cast_to_fp32 pipeline block), then
        # _ShardedCrossEntropy (src/nanotron/parallel/tensor_parallel/functional.py) in
        # separate passes: max (read 4), subtract (read 4, write 4), exp in place (8), sum
        # (4), divide in place (8): 32 bytes per fp32 logit forward; its backward scales
        # the saved softmax in place (8). F.cross_entropy moves 8 and 16.
        loss_forward_bytes_per_logit=32.0,
        loss_backward_bytes_per_logit=8.0,
    ),
    # torch DDP's bucketed all-reduce during the backward (nanotron trainer.py)
    dp_overlap=1.0,
    # Recompute and what its 1F1B engine keeps of a sent activation are not described
    # (autoplan's defaults): the scored Ultra-Scale Playbook runs use neither.
    # build_model cuts the stages by its blocks' compute cost (no flag states a cut).
    pipeline_split="nanotron",
    stage_cuts="own",
    # its PipelineEngines: all-forward-all-backward and 1F1B
    # (src/nanotron/parallel/pipeline_parallel/engine.py)
    schedules=("gpipe", "1f1b"),
    # recompute_layer: one setting for every decoder layer (its config's ModelArgs)
    recompute_scope="global",
    # Fitted (bench/data/validation_assumptions.yaml, fitted_constants) to the
    # Ultra-Scale Playbook's tensor-parallel runs at micro-batch 1, whose time per
    # micro-batch and decoder layer is the same 4.4 ms for hidden sizes 2048, 3072 and
    # 4096 at TP 2, 4 and 8 (16, 28 and 32 layers: 70, 122 and 141 ms a micro-batch)
    # wherever the device needs less: a floor that grows with the layers alone, as the
    # host's per-layer work does (its Triton RMSNorm and rotary kernels, flash-attn's
    # Python wrapper, its tensor-parallel autograd functions and their collectives).
    # The source does not say which; rows without TP need more than the floor, so it
    # is not known whether one applies there.
    tp_block_host_floor_s=4.4e-3,
    # OptimizerArgs.zero_stage > 0 builds ZeroDistributedOptimizer, "partitioning of
    # optimizer's states across DP ranks ... ZeRO Stage 1" (src/nanotron/helpers.py,
    # src/nanotron/optim/zero.py; README: "ZeRO-3 optimizer (a.k.a FSDP)" unchecked), at
    # 2411b022 (2026-04)
    zero_stages=(0, 1),
    # LlamaForTraining takes no cp group (src/nanotron/models/llama.py at 2411b022): its
    # context parallelism is the Qwen model's own attention (src/nanotron/models/qwen.py,
    # from b641237d, 2025-03), not a plan degree of any model
    context_parallel=False,
    # its optimizer's fp32 master weights and states, gradients accumulated and all-reduced in
    # fp32 (accumulate_grad_in_fp32; src/nanotron/optim/gradient_accumulator.py)
    grad_reduce_dtypes=("fp32", "fp16"),
    master_and_states=(("fp32", "fp32", 0),),
    sources=(
        "huggingface/nanotron src/nanotron/models/base.py (build_model's stage split)",
        "huggingface/nanotron src/nanotron/models/llama.py (flash_attn kernels)",
        "huggingface/nanotron src/nanotron/trainer.py (DDP)",
        "huggingface/nanotron src/nanotron/parallel/tensor_parallel/functional.py (loss)",
    ),
)
