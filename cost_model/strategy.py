"""What the cost model reads from a plan, and where each parallel group sits on the cluster.

`PlanLike` is a read-only protocol that `autoplan.Plan` satisfies structurally (cost_model never
imports autoplan). `Strategy` holds a plan's "outer" choices: everything except the stage cuts
and per-stage recompute, which is what the planner fixes before it solves for the cuts. The
placement helpers map mesh axes to global ranks the way `autoplan.Plan` does: ``rank_layout``
orders the axes outermost first, and stage ``i`` runs on pipeline rank ``i % pp_degree``.

Guarantees: pure functions of plain data; placements are deterministic and depend only on the
degrees, the layout and the cluster's node shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Protocol

from cost_model.hardware import Cluster
from cost_model.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    TORCH_SCHEDULE_CLASSES,
    V_SCHEDULES,
    Placement,
    ScheduleName,
    ScheduleSpec,
    stage_rank,
)
from cost_model.workload import OpKind, UnitKind

Axis = Literal["pp", "dp", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp", "tp")
RecomputeMode = Literal["none", "selective", "full"]
RECOMPUTE_ORDER: tuple[RecomputeMode, ...] = ("none", "selective", "full")
# How autoplan's runtime (passes/data_parallel.py) wraps a stage for data parallelism.
DataParallelWrapper = Literal["none", "ddp", "replicate", "fsdp"]

# Bytes per element of the training dtype (activations, parameters and gradients in this dtype).
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


class StageLike(Protocol):
    """One pipeline stage (model chunk) of a plan: units first_unit..last_unit inclusive."""

    @property
    def first_unit(self) -> int: ...
    @property
    def last_unit(self) -> int: ...
    @property
    def recompute(self) -> str: ...


class PlanLike(Protocol):
    """The plan fields the cost model reads (``autoplan.Plan`` satisfies it)."""

    @property
    def dp_degree(self) -> int: ...
    @property
    def tp_degree(self) -> int: ...
    @property
    def pp_degree(self) -> int: ...
    @property
    def virtual_stages(self) -> int: ...
    @property
    def stages(self) -> Sequence[StageLike]: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def num_micro_batches(self) -> int: ...
    @property
    def global_batch_size(self) -> int: ...
    @property
    def schedule(self) -> str: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def dtype(self) -> str: ...
    @property
    def rank_layout(self) -> Sequence[str]: ...
    @property
    def framework(self) -> str: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """A plan's outer choices: degrees, batching, schedule, sharding, dtype and rank layout."""

    tp_degree: int = 1
    dp_degree: int = 1
    pp_degree: int = 1
    virtual_stages: int = 1
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    schedule: ScheduleName = "1f1b"
    zero_stage: int = 0
    sequence_parallel: bool = False
    dtype: str = "bf16"
    rank_layout: tuple[Axis, Axis, Axis] = ("pp", "dp", "tp")

    def __post_init__(self) -> None:
        for name in (
            "tp_degree",
            "dp_degree",
            "pp_degree",
            "virtual_stages",
            "micro_batch_size",
            "num_micro_batches",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"strategy.{name} = {getattr(self, name)} must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"strategy.zero_stage = {self.zero_stage} must be 0, 1, 2 or 3")
        if sorted(self.rank_layout) != sorted(AXES):
            raise ValueError(f"strategy.rank_layout = {self.rank_layout} must order pp, dp, tp")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"strategy.dtype = {self.dtype!r}; use one of {sorted(DTYPE_BYTES)}")

    @classmethod
    def of(cls, plan: PlanLike) -> Strategy:
        """The outer choices of ``plan``."""
        layout = tuple(plan.rank_layout)
        assert len(layout) == 3 and all(a in AXES for a in layout), layout
        schedule = plan.schedule
        assert schedule in SCHEDULES, schedule
        return cls(
            tp_degree=plan.tp_degree,
            dp_degree=plan.dp_degree,
            pp_degree=plan.pp_degree,
            virtual_stages=plan.virtual_stages,
            micro_batch_size=plan.micro_batch_size,
            num_micro_batches=plan.num_micro_batches,
            schedule=schedule,
            zero_stage=plan.zero_stage,
            sequence_parallel=plan.sequence_parallel,
            dtype=plan.dtype,
            rank_layout=layout,  # type: ignore[arg-type]
        )

    @property
    def num_devices(self) -> int:
        return self.tp_degree * self.dp_degree * self.pp_degree

    @property
    def decisions(self) -> Decisions:
        """What autoplan's runtime does for this plan (`decide`)."""
        return decide(self)

    @property
    def dp_wrapper(self) -> DataParallelWrapper:
        return self.decisions.dp_wrapper

    @property
    def runtime_zero_stage(self) -> int:
        return self.decisions.zero_stage

    @property
    def checkpointable(self) -> bool:
        return self.decisions.checkpointable

    @property
    def num_stages(self) -> int:
        return self.pp_degree * self.virtual_stages

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.dp_degree

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def degree(self, axis: Axis) -> int:
        return {"pp": self.pp_degree, "dp": self.dp_degree, "tp": self.tp_degree}[axis]

    def axis_stride(self, axis: Axis) -> int:
        """Distance in global rank between neighbours along ``axis`` (as `autoplan.Plan`)."""
        idx = self.rank_layout.index(axis)
        return math.prod(self.degree(a) for a in self.rank_layout[idx + 1 :])

    def global_rank(self, *, pp: int, dp: int, tp: int) -> int:
        """Global rank of the device at mesh coordinates (pp, dp, tp)."""
        coords = {"pp": pp, "dp": dp, "tp": tp}
        return sum(coords[a] * self.axis_stride(a) for a in AXES)

    @property
    def schedule_spec(self) -> ScheduleSpec:
        """The pipeline schedule with its degrees (raises `ScheduleError` if torch cannot run
        it)."""
        return schedule_spec(
            self.schedule, self.pp_degree, self.virtual_stages, self.num_micro_batches
        )

    def pipeline_rank_of_stage(self, stage_idx: int) -> int:
        """The schedule's placement: stage i on rank i % pp ("loop"), or in a V."""
        return stage_rank(self.schedule_placement, self.pp_degree, stage_idx)

    @property
    def schedule_placement(self) -> Placement:
        return "v" if self.schedule in V_SCHEDULES else "loop"


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupPlacement:
    """How one communication group sits on the nodes: ``ranks_per_node`` devices of it on each
    of ``num_nodes`` nodes (``size = num_nodes * ranks_per_node`` for regular layouts)."""

    size: int
    num_nodes: int
    ranks_per_node: int

    @property
    def crosses_nodes(self) -> bool:
        return self.num_nodes > 1


