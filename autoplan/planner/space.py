"""The search space: which outer choices (degrees, batching, schedule, sharding) to consider.

`SearchSpace.from_constraints` turns the keyword constraints of `autoplan.search` into a space
and rejects constraints that contradict each other or the cluster, naming them. `strategies`
enumerates the outer choices (`cost_model.Strategy`) that are valid for the model, the cluster
and the global batch: degrees multiply to the device count, TP divides every count the trace
reports and stays inside a node (unless allowed), batches divide, the schedule's micro-batch
rules hold (`cost_model.schedules.ScheduleSpec`: torch's own). Dominated choices are skipped:
ZeRO-1 when ZeRO-2 is allowed (same time, less memory), ZeRO levels and layouts that cannot
differ when dp = 1, GPipe on one pipeline rank (1F1B runs the same actions and holds less).
With several pipeline ranks GPipe is not dominated: with uneven stages either can be faster.

Context parallelism (cp) is enumerated only for long sequences, ``seq_len >=
SearchSpace.cp_min_seq_len`` (16384 by default), up to the degree that leaves
``cp_min_local_tokens`` (2048) tokens per rank, or as the ``cp`` constraint names degrees:
Llama 3 405B trained its 8K-token stage on 16,384 H100s with TP 8, CP 1, PP 16 and turned CP 16
on only for the 128K stage (Balaji, SC'24, "Herding Llamas", as tabled at
https://glennklockwood.com/garden/llama-3.1). Below that, TP with sequence parallelism and PP
already divide the activations, and cp's ring only adds communication, so the search of dense
short-sequence models is the one it was before cp existed (same candidates, same result).
A cp degree must divide the devices left by tp x pp and, with torch's load-balanced causal
sharding, ``2 cp`` must divide the sequence. Expert parallelism (ep) is enumerated for models
with mixture-of-experts units: every divisor of dp that divides each layer's expert count.
The rank layouts with cp > 1 place cp just outside tp (`with_cp`).

HSDP (`Plan.dp_shard_degree`) is tried where it can pay and little else: a member with sharded
weights (ZeRO >= 1) whose data-parallel group spans several scale-up domains is also offered
with its weights sharded within the dp ranks of one domain and replicated across domains
(`hsdp_shards`: one value a layout), for stacks that run HSDP. ZeRO-3 then keeps every
micro-batch's gathers and reduce-scatters inside a domain; at any stage the gradients cross
the domains as an all-reduce over one rank a domain instead of a ring over every rank, whose
steps grow with the data-parallel size.

Overlapped TP communication (`Plan.tp_comm_overlap`) is a policy, not an axis: a member with
sequence parallelism takes it wherever the space allows it (``tp_comm_overlap``; left unset,
the stack's: on where its overlap runs on the space's plans, `stack_filter.within_stack`; off
on devices that are not GPUs), because it never lengthens the step the cost model prices (each
collective's exposed time is at most its whole time, `cost_model.tp_overlap`) and holds no
memory it prices; ``tp_comm_overlap=False`` turns it off, ``True`` asks every plan for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.contract.errors import InputError
from autoplan.contract.plan import (
    RECOMPUTE_MODES,
    SCHEDULES,
    MeshAxis,
    Recompute,
    Schedule,
    split_backward_conflict,
)
from cost_model.degrees import (
    DTYPE_NAMES,
    ZERO_STAGES,
    cp_fits_sequence,
    experts_common,
    is_whole,
    sp_fits,
    tp_fits_node,
    tp_undivided,
)
from cost_model.hardware import Cluster
from cost_model.precision import (
    DEFAULT_MASTER_DTYPE,
    DEFAULT_OPTIMIZER_STATE_DTYPE,
    GRAD_REDUCE_DTYPES,
    MASTER_DTYPES,
    OPTIMIZER_STATE_DTYPES,
    fp8_recipe,
    precision_problem,
)
from cost_model.schedules import ONE_STAGE_SCHEDULES, SPLIT_BACKWARD, V_SCHEDULES, ScheduleError
from cost_model.strategy import Strategy, folded_ep_factors, schedule_spec, valid_layout
from cost_model.workload import ModelProfile

Layout = tuple[MeshAxis, ...]
DEFAULT_LAYOUTS: tuple[Layout, ...] = (("pp", "dp", "tp"), ("dp", "pp", "tp"))
MAX_VIRTUAL_STAGES = 8
# The shortest sequence for which the search tries context parallelism by itself (see the
# module docstring: Llama 3 trained 8K sequences without it).
CP_MIN_SEQ_LEN = 16384
# The fewest tokens of a sequence the search leaves on one cp rank (seq_len / cp): Llama 3
# 405B at 128K kept 8192 (CP 16, same source). With fewer, each ring step's block attention
# (quadratic in the chunk) is too short to hide the K/V exchange (linear in it) on any link,
# and the tokens per rank no longer fill a GEMM; the ``cp`` constraint may ask for more.
CP_MIN_LOCAL_TOKENS = 2048


class ConstraintError(InputError):
    """Search constraints contradict each other or the cluster."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """Allowed values per dimension; ``None`` means "any valid value"."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    # Where an ep group may sit (`Plan.ep_folding`): inside dp (False), folded over
    # dp x cp x tp (True); None: both, folded only where the two differ (tp > 1 with sequence
    # parallelism, or cp > 1). The search sets it from the framework's expert layout.
    ep_folding: tuple[bool, ...] | None = None
    # Expert tensor parallelism (`Plan.etp_degree`): the values to try where they divide tp;
    # None: 1, and tp too where the stack runs it (``expert_tensor_parallel``, set by the
    # search): the two layouts stacks use (experts whole, or split as the dense TP splits
    # them). Degrees between (part of each TP group) are searched when asked for: offered by
    # default they made the 64-expert MoE of bench/search.py 99k -> 123k candidates and its
    # default-budget gap 26.5% -> 33.5%, and no search tried (Mixtral 8x7B, DeepSeek-MoE 16B
    # shapes) chose one.
    etp: tuple[int, ...] | None = None
    expert_tensor_parallel: bool = False
    # cp > 1 is tried by itself only from this sequence length on (module docstring)
    cp_min_seq_len: int = CP_MIN_SEQ_LEN
    cp_min_local_tokens: int = CP_MIN_LOCAL_TOKENS
    micro_batch: tuple[int, ...] | None = None
    max_tp: int | None = None
    max_pp: int | None = None
    max_micro_batch: int = 64
    virtual_stages: tuple[int, ...] | None = None
    # every schedule the runtime builds; the combinations it refuses are skipped
    schedules: tuple[Schedule, ...] = SCHEDULES
    zero: tuple[int, ...] = ZERO_STAGES
    recompute: tuple[Recompute, ...] = RECOMPUTE_MODES
    sequence_parallel: tuple[bool, ...] = (False, True)
    # whether sequence-parallel members overlap their TP communication (module docstring):
    # True where allowed; None: as the stack runs it (`stack_filter.within_stack`), off
    # before that
    tp_comm_overlap: tuple[bool, ...] | None = None
    rank_layouts: tuple[Layout, ...] = DEFAULT_LAYOUTS
    # the training dtypes (or fp8 recipes) to try; None: the device's fastest
    # (`DeviceSpec.fastest_training_dtype`)
    dtype: tuple[str, ...] | None = None
    allow_cross_node_tp: bool = False
    # Whether to try HSDP (`Plan.dp_shard_degree`): members with sharded weights whose
    # data-parallel group spans several scale-up domains also shard within one domain's dp
    # ranks and replicate across domains (`hsdp_shards`). Not a constraint: the search sets
    # ``hsdp_domain``, the devices of a scale-up domain, where the stack runs HSDP (0: none).
    hsdp: bool = True
    hsdp_domain: int = 0
    # The precision policy every plan gets (`Plan.master_dtype`, ...; `cost_model.precision`):
    # a choice of the run's, not an axis; the dtypes it cannot go with are left out
    # (`within_policy`)
    master_dtype: str = DEFAULT_MASTER_DTYPE
    grad_reduce_dtype: str | None = None
    optimizer_state_dtype: str = DEFAULT_OPTIMIZER_STATE_DTYPE
    # torch.compile of every plan's blocks (`Plan.compile`): a policy of the run's, not an
    # axis (compiling never slows a unit the cost model prices: `cost_model.parts.fusion`);
    # the schedules that split the backward are left out (`split_backward_conflict`)
    compile: bool = False
    # Whether a member that cannot fit the device's memory is tried again with its whole
    # optimizer step on the host (`Plan.optimizer_offload` 1; `enumeration.Enumeration.expand`),
    # where the stack offloads at its ZeRO stage and the device states a host link: tried only
    # where memory binds, so a search whose plans fit is unchanged.
    optimizer_offload: bool = True
    # Likewise with its blocks' saved activations on the host (`StagePlan.activation_offload`:
    # every block under recompute 'none' but the model's last), where the stack offloads
    # activations and the device states a host link.
    activation_offload: bool = True

    @property
    def policy(self) -> tuple[str, str | None, str]:
        """(master_dtype, grad_reduce_dtype, optimizer_state_dtype)."""
        return (self.master_dtype, self.grad_reduce_dtype, self.optimizer_state_dtype)

    def within_policy(self, *, dtype_given: bool) -> SearchSpace:
        """This space (its dtypes resolved) without the dtypes its precision policy cannot go
        with (`cost_model.precision.precision_problem`); `ConstraintError` naming the rule when
        none is left."""
        assert self.dtype is not None, "resolve the dtypes first (for_cluster)"
        kept = tuple(d for d in self.dtype if precision_problem(d, *self.policy) is None)
        if kept:
            return dataclasses.replace(self, dtype=kept)
        problem = precision_problem(self.dtype[0], *self.policy)
        given = "" if dtype_given else " (the device's fastest)"
        raise ConstraintError(
            f"dtype={shown(self.dtype)}{given}: {problem}; e.g. pass dtype='bf16' (--dtype bf16)"
        )

    def for_cluster(self, cluster: Cluster) -> SearchSpace:
        """This space with its dtype resolved to the device's fastest when it is not set, and
        without overlapped TP communication on devices that are not GPUs (no stack overlaps
        it there: it moves shards through peer GPU memory)."""
        space = self
        if cluster.device.kind != "gpu" and self.tp_comm_overlap != (False,):
            if self.tp_comm_overlap == (True,):
                raise ConstraintError(
                    f"tp_comm_overlap=True on {cluster.device.name} ({cluster.device.kind}): "
                    "overlapped TP communication runs on GPUs only (Transformer Engine's "
                    "userbuffers, torch's symmetric memory); drop tp_comm_overlap"
                )
            space = dataclasses.replace(space, tp_comm_overlap=(False,))
        if space.dtype is not None:
            return space
        return dataclasses.replace(space, dtype=(cluster.device.fastest_training_dtype(),))

    @classmethod
    def from_constraints(cls, **constraints: Any) -> SearchSpace:
        """Build a space from `autoplan.search` keywords; unknown or contradictory ones raise."""
        fields = {}
        for key, value in constraints.items():
            if key not in _CONSTRAINT_KEYS:
                valid = ", ".join(sorted(_CONSTRAINT_KEYS))
                raise ConstraintError(f"unknown search constraint {key!r}; valid: {valid}")
            fields[key] = _normalise(key, value)
        space = cls(**fields)
        if space.compile:
            space = space._without_split_backward()
        space._check()
        return space

    def _without_split_backward(self) -> SearchSpace:
        """This (compiled) space without the schedules that split the backward, which a
        compiled unit cannot run (`split_backward_conflict`); `ConstraintError` when no
        schedule is left."""
        kept = tuple(s for s in self.schedules if s not in SPLIT_BACKWARD)
        if not kept:
            conflict = split_backward_conflict(self.schedules[0], 0, ("none",), compiled=True)
            raise ConstraintError(f"schedules={shown(self.schedules)}: {conflict}")
        return dataclasses.replace(self, schedules=kept)

    def _check(self) -> None:
        for name, allowed, limit in (("tp", self.tp, self.max_tp), ("pp", self.pp, self.max_pp)):
            if allowed is not None and limit is not None and min(allowed) > limit:
                raise ConstraintError(
                    f"{name}={shown(allowed)} contradicts max_{name}={limit}; drop one of them"
                )
        if self.micro_batch is not None and min(self.micro_batch) > self.max_micro_batch:
            raise ConstraintError(
                f"micro_batch={shown(self.micro_batch)} contradicts "
                f"max_micro_batch={self.max_micro_batch} (the search's largest micro-batch; "
                "autoplan.search(..., max_micro_batch=N) raises it)"
            )
        virtual = self.virtual_stages or (1,)
        multi = [s for s in self.schedules if s not in ONE_STAGE_SCHEDULES]
        if max(virtual) > 1 and not multi:
            raise ConstraintError(
                f"virtual_stages={shown(virtual)} needs a schedule with several stages per rank "
                f"('interleaved-1f1b', 'interleaved-zb', 'zbv' or 'dualpipev'), but "
                f"schedules={list(self.schedules)}"
            )
        if (
            self.pp is not None
            and max(self.pp) == 1
            and not set(self.schedules) & ONE_STAGE_SCHEDULES
        ):
            raise ConstraintError(
                f"schedules={list(self.schedules)} need pp >= 2, but pp=1; allow '1f1b'"
            )
        if self.tp is not None and max(self.tp) == 1 and self.sequence_parallel == (True,):
            raise ConstraintError("sequence_parallel=True needs tp > 1, but tp=1")
        if self.tp_comm_overlap == (True,):
            if True not in self.sequence_parallel:
                raise ConstraintError(
                    "tp_comm_overlap=True overlaps the sequence-parallel collectives, but "
                    "sequence_parallel=False; allow sequence_parallel=True"
                )
            if self.tp is not None and max(self.tp) == 1:
                raise ConstraintError("tp_comm_overlap=True needs tp > 1, but tp=1")

    def check_cluster(self, cluster: Cluster, profile: ModelProfile, global_batch: int) -> None:
        """Reject fixed choices that cannot work on this cluster or model, naming them: the
        rules of `cost_model.degrees`, broken by every value a constraint allows."""
        n = cluster.num_devices
        for name, allowed in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp)):
            if allowed is not None and all(n % d for d in allowed):
                raise ConstraintError(
                    f"{name}={shown(allowed)} does not divide the {n} devices of {cluster.name!r}"
                )
        per_domain = cluster.scale_up_domain
        if (
            self.tp is not None
            and not self.allow_cross_node_tp
            and not any(tp_fits_node(t, per_domain) for t in self.tp)
        ):
            where = (
                f"a node of {per_domain} devices"
                if per_domain == cluster.devices_per_node
                else f"a scale-up domain of {per_domain} devices"
            )
            raise ConstraintError(
                f"tp={shown(self.tp)} does not fit inside {where}; "
                "pass allow_cross_node_tp=True to allow it"
            )
        if self.pp is not None and min(self.pp) > profile.num_units:
            raise ConstraintError(
                f"pp={shown(self.pp)} exceeds the {profile.num_units} pipeline units of "
                f"{profile.name!r}"
            )
        if self.dp is not None and all(global_batch % d for d in self.dp):
            raise ConstraintError(
                f"dp={shown(self.dp)} does not divide global_batch={global_batch}"
            )
        if self.cp is not None and not any(cp_fits_sequence(c, profile.seq_len) for c in self.cp):
            raise ConstraintError(
                f"cp={shown(self.cp)}: 2 x cp must divide seq_len={profile.seq_len} of "
                f"{profile.name!r} (torch's load-balanced causal sharding)"
            )
        if self.ep is not None and max(self.ep) > 1:
            if not profile.moe_layers:
                raise ConstraintError(
                    f"ep={shown(self.ep)}: {profile.name!r} is dense (no mixture-of-experts "
                    "layer); drop the ep constraint"
                )
            experts = experts_common(profile)
            if all(experts % e for e in self.ep):
                raise ConstraintError(
                    f"ep={shown(self.ep)} does not divide the {experts} experts of {profile.name!r}"
                )
        if self.tp is not None and all(tp_undivided(t, profile) for t in self.tp):
            missed = {name for t in self.tp for name in tp_undivided(t, profile)}
            counts = profile.tp_divisible_counts()
            undivided = {k: v for k, v in counts.items() if k in missed}
            raise ConstraintError(
                f"tp={shown(self.tp)} does not divide the model's "
                f"{', '.join(f'{k}={v}' for k, v in undivided.items())}"
            )


