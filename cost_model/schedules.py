"""Pipeline schedules as data: each pipeline rank's action order, its simulation, its memory.

One schedule model for the whole product. `pipeline_order` takes each rank's order of compute
actions from torch's own schedule class (``torch.distributed.pipelining``), the class
`passes.pipeline` builds for the runtime, so what the cost model simulates is what the job runs:

========================  ==================================  =========  ================
``schedule``              torch class                         chunks/rank placement
========================  ==================================  =========  ================
``gpipe``                 ``ScheduleGPipe``                   1          loop
``1f1b``                  ``Schedule1F1B``                    1          loop
``interleaved-1f1b``      ``ScheduleInterleaved1F1B``         v >= 2     loop
``interleaved-zb``        ``ScheduleInterleavedZeroBubble``   v >= 2     loop
``zbv``                   ``ScheduleZBVZeroBubble``           2          V
``dualpipev``             ``ScheduleDualPipeV``               2          V
========================  ==================================  =========  ================

"loop" puts stage ``s`` on pipeline rank ``s % p``; "V" puts stages ``r`` and ``2p - 1 - r`` on
rank ``r`` (torch's ``generate_stage_to_rank_mapping(style="v")``), so the two middle stages
share a rank and hand over locally. The zero-bubble schedules split a stage's backward into
backward-input (``I``: the gradient the previous stage waits for) and backward-weight (``W``,
deferred into what would be bubbles; Qi et al. 2024, "Zero Bubble Pipeline Parallelism").

`simulate` runs the orders with list scheduling on the cost model's per-stage times: an action
starts when its rank has finished the previous one in its order and its input has arrived. A
forward of stage s needs stage s-1's forward of the same micro-batch, a backward (or
backward-input) needs stage s+1's backward (or backward-input), the last stage's backward its own
forward, a backward-weight its backward-input. A boundary's transfer delays the consumer by the
link time (zero between stages on one rank: torch hands the tensor over locally); the host time
of posting a message is busy time of the rank that sends it and is folded into the sender's
action by the caller (`StageTimes`). After its last action each rank runs its tail (exposed
data-parallel sync, optimizer step), and the step ends when the last rank's tail does::

    step = max over ranks r of (end of r's last action + tail_r)

The simulated time is the length of the longest path through the action graph, a maximum of
sums of stage times; `critical_path` returns that path's action and transfer counts, which the
planner uses as linear cuts (`autoplan.planner.partition`). Peak activation memory comes from
the same orders (`cost_model.schedule_memory.held_microbatches`): at each point of a rank's
order, how many micro-batches
each of its stages holds (forward done, backward not yet; under a split backward the
backward-input frees nothing, torch's ``stage_backward_input`` retains the graph until ``W``).
"""

from __future__ import annotations

import array
import functools
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from cost_model.errors import InputError

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"]
SCHEDULES: tuple[ScheduleName, ...] = (
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "interleaved-zb",
    "zbv",
    "dualpipev",
)
ActionKind = Literal["F", "B", "I", "W"]
ACTION_KINDS: tuple[ActionKind, ...] = ("F", "B", "I", "W")
Placement = Literal["loop", "v"]

