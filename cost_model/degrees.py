"""The degrees and shapes of a parallel plan: the names they take and the one statement of
their rules (as torchtitan's ``ParallelDims._validate`` is the one place its degrees are checked).

Expects plain values (a `Plan`, a `Strategy` or anything with the same fields); guarantees each
rule is written here once. The ``*_problems`` functions list what is wrong, one line each naming
the field, the value, the rule and the fix, in the order `autoplan.Plan` reports them (it raises
the first; ``list(...)`` gives all). The predicates (`cp_fits_sequence`, `tp_undivided`,
`experts_common`, `sp_fits`, ...) are the same rules for the search space, which reports them
for sets of allowed values and filters its enumeration with them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, Protocol, TypeGuard, cast

from cost_model.hardware import MAX_DEVICES
from cost_model.messages import shown_count
from cost_model.schedules import SCHEDULES, ScheduleError, ScheduleName, ScheduleSpec
from cost_model.schema import shown
from cost_model.workload import ModelProfile

__all__ = [
    "AXES",
    "DTYPE_NAMES",
    "LEGACY_AXES",
    "MAX_COUNT",
    "RECOMPUTE_MODES",
    "SCHEDULES",
    "ZERO_STAGES",
    "Axis",
    "DTypeName",
    "RecomputeMode",
    "ScheduleName",
]

# ------------------------------------------------------------------------------ name sets

RecomputeMode = Literal["none", "selective", "full"]
# in order of memory saved (and time spent)
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = ("none", "selective", "full")
Axis = Literal["pp", "dp", "cp", "tp"]
# The axes a rank layout orders. A layout may leave out "cp" (the three-axis layouts of plans
# written before context parallelism): a missing axis has degree 1 and no place.
AXES: tuple[Axis, ...] = ("pp", "dp", "cp", "tp")
LEGACY_AXES: tuple[Axis, ...] = ("pp", "dp", "tp")
# The plain training dtypes, then the fp8 recipes (`cost_model.precision`: bf16 training with
# the linears' GEMMs in fp8).
DTypeName = Literal["fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "mxfp8"]
DTYPE_NAMES: tuple[DTypeName, ...] = ("fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "mxfp8")
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
# The largest degree, batch or unit index a plan may hold (2^53: floats count exactly up to it,
# and the cost model computes in floats); far above any real job, it keeps messages short.
MAX_COUNT = 2**53


def is_whole(value: object, at_least: int | None = 1) -> TypeGuard[int]:
    """Whether ``value`` is an int (bools refused) of at least ``at_least`` (None: any)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return at_least is None or value >= at_least


# ------------------------------------------------------------------------------ rules


def valid_layout(layout: Sequence[str]) -> bool:
    """Whether ``layout`` orders pp, dp, tp once each, with cp once or left out."""
    try:
        return tuple(layout) in _VALID_LAYOUTS
    except TypeError:  # unhashable entries: not axis names
        return False


_VALID_LAYOUTS = frozenset(itertools.permutations(AXES)) | frozenset(
    itertools.permutations(LEGACY_AXES)
)


def folded_ep_factors(ep: int, tp: int, cp: int, dp: int) -> tuple[int, int, int] | None:
    """How ``ep`` consecutive ranks of the dp x cp x tp block (tp innermost) split over the
    axes, as (of tp, of cp, of dp); None when the groups are not products of axis parts (ep
    must divide the innermost axis it reaches into, and take every rank of those inside)."""
    parts = []
    rest = ep
    for size in (tp, cp, dp):
        if rest <= size:
            if size % rest:
                return None
            parts.append(rest)
            rest = 1
        else:
            if rest % size:
                return None
            parts.append(size)
            rest //= size
    if rest != 1:
        return None
    return parts[0], parts[1], parts[2]


def cp_fits_sequence(cp: int, seq_len: int) -> bool:
    """torch's load-balanced causal sharding cuts each sequence into ``2 cp`` chunks."""
    return cp == 1 or seq_len % (2 * cp) == 0


