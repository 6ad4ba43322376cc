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

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Protocol

import numpy as np

# the name sets and layout rules are `cost_model.degrees`'; re-exported under their names here
from cost_model.degrees import AXES as AXES
from cost_model.degrees import LEGACY_AXES as LEGACY_AXES
from cost_model.degrees import (
    RECOMPUTE_MODES,
    etp_problem,
    hsdp_problems,
    tp_comm_overlap_problem,
)
from cost_model.degrees import Axis as Axis
from cost_model.degrees import RecomputeMode as RecomputeMode
from cost_model.degrees import folded_ep_factors as folded_ep_factors
from cost_model.degrees import valid_layout as valid_layout
from cost_model.hardware import Cluster
from cost_model.offload import optimizer_offload_problem
from cost_model.precision import (
    DEFAULT_FP8_EXCLUDE,
    DEFAULT_MASTER_DTYPE,
    DEFAULT_OPTIMIZER_STATE_DTYPE,
    Fp8Recipe,
    PrecisionPolicy,
    fp8_field_problem,
    fp8_recipe,
    precision_policy,
    precision_problem,
)
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

# Communication groups of the mesh, named by the axes they span: a mesh axis, the
# data-parallel group of dense weights under context parallelism ("dp_cp": their gradients
# reduce over dp x cp, as torchtitan's dp_shard_cp mesh), and the expert-parallel split of dp
# ("ep": ep consecutive dp ranks; "edp_cp": the ranks that hold the same experts, over which
# expert gradients reduce), and HSDP's split of the dense weights' group ("dp_shard_cp": the
# dp_shard_degree consecutive dp ranks x cp that shard the weights, all of dp x cp without
# HSDP; "dp_replicate": the dp / dp_shard_degree ranks holding the same shard, one without
# HSDP). See `mesh_groups`.
GroupName = Literal[
    "pp", "dp", "cp", "tp", "dp_cp", "ep", "edp_cp", "dp_shard_cp", "dp_replicate", "etp"
]
# the name sets (`cost_model.degrees`), as this module exported them before
RECOMPUTE_ORDER = RECOMPUTE_MODES
# How autoplan's runtime (passes/data_parallel.py) wraps a stage for data parallelism.
DataParallelWrapper = Literal["none", "ddp", "replicate", "fsdp"]

# Bytes per element of the training dtype (activations, parameters and gradients in this dtype).
# An fp8 recipe trains in bf16 and casts only the GEMMs' inputs (`cost_model.precision`).
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "tf32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 2,
    "fp8-rowwise": 2,
    "mxfp8": 2,
}


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


def plan_cp_ep(plan: object) -> tuple[int, int]:
    """(cp_degree, ep_degree) of a plan-like object; 1 for plans (or stand-ins) without them."""
    return int(getattr(plan, "cp_degree", 1)), int(getattr(plan, "ep_degree", 1))