# torch.distributed.pipelining.schedules class of each schedule (the runtime builds the same).
TORCH_SCHEDULE_CLASSES: dict[ScheduleName, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SPLIT_BACKWARD: frozenset[ScheduleName] = frozenset({"interleaved-zb", "zbv", "dualpipev"})
V_SCHEDULES: frozenset[ScheduleName] = frozenset({"zbv", "dualpipev"})
# the schedules that run one stage per pipeline rank (virtual_stages = 1)
ONE_STAGE_SCHEDULES: frozenset[ScheduleName] = frozenset({"gpipe", "1f1b"})


class ScheduleError(InputError):
    """A schedule cannot run with these degrees (the message names the rule and the fix)."""


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action: a forward (``F``), backward (``B``), backward-input (``I``) or
    backward-weight (``W``) of one micro-batch through one stage. Prints as torch's ``_Action``
    does: ``2F0`` is stage 2, forward, micro-batch 0."""

    stage_idx: int
    kind: ActionKind
    microbatch_idx: int

    def __str__(self) -> str:
        return f"{self.stage_idx}{self.kind}{self.microbatch_idx}"


# The most micro-batches a step may have: the simulation and torch's schedule classes walk
# every one (far beyond any real job: a step of 2^20 sequences at micro-batch 1 and dp 16 has
# 65,536), so an absurd global batch is an error, not an out-of-memory.
MAX_MICRO_BATCHES = 100_000
# The most compute actions a step may have (`ScheduleSpec.num_actions`: stages x micro-batches
# x 2, or 3 under a split backward): torch's schedule class builds every one and the cost
# model compiles and walks them all, about 400 bytes an action at the peak of that build
# (`bench/limits.py`), so the largest schedule takes under 1 GiB and about 20 s. Far beyond any
# published run (Llama 3 405B: 16 ranks x 8 stages x 16 micro-batches x 2 = 4,096 actions);
# reached only by thousands of stages with thousands of micro-batches.
MAX_SCHEDULE_ACTIONS = 2**21
# The actions each memoised schedule table (orders, compiled graph, held micro-batches, rank
# paths) may keep across the schedules it holds: the least recently used go first.
_CACHED_ACTIONS = 2**21


def interleaved_rounds(num_micro_batches: int, pp_degree: int) -> int:
    """Rounds of torch's interleaved schedules: ``max(1, m // pp)``, each running
    ``m / rounds`` micro-batches through a virtual stage before the next."""
    return max(1, num_micro_batches // pp_degree)


def runs_in_gpipe_order(schedule: str, num_micro_batches: int, pp_degree: int) -> bool:
    """A ``gpipe`` plan with fewer micro-batches than stages: the order a 1F1B engine runs
    then (Megatron's and DeepSpeed's warm up min(pp - rank - 1, m) forwards), so such a
    plan is their 1F1B."""
    return schedule == "gpipe" and num_micro_batches < pp_degree


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSpec:
    """A pipeline schedule with its degrees; construction checks torch's rules for it."""

    schedule: ScheduleName
    pp_degree: int
    virtual_stages: int = 1
    num_micro_batches: int

    def __post_init__(self) -> None:
        p, v, m, name = self.pp_degree, self.virtual_stages, self.num_micro_batches, self.schedule
        if name not in SCHEDULES:
            raise ScheduleError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
        for field_name, value in (("pp_degree", p), ("virtual_stages", v), ("micro-batches", m)):
            if value < 1:
                raise ScheduleError(f"{field_name} = {value} must be >= 1")
        if m > MAX_MICRO_BATCHES:
            raise ScheduleError(
                f"num_micro_batches = {m:,}: the cost model simulates every micro-batch of a step "
                f"and takes at most {MAX_MICRO_BATCHES:,}; use a larger micro-batch or a smaller "
                "global batch"
            )
        if name in ONE_STAGE_SCHEDULES and v != 1:
            raise ScheduleError(
                f"schedule {name!r} runs one stage per pipeline rank, got virtual_stages = {v}; "
                "use 'interleaved-1f1b' or 'interleaved-zb' for virtual stages, or set "
                "virtual_stages: 1"
            )
        if name == "1f1b" and m < p:
            raise ScheduleError(
                f"num_micro_batches = {m} must be >= pp_degree = {p} for '1f1b' (torch's "
                "Schedule1F1B requires it); raise num_micro_batches or use 'gpipe'"
            )
        if name in ("interleaved-1f1b", "interleaved-zb"):
            if p < 2 or v < 2:
                raise ScheduleError(
                    f"schedule {name!r} needs pp_degree >= 2 and virtual_stages >= 2, got "
                    f"pp_degree = {p}, virtual_stages = {v}; use '1f1b' for one stage per rank"
                )
            rounds = interleaved_rounds(m, p)
            if m % rounds:
                raise ScheduleError(
                    f"num_micro_batches = {m} must be a multiple of its number of rounds "
                    f"max(1, num_micro_batches // pp_degree) = {rounds} for {name!r} (torch's "
                    f"{TORCH_SCHEDULE_CLASSES[name]}); use "
                    f"{_next_interleavable(m, p)} micro-batches"
                )
        if name in V_SCHEDULES:
            if v != 2 or p < 2:
                raise ScheduleError(
                    f"schedule {name!r} runs exactly two stages per pipeline rank in a V on "
                    f"pp_degree >= 2 ranks, got pp_degree = {p}, virtual_stages = {v}; set "
                    "virtual_stages: 2"
                )
            if name == "dualpipev" and m < 2 * p:
                raise ScheduleError(
                    f"num_micro_batches = {m} must be >= the number of stages 2 x pp_degree = "
                    f"{2 * p} for 'dualpipev' (torch's ScheduleDualPipeV requires it); raise "
                    "num_micro_batches or use 'zbv'"
                )
        if self.num_actions > MAX_SCHEDULE_ACTIONS:
            raise ScheduleError(
                f"{p * v:,} stages x {m:,} micro-batches = {self.num_actions:,} actions per step: "
                f"the cost model simulates every action and takes at most "
                f"{MAX_SCHEDULE_ACTIONS:,}; use fewer pipeline stages (pp x virtual stages), a "
                "larger micro-batch or a smaller global batch"
            )

    @property
    def num_stages(self) -> int:
        return self.pp_degree * self.virtual_stages

    @property
    def num_actions(self) -> int:
        """The compute actions of all ranks in one step, at most: a forward and a backward of
        every micro-batch through every stage (three under a split backward)."""
        return (3 if self.splits_backward else 2) * self.num_stages * self.num_micro_batches

    @property
    def placement(self) -> Placement:
        return "v" if self.schedule in V_SCHEDULES else "loop"

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs backward-input and backward-weight as separate actions."""
        return self.schedule in SPLIT_BACKWARD

    def stage_rank(self, stage_idx: int) -> int:
        """The pipeline rank that runs stage ``stage_idx``."""
        return stage_rank(self.placement, self.pp_degree, stage_idx)

    def rank_stages(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``pp_rank`` runs, in stage order: one per chunk of ``p``
        stages (the inverse of `stage_rank`, without visiting every stage)."""
        return rank_stages(self.placement, self.pp_degree, self.virtual_stages, pp_rank)


def stage_rank(placement: Placement, pp_degree: int, stage_idx: int) -> int:
    """Pipeline rank of stage ``stage_idx`` under a placement (torch's
    ``generate_stage_to_rank_mapping``: loop ``s % p``; V ``s`` then ``2p - 1 - s``)."""
    chunk, offset = divmod(stage_idx, pp_degree)
    if placement == "loop" or chunk % 2 == 0:
        return offset
    return pp_degree - 1 - offset


def rank_stages(
    placement: Placement, pp_degree: int, virtual_stages: int, pp_rank: int
) -> tuple[int, ...]:
    """The stages pipeline rank ``pp_rank`` runs under a placement, in stage order: one in
    each chunk of ``pp_degree`` stages (the inverse of `stage_rank`)."""
    p = pp_degree
    if not 0 <= pp_rank < p:
        return ()
    return tuple(
        chunk * p + (pp_rank if placement == "loop" or chunk % 2 == 0 else p - 1 - pp_rank)
        for chunk in range(virtual_stages)
    )


_Table = TypeVar("_Table")


def _memoised(table: Callable[[ScheduleSpec], _Table]) -> Callable[[ScheduleSpec], _Table]:
    """``table`` memoised on the (hashable, frozen) spec, least recently used first out, within
    `_CACHED_ACTIONS` actions of the schedules it holds (the latest always kept): the planner
    asks for the same few schedules often, and a few huge ones must not pile up."""
    cache: OrderedDict[ScheduleSpec, _Table] = OrderedDict()
    held = [0]  # actions of the cached schedules

    @functools.wraps(table)
    def cached(spec: ScheduleSpec) -> _Table:
        found = cache.get(spec)
        if found is not None:
            cache.move_to_end(spec)
            return found
        value = table(spec)
        cache[spec] = value
        held[0] += spec.num_actions
        while held[0] > _CACHED_ACTIONS and len(cache) > 1:
            old, _ = cache.popitem(last=False)
            held[0] -= old.num_actions
        return value

    return cached


def _next_interleavable(m: int, p: int) -> int:
    n = m + 1
    while n % max(1, n // p):
        n += 1
    return n


# ------------------------------------------------------------------------------ orders


@_memoised
def pipeline_order(spec: ScheduleSpec) -> tuple[tuple[Action, ...], ...]:
    """Each pipeline rank's compute actions in the order torch's schedule class runs them.

    Built without a process group, from the same code the runtime runs:

    - one stage per rank (``ScheduleGPipe``, ``Schedule1F1B``): the runtime is the class's own
      ``_step_microbatches`` loop, so that loop is run here on a stand-in stage that records
      each forward and backward instead of computing it (the classes' ``pipeline_order`` IR is
      only for display, and torch 2.13's ``Schedule1F1B`` IR numbers the last rank's
      micro-batches from 1);
    - several stages per rank: the runtime executes the class's ``pipeline_order`` (lowered
      with send/recv actions around the same compute actions), read here with idle slots
      (``None``) and gradient-reduction markers dropped, and an overlapped forward/backward
      pair (DualPipeV) as its two actions in order (the runtime runs them one after the other).

    Memoised on the (hashable, frozen) spec: the planner asks for the same few schedules often.
    """
    # torch loads here, on the first schedule asked for, not when cost_model is imported: the
    # CLI's file commands then start in a fraction of a second.
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, TORCH_SCHEDULE_CLASSES[spec.schedule])
    p, v, m = spec.pp_degree, spec.virtual_stages, spec.num_micro_batches
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        return tuple(_recorded_single(cls, rank, p, m) for rank in range(p))
    # The order is all this needs; lowering it with send/recv actions (for the runtime) is the
    # costly part of the constructor and is skipped.
    lean = type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": _skip_lowering})
    order = lean([_StandInStage(i, p, p * v) for i in range(v)], m).pipeline_order
    out: list[tuple[Action, ...]] = []
    for rank in range(p):
        actions: list[Action] = []
        for item in order[rank]:
            if item is None:
                continue
            parts = item.sub_actions if item.sub_actions is not None else (item,)
            for part in parts:
                # (the enum's raw value: its .value property is slow on long orders)
                kind = part.computation_type._value_
                if kind in _KIND_SLOT and part.microbatch_index is not None:
                    actions.append(Action(part.stage_index, kind, part.microbatch_index))
        out.append(tuple(actions))
    return tuple(out)


def _recorded_single(cls: type, rank: int, p: int, m: int) -> tuple[Action, ...]:
    """Run a one-stage schedule's ``_step_microbatches`` for pipeline rank ``rank`` on a
    stand-in stage and return the forwards and backwards it ran, in order."""
    stage = _StandInStage(rank, p, p)
    schedule = _lean_single(cls)(stage, m, loss_fn=_no_loss)
    schedule._initialize_stage = _skip_lowering  # nothing to allocate: no tensors flow
    schedule._step_microbatches([()] * m, [{}] * m, [None] * m, losses=None, return_outputs=False)
    return tuple(stage.recorded)


@functools.cache
def _lean_single(cls: type) -> type:
    """``cls`` without the display IR its constructor builds (``pipeline_order``: every rank's
    actions, which a one-stage schedule's ``_step_microbatches`` never reads); building it for
    each of p ranks cost O(p^2 m) and most of a schedule's compile time."""
    return type(cls.__name__, (cls,), {"_get_pipeline_order": _no_order})


def _no_order(self: object) -> None:
    return None


def _no_loss(output: object, target: object) -> None:
    return None


def _skip_lowering(self: object, *args: object, **kwargs: object) -> None:
    return None


class _StandInStage:
    """What torch's schedules read from a stage; records the compute it is asked for."""

    def __init__(self, stage_index: int, group_size: int, num_stages: int) -> None:
        self.stage_index = stage_index
        self.group_size = group_size
        self.group_rank = 0
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.has_backward = True
        self.recorded: list[Action] = []

    def forward_one_chunk(self, microbatch_idx: int, *args: object, **kwargs: object) -> None:
        self.recorded.append(Action(self.stage_index, "F", microbatch_idx))

    def backward_one_chunk(self, microbatch_idx: int, *args: object, **kwargs: object) -> None:
        self.recorded.append(Action(self.stage_index, "B", microbatch_idx))

    def _no_ops(self, *args: object, **kwargs: object) -> list[object]:
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _no_ops

    def perform_reduce_grad(self, *args: object, **kwargs: object) -> None:
        return None


# ------------------------------------------------------------------------------ simulation


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTimes:
    """One stage's times for one micro-batch, in seconds.

    ``forward_s`` and ``backward_s`` are the rank's busy time for the forward and the whole
    backward, host time of the messages the action sends included; under a split backward
    ``weight_s`` of ``backward_s`` is the deferred backward-weight (the backward-input takes
    the rest). ``transfer_s`` delays the next stage's forward by the time this stage's output
    takes over the link, and this stage's backward likewise for that output's gradient (0
    when the next stage is on the same rank or for the last stage).
    """

    forward_s: float
    backward_s: float
    weight_s: float = 0.0
    transfer_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.forward_s, self.backward_s, self.weight_s, self.transfer_s) < 0:
            raise ValueError(f"stage times must be >= 0, got {self}")
        if self.weight_s > self.backward_s:
            raise ValueError(f"weight_s {self.weight_s} exceeds backward_s {self.backward_s}")