def tp_undivided(tp: int, profile: ModelProfile) -> dict[str, int]:
    """The counts of the model that tensor parallelism must split and ``tp`` does not divide."""
    return {name: count for name, count in profile.tp_divisible_counts().items() if count % tp}


def experts_common(profile: ModelProfile) -> int:
    """The largest count dividing every mixture-of-experts layer's experts (1: dense): an
    expert-parallel degree must divide it (each rank holds num_experts / ep whole experts)."""
    layers = profile.moe_layers
    return math.gcd(*(facts.num_experts for facts in layers)) if layers else 1


def sp_fits(tp: int, seq_len: int) -> bool:
    """Sequence parallelism splits the TP-replicated work along the sequence over tp ranks."""
    return tp > 1 and seq_len % tp == 0


def tp_fits_node(tp: int, devices_per_node: int) -> bool:
    """A tensor-parallel group stays on the fast intra-node link."""
    return devices_per_node % tp == 0


def degree_product(
    dp: int, tp: int, pp: int, cp: int, *, suffix: str = "_degree"
) -> tuple[str, str, int]:
    """(``"dp x tp x pp"``, ``"2 x 4 x 1"``, 8): the degrees that multiply to the device count,
    named with ``suffix``; cp is named only when it is above 1."""
    names = [f"{axis}{suffix}" for axis in ("dp", "tp", "pp")]
    values = [dp, tp, pp]
    if cp > 1:
        names, values = [*names, f"cp{suffix}"], [*values, cp]
    return " x ".join(names), " x ".join(map(str, values)), math.prod(values)


# ------------------------------------------------------------------------------ problems

# The whole-number fields of a plan, in the order they are checked.
COUNT_FIELDS = (
    "dp_degree",
    "tp_degree",
    "pp_degree",
    "cp_degree",
    "ep_degree",
    "virtual_stages",
    "micro_batch_size",
    "num_micro_batches",
    "global_batch_size",
)


def count_problems(values: Mapping[str, object]) -> Iterator[str]:
    """Counts that are not whole numbers >= 1 or are over `MAX_COUNT`, then a device count over
    `MAX_DEVICES` (only once the four degrees are sound)."""
    sound = True
    for name, value in values.items():
        if not is_whole(value):
            sound = False
            yield f"{name} = {shown(value)} must be a whole number >= 1"
        elif value > MAX_COUNT:
            sound = False
            yield (
                f"{name} = {shown_count(value)} is over {MAX_COUNT:,}; give the size of a real job"
            )
    if not sound:
        return
    degrees = tuple(cast(int, values.get(f"{axis}_degree", 1)) for axis in ("dp", "tp", "pp", "cp"))
    if math.prod(degrees) > MAX_DEVICES:
        yield (
            "dp_degree x tp_degree x pp_degree x cp_degree = "
            f"{' x '.join(shown_count(d) for d in degrees)} = "
            f"{shown_count(math.prod(degrees))} devices is more than the {MAX_DEVICES:,} "
            "autoplan plans for; give degrees of a real job"
        )


class DegreesLike(Protocol):
    """The degree and batch fields of a plan (`autoplan.Plan` has them), already whole numbers."""

    @property
    def dp_degree(self) -> int: ...
    @property
    def tp_degree(self) -> int: ...
    @property
    def pp_degree(self) -> int: ...
    @property
    def cp_degree(self) -> int: ...
    @property
    def ep_degree(self) -> int: ...
    @property
    def ep_folding(self) -> bool: ...
    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def virtual_stages(self) -> int: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def num_micro_batches(self) -> int: ...
    @property
    def global_batch_size(self) -> int: ...
    @property
    def schedule(self) -> ScheduleName: ...