def is_subsequence(axes: Sequence[str], order: Sequence[str]) -> bool:
    """``axes`` appear in ``order`` in the same relative order."""
    position = iter(order)
    return all(axis in position for axis in axes)


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
    # TP collectives pipelined with their GEMMs (`Plan.tp_comm_overlap`,
    # `cost_model.parts.tensor_parallel`)
    tp_comm_overlap: bool = False
    dtype: str = "bf16"
    rank_layout: tuple[Axis, ...] = ("pp", "dp", "tp")
    # Context parallel (ring attention over the sequence) and expert parallel (experts split
    # over ep consecutive data-parallel ranks): see `cost_model.parts.context_parallel` and
    # `cost_model.parts.expert_parallel`.
    cp_degree: int = 1
    ep_degree: int = 1
    # ep over consecutive ranks of the dp x cp x tp block (Megatron-Core's folding), not dp
    ep_folding: bool = False
    # expert tensor parallelism (`Plan.etp_degree`): each routed expert split over etp
    # consecutive ranks of one TP group (`cost_model.parts.expert_parallel`)
    etp_degree: int = 1
    # Under an fp8 recipe: FSDP2 gathers fp8 weights; the linears kept in bf16 (`Plan`).
    fp8_all_gather: bool = False
    fp8_exclude: tuple[str, ...] = DEFAULT_FP8_EXCLUDE
    # The precision policy (`Plan.master_dtype`, ..., `cost_model.precision`; `precision`
    # resolves it): master weights, gradient accumulation and reduction (None: the dtype's
    # default), AdamW's moments
    master_dtype: str = DEFAULT_MASTER_DTYPE
    grad_reduce_dtype: str | None = None
    optimizer_state_dtype: str = DEFAULT_OPTIMIZER_STATE_DTYPE
    # torch.compile of the units (`cost_model.parts.fusion`): the plan's; a stage that
    # overrides it is priced with its own (`cost_model.estimate.CostModel`)
    compile: bool = False
    # HSDP: the weights sharded within groups of dp_shard_degree consecutive dp ranks (x cp),
    # replicated across the dp / dp_shard_degree groups; None: sharded over all of dp (a
    # value equal to dp_degree is stored as None)
    dp_shard_degree: int | None = None
    # The share of the optimizer step (master weights, moments, the Adam step) on the host
    # (`Plan.optimizer_offload`, `cost_model.parts.offload`); 0: none
    optimizer_offload: float = 0.0
    # The search's activation-offload twin (`autoplan.planner.enumeration`): every block under
    # recompute 'none' but the model's last keeps its saved activations on the host
    # (`CostModel.unit_costs`). Plans state it per stage (`StagePlan.activation_offload`), which
    # the estimate prices unit by unit: `Strategy.of` leaves it False.
    activation_offload: bool = False

    def __post_init__(self) -> None:
        if self.dp_shard_degree == self.dp_degree:
            object.__setattr__(self, "dp_shard_degree", None)
        for problem in hsdp_problems(self):
            raise ValueError(f"strategy: {problem}")
        for name in (
            "tp_degree",
            "dp_degree",
            "pp_degree",
            "cp_degree",
            "ep_degree",
            "virtual_stages",
            "micro_batch_size",
            "num_micro_batches",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"strategy.{name} = {getattr(self, name)} must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"strategy.zero_stage = {self.zero_stage} must be 0, 1, 2 or 3")
        if not valid_layout(self.rank_layout):
            raise ValueError(
                f"strategy.rank_layout = {self.rank_layout} must order pp, dp, (cp,) tp"
            )
        if self.cp_degree > 1 and "cp" not in self.rank_layout:
            raise ValueError(f"strategy.rank_layout = {self.rank_layout} must place cp")
        if self.etp_degree != 1 and (etp_why := etp_problem(self.tp_degree, self.etp_degree)):
            raise ValueError(f"strategy: {etp_why}")
        if self.ep_folding:
            if (
                folded_ep_factors(
                    self.ep_degree,
                    self.tp_degree // self.etp_degree,
                    self.cp_degree,
                    self.dp_degree,
                )
                is None
            ):
                raise ValueError(
                    f"strategy.ep_degree = {self.ep_degree} does not fold over tp "
                    f"{self.tp_degree}, cp {self.cp_degree}, dp {self.dp_degree}"
                )
        elif self.dp_degree % self.ep_degree:
            raise ValueError(
                f"strategy.ep_degree = {self.ep_degree} must divide dp_degree = {self.dp_degree}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"strategy.dtype = {self.dtype!r}; use one of {sorted(DTYPE_BYTES)}")
        field_problem = fp8_field_problem(
            self.dtype, self.fp8_all_gather, self.fp8_exclude, self.zero_stage, check_zero=False
        ) or precision_problem(
            self.dtype, self.master_dtype, self.grad_reduce_dtype, self.optimizer_state_dtype
        )
        if field_problem is not None:
            raise ValueError(f"strategy: {field_problem}")
        overlap_problem = tp_comm_overlap_problem(
            self.tp_degree, self.sequence_parallel, self.tp_comm_overlap
        )
        if overlap_problem is not None:
            raise ValueError(f"strategy: {overlap_problem}")
        if (offload_problem := optimizer_offload_problem(self.optimizer_offload)) is not None:
            raise ValueError(f"strategy: {offload_problem}")

    @classmethod
    def of(cls, plan: PlanLike) -> Strategy:
        """The outer choices of ``plan``."""
        layout = tuple(plan.rank_layout)
        assert valid_layout(layout), layout
        schedule = plan.schedule
        assert schedule in SCHEDULES, schedule
        cp, ep = plan_cp_ep(plan)
        return cls(
            cp_degree=cp,
            ep_degree=ep,
            ep_folding=bool(getattr(plan, "ep_folding", False)),
            etp_degree=int(getattr(plan, "etp_degree", 1)),
            tp_degree=plan.tp_degree,
            dp_degree=plan.dp_degree,
            pp_degree=plan.pp_degree,
            virtual_stages=plan.virtual_stages,
            micro_batch_size=plan.micro_batch_size,
            num_micro_batches=plan.num_micro_batches,
            schedule=schedule,
            zero_stage=plan.zero_stage,
            sequence_parallel=plan.sequence_parallel,
            tp_comm_overlap=bool(getattr(plan, "tp_comm_overlap", False)),
            dtype=plan.dtype,
            fp8_all_gather=bool(getattr(plan, "fp8_all_gather", False)),
            fp8_exclude=tuple(getattr(plan, "fp8_exclude", DEFAULT_FP8_EXCLUDE)),
            master_dtype=getattr(plan, "master_dtype", DEFAULT_MASTER_DTYPE),
            grad_reduce_dtype=getattr(plan, "grad_reduce_dtype", None),
            optimizer_state_dtype=getattr(
                plan, "optimizer_state_dtype", DEFAULT_OPTIMIZER_STATE_DTYPE
            ),
            compile=bool(getattr(plan, "compile", False)),
            dp_shard_degree=getattr(plan, "dp_shard_degree", None),
            optimizer_offload=float(getattr(plan, "optimizer_offload", 0.0)),
            rank_layout=layout,  # type: ignore[arg-type]
        )

    @property
    def num_devices(self) -> int:
        return self.tp_degree * self.dp_degree * self.pp_degree * self.cp_degree

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

    @property
    def precision(self) -> PrecisionPolicy:
        """The precision policy, defaults resolved (`cost_model.precision`)."""
        return precision_policy(
            self.dtype, self.master_dtype, self.grad_reduce_dtype, self.optimizer_state_dtype
        )

    @property
    def fp8(self) -> Fp8Recipe | None:
        """The plan's fp8 recipe (`cost_model.precision`), or None for a plain dtype."""
        return fp8_recipe(self.dtype)

    def degree(self, axis: Axis) -> int:
        return {
            "pp": self.pp_degree,
            "dp": self.dp_degree,
            "cp": self.cp_degree,
            "tp": self.tp_degree,
        }[axis]

    def axis_stride(self, axis: Axis) -> int:
        """Distance in global rank between neighbours along ``axis`` (as `autoplan.Plan`); an
        axis the layout leaves out (cp of degree 1) has stride 1."""
        if axis not in self.rank_layout:
            return 1
        idx = self.rank_layout.index(axis)
        return math.prod(self.degree(a) for a in self.rank_layout[idx + 1 :])

    def global_rank(self, *, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """Global rank of the device at mesh coordinates (pp, dp, cp, tp)."""
        coords = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        return sum(coords[a] * self.axis_stride(a) for a in self.rank_layout)

    @property
    def weight_dp_degree(self) -> int:
        """Ranks over which a dense weight's gradients reduce: dp x cp (ZeRO shards over them
        all, or under HSDP over `shard_degree` of them)."""
        return self.dp_degree * self.cp_degree

    @property
    def hsdp(self) -> bool:
        """Whether the weights are sharded within groups smaller than dp (HSDP)."""
        return self.dp_shard_degree is not None

    @property
    def shard_degree(self) -> int:
        """Ranks over which ZeRO shards a weight's state: ``dp_shard_degree`` under HSDP, else
        ``dp_degree`` (in `weights_view`, both times cp)."""
        return self.dp_degree if self.dp_shard_degree is None else self.dp_shard_degree

    @property
    def replicate_degree(self) -> int:
        """HSDP's replicas of each shard: dp / dp_shard_degree (1 without HSDP)."""
        return self.dp_degree // self.shard_degree

    @property
    def experts_span_tp(self) -> bool:
        """Whether the TP ranks route different tokens through the (never tensor-parallel)
        routed experts: under sequence parallelism each routes its own share of the sequence,
        so the experts' gradients also reduce over tp (or ep takes tp ranks, folded). Without
        it every TP rank routes the same tokens and computes the same expert gradients."""
        return self.tp_degree > 1 and (self.sequence_parallel or self.ep_folding)

    @property
    def expert_dp_degree(self) -> int:
        """Ranks that hold the same experts, over which their gradients reduce: dp x cp / ep
        (Megatron-LM's expert-data-parallel group, with cp folded in), x tp / etp when the TP
        ranks route different tokens (`experts_span_tp`; an expert's etp ranks hold different
        slices of it)."""
        tp = self.tp_degree // self.etp_degree if self.experts_span_tp else 1
        return self.dp_degree * self.cp_degree * tp // self.ep_degree

    @property
    def weights_view(self) -> Strategy:
        """The strategy as the data-parallel parts see dense weights: data parallel over
        dp x cp (their gradients reduce, and ZeRO shards, over both; under HSDP the shard
        groups are dp_shard_degree x cp ranks, as torchtitan's dp_shard x cp), no cp or ep.
        ``self`` when cp = ep = 1."""
        if self.cp_degree == 1 and self.ep_degree == 1:
            return self
        shard = None if self.dp_shard_degree is None else self.dp_shard_degree * self.cp_degree
        return dataclasses.replace(
            self,
            dp_degree=self.weight_dp_degree,
            cp_degree=1,
            ep_degree=1,
            ep_folding=False,
            etp_degree=1,
            dp_shard_degree=shard,
        )

    @property
    def expert_view(self) -> Strategy:
        """The strategy as the data-parallel parts see routed-expert weights: data parallel
        over the expert-data-parallel group (dp x cp / ep ranks)."""
        return dataclasses.replace(
            self,
            dp_degree=self.expert_dp_degree,
            cp_degree=1,
            ep_degree=1,
            ep_folding=False,
            etp_degree=1,
            dp_shard_degree=None,
        )

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
    of ``num_nodes`` nodes (``size = num_nodes * ranks_per_node`` for regular layouts). A
    "node" here is a scale-up domain (`Cluster.scale_up_domain`: a node, or a rack-scale
    NVLink domain), whose devices talk over the fast link."""

    size: int
    num_nodes: int
    ranks_per_node: int

    @property
    def crosses_nodes(self) -> bool:
        return self.num_nodes > 1


def group_placements(
    strategy: Strategy, cluster: Cluster, axis: GroupName
) -> tuple[GroupPlacement, ...]:
    """Every distinct placement among the ``axis`` groups of the mesh (usually one); ``axis``
    may also name a group spanning several axes (`GroupName`, `mesh_groups`)."""
    inside, outside = mesh_groups(strategy, axis)
    # (a "node" of a placement is a scale-up domain: the devices its fast links join)
    return _group_placements(inside, outside, cluster.scale_up_domain)


# The pieces of the mesh each group spans. Expert parallelism splits the data-sharded axes into
# an inner part (the ep group) and an outer one (the ranks holding the same experts): inside dp
# by default (ep consecutive data-parallel ranks, Megatron-LM's ``tp-cp-ep-dp-pp`` order), or
# folded over tp, then cp, then dp (`folded_ep_factors`). A piece of size 1 is left out.
_AXIS_PIECES: dict[str, frozenset[str]] = {
    "pp": frozenset({"pp"}),
    "dp": frozenset({"dp_in", "dp_out"}),
    "cp": frozenset({"cp_in", "cp_out"}),
    "tp": frozenset({"etp", "tp_in", "tp_out"}),
    "etp": frozenset({"etp"}),
    "dp_cp": frozenset({"dp_in", "dp_out", "cp_in", "cp_out"}),
}
_EP_PIECES = frozenset({"tp_in", "cp_in", "dp_in"})
_EDP_PIECES = frozenset({"tp_out", "cp_out", "dp_out"})


def mesh_groups(
    strategy: Strategy, group: GroupName
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """The ``group`` as (stride, size) factors, and the rest of the mesh likewise: the ranks of
    one group are ``base + sum_i c_i stride_i`` (``0 <= c_i < size_i`` over its factors), its
    bases the same sums over the rest. Factors of size 1 are left out."""
    stride = strategy.axis_stride
    tp, cp, dp, ep = (
        strategy.tp_degree,
        strategy.cp_degree,
        strategy.dp_degree,
        strategy.ep_degree,
    )
    # expert tensor parallelism: the innermost etp ranks of each TP group hold slices of the
    # same experts; ep folds over the tp / etp groups of them (Megatron-Core's expert rank
    # generator, etp innermost)
    etp = strategy.etp_degree
    if strategy.ep_folding:
        folded = folded_ep_factors(ep, tp // etp, cp, dp)
        assert folded is not None, (ep, tp, etp, cp, dp)
        ep_tp, ep_cp, ep_dp = folded
    else:
        ep_tp, ep_cp, ep_dp = 1, 1, ep
    pieces = {
        "pp": (stride("pp"), strategy.pp_degree),
        "etp": (stride("tp"), etp),
        "tp_in": (stride("tp") * etp, ep_tp),
        "tp_out": (stride("tp") * etp * ep_tp, tp // (etp * ep_tp)),
        "cp_in": (stride("cp"), ep_cp),
        "cp_out": (stride("cp") * ep_cp, cp // ep_cp),
        "dp_in": (stride("dp"), ep_dp),
        "dp_out": (stride("dp") * ep_dp, dp // ep_dp),
    }
    if group in ("dp_shard_cp", "dp_replicate") and strategy.hsdp:
        # HSDP (no expert parallelism, so dp is whole): dp_shard_degree consecutive dp ranks
        # shard, the dp / dp_shard_degree groups of them replicate (torchtitan's dp_shard
        # inside dp_replicate; Megatron-Core's intra-instance ranks, consecutive in dp-cp)
        shard = strategy.shard_degree
        del pieces["dp_in"], pieces["dp_out"]
        pieces["dp_shard"] = (stride("dp"), shard)
        pieces["dp_replicate"] = (stride("dp") * shard, dp // shard)
        names = (
            frozenset({"dp_shard", "cp_in", "cp_out"})
            if group == "dp_shard_cp"
            else frozenset({"dp_replicate"})
        )
    elif group == "dp_shard_cp":
        names = _AXIS_PIECES["dp_cp"]
    elif group == "dp_replicate":
        names = frozenset()
    elif group == "ep":
        names = _EP_PIECES
    elif group == "edp_cp" and not strategy.ep_folding:
        # ep inside dp (so tp_in and cp_in are empty): the other dp ranks and every cp rank,
        # and the TP ranks when they route different tokens through their replicated experts
        names = frozenset({"dp_out", "cp_out"})
        if strategy.experts_span_tp:
            names |= {"tp_out"}
    elif group == "edp_cp":
        names = _EDP_PIECES
    else:
        names = _AXIS_PIECES[group]
    inside = tuple(sorted(f for name, f in pieces.items() if name in names and f[1] > 1))
    outside = tuple(sorted(f for name, f in pieces.items() if name not in names and f[1] > 1))
    return inside, outside


@lru_cache(maxsize=4096)
def _group_placements(
    inside: tuple[tuple[int, int], ...],
    outside: tuple[tuple[int, int], ...],
    devices_per_node: int,
) -> tuple[GroupPlacement, ...]:
    size = math.prod(count for _, count in inside)
    if size == 1:
        return (GroupPlacement(size=1, num_nodes=1, ranks_per_node=1),)
    # A group's spread over nodes depends only on where its base falls within a node: the
    # residues of the bases modulo the node size (at most devices_per_node of them; i * step
    # modulo the node size repeats within devices_per_node steps).
    residues = {0}
    for step, count in outside:
        residues = {
            (r + i * step) % devices_per_node
            for r in residues
            for i in range(min(count, devices_per_node))
        }
    found: set[GroupPlacement] = set()
    if size > _VECTOR_GROUP:
        # (a data-parallel group of thousands of ranks: the nodes of every offset at once)
        spread = np.zeros(1, dtype=np.int64)
        for step, count in inside:
            spread = (spread[:, None] + np.arange(count, dtype=np.int64) * step).ravel()
        for base in residues:
            _, per_node = np.unique((base + spread) // devices_per_node, return_counts=True)
            found.add(
                GroupPlacement(
                    size=size, num_nodes=len(per_node), ranks_per_node=int(per_node.max())
                )
            )
        return tuple(sorted(found, key=lambda g: (g.num_nodes, g.ranks_per_node)))
    offsets = [0]
    for step, count in inside:
        offsets = [o + i * step for o in offsets for i in range(count)]
    for base in residues:
        counts: dict[int, int] = {}
        for offset in offsets:
            node = (base + offset) // devices_per_node
            counts[node] = counts.get(node, 0) + 1
        found.add(
            GroupPlacement(size=size, num_nodes=len(counts), ranks_per_node=max(counts.values()))
        )
    return tuple(sorted(found, key=lambda g: (g.num_nodes, g.ranks_per_node)))


# Groups larger than this are placed with numpy (`_group_placements`).
_VECTOR_GROUP = 64


def pipeline_link_crosses_nodes(
    strategy: Strategy, cluster: Cluster, from_pp_rank: int, to_pp_rank: int
) -> bool:
    """Whether any device of pipeline rank ``from_pp_rank`` sends to its peer (same dp and tp
    coordinates) of pipeline rank ``to_pp_rank`` in another scale-up domain. Stages are
    synchronous, so the slowest pair of the dp x tp peers sets the boundary's time."""
    return _pipeline_link(
        strategy.pp_degree,
        strategy.dp_degree,
        strategy.tp_degree,
        strategy.cp_degree,
        strategy.rank_layout,
        cluster.scale_up_domain,
        from_pp_rank,
        to_pp_rank,
    )


@lru_cache(maxsize=4096)
def _pipeline_link(
    pp: int,
    dp: int,
    tp: int,
    cp: int,
    layout: tuple[Axis, ...],
    devices_per_node: int,
    a: int,
    b: int,
) -> bool:
    strategy = Strategy(pp_degree=pp, dp_degree=dp, tp_degree=tp, cp_degree=cp, rank_layout=layout)
    # A peer at global rank x (pipeline rank a) and its partner x + delta (pipeline rank b)
    # sit on different nodes iff x's place within its node, plus delta, leaves the node: only
    # the residues of x modulo the node size matter, and along an axis of stride s the
    # residues of i s repeat within devices_per_node steps (not dp x cp x tp peers: 2^20
    # devices would walk 2^17 of them per boundary).
    node = devices_per_node
    pp_stride = strategy.axis_stride("pp")
    delta = (b - a) * pp_stride
    residues = {(a * pp_stride) % node}
    axes: tuple[tuple[Axis, int], ...] = (("dp", dp), ("cp", cp), ("tp", tp))
    for axis, count in axes:
        step = strategy.axis_stride(axis)
        residues = {(r + i * step) % node for r in residues for i in range(min(count, node))}
    return any(not 0 <= r + delta < node for r in residues)


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


# Units torch.compile compiles under a compiled plan: each block (and the units of a model traced
# without a block structure), as torchtitan compiles each TransformerBlock and leaves the
# embedding and the head eager (torchtitan/distributed/compile.py, apply_compile).
COMPILED_UNIT_KINDS: frozenset[UnitKind] = frozenset({"block", "other"})


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
    # the units a compiled stage compiles (`COMPILED_UNIT_KINDS`)
    compiled_unit_kinds: frozenset[UnitKind] = COMPILED_UNIT_KINDS


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
    - ``fsdp``: FSDP2 ``fully_shard`` per unit for ZeRO-1 (run as ZeRO-2) to ZeRO-3, and for
      HSDP (``dp_shard_degree``) at any of them, on a 2-D (replicate, shard) mesh;
    - ``replicate``: FSDP2 ``replicate`` per unit for ZeRO-0 otherwise.

    ZeRO-1 on DDP keeps its optimizer state in ZeroRedundancyOptimizer's own layout, which
    torch.distributed.checkpoint cannot save.
    """
    # the data-parallel group of the weights: dp x cp (context-parallel ranks hold replicas)
    replicas = strategy.weight_dp_degree
    if replicas == 1 and strategy.dtype == "fp32":
        wrapper: DataParallelWrapper = "none"
    elif (
        replicas > 1
        and strategy.zero_stage <= 1
        and strategy.tp_degree == 1
        and strategy.pp_degree == 1
        and strategy.dtype == "fp32"
        and not (strategy.schedule == "gpipe" and strategy.num_micro_batches > 1)
        # HSDP runs as FSDP2 over a 2-D (replicate, shard) mesh
        and not strategy.hsdp
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