# Duration slots per stage: index 4 s + k of an action of stage s and kind ACTION_KINDS[k].
_KIND_SLOT = {"F": 0, "B": 1, "I": 2, "W": 3}


@dataclass(frozen=True, slots=True, eq=False)
class CompiledSchedule:
    """A schedule's action graph in one topological order, as flat tables for fast simulation.

    Position ``j`` of the order is ``actions[j]``, on rank ``ranks[j]``; ``rank_pred[j]`` is
    the position of the rank's previous action, ``data_pred[j]`` the producer of its input,
    ``transfer[j]`` the boundary whose link that input crosses (``num_stages`` for none) and
    ``slot[j]`` its duration slot (4 stage + kind). The sentinel position ``len(actions)``
    stands for "nothing" (time 0). The per-action tables are int arrays (8 bytes an entry, a
    tenth of a tuple of large ints: a schedule may have millions of actions).
    """

    spec: ScheduleSpec
    actions: tuple[Action, ...]
    ranks: Sequence[int]
    rank_pred: Sequence[int]
    data_pred: Sequence[int]
    transfer: Sequence[int]
    slot: Sequence[int]
    rank_last: tuple[int, ...]  # position of each rank's last action


@_memoised
def compile_schedule(spec: ScheduleSpec) -> CompiledSchedule:
    """The action graph of ``spec``'s orders, topologically sorted (memoised on the spec)."""
    orders = pipeline_order(spec)
    num_stages = spec.num_stages
    rank_of = [spec.stage_rank(s) for s in range(num_stages)]
    for r, actions in enumerate(orders):
        wrong = [a for a in actions if rank_of[a.stage_idx] != r]
        assert not wrong, f"{spec}: rank {r} runs {wrong[0]} of another rank"
    # Every action by its rank-major index, and the index of the action that produces its
    # input (-1: none) with the boundary that input crosses (num_stages: none).
    flat = [a for actions in orders for a in actions]
    m = spec.num_micro_batches

    def key(stage_idx: int, kind: str, microbatch_idx: int) -> int:
        """An action's place in `index`: (stage, kind slot, micro-batch), row-major."""
        return (4 * stage_idx + _KIND_SLOT[kind]) * m + microbatch_idx

    # index[key]: the rank-major index of that action (-1: none)
    index = array.array("q", [-1]) * (4 * num_stages * m)
    for k, a in enumerate(flat):
        assert 0 <= a.microbatch_idx < m, f"{spec}: {a} numbers micro-batches past {m}"
        index[key(a.stage_idx, a.kind, a.microbatch_idx)] = k

    def found(stage_idx: int, kind: str, microbatch_idx: int) -> int:
        k = index[key(stage_idx, kind, microbatch_idx)]
        assert k >= 0, f"{spec}: no {stage_idx}{kind}{microbatch_idx} in the orders"
        return k

    producer = array.array("q", [-1]) * len(flat)
    boundary = array.array("q", [num_stages]) * len(flat)
    for k, a in enumerate(flat):
        s, kind, i = a.stage_idx, a.kind, a.microbatch_idx
        if kind == "F":
            if s > 0:
                producer[k] = found(s - 1, "F", i)
                if rank_of[s - 1] != rank_of[s]:
                    boundary[k] = s - 1
        elif kind == "W":
            producer[k] = found(s, "I", i)
        elif s == num_stages - 1:
            producer[k] = found(s, "F", i)
        else:
            grad = index[key(s + 1, "I", i)]
            if grad < 0:
                grad = index[key(s + 1, "B", i)]
            assert grad >= 0, f"{spec}: no backward of stage {s + 1} for micro-batch {i}"
            producer[k] = grad
            if rank_of[s + 1] != rank_of[s]:
                boundary[k] = s

    # Topological order: advance every rank as far as its inputs allow, round after round.
    position = array.array("q", [-1]) * len(flat)
    sequence = array.array("q")
    bounds = list(itertools.accumulate((len(a) for a in orders), initial=0))
    cursor = bounds[:-1]
    remaining = len(flat)
    while remaining:
        moved = False
        for r in range(len(orders)):
            k, stop = cursor[r], bounds[r + 1]
            while k < stop and (producer[k] < 0 or position[producer[k]] >= 0):
                position[k] = len(sequence)
                sequence.append(k)
                k += 1
            if k != cursor[r]:
                remaining -= k - cursor[r]
                cursor[r] = k
                moved = True
        assert moved, f"{spec}: torch's order deadlocks at {cursor}"
    sentinel = len(sequence)
    ranks, rank_pred, data_pred, transfer, slot = (array.array("q") for _ in range(5))
    last = [sentinel] * len(orders)
    for k in sequence:
        a = flat[k]
        r = rank_of[a.stage_idx]
        ranks.append(r)
        rank_pred.append(last[r])
        data_pred.append(sentinel if producer[k] < 0 else position[producer[k]])
        transfer.append(boundary[k])
        slot.append(4 * a.stage_idx + _KIND_SLOT[a.kind])
        last[r] = position[k]
    return CompiledSchedule(
        spec=spec,
        actions=tuple(flat[k] for k in sequence),
        ranks=ranks,
        rank_pred=rank_pred,
        data_pred=data_pred,
        transfer=transfer,
        slot=slot,
        rank_last=tuple(last),
    )