def shape_problems(plan: DegreesLike, num_stages: int) -> Iterator[str]:
    """How the degrees disagree with each other: the expert-parallel placement, the HSDP shard
    group (`hsdp_problems`), the batch, the schedule's micro-batch rules (torch's,
    `cost_model.schedules`) and the stage count."""
    yield from _expert_problems(plan)
    yield from hsdp_problems(plan)
    expected = plan.micro_batch_size * plan.num_micro_batches * plan.dp_degree
    if plan.global_batch_size != expected:
        yield (
            f"global_batch_size = {plan.global_batch_size} must equal micro_batch_size x "
            f"num_micro_batches x dp_degree = {plan.micro_batch_size} x "
            f"{plan.num_micro_batches} x {plan.dp_degree} = {expected}; "
            "change one of them so the batch divides evenly"
        )
    try:
        ScheduleSpec(
            schedule=plan.schedule,
            pp_degree=plan.pp_degree,
            virtual_stages=plan.virtual_stages,
            num_micro_batches=plan.num_micro_batches,
        )
    except ScheduleError as error:
        yield str(error)
    stages = plan.pp_degree * plan.virtual_stages
    if num_stages != stages:
        yield (
            f"stages has {num_stages} entries; pp_degree x virtual_stages = "
            f"{plan.pp_degree} x {plan.virtual_stages} = {stages} are needed"
        )


