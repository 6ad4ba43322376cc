"""passes: compile an `autoplan.Plan` into a distributed training module, one pass a technique.

Passes run in this order, each with typed input and output and a check of its own result:
`split_stages` (stages and per-unit submodules) -> `convert_to_fp8` (an fp8 plan's linears to
torchao's float8 linears, as `select_fp8_linears` chose them) -> `apply_tensor_parallel`
(DTensor styles, torchao's float8 ones for tensor-wise fp8 linears; under sequence parallelism
MoE layers route their sequence shard, `sequence_parallel_moe`) ->
`apply_context_parallel` (load-balanced sequence sharding, ring attention; cp > 1) ->
`apply_expert_parallel` (experts sharded over ep, all-to-all dispatch and combine; ep > 1;
each expert split over etp ranks of the TP group under etp > 1) ->
`apply_recompute` (activation checkpointing) -> `apply_data_parallel` (FSDP2 / replicate / DDP +
ZeRO, dense weights over dp x cp, experts over edp x cp) -> `materialize` (meta model to real
shards) -> `build_pipeline` (``PipelineStage`` and torch's schedules) -> `DistributedModel` (the
runtime; its optimizers step a plan's ``optimizer_offload`` share on the host,
`OffloadedOptimizer`). `build_mesh` creates the one device mesh.

Imports only autoplan's plan, graph and error types (never the search or the cost model).
"""

from __future__ import annotations

from passes._log import announce_rank0, is_rank0, log_rank0
from passes.async_tp import async_tp_refusal, enable_async_tp
from passes.compile import apply_compile, is_compiled
from passes.context_parallel import (
    ContextParallelResult,
    RingAttention,
    apply_context_parallel,
    average_gradients,
    check_context_parallel,
    load_balanced_positions,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from passes.data_parallel import DataParallelResult, apply_data_parallel, uses_ddp
from passes.expert_parallel import (
    ExpertParallelExperts,
    ExpertParallelResult,
    ExpertTensorParallel,
    apply_expert_parallel,
    check_expert_parallel,
    find_grouped_experts,
    reduce_gradients,
)
from passes.fp8 import (
    Fp8Result,
    Fp8ScalePrecompute,
    Fp8Selection,
    convert_to_fp8,
    select_fp8_linears,
    torchao_float8,
)
from passes.materialize import (
    has_meta_tensors,
    init_full_model_,
    materialize,
    meta_buffer_values,
    norm_parameter_names,
)
from passes.mesh import ParallelMesh, build_mesh
from passes.moe_sequence_parallel import ReplicatedGradientSum, sequence_parallel_moe
from passes.optimizer_offload import OffloadedOptimizer, offloaded_params, offloading_factory
from passes.pipeline import Pipeline, build_pipeline
from passes.recompute import apply_recompute, selective_policy
from passes.runtime import DistributedModel, TiedGradientSync
from passes.split import (
    SplitModel,
    StageModule,
    TiedCopy,
    TiedParameter,
    UnitModule,
    original_fqn,
    retarget_devices,
    split_stages,
)
from passes.tensor_parallel import TensorParallelResult, apply_tensor_parallel

__all__ = [
    "ContextParallelResult",
    "DataParallelResult",
    "DistributedModel",
    "ExpertParallelExperts",
    "ExpertParallelResult",
    "ExpertTensorParallel",
    "Fp8Result",
    "Fp8ScalePrecompute",
    "Fp8Selection",
    "OffloadedOptimizer",
    "ParallelMesh",
    "Pipeline",
    "ReplicatedGradientSum",
    "RingAttention",
    "SplitModel",
    "StageModule",
    "TensorParallelResult",
    "TiedCopy",
    "TiedGradientSync",
    "TiedParameter",
    "UnitModule",
    "announce_rank0",
    "apply_compile",
    "apply_context_parallel",
    "apply_data_parallel",
    "apply_expert_parallel",
    "apply_recompute",
    "apply_tensor_parallel",
    "async_tp_refusal",
    "average_gradients",
    "build_mesh",
    "build_pipeline",
    "check_context_parallel",
    "check_expert_parallel",
    "convert_to_fp8",
    "enable_async_tp",
    "find_grouped_experts",
    "has_meta_tensors",
    "init_full_model_",
    "is_compiled",
    "is_rank0",
    "load_balanced_positions",
    "log_rank0",
    "materialize",
    "meta_buffer_values",
    "norm_parameter_names",
    "offloaded_params",
    "offloading_factory",
    "original_fqn",
    "reduce_gradients",
    "retarget_devices",
    "ring_attention",
    "select_fp8_linears",
    "selective_policy",
    "sequence_parallel_moe",
    "shard_sequence",
    "split_stages",
    "torchao_float8",
    "unshard_sequence",
    "uses_ddp",
]