def duration_slots(spec: ScheduleSpec, stage_times: Sequence[StageTimes]) -> list[float]:
    """Per stage the durations of F, B, I, W (slot 4 s + k), from its times."""
    if len(stage_times) != spec.num_stages:
        raise ValueError(f"{len(stage_times)} stage times for {spec.num_stages} stages")
    out: list[float] = []
    for t in stage_times:
        out += [t.forward_s, t.backward_s, t.backward_s - t.weight_s, t.weight_s]
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Simulation:
    """One simulated step: when each rank finishes, and the step's end."""

    spec: ScheduleSpec
    end_s: tuple[float, ...]  # per action, in the compiled order
    rank_end_s: tuple[float, ...]  # end of each rank's last action
    rank_busy_s: tuple[float, ...]  # compute time of each rank (sum of its actions)
    tail_s: tuple[float, ...]
    transfer_s: tuple[float, ...]  # per boundary stage, then 0 for "no link"
    pipeline_time_s: float  # the last action's end
    step_time_s: float  # max over ranks of (rank end + tail)

    @property
    def last_rank(self) -> int:
        """The rank whose tail ends the step."""
        ends = [e + t for e, t in zip(self.rank_end_s, self.tail_s, strict=True)]
        return max(range(len(ends)), key=ends.__getitem__)