_CONSTRAINT_KEYS = {f for f in SearchSpace.__dataclass_fields__} - {
    "hsdp_domain",
    "expert_tensor_parallel",
}


def shown(values: object) -> str:
    """A constraint for a message: ``8`` for one value, ``[2, 4]`` for several."""
    if not isinstance(values, (tuple, list)):
        return str(values)
    return str(values[0]) if len(values) == 1 else str(list(values))


def _normalise(key: str, value: Any) -> Any:
    """Accept a scalar or a collection for set-valued constraints, check the values."""
    if key in ("tp", "pp", "dp", "cp", "ep", "etp", "micro_batch", "virtual_stages", "zero"):
        values = _as_tuple(key, value)
        for v in values:
            if not is_whole(v, 0 if key == "zero" else 1):
                raise ConstraintError(f"{key}={value!r}: values must be whole numbers >= 1")
        if key == "zero" and any(v > 3 for v in values):
            raise ConstraintError(f"zero={shown(values)}: ZeRO levels are 0, 1, 2, 3")
        return values
    if key in ("max_tp", "max_pp", "max_micro_batch", "cp_min_seq_len", "cp_min_local_tokens"):
        if not is_whole(value):
            raise ConstraintError(f"{key}={value!r} must be a whole number >= 1")
        return value
    if key == "schedules":
        values = _as_tuple(key, value)
        bad = [v for v in values if v not in SCHEDULES]
        if bad:
            raise ConstraintError(f"schedules: unknown {bad[0]!r}; use {', '.join(SCHEDULES)}")
        return values
    if key == "recompute":
        values = _as_tuple(key, value)
        bad = [v for v in values if v not in RECOMPUTE_MODES]
        if bad:
            raise ConstraintError(
                f"recompute: unknown {bad[0]!r}; use {', '.join(RECOMPUTE_MODES)}"
            )
        return values
    if key in ("sequence_parallel", "ep_folding", "tp_comm_overlap"):
        values = _as_tuple(key, value)
        if any(not isinstance(v, bool) for v in values):
            raise ConstraintError(f"{key}={value!r} must be True, False or both")
        return values
    if key == "rank_layouts":
        layouts = tuple(tuple(layout) for layout in value)
        for layout in layouts:
            if not valid_layout(layout):
                raise ConstraintError(
                    f"rank_layouts: {list(layout)} must order pp, dp, tp once (and cp once or "
                    "not at all)"
                )
        return layouts
    if key in ("master_dtype", "grad_reduce_dtype", "optimizer_state_dtype"):
        allowed = {
            "master_dtype": MASTER_DTYPES,
            "grad_reduce_dtype": (None, *GRAD_REDUCE_DTYPES),
            "optimizer_state_dtype": OPTIMIZER_STATE_DTYPES,
        }[key]
        if value not in allowed:
            named = ", ".join(str(a) for a in allowed)
            raise ConstraintError(f"{key}={value!r}: the precision policy's values are {named}")
        return value
    if key == "allow_cross_node_tp":
        return bool(value)
    if key == "compile":
        if not isinstance(value, bool):
            raise ConstraintError(f"compile={value!r} must be True or False")
        return value
    if key == "hsdp":
        if not isinstance(value, bool):
            raise ConstraintError(f"hsdp={value!r} must be True or False")
        return value
    if key in ("optimizer_offload", "activation_offload"):
        if not isinstance(value, bool):
            raise ConstraintError(f"{key}={value!r} must be True or False")
        return value
    if key == "dtype":
        dtypes = tuple(value.split(",")) if isinstance(value, str) else _as_tuple(key, value)
        for dtype in dtypes:
            if dtype not in DTYPE_NAMES:
                raise ConstraintError(
                    f"dtype={dtype!r}; use one of {', '.join(DTYPE_NAMES)}, or a list of them"
                )
        return tuple(dict.fromkeys(dtypes))
    raise AssertionError(key)