def group_placements(
    strategy: Strategy, cluster: Cluster, axis: Axis
) -> tuple[GroupPlacement, ...]:
    """Every distinct placement among the ``axis`` groups of the mesh (usually one)."""
    return _group_placements(
        strategy.degree("pp"),
        strategy.degree("dp"),
        strategy.degree("tp"),
        strategy.rank_layout,
        axis,
        cluster.devices_per_node,
    )


@lru_cache(maxsize=4096)
def _group_placements(
    pp: int, dp: int, tp: int, layout: tuple[Axis, Axis, Axis], axis: Axis, devices_per_node: int
) -> tuple[GroupPlacement, ...]:
    strategy = Strategy(pp_degree=pp, dp_degree=dp, tp_degree=tp, rank_layout=layout)
    stride = strategy.axis_stride(axis)
    size = strategy.degree(axis)
    found: set[GroupPlacement] = set()
    for base in range(strategy.num_devices):
        if (base // stride) % size != 0:
            continue  # not the first rank of its group
        counts: dict[int, int] = {}
        for i in range(size):
            node = (base + i * stride) // devices_per_node
            counts[node] = counts.get(node, 0) + 1
        found.add(
            GroupPlacement(size=size, num_nodes=len(counts), ranks_per_node=max(counts.values()))
        )
    return tuple(sorted(found, key=lambda g: (g.num_nodes, g.ranks_per_node)))


def pipeline_link_crosses_nodes(
    strategy: Strategy, cluster: Cluster, from_pp_rank: int, to_pp_rank: int
) -> bool:
    """Whether any device of pipeline rank ``from_pp_rank`` sends to its peer (same dp and tp
    coordinates) of pipeline rank ``to_pp_rank`` on another node. Stages are synchronous, so
    the slowest pair of the dp x tp peers sets the boundary's time."""
    return _pipeline_link(
        strategy.pp_degree,
        strategy.dp_degree,
        strategy.tp_degree,
        strategy.rank_layout,
        cluster.devices_per_node,
        from_pp_rank,
        to_pp_rank,
    )


@lru_cache(maxsize=4096)
def _pipeline_link(
    pp: int,
    dp: int,
    tp: int,
    layout: tuple[Axis, Axis, Axis],
    devices_per_node: int,
    a: int,
    b: int,
) -> bool:
    strategy = Strategy(pp_degree=pp, dp_degree=dp, tp_degree=tp, rank_layout=layout)
    return any(
        strategy.global_rank(pp=a, dp=d, tp=t) // devices_per_node
        != strategy.global_rank(pp=b, dp=d, tp=t) // devices_per_node
        for d in range(dp)
        for t in range(tp)
    )


@lru_cache(maxsize=8192)
def schedule_spec(schedule: ScheduleName, p: int, v: int, m: int) -> ScheduleSpec:
    """``ScheduleSpec(schedule, p, v, m)``, memoised: the planner asks for the spec of every
    candidate, often more than once (raises `ScheduleError` if torch cannot run it)."""
    return ScheduleSpec(schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=m)


# --------------------------------------------------------------------------------------------
# The runtime's decisions
# --------------------------------------------------------------------------------------------

# Outputs selective recompute keeps: GEMMs and attention, the expensive ops; the cheap ones between
# them (norms, activations, residual adds, rotary embeddings) run again in backward. Korthikanti
# et al. 2022, section 5, recompute the cheap attention core and keep the GEMM outputs; with a
# fused (flash) attention kernel the s^2 scores are never saved, so what is left to drop is the
# element-wise and normalisation work, as torchtitan's op-level selective checkpointing does.
SELECTIVE_SAVED_KINDS: frozenset[OpKind] = frozenset({"matmul", "attention"})


# Units that a stage's recompute applies to: blocks (and the units of a model traced without a
# block structure); embedding and head units never, as in Megatron-LM and torchtitan.
RECOMPUTED_UNIT_KINDS: frozenset[UnitKind] = frozenset({"block", "other"})


@dataclass(frozen=True, kw_only=True, slots=True)
class RecomputePolicy:
    """What a recomputed unit keeps for backward; everything else runs again."""

    unit_kinds: frozenset[UnitKind]  # the units a stage's recompute mode applies to
    # op kinds (the trace's `OpKind`) whose outputs "selective" keeps
    saved_kinds: frozenset[OpKind]
    # collective outputs (tensor parallelism's) are kept too: recomputing one communicates again
    keeps_collectives: bool

    def recomputes(self, kind: OpKind, mode: RecomputeMode) -> bool:
        """Whether an op of this kind runs again in backward under ``mode``."""
        if mode == "none":
            return False
        return mode == "full" or kind not in self.saved_kinds


@dataclass(frozen=True, kw_only=True, slots=True)
class Decisions:
    """What autoplan's runtime does for a plan, decided once by `decide`: the passes carry it
    out, the cost model prices it, `autoplan.Plan.decisions` shows it."""

    dp_wrapper: DataParallelWrapper
    zero_stage: int  # the ZeRO stage that runs (ZeRO-1 outside DDP runs as ZeRO-2)
    checkpointable: bool  # torch.distributed.checkpoint can save the optimizer's state
    schedule_class: str  # the torch.distributed.pipelining.schedules class that runs
    split_backward: bool  # the schedule runs backward-input and backward-weight apart
    recompute: RecomputePolicy


_RECOMPUTE = RecomputePolicy(
    unit_kinds=RECOMPUTED_UNIT_KINDS, saved_kinds=SELECTIVE_SAVED_KINDS, keeps_collectives=True
)


@lru_cache(maxsize=4096)
def decide(strategy: Strategy) -> Decisions:
    """The one function that decides, for a plan's outer choices, what the runtime runs.

    The data-parallel wrapper:

    - ``none``: fp32 on one data-parallel rank needs no wrapper;
    - ``ddp``: bucketed DDP (+ ZeroRedundancyOptimizer for ZeRO-1) for fp32 ZeRO-0/1 over
      several replicas without TP or PP. DDP is unsafe with TP and PP, has no mixed-precision
      policy, and its reducer refuses GPipe's several forwards before a backward (an internal
      assert);
    - ``fsdp``: FSDP2 ``fully_shard`` per unit for ZeRO-1 (run as ZeRO-2) to ZeRO-3;
    - ``replicate``: FSDP2 ``replicate`` per unit for ZeRO-0 otherwise.

    ZeRO-1 on DDP keeps its optimizer state in ZeroRedundancyOptimizer's own layout, which
    torch.distributed.checkpoint cannot save.
    """
    if strategy.dp_degree == 1 and strategy.dtype == "fp32":
        wrapper: DataParallelWrapper = "none"
    elif (
        strategy.dp_degree > 1
        and strategy.zero_stage <= 1
        and strategy.tp_degree == 1
        and strategy.pp_degree == 1
        and strategy.dtype == "fp32"
        and not (strategy.schedule == "gpipe" and strategy.num_micro_batches > 1)
    ):
        wrapper = "ddp"
    else:
        wrapper = "fsdp" if strategy.zero_stage >= 1 else "replicate"
    return Decisions(
        dp_wrapper=wrapper,
        zero_stage=2 if strategy.zero_stage == 1 and wrapper == "fsdp" else strategy.zero_stage,
        checkpointable=not (strategy.zero_stage == 1 and wrapper == "ddp"),
        schedule_class=TORCH_SCHEDULE_CLASSES[strategy.schedule],
        split_backward=strategy.schedule in SPLIT_BACKWARD,
        recompute=_RECOMPUTE,
    )