def simulate(
    spec: ScheduleSpec,
    stage_times: Sequence[StageTimes],
    tail_s: Sequence[float] | None = None,
) -> Simulation:
    """Run ``spec``'s orders with these per-stage times (module docstring)."""
    compiled = compile_schedule(spec)
    durations = duration_slots(spec, stage_times)
    transfers = [t.transfer_s for t in stage_times] + [0.0]
    end = _longest_paths(compiled, durations, transfers)
    p = spec.pp_degree
    tails = tuple(tail_s) if tail_s is not None else (0.0,) * p
    if len(tails) != p:
        raise ValueError(f"{len(tails)} tail times for {p} pipeline ranks")
    busy = [0.0] * p
    for j, r in enumerate(compiled.ranks):
        busy[r] += durations[compiled.slot[j]]
    rank_end = tuple(end[j] for j in compiled.rank_last)
    return Simulation(
        spec=spec,
        end_s=tuple(end[:-1]),
        rank_end_s=rank_end,
        rank_busy_s=tuple(busy),
        tail_s=tails,
        transfer_s=tuple(transfers),
        pipeline_time_s=max(rank_end),
        step_time_s=max(e + t for e, t in zip(rank_end, tails, strict=True)),
    )


def _longest_paths(
    compiled: CompiledSchedule, durations: Sequence[float], transfers: Sequence[float]
) -> list[float]:
    """End time of every action (list scheduling = longest path in the action graph); the
    last entry is the sentinel's 0."""
    n = len(compiled.actions)
    end = [0.0] * (n + 1)
    rank_pred, data_pred, transfer, slot = (
        compiled.rank_pred,
        compiled.data_pred,
        compiled.transfer,
        compiled.slot,
    )
    for j in range(n):
        a = end[rank_pred[j]]
        b = end[data_pred[j]] + transfers[transfer[j]]
        end[j] = (a if a >= b else b) + durations[slot[j]]
    return end


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticalPath:
    """A longest path of a simulated step, as counts: the step time is exactly
    ``sum(count * duration of slot) + sum(count * transfer of boundary) + tail[rank]``."""

    slots: dict[int, int]  # duration slot (4 stage + kind) -> actions of that slot on the path
    transfers: dict[int, int]  # boundary stage -> link crossings on the path
    tail_rank: int  # the rank whose tail ends the path


