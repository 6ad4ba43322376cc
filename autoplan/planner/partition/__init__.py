"""Optimal pipeline-stage cuts and per-stage recompute for the schedule that really runs.

Given fixed outer choices (degrees, micro-batching, schedule, ZeRO level), the cost model gives
every pipeline unit, per recompute mode, its per-micro-batch forward, backward and
weight-gradient time, activation bytes and tail coefficients, plus static bytes and the link
time of a cut after it. This package chooses where to cut the units into the schedule's stages
and which recompute mode each stage uses, minimising the step time of the schedule simulation
(`cost_model.schedules.simulate` on torch's own action orders) subject to every rank's memory
at each of its candidate peak points (`cost_model.schedule_memory.held_microbatches`).

Private modules, from data to solve: ``problem`` (the records, `evaluate`, `brute_force`; no
OR-tools), ``scaled`` (the tables as the model's integers), ``formulations`` (the CP-SAT
models), ``heuristics`` (even splits and local search), ``solve`` (`solve` and
`min_peak_memory`: pick a formulation and run the lazy path loop; its docstring gives the
method).
"""

from __future__ import annotations

# Private names tests/test_partition.py and tests/test_search_limits.py read from this package
# (`partition._scale`, ...), as they did from the former module.
from autoplan.planner.partition.formulations import _CutModel as _CutModel
from autoplan.planner.partition.formulations import _RunsModel as _RunsModel
from autoplan.planner.partition.formulations import _step_model as _step_model
from autoplan.planner.partition.heuristics import (
    balanced_hint,
    even_splits,
    fastest_fitting,
    heuristic,
    improve,
    rank_balanced_hint,
)
from autoplan.planner.partition.problem import (
    Cuts,
    HeuristicResult,
    ImproveResult,
    ModeCosts,
    ModelKind,
    Partition,
    PartitionProblem,
    PeakMemory,
    SolveResult,
    SolverStatus,
    SolveStats,
    SolveStatus,
    brute_force,
    count_choices,
    evaluate,
    path_bound,
    rank_memory,
    rank_tails,
    stage_times,
    unit_runs,
)
from autoplan.planner.partition.problem import _uniform_middle as _uniform_middle
from autoplan.planner.partition.scaled import _FINE_MEMORY as _FINE_MEMORY
from autoplan.planner.partition.scaled import _RESOLUTION as _RESOLUTION
from autoplan.planner.partition.scaled import _fine_byte_unit as _fine_byte_unit
from autoplan.planner.partition.scaled import _ints as _ints
from autoplan.planner.partition.scaled import _scale as _scale
from autoplan.planner.partition.scaled import _worst_bytes as _worst_bytes
from autoplan.planner.partition.solve import min_peak_memory, solve

__all__ = [
    "Cuts",
    "HeuristicResult",
    "ImproveResult",
    "ModeCosts",
    "ModelKind",
    "Partition",
    "PartitionProblem",
    "PeakMemory",
    "SolveResult",
    "SolveStats",
    "SolveStatus",
    "SolverStatus",
    "balanced_hint",
    "brute_force",
    "count_choices",
    "evaluate",
    "even_splits",
    "fastest_fitting",
    "heuristic",
    "improve",
    "min_peak_memory",
    "path_bound",
    "rank_balanced_hint",
    "rank_memory",
    "rank_tails",
    "solve",
    "stage_times",
    "unit_runs",
]
