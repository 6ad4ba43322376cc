"""cost_model: how devices, memory and links behave under a parallel plan.

Pure functions of plain data (a `ModelProfile`, a `Cluster`, a plan); no torch.distributed.
Imports neither `autoplan` nor `passes`.
"""

from __future__ import annotations

from cost_model.calibration import Calibration
from cost_model.communication import (
    LinkRate,
    all_gather_time_s,
    all_reduce_time_s,
    link_rate,
    p2p_time_s,
    reduce_scatter_time_s,
)
from cost_model.compute import OpTime, op_time
from cost_model.errors import ClusterError, InputError, SchemaError
from cost_model.estimate import (
    Estimate,
    MemoryBreakdown,
    MemoryCapacityError,
    MemoryConstants,
    RankEstimate,
    StageEstimate,
    UnitCost,
    estimate,
    memory_constants,
    oversubscription_factors,
    rank_memory,
    rank_tail_s,
    stage_p2p_time_s,
    unit_costs,
)
from cost_model.hardware import Cluster, DeviceSpec, LinkSpec, load_cluster, preset_names
from cost_model.memory import StaticBytes, activation_bytes, param_state_bytes, static_bytes
from cost_model.schedules import (
    bubble_fraction,
    bubble_time_s,
    inflight_microbatches,
    pipeline_time_s,
)
from cost_model.strategy import (
    GroupPlacement,
    PlanLike,
    StageLike,
    Strategy,
    group_placements,
    pipeline_link_crosses_nodes,
)
from cost_model.workload import (
    GemmShape,
    ModelProfile,
    OpProfile,
    TpLinear,
    TpStructure,
    UnitProfile,
)

__all__ = [
    "Calibration",
    "Cluster",
    "ClusterError",
    "DeviceSpec",
    "Estimate",
    "GemmShape",
    "GroupPlacement",
    "InputError",
    "LinkRate",
    "LinkSpec",
    "MemoryBreakdown",
    "MemoryCapacityError",
    "MemoryConstants",
    "ModelProfile",
    "OpProfile",
    "OpTime",
    "PlanLike",
    "RankEstimate",
    "SchemaError",
    "StageEstimate",
    "StageLike",
    "StaticBytes",
    "Strategy",
    "TpLinear",
    "TpStructure",
    "UnitCost",
    "UnitProfile",
    "activation_bytes",
    "all_gather_time_s",
    "all_reduce_time_s",
    "bubble_fraction",
    "bubble_time_s",
    "estimate",
    "group_placements",
    "inflight_microbatches",
    "link_rate",
    "load_cluster",
    "memory_constants",
    "op_time",
    "oversubscription_factors",
    "p2p_time_s",
    "param_state_bytes",
    "pipeline_link_crosses_nodes",
    "pipeline_time_s",
    "preset_names",
    "rank_memory",
    "rank_tail_s",
    "reduce_scatter_time_s",
    "stage_p2p_time_s",
    "static_bytes",
    "unit_costs",
]