def path_key(path: CriticalPath) -> tuple[object, ...]:
    """Equal for paths with the same counts (the same cut in a solver's model)."""
    return (
        tuple(sorted(path.slots.items())),
        tuple(sorted(path.transfers.items())),
        path.tail_rank,
    )


def path_length(
    path: CriticalPath,
    forward: Sequence[Any],
    backward: Sequence[Any],
    weight: Sequence[Any],
    *,
    message: Sequence[Any] | None = None,
    transfer: Sequence[Any] | None = None,
    tail: Sequence[Any] | None = None,
) -> Any:
    """The path's length over per-stage times given apart from the messages (numbers, or a
    solver's linear expressions of them): each action's stage time with the host time of the
    message it posts (the forward its output's, ``message[s]``; the backward its gradient's,
    ``message[s - 1]``), the backward-input as the backward without its weight half, the link
    crossings and its rank's tail; what is not given counts 0. The path exists in every stage
    cut's action graph, so over a cut's own times it is a lower bound on its simulated step."""
    # (0, not 0.0: a CP-SAT expression takes integers only)
    expr: Any = tail[path.tail_rank] if tail is not None else 0
    for slot, count in path.slots.items():
        s, kind = divmod(slot, 4)
        send_f = message[s] if message is not None else 0
        send_b = message[s - 1] if message is not None and s > 0 else 0
        if kind == 0:  # F
            expr += count * (forward[s] + send_f)
        elif kind == 1:  # B
            expr += count * (backward[s] + send_b)
        elif kind == 2:  # I: the backward without its weight half
            expr += count * (backward[s] + send_b - weight[s])
        else:  # W
            expr += count * weight[s]
    if transfer is not None:
        for boundary, count in path.transfers.items():
            expr += count * transfer[boundary]
    return expr


