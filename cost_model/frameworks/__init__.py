"""Framework profiles: what a training stack does that changes step time or memory.

A plan runs on one stack: autoplan's own runtime (the default), or a plan exported to Megatron-LM,
DeepSpeed or torchtitan (`autoplan export`). The stacks differ in behaviour the hardware does not
decide: the attention kernel, how far full recompute re-runs the forward, which op outputs
selective recompute keeps, whether data-parallel gradient sync overlaps the backward, whether
the pipeline keeps the activations it sent, the bytes the loss keeps, how ZeRO-3 gathers
weights (FSDP2 per block, DeepSpeed per module in prefetch buckets), the least time its host
work lets a tensor-parallel block take on a GPU (nanotron's), and a pipeline engine that
re-times the whole step (DeepSpeed's, with BF16_Optimizer or its fp16 optimizers). A
`FrameworkProfile` names each behaviour with its source; `FrameworkProfile.cluster_for` writes
the calibration ones into the cluster's `Calibration`, whose fields the cost model's parts read,
and `cost_model.estimate.CostModel` reads the ZeRO-3 gathers and the engine. A field left
``None`` keeps the cluster's own value, so the ``autoplan`` profile is the identity: a
cluster's calibration (presets, `autoplan calibrate`) describes autoplan's runtime.

Applying a profile twice equals applying it once (every field is a replacement, and the
overlap a minimum), so a cluster that already carries a profile may be passed again.

Described alike for every stack, with the reason:
- the optimizer: each profiled stack but Megatron-LM 2019 (FP16_Optimizer over a per-tensor
  FusedAdam, `optimizer_bytes_per_param`) runs a fused or multi-tensor Adam (Megatron-Core:
  Transformer Engine's or apex's FusedAdam, megatron/core/optimizer/__init__.py; DeepSpeed: its
  FusedAdam, deepspeed/runtime/engine.py; torchtitan: ``implementation = "fused"``, its default,
  torchtitan/components/optimizer/optimizer.py; autoplan: torch's AdamW, foreach on CUDA), which
  `cost_model.parts.optimizer` prices as one memory-bound pass. Megatron-LM's distributed
  optimizer is the plan's ZeRO-1 (`autoplan export` writes ``--use-distributed-optimizer``).
- a fixed time per step (data loading, logging, timers): no source separates it for any stack,
  so it is `Calibration.step_overhead_s`, zero in the presets; the `megatron-lm-2019` profile
  carries the one fitted to Shoeybi et al.'s rows (bench/data/validation_assumptions.yaml).
Not described: fp8 training.

The package: `cost_model.frameworks.profile` holds the type (`FrameworkProfile` with its nested
records `Pricing`, `EngineBehaviour` and `Capabilities`) and the rules that read it;
`cost_model.frameworks.catalog` holds `FRAMEWORKS` and `framework_profile`; one module a stack
(Megatron-LM's releases and Megatron-DeepSpeed together) holds its values, each with its source.
"""

from cost_model.frameworks.catalog import FRAMEWORKS, framework_profile
from cost_model.frameworks.limits import Explanation, LimitKey, ModelFacts, Refusal
from cost_model.frameworks.profile import (
    DEFAULT_FRAMEWORK,
    AttentionKernel,
    Capabilities,
    Engine,
    EngineBehaviour,
    ExpertLayout,
    FrameworkError,
    FrameworkProfile,
    OptionValue,
    Pricing,
    Zero3Gathers,
    unfused_attention_efficiency,
)

__all__ = [
    "DEFAULT_FRAMEWORK",
    "FRAMEWORKS",
    "AttentionKernel",
    "Capabilities",
    "Engine",
    "EngineBehaviour",
    "ExpertLayout",
    "Explanation",
    "FrameworkError",
    "FrameworkProfile",
    "LimitKey",
    "ModelFacts",
    "OptionValue",
    "Pricing",
    "Refusal",
    "Zero3Gathers",
    "framework_profile",
    "unfused_attention_efficiency",
]
