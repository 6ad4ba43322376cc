"""The plan: how one model is split over one cluster, as plain frozen data.

`Plan` is the only contract between the search and the passes, and the format users read and
edit (YAML, `schema_version` 1, every field documented in docs/plan-format.md). Construction
checks that the plan is consistent with itself; `Plan.validate` checks it against a model and a
cluster. Both raise `PlanError` naming the field, the value, the rule and the fix.

Rank layout: ``rank_layout`` orders the mesh axes from outermost to innermost. With the default
``("pp", "dp", "tp")`` the ranks of one TP group are consecutive (inside one node) and pipeline
stages are furthest apart, as in Megatron-LM. Stage ``i`` of ``pp_degree * virtual_stages``
stages runs where the schedule puts it (`cost_model.schedules`): pipeline rank ``i % pp_degree``
(torch's "loop" placement) for all but the V schedules (``zbv``, ``dualpipev``), which put
stages ``r`` and ``2 pp_degree - 1 - r`` on rank ``r``.

Context and expert parallelism: ``cp_degree`` splits every sequence over a ring of ranks (ring
attention, torch's load-balanced causal sharding into ``2 cp_degree`` chunks); the layout
then orders four axes, e.g. ``("pp", "dp", "cp", "tp")`` (Megatron-LM's ``tp-cp-ep-dp-pp``,
innermost first). A three-axis layout (plans written before cp) means cp = 1. ``ep_degree``
splits the experts of a mixture-of-experts model over ``ep_degree`` consecutive data-parallel
ranks: expert-data parallelism, dp = ep x edp for the expert weights, as DeepSpeed's
expert-data-parallel groups and Megatron-LM's expert rank generator (megatron/core/
parallel_state.py, ``initialize_model_parallel``: ``expert_data_parallel_size =
decoder_world_size // (expert_tensor_parallel_size * expert_model_parallel_size *
pipeline_model_parallel_size)``, so ep x edp = dp x cp there). Megatron-LM lets ep span dp x
cp; by default autoplan keeps ep inside dp (ep divides dp_degree), so the all-to-all never
mixes ranks that hold different chunks of one sequence. ``ep_folding`` takes Megatron-Core's
layout instead ("MoE parallel folding", Liu et al. 2025, arXiv:2504.14960; expert tensor
parallelism 1): the routed experts are not tensor-parallel, and an ep group is ``ep_degree``
consecutive ranks of the data-sharded block ``dp x cp x tp`` numbered tp innermost, then cp,
then dp (Megatron-LM's order), so ep may take TP and CP ranks and usually stays inside a node.
Every rank of that block must route its own tokens: with ``tp_degree > 1`` folding needs
sequence parallelism. Both degrees default to 1 and folding to false, and a plan at those
defaults writes none of the three fields: older plan files load and save byte for byte.
``etp_degree`` (expert tensor parallelism, Megatron-Core's ``--expert-tensor-parallel-size``)
splits each routed expert over ``etp_degree`` consecutive ranks of the TP group (gate and up
column-parallel, down row-parallel); it must divide ``tp_degree`` (`etp_problem`), and with
folding the ep groups fold over the ``tp / etp`` expert-TP groups of the block (Megatron-Core's
expert rank generator, etp innermost, then ep, then edp). The default 1 (not written) is
what autoplan did before it existed: routed experts are never tensor-parallel.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from autoplan._format import fmt_headroom, fmt_memory, fmt_time_range
from autoplan.contract.errors import PlanError, SchemaError
from cost_model.activation_offload import offloaded_mask, stage_activation_offload_problem
from cost_model.degrees import (
    AXES,
    LEGACY_AXES,
    Axis,
    RecomputeMode,
    count_problems,
    degree_product,
    etp_problem,
    is_whole,
    model_problems,
    shape_problems,
    tp_comm_overlap_problem,
    tp_fits_node,
)
from cost_model.degrees import COUNT_FIELDS as _COUNT_FIELDS
from cost_model.degrees import DTYPE_NAMES as DTYPE_NAMES
from cost_model.degrees import MAX_COUNT as MAX_COUNT
from cost_model.degrees import RECOMPUTE_MODES as RECOMPUTE_MODES
from cost_model.degrees import DTypeName as DTypeName
from cost_model.degrees import sequence_parallel_problems as _sp_problems
from cost_model.estimate import Estimate
from cost_model.frameworks import DEFAULT_FRAMEWORK, FrameworkError, framework_profile
from cost_model.frameworks.limits import expert_layout_refusal
from cost_model.hardware import Cluster, as_cluster
from cost_model.headroom import MemoryHeadroomError, check_memory_headroom
from cost_model.memory import activation_bytes
from cost_model.messages import shown_count
from cost_model.offload import (
    activation_offload_problem,
    host_link_problem,
    optimizer_offload_problem,
)
from cost_model.partial_recompute import (
    recompute_units_problem,
    stage_recompute_units_problem,
    unit_modes,
)
from cost_model.parts.fp8 import fp8_shape_problem
from cost_model.parts.offload import (
    activation_link_problem,
    host_held_micro_batches,
    host_memory_problem,
    optimizer_host_bytes,
)
from cost_model.precision import (
    DEFAULT_FP8_EXCLUDE,
    DEFAULT_MASTER_DTYPE,
    DEFAULT_OPTIMIZER_STATE_DTYPE,
    GradReduceDtype,
    MasterDtype,
    OptimizerStateDtype,
    PrecisionPolicy,
    fp8_field_problem,
    fp8_recipe,
    precision_policy,
    precision_problem,
)
from cost_model.schedules import SCHEDULES as _SCHEDULE_NAMES
from cost_model.schedules import (
    SPLIT_BACKWARD,
    ScheduleName,
    ScheduleSpec,
    stage_rank,
)
from cost_model.schema import (
    PATH_LIMIT,
    check_schema_version,
    from_data,
    read_yaml,
    shown,
    to_data,
    unit_field,
    write_yaml,
)
from cost_model.stage_splits import StageSplitError, even_stage_starts
from cost_model.strategy import Decisions, Strategy, valid_layout
from cost_model.workload import ModelProfile

PLAN_SCHEMA_VERSION = 1

# The name sets are the cost model's (`cost_model.degrees`), under the names plans use.
Schedule = ScheduleName
Recompute = RecomputeMode
MeshAxis = Axis
_AXES = AXES
SCHEDULES: tuple[Schedule, ...] = _SCHEDULE_NAMES
MESH_AXES: tuple[MeshAxis, ...] = LEGACY_AXES
# The four-axis layout a context-parallel plan uses by default (cp between dp and tp).
CP_RANK_LAYOUT: tuple[MeshAxis, ...] = AXES


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage (model chunk): pipeline units ``first_unit..last_unit`` inclusive."""

    first_unit: int
    last_unit: int
    recompute: Recompute = "none"
    # torch.compile of this stage's units: None (not written) takes the plan's ``compile``
    compile: bool | None = None
    # partial recompute: under ``recompute`` selective or full, how many of the stage's
    # recomputable units (its blocks) are recomputed, the first ones in order (Megatron-LM's
    # ``--recompute-method block --recompute-num-layers N`` per pipeline / virtual stage); the
    # others keep their activations. None (not written): all of them.
    recompute_units: int | None = None
    # activation offload: how many of the stage's blocks its recompute does not cover keep
    # their saved activations on the host, the first ones in order (Megatron-LM's
    # ``--cpu-offloading-num-layers N``, torch's ``save_on_cpu``; `cost_model.offload`);
    # 0 (not written): none.
    activation_offload: int = 0

    def __post_init__(self) -> None:
        for name in ("first_unit", "last_unit"):
            value = getattr(self, name)
            if not is_whole(value, None):
                raise PlanError(f"{name} = {shown(value)} must be a whole number")
            if value > MAX_COUNT:
                raise PlanError(
                    f"{name} = {shown_count(value)} is over {MAX_COUNT:,}; give a real unit"
                )
        if self.recompute not in RECOMPUTE_MODES:
            raise PlanError(
                f"recompute = {shown(self.recompute)} must be one of {', '.join(RECOMPUTE_MODES)}"
            )
        if (why := recompute_units_problem(self.recompute, self.recompute_units)) is not None:
            raise PlanError(why)
        if (why := activation_offload_problem(self.activation_offload)) is not None:
            raise PlanError(why)
        if self.compile is not None and not isinstance(self.compile, bool):
            raise PlanError(
                f"compile = {shown(self.compile)} must be true or false (or left out: the "
                "plan's compile)"
            )
        if self.first_unit < 0:
            raise PlanError(f"first_unit = {self.first_unit} must be >= 0")
        if self.last_unit < self.first_unit:
            raise PlanError(
                f"last_unit = {self.last_unit} is before first_unit = {self.first_unit}; "
                "a stage holds units first_unit..last_unit inclusive"
            )

    @property
    def num_units(self) -> int:
        return self.last_unit - self.first_unit + 1

    @property
    def unit_range(self) -> range:
        return range(self.first_unit, self.last_unit + 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRef:
    """Which model a plan was made for (checked when the plan is used)."""

    name: str
    num_units: int
    seq_len: int
    fingerprint: str = ""

    @classmethod
    def of(cls, profile: ModelProfile) -> ModelRef:
        """The reference to a traced model."""
        return cls(
            name=profile.name,
            num_units=profile.num_units,
            seq_len=profile.seq_len,
            fingerprint=profile.fingerprint,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEstimate:
    """The cost model's prediction for a plan on a named cluster (informational)."""

    cluster: str
    num_devices: int
    step_time_s: float = unit_field("time")
    tokens_per_s: float
    model_tflops_per_device: float
    mfu: float
    peak_memory_bytes: int = unit_field("bytes")
    # of the peak: the framework reserve and allocator margin (0: not recorded), and the device
    memory_reserve_bytes: int = unit_field("bytes", default=0)
    memory_capacity_bytes: int = unit_field("bytes", default=0)
    # the 80% range of the step time, and the upper end of the peak's (0: not recorded)
    step_time_low_s: float = unit_field("time", default=0.0)
    step_time_high_s: float = unit_field("time", default=0.0)
    peak_memory_high_bytes: int = unit_field("bytes", default=0)
    # the largest peak that fits with the plan's memory headroom and the peak's range, and that
    # headroom (0: not recorded; the peak is then judged against the capacity)
    memory_usable_bytes: int = unit_field("bytes", default=0)
    memory_headroom: float = 0.0

    @property
    def step_time_range_s(self) -> tuple[float, float]:
        return (self.step_time_low_s, self.step_time_high_s)

    def __str__(self) -> str:
        """One sentence: "on 64 dgx-a100-80g devices: a step takes 3.99 s (131,539 tokens/s,
        MFU 57.4%); peak memory predicted 70.8 GiB + 5.5 GiB reserve/margin of 80 GiB"."""
        fits = ""
        if self.memory_capacity_bytes:
            usable = self.memory_usable_bytes or self.memory_capacity_bytes
            fits = " (fits)" if self.peak_memory_bytes <= usable else (" (DOES NOT FIT)")
        memory = fmt_memory(
            self.peak_memory_bytes, self.memory_reserve_bytes, self.memory_capacity_bytes
        )
        if self.memory_usable_bytes:
            memory += ", " + fmt_headroom(
                self.peak_memory_bytes,
                self.memory_capacity_bytes,
                self.memory_headroom,
                self.memory_usable_bytes,
            )
        return (
            f"on {self.num_devices} {self.cluster} devices: a step takes "
            f"{fmt_time_range(self.step_time_s, self.step_time_range_s)} "
            f"({self.tokens_per_s:,.0f} tokens/s, MFU "
            f"{self.mfu:.1%}); peak memory {memory}{fits}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Degrees, stages, batching, schedule, sharding and recompute for one training job."""

    schema_version: int = PLAN_SCHEMA_VERSION
    model: ModelRef | None = None
    dp_degree: int
    tp_degree: int
    pp_degree: int
    cp_degree: int = 1
    ep_degree: int = 1
    # ep over the dp x cp x tp block (Megatron-Core's folding) instead of inside dp
    ep_folding: bool = False
    # each routed expert split over etp consecutive ranks of the TP group (expert tensor
    # parallelism; `cost_model.parts.expert_parallel`); 1 (not written): not split
    etp_degree: int = 1
    virtual_stages: int = 1
    stages: tuple[StagePlan, ...]
    micro_batch_size: int
    num_micro_batches: int
    global_batch_size: int
    schedule: Schedule = "1f1b"
    zero_stage: int = 0
    # HSDP (`cost_model.degrees.hsdp_problems`): the weights sharded within groups of this
    # many consecutive dp ranks (x cp), replicated across the dp / dp_shard_degree groups;
    # None (not written): over all of dp. Equal to dp_degree it is stored as None.
    dp_shard_degree: int | None = None
    sequence_parallel: bool = False
    # The sequence-parallel TP all-gathers and reduce-scatters pipelined with the GEMMs they
    # feed or follow (Megatron-LM's --tp-comm-overlap, torch's async TP;
    # `cost_model.parts.tensor_parallel`); needs sequence_parallel with tp_degree > 1 and is
    # written only when true.
    tp_comm_overlap: bool = False
    dtype: DTypeName = "bf16"
    # The precision policy (`cost_model.precision.PrecisionPolicy`): the master weights',
    # gradient accumulation and reduction's (None: the dtype's default, fp32 or fp16 under
    # fp16) and AdamW's moments' dtypes; written only where they differ from the defaults.
    master_dtype: MasterDtype = DEFAULT_MASTER_DTYPE
    grad_reduce_dtype: GradReduceDtype | None = None
    optimizer_state_dtype: OptimizerStateDtype = DEFAULT_OPTIMIZER_STATE_DTYPE
    # Under an fp8 recipe (`cost_model.precision`): FSDP2 all-gathers the converted linears'
    # weights in fp8 (tensor-wise fp8 with ZeRO >= 1), and the linears kept in bf16 ("head",
    # "router", or module names and their prefixes).
    fp8_all_gather: bool = False
    fp8_exclude: tuple[str, ...] = DEFAULT_FP8_EXCLUDE
    # torch.compile of every unit (each block apart, as torchtitan compiles each
    # TransformerBlock); a stage's own ``compile`` overrides it (`cost_model.parts.fusion`)
    compile: bool = False
    # The share (0 to 1) of each device's optimizer step, with its master weights and moments,
    # kept and run on the host CPU (Megatron-LM's --optimizer-offload-fraction, DeepSpeed's
    # offload_optimizer; `cost_model.parts.offload`); written only when above 0.
    optimizer_offload: float = 0.0
    rank_layout: tuple[MeshAxis, ...] = ("pp", "dp", "tp")
    # The training stack the plan is priced for (`cost_model.frameworks`): autoplan's runtime,
    # or a stack `autoplan export` writes a launch config for.
    framework: str = DEFAULT_FRAMEWORK
    # The share of each device's memory the plan was made to leave free beyond the upper end of
    # its peak's range (`cost_model.headroom`); None (files written before it existed): the
    # default. `autoplan validate` and `parallelize` check the plan with it.
    memory_headroom: float | None = field(default=None, compare=False)
    estimate: PlanEstimate | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if type(self.schema_version) is not int or self.schema_version != PLAN_SCHEMA_VERSION:
            raise PlanError(
                f"schema_version = {shown(self.schema_version)}; this autoplan reads version "
                f"{PLAN_SCHEMA_VERSION}"
            )
        _raise_first(count_problems({name: getattr(self, name) for name in _COUNT_FIELDS}))
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero_stage = {shown(self.zero_stage)} must be 0, 1, 2 or 3")
        if self.dtype not in DTYPE_NAMES:
            raise PlanError(f"dtype = {shown(self.dtype)} must be one of {', '.join(DTYPE_NAMES)}")
        if self.schedule not in SCHEDULES:
            raise PlanError(
                f"schedule = {shown(self.schedule)} must be one of {', '.join(SCHEDULES)}"
            )
        problem = fp8_field_problem(
            self.dtype, self.fp8_all_gather, self.fp8_exclude, self.zero_stage
        ) or precision_problem(
            self.dtype, self.master_dtype, self.grad_reduce_dtype, self.optimizer_state_dtype
        )
        if problem is not None:
            raise PlanError(problem)
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(
                f"sequence_parallel = {shown(self.sequence_parallel)} must be true or false"
            )
        problem = tp_comm_overlap_problem(
            self.tp_degree, self.sequence_parallel, self.tp_comm_overlap
        )
        if problem is not None:
            raise PlanError(problem)
        if not isinstance(self.compile, bool):
            raise PlanError(f"compile = {shown(self.compile)} must be true or false")
        if (problem := optimizer_offload_problem(self.optimizer_offload)) is not None:
            raise PlanError(problem)
        try:
            stack = framework_profile(self.framework)
        except FrameworkError as error:
            raise PlanError(f"framework = {shown(self.framework)}: {error}") from None
        # the spec in its normal form (``megatron-lm:`` is ``megatron-lm``)
        object.__setattr__(self, "framework", stack.name)
        if not isinstance(self.stages, tuple) or not all(
            isinstance(stage, StagePlan) for stage in self.stages
        ):
            raise PlanError("stages must be a tuple of StagePlan")
        if not isinstance(self.rank_layout, tuple) or not valid_layout(self.rank_layout):
            layout = (
                shown(list(self.rank_layout))
                if isinstance(self.rank_layout, (tuple, list))
                else shown(self.rank_layout)
            )
            raise PlanError(
                f"rank_layout = {layout} must order each of pp, dp, tp once, "
                "and cp once or not at all (outermost first), e.g. [pp, dp, tp] or "
                "[pp, dp, cp, tp]"
            )
        if self.cp_degree > 1 and "cp" not in self.rank_layout:
            raise PlanError(
                f"cp_degree = {self.cp_degree} needs 'cp' in rank_layout = "
                f"{list(self.rank_layout)}; place it, e.g. [pp, dp, cp, tp]"
            )
        if not isinstance(self.ep_folding, bool):
            raise PlanError(f"ep_folding = {shown(self.ep_folding)} must be true or false")
        if self.memory_headroom is not None:
            try:
                check_memory_headroom(self.memory_headroom)
            except MemoryHeadroomError as error:
                raise PlanError(f"memory_headroom: {error}") from None
        if (etp_why := etp_problem(self.tp_degree, self.etp_degree)) is not None:
            raise PlanError(etp_why)
        self._check_expert_layout()
        if type(self.dp_shard_degree) is int and self.dp_shard_degree == self.dp_degree:
            object.__setattr__(self, "dp_shard_degree", None)  # all of dp: the default
        _raise_first(shape_problems(self, len(self.stages)))
        self._check_stages()

    def _check_expert_layout(self) -> None:
        """A stack that places expert-parallel groups one way only cannot run the other where
        the two differ (ep taking TP or CP ranks, or not): `expert_layout_refusal`."""
        refusal = expert_layout_refusal(
            framework_profile(self.framework),
            ep_degree=self.ep_degree,
            tp_degree=self.tp_degree,
            cp_degree=self.cp_degree,
            ep_folding=self.ep_folding,
            etp_degree=self.etp_degree,
        )
        if refusal is not None:
            raise PlanError(str(refusal))

    def _check_stack(self, profile: ModelProfile) -> None:
        """The plan's stack runs it on ``profile``'s model (`FrameworkProfile.plan_refusal`;
        autoplan's runtime with its traced graph's limits: `runtime_refusal`)."""
        if self.framework == DEFAULT_FRAMEWORK:
            refusal = runtime_refusal(self, profile)
            if refusal is not None:
                raise PlanError(refusal)
            return
        why = framework_profile(self.framework).plan_refusal(self, profile)
        if why is not None:
            # as the estimate refuses it: the stack, not the plan's own shape
            raise FrameworkError(
                f"{self.framework} cannot run this plan: {why}, or price it for autoplan's "
                "runtime (framework autoplan)"
            )

    @property
    def folded_expert_groups(self) -> bool:
        """Whether the ep groups are Megatron-Core's folded ones (ep consecutive ranks of the
        dp x cp x tp block, tp innermost): with ``ep_folding``, or with tp = cp = 1, where ep
        consecutive data-parallel ranks are the same ranks."""
        return self.ep_folding or self.tp_degree == self.cp_degree == 1

    def _block_index(self, rank: int) -> tuple[int, int]:
        """(pipeline rank, index in the data-sharded block): the block numbers the dp x cp x tp
        ranks of one pipeline rank tp innermost, then cp, then dp."""
        coord = {axis: (rank // self.axis_stride(axis)) % self.degree(axis) for axis in _AXES}
        index = (coord["dp"] * self.cp_degree + coord["cp"]) * self.tp_degree + coord["tp"]
        return coord["pp"], index

    def _block_rank(self, pp: int, index: int) -> int:
        """The global rank at (pipeline rank, block index): `_block_index` inverted."""
        tp = index % self.tp_degree
        cp = (index // self.tp_degree) % self.cp_degree
        dp = index // (self.tp_degree * self.cp_degree)
        coord = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        return sum(coord[axis] * self.axis_stride(axis) for axis in _AXES)

    def _check_stages(self) -> None:
        # the stage count is checked with the degrees (`shape_problems`)
        next_unit = 0
        for idx, stage in enumerate(self.stages):
            if stage.first_unit != next_unit:
                raise PlanError(
                    f"stages[{idx}].first_unit = {stage.first_unit}; stages must cover the units "
                    f"once each in order, so it must be {next_unit}"
                )
            next_unit = stage.last_unit + 1
        if self.model is not None and next_unit != self.model.num_units:
            raise PlanError(
                f"stages end at unit {next_unit - 1} but the plan's model.num_units = "
                f"{self.model.num_units} (units 0..{self.model.num_units - 1}); extend the last "
                "stage's last_unit, or correct model.num_units"
            )

    # ----------------------------------------------------------------------------- derived

    @property
    def num_devices(self) -> int:
        return self.dp_degree * self.tp_degree * self.pp_degree * self.cp_degree

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_units(self) -> int:
        return self.stages[-1].last_unit + 1

    @property
    def precision(self) -> PrecisionPolicy:
        """The plan's precision policy, defaults resolved (`cost_model.precision`)."""
        return precision_policy(
            self.dtype, self.master_dtype, self.grad_reduce_dtype, self.optimizer_state_dtype
        )

    def stage_compiled(self, stage_idx: int) -> bool:
        """Whether stage ``stage_idx`` runs torch.compile: its own ``compile``, else the
        plan's."""
        own = self.stages[stage_idx].compile
        return self.compile if own is None else own

    @property
    def any_compiled(self) -> bool:
        """Whether any stage runs torch.compile."""
        return any(self.stage_compiled(s) for s in range(self.num_stages))

    def degree(self, axis: MeshAxis) -> int:
        return {
            "pp": self.pp_degree,
            "dp": self.dp_degree,
            "cp": self.cp_degree,
            "tp": self.tp_degree,
        }[axis]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Device-mesh shape in ``rank_layout`` order (outermost first)."""
        return tuple(self.degree(axis) for axis in self.rank_layout)

    def axis_stride(self, axis: MeshAxis) -> int:
        """Distance in global rank between neighbours along ``axis`` (1 for an axis the layout
        leaves out: cp of degree 1)."""
        if axis not in self.rank_layout:
            return 1
        idx = self.rank_layout.index(axis)
        return math.prod(self.degree(a) for a in self.rank_layout[idx + 1 :])

    def group_ranks(self, axis: MeshAxis, rank: int = 0) -> tuple[int, ...]:
        """Global ranks of the ``axis`` group that contains ``rank``."""
        stride = self.axis_stride(axis)
        degree = self.degree(axis)
        base = rank - ((rank // stride) % degree) * stride
        return tuple(base + i * stride for i in range(degree))

    def shard_group_ranks(self, rank: int = 0) -> tuple[int, ...]:
        """Global ranks of the HSDP shard group that contains ``rank``: ``dp_shard_degree``
        consecutive data-parallel ranks (same pp, cp and tp coordinates; all of dp without
        HSDP). Under context parallelism the weights shard over these times the cp ranks."""
        shard = self.dp_shard_degree or self.dp_degree
        stride = self.axis_stride("dp")
        d = (rank // stride) % self.dp_degree
        base = rank - (d % shard) * stride
        return tuple(base + i * stride for i in range(shard))

    def replicate_group_ranks(self, rank: int = 0) -> tuple[int, ...]:
        """Global ranks holding the same HSDP shard as ``rank``: the data-parallel ranks at the
        same place in the other shard groups (``dp_degree / dp_shard_degree`` of them; ``rank``
        alone without HSDP)."""
        shard = self.dp_shard_degree or self.dp_degree
        stride = self.axis_stride("dp")
        d = (rank // stride) % self.dp_degree
        base = rank - (d - d % shard) * stride
        return tuple(base + i * shard * stride for i in range(self.dp_degree // shard))

    def ep_group_ranks(self, rank: int = 0) -> tuple[int, ...]:
        """Global ranks of the expert-parallel group that contains ``rank``: ``ep_degree``
        consecutive data-parallel ranks (same pp, cp and tp coordinates), which split the experts
        among them and exchange tokens by all-to-all. With ``ep_folding``: ``ep_degree``
        consecutive ranks of the dp x cp x tp block (`_block_index`), counted in etp-sized
        steps under expert tensor parallelism (the ranks at this rank's place in consecutive
        expert-TP groups: Megatron-Core's expert rank generator, etp innermost, then ep)."""
        if self.ep_folding:
            pp, index = self._block_index(rank)
            etp, group = self.etp_degree, index // self.etp_degree
            first = (group - group % self.ep_degree) * etp + index % etp
            return tuple(self._block_rank(pp, first + i * etp) for i in range(self.ep_degree))
        stride = self.axis_stride("dp")
        d = (rank // stride) % self.dp_degree
        base = rank - (d % self.ep_degree) * stride
        return tuple(base + i * stride for i in range(self.ep_degree))

    def etp_group_ranks(self, rank: int = 0) -> tuple[int, ...]:
        """Global ranks of the expert-tensor-parallel group that contains ``rank``: the
        ``etp_degree`` consecutive ranks of its TP group that split each of their routed experts
        (Megatron-Core's expert rank generator puts etp innermost); ``rank`` alone at etp 1."""
        stride = self.axis_stride("tp")
        t = (rank // stride) % self.tp_degree
        base = rank - (t % self.etp_degree) * stride
        return tuple(base + i * stride for i in range(self.etp_degree))

    def expert_data_group_ranks(self, rank: int = 0) -> tuple[int, ...]:
        """Global ranks that hold the same experts as ``rank`` (same pp and tp coordinates, the
        same position in their expert-parallel group, any cp coordinate): the group over which
        expert gradients reduce, ``dp_degree x cp_degree / ep_degree`` ranks. With
        ``ep_folding``: the ranks of the dp x cp x tp block at the same position in their ep group,
        ``dp x cp x tp / ep`` of them (``/ etp``: the same place in their expert-TP group too)."""
        if self.ep_folding:
            pp, index = self._block_index(rank)
            block = self.dp_degree * self.cp_degree * self.tp_degree
            etp, span = self.etp_degree, self.ep_degree * self.etp_degree
            start = (index // etp) % self.ep_degree * etp + index % etp
            return tuple(sorted(self._block_rank(pp, i) for i in range(start, block, span)))
        dp_stride, cp_stride = self.axis_stride("dp"), self.axis_stride("cp")
        d = (rank // dp_stride) % self.dp_degree
        c = (rank // cp_stride) % self.cp_degree
        base = rank - (d - d % self.ep_degree) * dp_stride - c * cp_stride
        return tuple(
            sorted(
                base + block * self.ep_degree * dp_stride + k * cp_stride
                for block in range(self.dp_degree // self.ep_degree)
                for k in range(self.cp_degree)
            )
        )

    @property
    def schedule_spec(self) -> ScheduleSpec:
        """The pipeline schedule with its degrees (`cost_model.schedules`)."""
        return ScheduleSpec(
            schedule=self.schedule,
            pp_degree=self.pp_degree,
            virtual_stages=self.virtual_stages,
            num_micro_batches=self.num_micro_batches,
        )

    def pipeline_rank_of_stage(self, stage_idx: int) -> int:
        return stage_rank(self.schedule_spec.placement, self.pp_degree, stage_idx)

    def stages_of_pipeline_rank(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if self.pipeline_rank_of_stage(s) == pp_rank)

    # ----------------------------------------------------------------------------- checks

    def validate(
        self,
        graph: HasProfile | ModelProfile | None,
        cluster: Cluster | str,
        *,
        allow_cross_node_tp: bool = False,
        stack: bool = True,
    ) -> None:
        """Check the plan against a model (optional) and a cluster (or its spec string);
        raises PlanError, or FrameworkError where the plan's stack cannot run it (``stack``
        False: not that, for a plan whose stages are still to be cut the stack's way, as
        `autoplan.manual_plan` builds one; autoplan's runtime's limits apply either way)."""
        cluster = as_cluster(cluster)
        conflict = split_backward_conflict(
            self.schedule,
            self.zero_stage,
            (stage.recompute for stage in self.stages),
            compiled=self.any_compiled,
        )
        if conflict is not None:
            raise PlanError(conflict)
        if self.num_devices != cluster.num_devices:
            names, values, _ = degree_product(
                self.dp_degree, self.tp_degree, self.pp_degree, self.cp_degree
            )
            raise PlanError(
                f"{names} = {values} = {self.num_devices} devices, but "
                f"cluster {shown(cluster.name)} has "
                f"{cluster.num_devices} ({cluster.num_nodes} node(s) x "
                f"{cluster.devices_per_node}); change the degrees so they multiply to "
                f"{cluster.num_devices}"
            )
        missing = cluster.device.missing_rate(self.dtype)
        if missing is not None and fp8_recipe(self.dtype) is not None:
            raise PlanError(missing)
        if missing is not None:
            raise PlanError(
                f"dtype = {shown(self.dtype)}, but {missing}; use dtype 'fp16', or add "
                f"device.peak_flops.{self.dtype} to the cluster file"
            )
        if not allow_cross_node_tp and self.tp_degree > 1:
            # the fast link joins a scale-up domain: a node, or a rack-scale NVLink domain
            domain = cluster.scale_up_domain
            domains = {cluster.domain_of(r) for r in self.group_ranks("tp", 0)}
            if len(domains) > 1 or not tp_fits_node(self.tp_degree, domain):
                what = (
                    f"nodes of {domain} devices"
                    if domain == cluster.devices_per_node
                    else f"scale-up domains of {domain} devices"
                )
                raise PlanError(
                    f"tp_degree = {self.tp_degree} with rank_layout {list(self.rank_layout)} "
                    f"puts a tensor-parallel group across {what}; TP needs the fast scale-up "
                    f"link: use a tp_degree that divides {domain} with 'tp' innermost in "
                    "rank_layout, or allow cross-node TP"
                )
        if (
            self.tp_comm_overlap
            and len({cluster.domain_of(r) for r in self.group_ranks("tp", 0)}) > 1
        ):
            # Transformer Engine's userbuffers and torch's symmetric memory map the TP peers'
            # memory, which only GPUs of one NVLink (scale-up) domain share
            raise PlanError(
                f"tp_comm_overlap with tp_degree = {self.tp_degree} across scale-up domains of "
                f"{cluster.scale_up_domain} devices: the overlap moves shards through the TP "
                "peers' memory (Transformer Engine's userbuffers, torch's symmetric memory), "
                "which only GPUs of one NVLink domain share; keep TP inside a domain, or set "
                "tp_comm_overlap: false"
            )
        device = cluster.device
        link = device.host_link_bandwidth_bytes_per_s
        offload_problem = host_link_problem(self.optimizer_offload, device.name, device.kind, link)
        if offload_problem is not None:
            raise PlanError(offload_problem)
        offloaded = [stage.activation_offload for stage in self.stages]
        offload_problem = activation_link_problem(
            cluster, sum(offloaded), f"activation_offload {offloaded}"
        )
        if offload_problem is not None:
            raise PlanError(offload_problem)
        if graph is not None:
            profile = graph if isinstance(graph, ModelProfile) else graph.profile
            self._validate_model(profile, stack=stack)
            if (problem := self._host_memory_problem(profile, cluster)) is not None:
                raise PlanError(problem)

    def _host_memory_problem(self, profile: ModelProfile, cluster: Cluster) -> str | None:
        """What the plan offloads against the device's share of its node's host memory
        (`Cluster.host_memory_bytes`). The optimizer state: the model's parameters split over
        tp x pp (x ep for routed experts, taken as dense here: an upper bound), sharded over
        the shard group from ZeRO-1 on. The saved activations: each stage's offloaded blocks'
        (as recompute 'none' saves them), for as many micro-batches as its rank can hold (all
        of them under GPipe, else at most the pipeline's stages: an upper bound), summed over
        the stages (every stage on one rank: an upper bound)."""
        strategy = Strategy.of(self)
        host = optimizer_host_bytes(profile, strategy)
        held = host_held_micro_batches(strategy)
        traced = profile.traced_dtype_bytes
        for stage in self.stages:
            if not stage.activation_offload:
                continue
            kinds = [profile.units[u].kind for u in stage.unit_range]
            modes = unit_modes(stage.recompute, kinds, stage.recompute_units)
            mask = offloaded_mask(kinds, modes, stage.activation_offload)
            saved = sum(
                activation_bytes(profile.units[u], strategy, "none", traced) / self.cp_degree
                for u, host_side in zip(stage.unit_range, mask, strict=True)
                if host_side
            )
            host += held * saved
        what = "the plan's offload puts"
        return host_memory_problem(host, cluster, what=what)

    def _validate_model(self, profile: ModelProfile, *, stack: bool) -> None:
        if (problem := fp8_shape_problem(profile, Strategy.of(self))) is not None:
            raise PlanError(problem)
        model = self.model
        if model and model.fingerprint and profile.fingerprint != model.fingerprint:
            if model.name == profile.name:
                raise PlanError(
                    "plan's model.fingerprint "
                    f"{shown(model.fingerprint, quoted=False)} is not that of model "
                    f"{shown(profile.name)} ({profile.fingerprint}): the model changed since the "
                    "plan was made, or the file's model section was edited; search a new plan"
                )
            raise PlanError(
                f"plan was made for model {shown(model.name)} "
                f"(fingerprint {shown(model.fingerprint, quoted=False)}), "
                f"not {shown(profile.name)} (fingerprint {profile.fingerprint}); "
                "search a new plan for this model"
            )
        if model and model.seq_len != profile.seq_len:
            # the fingerprint hashes the sequence too, but a hand-edited file keeps the old one
            raise PlanError(
                f"model.seq_len = {model.seq_len}, but model {shown(profile.name)} is traced at "
                f"{profile.seq_len} tokens: the plan's memory and time are for "
                f"{model.seq_len}; set model.seq_len back to {profile.seq_len}, or search a "
                f"plan at {model.seq_len} tokens"
            )
        if self.num_units != profile.num_units:
            raise PlanError(
                f"stages cover {self.num_units} units but model {shown(profile.name)} has "
                f"{profile.num_units}; the last stage's last_unit must be {profile.num_units - 1}"
            )
        _raise_first(model_problems(self, profile))
        _raise_first(
            why
            for idx, stage in enumerate(self.stages)
            if (
                why := stage_recompute_units_problem(
                    idx, stage.recompute_units, [profile.units[u].kind for u in stage.unit_range]
                )
            )
            is not None
        )
        for idx, stage in enumerate(self.stages):
            if not stage.activation_offload:
                continue
            kinds = [profile.units[u].kind for u in stage.unit_range]
            modes = unit_modes(stage.recompute, kinds, stage.recompute_units)
            why = stage_activation_offload_problem(idx, stage.activation_offload, kinds, modes)
            if why is not None:
                raise PlanError(why)
        if stack or self.framework == DEFAULT_FRAMEWORK:
            self._check_stack(profile)
        _raise_first(_sp_problems(self, profile.seq_len))

    # ----------------------------------------------------------------------------- files

    @classmethod
    def from_data(cls, data: object, *, source: str = "plan") -> Plan:
        try:
            body = check_schema_version(data, PLAN_SCHEMA_VERSION, "the plan")
            return from_data(cls, body)
        except SchemaError as error:
            raise PlanError(f"plan {shown(source, PATH_LIMIT)}: {error}") from None
        except PlanError as error:
            raise PlanError(f"plan {shown(source, PATH_LIMIT)}: {error}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> Plan:
        """Load and check a plan file; raises PlanError naming the bad field."""
        try:
            data = read_yaml(path, "plan")
        except SchemaError as error:
            raise PlanError(str(error)) from None
        return cls.from_data(data, source=str(path))

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = to_data(self)
        if data["estimate"] is None:
            del data["estimate"]
        if data["model"] is None:
            del data["model"]
        # cp and ep at their default are left out: a plan without them reads and writes as
        # before they existed (golden files, digests)
        for name in ("cp_degree", "ep_degree"):
            if data[name] == 1:
                del data[name]
        if not data["ep_folding"]:
            del data["ep_folding"]
        if data["etp_degree"] == 1:  # written only when experts are split
            del data["etp_degree"]
        if data["memory_headroom"] is None:
            del data["memory_headroom"]
        if not data["tp_comm_overlap"]:  # written only when on
            del data["tp_comm_overlap"]
        if not data["optimizer_offload"]:  # written only when some is offloaded
            del data["optimizer_offload"]
        # the precision policy at its defaults is left out (files read and write as before it)
        if data["master_dtype"] == DEFAULT_MASTER_DTYPE:
            del data["master_dtype"]
        if data["grad_reduce_dtype"] is None:
            del data["grad_reduce_dtype"]
        if data["optimizer_state_dtype"] == DEFAULT_OPTIMIZER_STATE_DTYPE:
            del data["optimizer_state_dtype"]
        if data["dp_shard_degree"] is None:  # all of dp: left out, as before HSDP
            del data["dp_shard_degree"]
        # the fp8 fields only under an fp8 recipe (a bf16 plan reads and writes as before)
        if fp8_recipe(self.dtype) is None:
            del data["fp8_all_gather"], data["fp8_exclude"]
        # compile at its default (false; a stage's None: the plan's) is left out
        if not data["compile"]:
            del data["compile"]
        for stage in data["stages"]:
            if stage["compile"] is None:
                del stage["compile"]
            if stage["recompute_units"] is None:  # all of the stage's blocks: left out
                del stage["recompute_units"]
            if not stage["activation_offload"]:  # none offloaded: left out
                del stage["activation_offload"]
        return data

    @property
    def decisions(self) -> Decisions:
        """What autoplan's runtime does for this plan, decided once (`cost_model.strategy.decide`):
        the data-parallel wrapper, the ZeRO stage that runs, whether its state checkpoints, the
        torch schedule class and what recompute keeps. The passes carry it out; the cost model
        prices it."""
        return Strategy.of(self).decisions

    @property
    def zero_text(self) -> str:
        """``ZeRO-2``; ``ZeRO-1 (runs as ZeRO-2)`` when the runtime runs another stage than the
        plan names (ZeRO-1 outside DDP: FSDP2 shards gradients too); under HSDP with its groups,
        ``ZeRO-3 HSDP (shard 8 x replicate 4)``."""
        run = self.decisions.zero_stage
        # `decide` is autoplan's runtime: other stacks run the stage the plan names
        if self.framework != DEFAULT_FRAMEWORK:
            run = self.zero_stage
        suffix = "" if run == self.zero_stage else f" (runs as ZeRO-{run})"
        if (shard := self.dp_shard_degree) is not None:
            suffix += f" HSDP (shard {shard} x replicate {self.dp_degree // shard})"
        return f"ZeRO-{self.zero_stage}{suffix}"

    def checkpoint_problem(self) -> str | None:
        """Why `torch.distributed.checkpoint` cannot save this plan's training state, or None
        (`Strategy.checkpointable`; `Checkpointer`, `Trainer` and ``autoplan validate
        --checkpoint`` refuse such plans before they run)."""
        if self.decisions.checkpointable:
            return None
        return (
            "state_dict() is not supported with zero_stage 1 on DDP (ZeroRedundancyOptimizer "
            "keeps optimizer state in a layout torch.distributed.checkpoint cannot save); use "
            "zero_stage 2, which shards the optimizer state the same way"
        )

    def digest(self) -> str:
        """A short hash of what the runtime runs (everything but the estimate): two ranks whose
        plans have the same digest build the same job."""
        data = self.to_data()
        data.pop("estimate", None)
        data.pop("memory_headroom", None)  # a planning margin: the job it builds is the same
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:15]

    def to_yaml(self, path: str | Path) -> None:
        header = (
            "# autoplan plan: every field is described in docs/plan-format.md.\n"
            "# Edit freely; `autoplan validate` checks the result.\n"
        )
        write_yaml(path, self.to_data(), header=header)

    def with_estimate(self, estimate: PlanEstimate | None) -> Plan:
        return replace(self, estimate=estimate)


def _raise_first(problems: Iterable[str]) -> None:
    """Raise `PlanError` with the first of ``problems`` (the validity rules of
    `cost_model.degrees`), if any."""
    for problem in problems:
        raise PlanError(problem)


def split_backward_conflict(
    schedule: Schedule,
    zero_stage: int,
    recompute: Iterable[Recompute],
    *,
    compiled: bool = False,
) -> str | None:
    """Why autoplan's runtime refuses ``schedule`` with this ZeRO stage, these per-stage
    recompute modes and torch.compile in some stage (``compiled``) (a message naming the rule
    and the fix), or None if it runs them.

    The zero-bubble schedules (``interleaved-zb``, ``zbv``, ``dualpipev``) split each backward
    into backward-input and backward-weight, two ``torch.autograd.grad`` calls over one graph
    (torch's ``stage_backward_input`` / ``stage_backward_weight``). Measured with torch 2.13 on
    CPU/gloo (docs/plan-format.md, "Schedules at run time"): FSDP2 resharding after forward
    (ZeRO-3) gets the weight gradients wrong; selective recompute allows one backward through
    a region and fails; full recompute gives the right gradients but re-runs each block once for
    backward-input and once per weight-gradient group for backward-weight. A compiled unit's
    backward is one autograd node (AOTAutograd's compiled backward), which frees its saved
    buffers after one call: backward-weight's second call fails (measured, torch 2.13 on CPU).
    """
    if schedule not in SPLIT_BACKWARD:
        return None
    if compiled:
        return (
            f"compile with schedule {shown(schedule)}: a compiled unit's backward is one "
            "autograd node (AOTAutograd's compiled backward, its saved buffers donated to the "
            "first call), and torch's split backward calls it twice (backward-input, then "
            "backward-weight; torch raises 'compiled with non-empty donated buffers ... "
            "retain_graph=False'); use schedule 'interleaved-1f1b', or compile: false"
        )
    if zero_stage == 3:
        return (
            f"zero_stage = 3 with schedule {shown(schedule)}: with FSDP2 resharding parameters "
            "after forward (ZeRO-3), torch's split backward (backward-input, then "
            "backward-weight) silently gets the weight gradients wrong (measured: block "
            "gradients off by up to 45%); use zero_stage 2 (the same sharding of gradients "
            "and optimizer state, parameters kept gathered from forward to backward) or a "
            "schedule without split backward ('interleaved-1f1b')"
        )
    for idx, mode in enumerate(recompute):
        if mode != "none":
            return (
                f"stages[{idx}].recompute = {shown(mode)} with schedule {shown(schedule)}: a split "
                "backward runs two backward passes over each micro-batch's graph; selective "
                "recompute allows one (torch raises 'Trying to backward an extra time'), and "
                "full recompute re-runs each block once for backward-input and once per "
                "weight-gradient group for backward-weight (10 forwards of a GPT block per "
                "micro-batch instead of 2), which the cost model does not price; set recompute "
                "'none' in every stage or use schedule 'interleaved-1f1b'"
            )
    return None


class HasProfile(Protocol):
    """Anything carrying a traced `ModelProfile` (an `autoplan.ModelGraph`)."""

    @property
    def profile(self) -> ModelProfile: ...


def even_stages(
    num_units: int, num_stages: int, recompute: Recompute = "none"
) -> tuple[StagePlan, ...]:
    """Split ``num_units`` into ``num_stages`` contiguous stages differing by at most one unit
    (`cost_model.stage_splits.even_stage_starts`, the larger first)."""
    try:
        starts = even_stage_starts(num_units, num_stages)
    except StageSplitError as error:
        raise PlanError(f"{error}; lower pp_degree x virtual_stages") from None
    ends = (*starts[1:], num_units)
    return tuple(
        StagePlan(first_unit=first, last_unit=end - 1, recompute=recompute)
        for first, end in zip(starts, ends, strict=True)
    )


def plan_estimate(result: Estimate, cluster: Cluster) -> PlanEstimate:
    """The summary a `Plan` file records (informational)."""
    return PlanEstimate(
        cluster=cluster.name,
        num_devices=result.num_devices,
        step_time_s=result.step_time_s,
        tokens_per_s=result.tokens_per_s,
        model_tflops_per_device=result.model_tflops_per_device,
        mfu=result.mfu,
        peak_memory_bytes=int(result.peak_memory_bytes),
        memory_reserve_bytes=int(result.peak_rank.memory.reserve_bytes),
        memory_capacity_bytes=int(result.memory_capacity_bytes),
        step_time_low_s=result.step_time_range_s[0],
        step_time_high_s=result.step_time_range_s[1],
        peak_memory_high_bytes=int(result.peak_memory_range_bytes[1]),
        memory_usable_bytes=int(result.memory_usable_bytes),
        memory_headroom=result.memory_headroom,
    )


def runtime_refusal(plan: Plan, profile: ModelProfile) -> str | None:
    """Why autoplan's own runtime cannot run ``plan`` on ``profile``'s model, or None: the
    ``autoplan`` framework profile's limits with those of running the traced model
    (`cost_model.frameworks.limits`, ``running``), which `parallelize` asks whatever stack
    the plan is priced for."""
    stack = framework_profile(DEFAULT_FRAMEWORK)
    refusal = stack.plan_refusal(plan, profile, running=True)
    return None if refusal is None else str(refusal)