def critical_path(
    spec: ScheduleSpec, simulation: Simulation, rank: int | None = None
) -> CriticalPath:
    """The longest path of ``simulation`` (ties: the rank's own previous action first); with
    ``rank``, the longest path that ends with that rank's last action and its tail."""
    compiled = compile_schedule(spec)
    end = [*simulation.end_s, 0.0]
    sentinel = len(compiled.actions)
    r = simulation.last_rank if rank is None else rank
    slots: dict[int, int] = {}
    transfers: dict[int, int] = {}
    j = compiled.rank_last[r]
    num_stages = spec.num_stages
    link = simulation.transfer_s
    while j != sentinel:
        slot = compiled.slot[j]
        slots[slot] = slots.get(slot, 0) + 1
        rp, dp, boundary = compiled.rank_pred[j], compiled.data_pred[j], compiled.transfer[j]
        if dp != sentinel and end[dp] + link[boundary] > end[rp]:
            if boundary < num_stages:
                transfers[boundary] = transfers.get(boundary, 0) + 1
            j = dp
        else:
            j = rp
    return CriticalPath(slots=slots, transfers=transfers, tail_rank=r)


@_memoised
def rank_paths(spec: ScheduleSpec) -> tuple[CriticalPath, ...]:
    """For each rank, one path through all of its actions: the chain of inputs that leads to
    its first action, its whole order, and the chain its last action's output feeds (a
    gradient down to stage 0, or nothing). Each is a lower bound on the step for any stage
    times (``m`` times the rank's per-micro-batch work plus fill and drain); the planner starts
    from them."""
    compiled = compile_schedule(spec)
    sentinel = len(compiled.actions)
    num_stages = spec.num_stages
    successors: dict[int, list[int]] = {}
    for j, dp in enumerate(compiled.data_pred):
        if dp != sentinel:
            successors.setdefault(dp, []).append(j)
    out = []
    for r in range(spec.pp_degree):
        members = [j for j, rank in enumerate(compiled.ranks) if rank == r]
        visited = list(members)  # actions on the path
        crossed: list[int] = []  # actions whose input crossed a boundary on the path
        j = members[0]
        while compiled.data_pred[j] != sentinel:  # fill: the inputs of the first action
            crossed.append(j)
            j = compiled.data_pred[j]
            visited.append(j)
        j = members[-1]
        while successors.get(j):  # drain: prefer the gradient chain over a weight action
            following = sorted(successors[j], key=lambda k: compiled.actions[k].kind == "W")
            j = following[0]
            crossed.append(j)
            visited.append(j)
        slots = dict(Counter(compiled.slot[k] for k in visited))
        transfers = dict(
            Counter(compiled.transfer[k] for k in crossed if compiled.transfer[k] < num_stages)
        )
        out.append(CriticalPath(slots=slots, transfers=transfers, tail_rank=compiled.ranks[j]))
    return tuple(out)