def _as_tuple(key: str, value: Any) -> tuple[Any, ...]:
    if isinstance(value, (str, int, bool)):
        return (value,)
    if not isinstance(value, (list, tuple, set, frozenset, range)):
        raise ConstraintError(
            f"{key}={value!r}: give one value or a list of them, e.g. {key}=[1, 2]"
        )
    values = tuple(value)
    if not values:
        raise ConstraintError(f"{key}=() allows nothing; give at least one value")
    return values


def _divisors(n: int, at_most: int | None = None) -> list[int]:
    """The divisors of ``n`` in ascending order (only those <= ``at_most`` if given), in
    O(sqrt(n)) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    found = sorted({*small, *(n // d for d in small)})
    return found if at_most is None else [d for d in found if d <= at_most]


@dataclass(frozen=True, slots=True)
class Shape:
    """The degrees and micro-batching a group of outer choices shares (`shapes`); its members
    differ in schedule, virtual stages, sequence parallelism, ZeRO level and rank layout
    (`shape_strategies`)."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    ep_folding: bool
    micro_batch_size: int
    num_micro_batches: int
    dtype: str = "bf16"
    # the space's precision policy (`SearchSpace.policy`)
    master_dtype: str = DEFAULT_MASTER_DTYPE
    grad_reduce_dtype: str | None = None
    optimizer_state_dtype: str = DEFAULT_OPTIMIZER_STATE_DTYPE
    compile: bool = False  # the space's (`SearchSpace.compile`)
    etp: int = 1  # expert tensor parallelism (`Plan.etp_degree`)

    def member(
        self,
        schedule: Schedule,
        virtual_stages: int,
        zero: int,
        sequence_parallel: bool,
        layout: Layout,
        tp_comm_overlap: bool = False,
    ) -> Strategy:
        """The outer choice of this shape with these options. Under tensor-wise fp8 with
        sharded weights, FSDP2 gathers them in fp8 (`Strategy.fp8_all_gather`): half the
        gathered bytes, no cast of the weights in the backward, for one small all-reduce a
        step, so the search takes it wherever it can."""
        dtype = self.dtype
        recipe = fp8_recipe(dtype)
        return Strategy(
            fp8_all_gather=(
                recipe is not None and recipe.fp8_all_gather and zero >= 1 and self.dp > 1
            ),
            tp_degree=self.tp,
            dp_degree=self.dp,
            pp_degree=self.pp,
            virtual_stages=virtual_stages,
            micro_batch_size=self.micro_batch_size,
            num_micro_batches=self.num_micro_batches,
            schedule=schedule,
            zero_stage=zero,
            sequence_parallel=sequence_parallel,
            tp_comm_overlap=tp_comm_overlap,
            dtype=dtype,
            master_dtype=self.master_dtype,
            grad_reduce_dtype=self.grad_reduce_dtype,
            optimizer_state_dtype=self.optimizer_state_dtype,
            compile=self.compile,
            rank_layout=layout,
            cp_degree=self.cp,
            ep_degree=self.ep,
            ep_folding=self.ep_folding and self.ep > 1,
            etp_degree=self.etp,
        )


