"""passes: compile an `autoplan.Plan` into a distributed training module, one pass a technique.

Passes run in this order, each with typed input and output and a check of its own result:
`split_stages` (stages and per-unit submodules) -> `apply_tensor_parallel` (DTensor styles) ->
`apply_recompute` (activation checkpointing) -> `apply_data_parallel` (FSDP2 / replicate / DDP +
ZeRO) -> `materialize` (meta model to real shards) -> `build_pipeline` (``PipelineStage`` and
torch's schedules) -> `DistributedModel` (the runtime). `build_mesh` creates the one device mesh.

Imports only autoplan's plan, graph and error types (never the search or the cost model).
"""

from __future__ import annotations

from passes._log import is_rank0, log_rank0
from passes.data_parallel import DataParallelResult, apply_data_parallel, uses_ddp
from passes.materialize import (
    has_meta_tensors,
    init_full_model_,
    materialize,
    meta_buffer_values,
    norm_parameter_names,
)
from passes.mesh import ParallelMesh, build_mesh
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
    "DataParallelResult",
    "DistributedModel",
    "ParallelMesh",
    "Pipeline",
    "SplitModel",
    "StageModule",
    "TensorParallelResult",
    "TiedCopy",
    "TiedGradientSync",
    "TiedParameter",
    "UnitModule",
    "apply_data_parallel",
    "apply_recompute",
    "apply_tensor_parallel",
    "build_mesh",
    "build_pipeline",
    "has_meta_tensors",
    "init_full_model_",
    "is_rank0",
    "log_rank0",
    "materialize",
    "meta_buffer_values",
    "norm_parameter_names",
    "original_fqn",
    "retarget_devices",
    "selective_policy",
    "split_stages",
    "uses_ddp",
]