def hsdp_problems(plan: object) -> Iterator[str]:
    """The HSDP shard group (``dp_shard_degree``: shard within groups of that many consecutive
    data-parallel ranks, replicate across the dp / dp_shard_degree groups) against the degrees
    and the ZeRO stage: a whole number dividing dp_degree, with something to shard (ZeRO >= 1;
    more than one rank, or context-parallel ranks beside it), and dense weights only (HSDP of
    routed experts, whose data-parallel groups are their own, is neither priced nor run).
    Nothing for a plan without one (None: all of dp). ``plan`` is read by attribute (a `Plan`,
    a `Strategy`)."""
    shard = getattr(plan, "dp_shard_degree", None)
    if shard is None:
        return
    dp = getattr(plan, "dp_degree", 1)
    if not is_whole(shard):
        yield (
            f"dp_shard_degree = {shown(shard)} must be a whole number >= 1 dividing dp_degree "
            f"= {dp} (or left out: the weights sharded over all of dp)"
        )
        return
    if dp % shard:
        # the divisors of dp in [2, dp) nearest the value asked (O(sqrt dp) steps)
        small = [d for d in range(2, math.isqrt(dp) + 1) if dp % d == 0]
        divisors = sorted({*small, *(dp // d for d in small)} - {dp})
        below = [d for d in divisors if d < shard][-1:]
        above = [d for d in divisors if d > shard][:1]
        nearest = " or ".join(map(str, below + above))
        kind = "divisors" if below and above else "divisor"
        use = f"use {nearest} (the nearest {kind} of {dp}), or " if nearest else ""
        yield (
            f"dp_shard_degree = {shard} does not divide dp_degree = {dp}: HSDP shards the weights "
            "within groups of dp_shard_degree consecutive data-parallel ranks and replicates "
            f"them across dp_degree / dp_shard_degree groups; {use}leave dp_shard_degree out "
            "(sharded over all of dp)"
        )
        return
    zero = getattr(plan, "zero_stage", 0)
    if zero == 0:
        yield (
            f"dp_shard_degree = {shard} with zero_stage 0: HSDP shards weights, gradients or "
            "optimizer state within its groups, and ZeRO-0 shards none of them; set zero_stage "
            "1, 2 or 3, or leave dp_shard_degree out"
        )
    elif shard == 1 and getattr(plan, "cp_degree", 1) == 1:
        yield (
            "dp_shard_degree = 1 shards nothing (a shard group of one rank, every rank a "
            f"replica): that is zero_stage 0 priced as ZeRO-{zero}; use zero_stage 0 without "
            "dp_shard_degree, or a dp_shard_degree above 1"
        )
    ep = getattr(plan, "ep_degree", 1)
    if ep > 1:
        yield (
            f"dp_shard_degree = {shard} with ep_degree = {ep}: autoplan prices and runs HSDP for "
            "dense weights only (routed experts reduce over their own expert-data-parallel "
            "groups, which it does not split into shard and replica groups); leave "
            "dp_shard_degree out, or set ep_degree 1"
        )


def etp_problem(tp: int, etp: object) -> str | None:
    """Expert tensor parallelism (Megatron-Core's ``--expert-tensor-parallel-size``): each
    routed expert's GEMMs split over ``etp`` ranks. Megatron-Core only asks that etp x ep x pp
    divide the world (megatron/core/parallel_state.py, ``initialize_model_parallel``);
    autoplan also keeps an expert's ranks inside one TP group (consecutive, on one scale-up
    domain), so etp must divide tp."""
    if not is_whole(etp):
        return f"etp_degree = {shown(etp)} must be a whole number >= 1"
    assert isinstance(etp, int)
    if tp % etp:
        choices = [d for d in range(1, tp + 1) if tp % d == 0]
        return (
            f"etp_degree = {etp} does not divide tp_degree = {tp}: each routed expert is split "
            "over etp consecutive ranks of one TP group (expert tensor parallelism), so etp "
            f"must divide tp; use one of {choices}"
        )
    return None


def _expert_problems(plan: DegreesLike) -> Iterator[str]:
    tp, cp, dp, ep = plan.tp_degree, plan.cp_degree, plan.dp_degree, plan.ep_degree
    etp = getattr(plan, "etp_degree", 1)
    problem = etp_problem(tp, etp)
    if problem is not None:
        yield problem
        return
    if not plan.ep_folding:
        if dp % ep:
            yield (
                f"ep_degree = {ep} does not divide dp_degree = {dp}: "
                "expert parallelism splits the experts over ep of the data-parallel ranks "
                "(dp = ep x expert-data-parallel); use an ep_degree that divides dp_degree"
            )
        return
    # with etp > 1 the ep groups fold over the tp / etp expert-TP groups of the block
    # (Megatron-Core's expert rank generator: etp innermost, then ep, then edp)
    if folded_ep_factors(ep, tp // etp, cp, dp) is None:
        block = dp * cp * tp // etp
        choices = [e for e in range(1, block + 1) if folded_ep_factors(e, tp // etp, cp, dp)]
        over = f"tp {tp}" if etp == 1 else f"tp {tp} / etp {etp}"
        yield (
            f"ep_degree = {ep} with ep_folding does not fold over {over} x cp "
            f"{cp} x dp {dp}: a folded expert-parallel group is ep consecutive ranks of that "
            "block (tp innermost), which must divide the innermost axis it reaches into and "
            f"take all of those inside; use one of {choices}"
        )
    if tp > 1 and not plan.sequence_parallel:
        yield (
            f"ep_folding with tp_degree = {tp} needs sequence_parallel: true: "
            "folded expert parallelism gives every TP rank its own tokens to route, which "
            "only sequence parallelism splits; set sequence_parallel: true or ep_folding: false"
        )


def model_problems(plan: DegreesLike, profile: ModelProfile) -> Iterator[str]:
    """How the degrees disagree with the model's shapes: tp against the counts it splits, cp
    against the sequence and attention, ep against the experts (issue 21's rules)."""
    name = shown(profile.name)
    for count_name, count in tp_undivided(plan.tp_degree, profile).items():
        yield (
            f"tp_degree = {plan.tp_degree} does not divide {count_name} = {count} of model "
            f"{name}; use a tp_degree that divides {count}"
        )
    cp = plan.cp_degree
    if cp > 1:
        if not cp_fits_sequence(cp, profile.seq_len):
            yield (
                f"cp_degree = {cp}: 2 x cp_degree = {2 * cp} must divide seq_len = "
                f"{profile.seq_len} of model {name} (torch's load-balanced "
                "causal sharding cuts each sequence into 2 x cp chunks, chunks i and 2cp-1-i "
                f"per rank); use a cp_degree with 2 x cp_degree dividing {profile.seq_len}"
            )
        if profile.num_heads is None or not any(
            op.kind == "attention" for unit in profile.units for op in unit.ops
        ):
            yield (
                f"cp_degree = {cp} but model {name} has no attention the trace "
                "recognises (context parallelism shards attention along the sequence); "
                "set cp_degree to 1"
            )
    layers = profile.moe_layers
    shard = getattr(plan, "dp_shard_degree", None)
    if shard is not None and layers and getattr(plan, "ep_degree", 1) == 1:
        yield (
            f"dp_shard_degree = {shard} on mixture-of-experts model {name}: autoplan prices and "
            "runs HSDP for dense models only (a routed expert's gradients reduce over their own "
            "groups, which it does not split into shard and replica groups); leave "
            "dp_shard_degree out"
        )
    for facts in layers:
        if facts.top_k > facts.num_experts:
            yield (
                f"model {name} routes each token to top_k = {facts.top_k} "
                f"experts of num_experts = {facts.num_experts}; top_k must be <= "
                "num_experts: lower top_k or add experts"
            )
    ep = plan.ep_degree
    if ep > 1 and not layers:
        yield (
            f"ep_degree = {ep} but model {name} is dense (no "
            "mixture-of-experts layer): expert parallelism needs experts to split; set "
            "ep_degree to 1"
        )
    etp = getattr(plan, "etp_degree", 1)
    if etp > 1 and not layers:
        yield (
            f"etp_degree = {etp} but model {name} is dense (no mixture-of-experts layer): "
            "expert tensor parallelism needs experts to split; set etp_degree to 1"
        )
    for facts in layers if etp > 1 else ():
        if facts.expert_ffn_hidden_size % etp:
            yield (
                f"etp_degree = {etp} does not divide the experts' ffn hidden size "
                f"{facts.expert_ffn_hidden_size} of model {name} (each expert's up and gate "
                "GEMMs split their columns over etp ranks); use an etp_degree that divides it"
            )
            break
    for facts in layers if ep > 1 else ():
        if facts.num_experts % ep:
            yield (
                f"ep_degree = {ep} does not divide num_experts = {facts.num_experts} of "
                f"model {name} (each expert-parallel rank holds "
                "num_experts / ep whole experts); use an ep_degree that divides "
                f"{facts.num_experts} and dp_degree = {plan.dp_degree}"
            )


def sequence_parallel_problems(plan: DegreesLike, seq_len: int) -> Iterator[str]:
    """Sequence parallelism against tp and the sequence (`sp_fits`)."""
    if not plan.sequence_parallel or sp_fits(plan.tp_degree, seq_len):
        return
    if plan.tp_degree == 1:
        yield (
            "sequence_parallel: true needs tp_degree > 1 (it splits the TP-replicated "
            "work along the sequence); set it to false"
        )
    else:
        yield (
            f"sequence_parallel needs tp_degree = {plan.tp_degree} to divide seq_len = "
            f"{seq_len}; change tp_degree or turn sequence_parallel off"
        )


def tp_comm_overlap_problem(
    tp_degree: int, sequence_parallel: bool, tp_comm_overlap: object
) -> str | None:
    """``tp_comm_overlap`` against tp and sequence parallelism: the overlap pipelines the
    sequence-parallel all-gathers and reduce-scatters with the GEMMs they feed or follow, so it
    needs both. Megatron-LM asserts it ("Tensor parallel communication/GEMM overlap can happen
    only when sequence parallelism is enabled", megatron/training/arguments.py validate_args);
    torch's async TP fuses all-gather + matmul and matmul + reduce-scatter only, which
    all-reducing TP without sequence parallelism has none of."""
    if not isinstance(tp_comm_overlap, bool):
        return f"tp_comm_overlap = {shown(tp_comm_overlap)} must be true or false"
    if not tp_comm_overlap:
        return None
    if tp_degree == 1:
        return (
            "tp_comm_overlap: true needs tp_degree > 1 (it overlaps tensor-parallel "
            "collectives with their GEMMs, and tp_degree 1 has none); set tp_comm_overlap to "
            "false"
        )
    if not sequence_parallel:
        return (
            f"tp_comm_overlap: true with tp_degree = {tp_degree} needs sequence_parallel: true "
            "(the overlap splits the sequence-parallel all-gathers and reduce-scatters around "
            "their GEMMs; without sequence parallelism TP all-reduces, which no stack "
            "overlaps so); set sequence_parallel: true, or tp_comm_overlap to false"
        )
    return None