@dataclass(frozen=True, slots=True)
class ShapeOptions:
    """What a shape's members choose from: (schedule, virtual stages) pairs torch runs,
    sequence parallelism, ZeRO levels and rank layouts (dominated ones left out), and the
    overlapped TP communication of the sequence-parallel members (without: none)."""

    schedules: tuple[tuple[Schedule, int], ...]
    sequence_parallel: tuple[bool, ...]
    zero: tuple[int, ...]
    layouts: tuple[Layout, ...]
    # (layout, dp_shard_degree): the HSDP shard group the members of that layout with sharded
    # weights also take (`hsdp_shards`)
    dp_shard: tuple[tuple[Layout, int], ...] = ()
    tp_comm_overlap: tuple[bool, ...] = (False,)


def strategies(
    space: SearchSpace,
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    skip_dominated: bool = True,
) -> Iterator[Strategy]:
    """Every valid outer choice in ``space``; dominated ones only if ``skip_dominated`` is off
    (the tests' brute force enumerates them to show skipping them loses nothing): the members
    of each of `shapes`, in order."""
    space = space.for_cluster(cluster)
    for shape in shapes(space, profile, cluster, global_batch):
        options = shape_options(space, profile, shape, skip_dominated=skip_dominated)
        yield from shape_strategies(space, shape, options)


