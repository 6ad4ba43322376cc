"""cost_model: how devices, memory and links behave under a parallel plan.

Pure functions of plain data (a `ModelProfile`, a `Cluster`, a plan); no process groups. The
one piece of torch it reads is the action order of torch's pipeline schedule classes
(`schedules.pipeline_order`), so the simulated schedule is the one the runtime runs. Imports
neither `autoplan` nor `passes`.

Layout: the inputs (`workload`: the model profile; `hardware`: the cluster, both hashable
values; `strategy`: a plan's outer choices and `decide`, what the runtime runs for them), the
formulas (`compute`, `communication`, `memory`, `schedules`), one part per technique
(`parts/`), and their composition: `estimate.CostModel(profile, cluster)` sums the parts into a
`unit_cost.UnitCost` per unit, and assembles stages, ranks (`rank_memory`) and the step into
the records of `results`; `estimate(profile, cluster, plan)` is one fresh `CostModel`'s answer.
"""

from __future__ import annotations

from cost_model.calibration import Calibration
from cost_model.communication import (
    LinkRate,
    all_gather_time_s,
    all_reduce_time_s,
    all_to_all_time_s,
    link_rate,
    p2p_time_s,
    reduce_scatter_time_s,
)
from cost_model.compute import OpTime, op_time
from cost_model.errors import ClusterError, InputError, SchemaError
from cost_model.estimate import (
    Boundary,
    CostModel,
    Estimate,
    MemoryBreakdown,
    MemoryCapacityError,
    MemoryConstants,
    RankEstimate,
    StageEstimate,
    UnitCost,
    boundary_costs,
    estimate,
    memory_constants,
    oversubscription_factors,
    peak_activations,
    rank_memory,
    rank_tail_s,
    stage_times,
    unit_costs,
)
from cost_model.hardware import Cluster, DeviceSpec, LinkSpec, load_cluster, preset_names
from cost_model.memory import StaticBytes, activation_bytes, param_state_bytes, static_bytes
from cost_model.schedule_memory import HeldProfile, held_microbatches
from cost_model.schedules import (
    SCHEDULES,
    Action,
    CriticalPath,
    ScheduleError,
    ScheduleSpec,
    Simulation,
    StageTimes,
    critical_path,
    pipeline_order,
    simulate,
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
    MoELayerFacts,
    OpProfile,
    TpLinear,
    TpStructure,
    UnitProfile,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Boundary",
    "Calibration",
    "Cluster",
    "ClusterError",
    "CostModel",
    "CriticalPath",
    "DeviceSpec",
    "Estimate",
    "GemmShape",
    "GroupPlacement",
    "HeldProfile",
    "InputError",
    "LinkRate",
    "LinkSpec",
    "MemoryBreakdown",
    "MemoryCapacityError",
    "MemoryConstants",
    "MoELayerFacts",
    "ModelProfile",
    "OpProfile",
    "OpTime",
    "PlanLike",
    "RankEstimate",
    "ScheduleError",
    "ScheduleSpec",
    "SchemaError",
    "Simulation",
    "StageEstimate",
    "StageLike",
    "StageTimes",
    "StaticBytes",
    "Strategy",
    "TpLinear",
    "TpStructure",
    "UnitCost",
    "UnitProfile",
    "activation_bytes",
    "all_gather_time_s",
    "all_reduce_time_s",
    "all_to_all_time_s",
    "boundary_costs",
    "critical_path",
    "estimate",
    "group_placements",
    "held_microbatches",
    "link_rate",
    "load_cluster",
    "memory_constants",
    "op_time",
    "oversubscription_factors",
    "p2p_time_s",
    "param_state_bytes",
    "peak_activations",
    "pipeline_link_crosses_nodes",
    "pipeline_order",
    "preset_names",
    "rank_memory",
    "rank_tail_s",
    "reduce_scatter_time_s",
    "simulate",
    "stage_times",
    "static_bytes",
    "unit_costs",
]