def pipeline_lower_bound_s(
    spec: ScheduleSpec, work_s: float, largest_s: float, chain_share: float = 0.0
) -> float:
    """A lower bound on the simulated pipeline time (the last action's end) of ANY stage cut
    whose stages' per-micro-batch work (forward + backward, sends included) sums to ``work_s``,
    no stage doing less than ``largest_s`` of it (the largest indivisible unit).

    - Every rank runs all of its ``m`` micro-batches' actions, and some rank holds at least
      ``work_s / p`` of the work and the largest unit: ``m * max(work_s / p, largest_s)``.
    - One stage per rank (``gpipe``, ``1f1b``): rank r's first action is stage r's forward of
      micro-batch 0 and its last stage r's backward of the last one, so the pipeline lasts at
      least ``A_r = sum_{s<r} T_s + m T_r`` (fill, busy, drain; ``T_s = F_s + B_s``). With
      ``q = 1 - 1/m`` and weights ``w_r = q^(p-1-r) / m``, every ``T_s`` gets the coefficient
      ``m w_s + sum_{r>s} w_r = q^(p-1-s) + (1 - q^(p-1-s)) = 1`` in ``sum_r w_r A_r``, and
      ``sum_r w_r = 1 - q^p``; so ``max_r A_r >= work_s / (1 - q^p)`` for every cut, about
      ``(m + (p - 1) / 2) / p`` per-rank shares (half the uniform bubble).

    - Every schedule: the first micro-batch's forward through every stage, then its backward
      back (each waits for the one before it): ``work_s`` without a split backward, else
      at least ``chain_share`` of it (the least share of a stage's work outside its weight
      half: the weight halves are off that chain). What counts when ``m`` is below ``p``.

    Used by the search to skip outer choices whose every cut is slower than the best found.
    """
    p, m = spec.pp_degree, spec.num_micro_batches
    bound = m * max(work_s / p, largest_s)
    if spec.virtual_stages == 1 and p > 1:
        bound = max(bound, work_s / (1.0 - (1.0 - 1.0 / m) ** p))
    bound = max(bound, work_s * (chain_share if spec.splits_backward else 1.0))
    return bound