def shapes(
    space: SearchSpace, profile: ModelProfile, cluster: Cluster, global_batch: int
) -> Iterator[Shape]:
    """The degrees, micro-batchings and dtypes of ``space`` on ``cluster``: tp, then pp, cp,
    the expert layouts and the micro-batch size, ascending, then the dtypes in their order."""
    space = space.for_cluster(cluster)
    n = cluster.num_devices
    tp_choices = [
        t
        for t in _divisors(n)
        if (space.tp is None or t in space.tp)
        and (space.max_tp is None or t <= space.max_tp)
        and (space.allow_cross_node_tp or tp_fits_node(t, cluster.scale_up_domain))
        and not tp_undivided(t, profile)
    ]
    for tp in tp_choices:
        for pp in _divisors(n // tp):
            if (space.pp is not None and pp not in space.pp) or pp > profile.num_units:
                continue
            if space.max_pp is not None and pp > space.max_pp:
                continue
            for cp in cp_choices(space, profile, n // (tp * pp)):
                dp = n // (tp * pp * cp)
                if (space.dp is not None and dp not in space.dp) or global_batch % dp:
                    continue
                per_replica = global_batch // dp
                for ep, folded, etp in expert_layouts(space, profile, tp, cp, dp):
                    for b in _divisors(per_replica, space.max_micro_batch):
                        if space.micro_batch is not None and b not in space.micro_batch:
                            continue
                        for dtype in space.dtype or ():
                            if precision_problem(dtype, *space.policy) is not None:
                                continue  # (`SearchSpace.within_policy` names it)
                            yield Shape(
                                tp, pp, cp, dp, ep, folded, b, per_replica // b, dtype,
                                *space.policy, compile=space.compile, etp=etp,
                            )  # fmt: skip


def cp_choices(space: SearchSpace, profile: ModelProfile, devices: int) -> list[int]:
    """Context-parallel degrees to try on ``devices`` (what tp x pp leave): divisors with
    ``2 cp | seq_len``; only 1 below ``cp_min_seq_len``, and none leaving fewer than
    ``cp_min_local_tokens`` tokens per rank, unless the ``cp`` constraint names them."""
    if space.cp is None and profile.seq_len < space.cp_min_seq_len:
        return [1]
    return [
        cp
        for cp in _divisors(devices)
        if cp_fits_sequence(cp, profile.seq_len)
        and (
            cp in space.cp
            if space.cp is not None
            else cp == 1 or profile.seq_len // cp >= space.cp_min_local_tokens
        )
    ]


def ep_choices(space: SearchSpace, profile: ModelProfile, dp: int) -> list[int]:
    """Expert-parallel degrees to try with ``dp`` data-parallel ranks: 1 for a dense model,
    else the divisors of dp that divide every layer's expert count."""
    experts = experts_common(profile)
    return [ep for ep in _divisors(math.gcd(dp, experts)) if space.ep is None or ep in space.ep]


def expert_layouts(
    space: SearchSpace, profile: ModelProfile, tp: int, cp: int, dp: int
) -> list[tuple[int, bool, int]]:
    """(ep, folded, etp) triples to try: ep inside dp (`ep_choices`) and, where folding
    differs (tp > 1 or cp > 1), ep folded over dp x cp x tp (`folded_ep_factors`), as
    ``space.ep_folding`` allows, with the experts whole (etp 1); then each other etp of
    `etp_choices`, ep folded over the tp / etp expert-TP groups (with etp = tp and cp = 1 that
    is ep inside dp). Where the two layouts coincide the folded spelling is used if only
    folding is allowed (a stack that folds runs that plan too)."""
    triples = [(ep, folded, 1) for ep, folded in _whole_expert_layouts(space, profile, tp, cp, dp)]
    allowed = space.ep_folding if space.ep_folding is not None else (False, True)
    experts = experts_common(profile)
    for etp in etp_choices(space, profile, tp):
        if etp == 1:
            continue
        # ep folds over the tp / etp groups (Megatron-Core's expert rank generator); inside dp
        # only where that is the same layout (etp = tp, cp = 1) and a stack places ep there
        same = tp == etp and cp == 1
        folded = True in allowed and not (same and False in allowed)
        if not folded and not (same and False in allowed):
            continue
        triples += [
            (ep, folded and ep > 1, etp)
            for ep in _divisors(experts)
            if folded_ep_factors(ep, tp // etp, cp, dp) is not None
            and (space.ep is None or ep in space.ep)
        ]
    return triples


def etp_choices(space: SearchSpace, profile: ModelProfile, tp: int) -> list[int]:
    """Expert-tensor-parallel degrees to try at ``tp``: 1 for a dense model; those of
    ``space.etp`` that divide tp and the experts' width, or 1 and tp where the stack runs
    expert tensor parallelism (`SearchSpace.etp`)."""
    if not profile.moe_layers:
        return [1]
    if space.etp is not None:
        wanted = list(space.etp)
    else:
        wanted = [1, tp] if space.expert_tensor_parallel and tp > 1 else [1]
    widths = [facts.expert_ffn_hidden_size for facts in profile.moe_layers]
    return [e for e in wanted if tp % e == 0 and all(w % e == 0 for w in widths)]


def _whole_expert_layouts(
    space: SearchSpace, profile: ModelProfile, tp: int, cp: int, dp: int
) -> list[tuple[int, bool]]:
    """(ep, folded) pairs with the experts whole (etp 1), as `expert_layouts` describes."""
    if space.etp is not None and 1 not in space.etp and profile.moe_layers:
        return []
    allowed = space.ep_folding if space.ep_folding is not None else (False, True)
    differ = tp > 1 or cp > 1
    pairs: list[tuple[int, bool]] = [(1, False)]
    if False in allowed or not differ:
        folded_spelling = False not in allowed
        pairs += [(ep, folded_spelling) for ep in ep_choices(space, profile, dp) if ep > 1]
    if True in allowed and differ and profile.moe_layers:
        experts = experts_common(profile)
        pairs += [
            (ep, True)
            for ep in _divisors(experts)
            if ep > 1
            and folded_ep_factors(ep, tp, cp, dp) is not None
            and (space.ep is None or ep in space.ep)
        ]
    if space.ep is not None and 1 not in space.ep:
        pairs = [pair for pair in pairs if pair[0] > 1]
    return pairs


def with_cp(layout: Layout, cp_degree: int) -> Layout:
    """``layout`` with cp placed just outside tp when cp > 1 and the layout leaves it out
    (Megatron-LM's ``tp-cp-ep-dp-pp`` order, innermost first); else ``layout``."""
    if cp_degree == 1 or "cp" in layout:
        return layout
    idx = layout.index("tp")
    return (*layout[:idx], "cp", *layout[idx:])


def recompute_modes(space: SearchSpace, schedule: Schedule) -> tuple[Recompute, ...]:
    """The recompute modes the search may give the stages of ``schedule``: a split backward
    runs without recompute (`autoplan.contract.plan.split_backward_conflict`)."""
    return _allowed_modes(tuple(space.recompute), schedule)


@functools.lru_cache(maxsize=256)
def _allowed_modes(modes: tuple[Recompute, ...], schedule: Schedule) -> tuple[Recompute, ...]:
    return tuple(mode for mode in modes if split_backward_conflict(schedule, 0, (mode,)) is None)


def shape_options(
    space: SearchSpace, profile: ModelProfile, shape: Shape, *, skip_dominated: bool = True
) -> ShapeOptions:
    """What the members of ``shape`` in ``space`` (resolved for the cluster) choose from."""
    tp, pp, dp, m = shape.tp, shape.pp, shape.dp, shape.num_micro_batches
    # ranks holding replicas of the weights (dp x cp): ZeRO levels differ only with several
    replicas = dp * shape.cp
    options: list[tuple[Schedule, int]] = []
    for schedule in space.schedules:
        if skip_dominated and schedule == "gpipe" and pp == 1 and "1f1b" in space.schedules:
            # One pipeline rank: the same actions back to back either way, and GPipe holds
            # every micro-batch's activations (and cannot use DDP): 1F1B is never worse.
            continue
        if schedule in ONE_STAGE_SCHEDULES:
            counts: Sequence[int] = (1,)
        elif schedule in V_SCHEDULES:
            counts = (2,)
        else:
            counts = range(2, MAX_VIRTUAL_STAGES + 1)
        for v in counts:
            if pp * v > profile.num_units:
                break
            if space.virtual_stages is not None and v not in space.virtual_stages:
                continue
            try:
                schedule_spec(schedule, pp, v, m)
            except ScheduleError:
                continue  # torch cannot run it with these degrees
            if recompute_modes(space, schedule):
                options.append((schedule, v))
    sp_choices = [
        sp
        for sp in space.sequence_parallel
        if (not sp or sp_fits(tp, profile.seq_len))
        # a folded ep group takes TP ranks only if each routes its own tokens
        and (sp or not (shape.ep_folding and shape.ep > 1 and tp > 1))
        # every plan overlapping its TP communication needs sequence parallelism
        and (sp or space.tp_comm_overlap != (True,))
    ]
    # the overlap never lengthens a step (module docstring): without it only where asked, or
    # in the brute force
    overlap = space.tp_comm_overlap or (False,)
    if skip_dominated and True in overlap:
        overlap = (True,)
    zero_choices = [
        z for z in space.zero if replicas > 1 or z == min(space.zero) or not skip_dominated
    ]
    if skip_dominated and 1 in zero_choices and 2 in zero_choices:
        # ZeRO-1 and ZeRO-2 communicate alike (gradients reduce-scattered, weights all-gathered
        # after the step) and ZeRO-2 also shards the gradients: same time, less memory.
        zero_choices.remove(1)
    layouts = space.rank_layouts
    if skip_dominated and not (dp > 1 and pp > 1):
        layouts = layouts[:1]
    return ShapeOptions(
        schedules=tuple(options),
        sequence_parallel=tuple(sp_choices),
        zero=tuple(zero_choices),
        layouts=tuple(with_cp(layout, shape.cp) for layout in layouts),
        dp_shard=hsdp_shards(space, profile, shape, [with_cp(lay, shape.cp) for lay in layouts]),
        tp_comm_overlap=overlap,
    )


def hsdp_shards(
    space: SearchSpace, profile: ModelProfile, shape: Shape, layouts: Sequence[Layout]
) -> tuple[tuple[Layout, int], ...]:
    """The HSDP shard group each of ``layouts`` offers ``shape``'s members: the dp ranks of one
    scale-up domain (``space.hsdp_domain`` devices over the ranks inside a dp step), where that
    is 2 or more ranks, divides dp and is less than dp (so the data-parallel group spans
    several domains: inside one, sharding over all of dp costs the same links and holds less).
    One value a layout, so the enumeration grows by one member per sharded member of a shape
    that spans domains. None for mixture-of-experts models (HSDP is priced for dense weights:
    `cost_model.degrees.hsdp_problems`)."""
    domain = space.hsdp_domain
    if not (space.hsdp and domain) or shape.ep > 1 or profile.moe_layers:
        return ()
    degrees = {"pp": shape.pp, "dp": shape.dp, "cp": shape.cp, "tp": shape.tp}
    found = []
    for layout in layouts:
        step = math.prod(degrees[axis] for axis in layout[layout.index("dp") + 1 :])
        shard = domain // step if domain % step == 0 else 0
        if 2 <= shard < shape.dp and shape.dp % shard == 0:
            found.append((tuple(layout), shard))
    return tuple(found)


def shape_strategies(space: SearchSpace, shape: Shape, options: ShapeOptions) -> Iterator[Strategy]:
    """The members of ``shape``: every combination of its ``options`` the runtime runs, each
    with sharded weights (ZeRO >= 1) also with its layout's HSDP shard group
    (`ShapeOptions.dp_shard`)."""
    shards = dict(options.dp_shard)
    for strategy in _members(space, shape, options):
        yield strategy
        shard = shards.get(strategy.rank_layout)
        if shard is not None and strategy.zero_stage >= 1:
            yield dataclasses.replace(strategy, dp_shard_degree=shard)


def _members(space: SearchSpace, shape: Shape, options: ShapeOptions) -> Iterator[Strategy]:
    """The members of ``shape`` without HSDP."""
    for schedule, v in options.schedules:
        for sp in options.sequence_parallel:
            for zero in options.zero:
                if split_backward_conflict(schedule, zero, ("none",)) is not None:
                    continue  # the runtime refuses it (ZeRO-3 with a split backward)
                for layout in options.layouts:
                    for overlap in options.tp_comm_overlap if sp else (False,):
                        yield shape.member(schedule, v, zero, sp, layout, overlap)
