"""One training step of a pipeline schedule, simulated event by event from the cost model's times.

Expects per-stage times for one micro-batch (forward, backward, boundary sends; e.g. from a
`cost_model.Estimate` via `timeline_of`) and a schedule: ``gpipe``, ``1f1b`` or
``interleaved-1f1b``. `schedule_actions` writes each pipeline rank's order of forwards and
backwards as data (an `Action` prints as ``2F0``: stage 2, forward, micro-batch 0, like torch's
``_Action``); `simulate` runs those orders with list scheduling: an action starts when its rank
is free and its input is ready, where the forward of micro-batch i on stage s needs stage
s - 1's forward of i, and its backward needs stage s + 1's backward of i (the last stage's
backward follows its own forward).

Orders (Narayanan et al. 2021, section 2.2; Megatron-LM ``schedules.py``, whose warm-up counts
torch's ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` share):

- GPipe (Huang et al. 2019): every forward, then every backward, micro-batches in order.
- 1F1B: pipeline rank r runs ``min(p - r - 1, m)`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards.
- Interleaved 1F1B: rank r holds chunks (stages ``k p + r``); it runs
  ``min((p - r - 1) * 2 + (v - 1) * p, m v)`` warm-up chunk-forwards, then alternates; the
  k-th chunk-forward is chunk ``(k mod p v) // p`` of micro-batch ``(k // (p v)) p + k mod p``;
  backwards walk the chunks in reverse.

Communication: the cost model charges each stage but the last two sends per micro-batch (its
output forward, that output's gradient back; `cost_model.estimate.stage_p2p_time_s`). The
simulation puts the first right after the stage's forward and the second right before its
backward, on that stage's rank, so a rank's busy time per micro-batch is exactly the ``T_r`` of
`cost_model.schedules.pipeline_time_s`. After the flush every rank runs its tail (exposed
data-parallel sync and the optimizer) from the end of the pipeline, as the cost model charges it
(step time = pipeline time + the longest tail).

Guarantees: a deadlock-free schedule is simulated exactly (no action starts before its inputs or
overlaps another on its rank); for uniform stages without sends the simulated pipeline time
equals ``pipeline_time_s`` (tests check this and bound the difference with sends).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cost_model.estimate import Estimate
from cost_model.schedules import pipeline_time_s
from cost_model.strategy import PlanLike

ActionKind = Literal["F", "B"]
EventKind = Literal["forward", "backward", "send", "tail", "idle"]
EVENT_KINDS: tuple[EventKind, ...] = ("forward", "backward", "send", "tail", "idle")


@dataclass(frozen=True, kw_only=True, slots=True)
class Action:
    """One forward or backward of one micro-batch through one stage (model chunk)."""

    stage_idx: int
    kind: ActionKind
    microbatch_idx: int

    def __str__(self) -> str:
        return f"{self.stage_idx}{self.kind}{self.microbatch_idx}"


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTimes:
    """One stage's times for one micro-batch, in seconds."""

    forward_s: float
    backward_s: float
    send_s: float = 0.0  # both boundary sends (forward output + its gradient); 0 for the last

    def __post_init__(self) -> None:
        if min(self.forward_s, self.backward_s, self.send_s) < 0:
            raise ValueError(f"stage times must be >= 0, got {self}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineEvent:
    """A span of one pipeline rank's time within the step."""

    pp_rank: int
    kind: EventKind
    start_s: float
    end_s: float
    stage_idx: int | None = None
    microbatch_idx: int | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """A simulated step: every rank's events, sorted by rank then start time."""

    schedule: str
    pp_degree: int
    virtual_stages: int
    num_micro_batches: int
    events: tuple[TimelineEvent, ...]
    pipeline_time_s: float  # simulated: the end of the last backward
    step_time_s: float  # pipeline time + the longest tail
    formula_pipeline_time_s: float  # cost_model.schedules.pipeline_time_s of the same times
    rank_times_s: tuple[float, ...]  # T_r: one micro-batch through all chunks of rank r

    def rank_events(self, pp_rank: int) -> tuple[TimelineEvent, ...]:
        return tuple(e for e in self.events if e.pp_rank == pp_rank)

    def time_of(self, pp_rank: int, kind: EventKind) -> float:
        """Total seconds rank ``pp_rank`` spends in events of ``kind``."""
        return sum(e.duration_s for e in self.events if e.pp_rank == pp_rank and e.kind == kind)


# ------------------------------------------------------------------------------ orders


def schedule_actions(
    schedule: str, pp_degree: int, num_micro_batches: int, virtual_stages: int = 1
) -> dict[int, tuple[Action, ...]]:
    """Each pipeline rank's actions in the order the schedule runs them (module docstring)."""
    p, m, v = pp_degree, num_micro_batches, virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pp_degree={p}, num_micro_batches={m}, virtual_stages={v} must be >= 1")
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"schedule {schedule!r} runs one chunk per rank, got virtual_stages={v}")
    orders: dict[int, tuple[Action, ...]] = {}
    for r in range(p):
        if schedule == "gpipe":
            forwards = [Action(stage_idx=r, kind="F", microbatch_idx=i) for i in range(m)]
            backwards = [Action(stage_idx=r, kind="B", microbatch_idx=i) for i in range(m)]
            orders[r] = (*forwards, *backwards)
        elif schedule == "1f1b":
            orders[r] = _one_f_one_b(r, p, m, v, warmup=min(p - r - 1, m))
        elif schedule == "interleaved-1f1b":
            if m % p != 0:
                raise ValueError(
                    f"interleaved-1f1b needs num_micro_batches ({m}) to be a multiple of "
                    f"pp_degree ({p}) (Narayanan et al. 2021, section 2.2.2)"
                )
            # Megatron-LM forward_backward_pipelining_with_interleaving: num_warmup_microbatches
            warmup = min((p - r - 1) * 2 + (v - 1) * p, m * v)
            orders[r] = _one_f_one_b(r, p, m, v, warmup=warmup)
        else:
            raise ValueError(f"unknown schedule {schedule!r}; use gpipe, 1f1b or interleaved-1f1b")
    return orders


def _one_f_one_b(r: int, p: int, m: int, v: int, *, warmup: int) -> tuple[Action, ...]:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards.

    The k-th forward (backward) of rank r: micro-batch ``(k // (p v)) p + k mod p`` through
    chunk ``(k mod p v) // p`` (backward: ``v - 1 -`` that chunk), i.e. stage ``chunk p + r``.
    With v = 1 this is plain 1F1B over micro-batches 0..m-1.
    """
    total = m * v

    def action(k: int, kind: ActionKind) -> Action:
        chunk = (k % (p * v)) // p
        if kind == "B":
            chunk = v - 1 - chunk
        microbatch = (k // (p * v)) * p + k % p
        return Action(stage_idx=chunk * p + r, kind=kind, microbatch_idx=microbatch)

    ordered = [action(k, "F") for k in range(warmup)]
    for j in range(total - warmup):
        ordered += [action(warmup + j, "F"), action(j, "B")]
    ordered += [action(j, "B") for j in range(total - warmup, total)]
    return tuple(ordered)


# ------------------------------------------------------------------------------ simulation


def simulate(
    schedule: str,
    stage_times: Sequence[StageTimes],
    *,
    pp_degree: int,
    num_micro_batches: int,
    virtual_stages: int = 1,
    tail_s: Sequence[float] | None = None,
) -> Timeline:
    """Run the schedule's per-rank orders with the given stage times (module docstring).

    ``stage_times[s]`` belongs to stage s (on pipeline rank ``s % pp_degree``); ``tail_s[r]``
    is rank r's work after the flush (default none).
    """
    p, m, v = pp_degree, num_micro_batches, virtual_stages
    num_stages = p * v
    if len(stage_times) != num_stages:
        raise ValueError(
            f"{len(stage_times)} stage times given; pp_degree x virtual_stages = {num_stages}"
        )
    tails = tuple(tail_s) if tail_s is not None else (0.0,) * p
    if len(tails) != p:
        raise ValueError(f"{len(tails)} tail times given for {p} pipeline ranks")
    orders = schedule_actions(schedule, p, m, v)
    done: dict[tuple[int, ActionKind, int], float] = {}  # (stage, kind, micro-batch) -> end
    free = [0.0] * p
    position = [0] * p
    spans: list[TimelineEvent] = []
    remaining = sum(len(actions) for actions in orders.values())
    while remaining:
        progressed = False
        for r in range(p):
            while position[r] < len(orders[r]):
                act = orders[r][position[r]]
                ready = _input_ready(act, done, num_stages)
                if ready is None:
                    break  # waits for another rank
                start = max(free[r], ready)
                free[r] = _run(act, start, r, stage_times[act.stage_idx], num_stages, spans)
                done[(act.stage_idx, act.kind, act.microbatch_idx)] = free[r]
                position[r] += 1
                remaining -= 1
                progressed = True
        # Every order is a valid schedule of the same dependency graph, so some rank can always
        # move on; if none can, the orders deadlock (a bug in `schedule_actions`).
        assert progressed, f"schedule {schedule!r} deadlocks at {position} (p={p}, m={m}, v={v})"

    pipeline_end = max(free)
    step_end = pipeline_end + max(tails)
    for r in range(p):
        if tails[r] > 0:
            spans.append(
                TimelineEvent(
                    pp_rank=r, kind="tail", start_s=pipeline_end, end_s=pipeline_end + tails[r]
                )
            )
    events = _with_idle(spans, p, step_end)
    rank_times = tuple(
        sum(t.forward_s + t.backward_s + t.send_s for s, t in enumerate(stage_times) if s % p == r)
        for r in range(p)
    )
    return Timeline(
        schedule=schedule,
        pp_degree=p,
        virtual_stages=v,
        num_micro_batches=m,
        events=events,
        pipeline_time_s=pipeline_end,
        step_time_s=step_end,
        formula_pipeline_time_s=pipeline_time_s(rank_times, m, v),
        rank_times_s=rank_times,
    )


def _input_ready(
    act: Action, done: dict[tuple[int, ActionKind, int], float], num_stages: int
) -> float | None:
    """When the input of ``act`` is available, or None if its producer has not run yet."""
    if act.kind == "F":
        if act.stage_idx == 0:
            return 0.0
        return done.get((act.stage_idx - 1, "F", act.microbatch_idx))
    if act.stage_idx == num_stages - 1:
        return done.get((act.stage_idx, "F", act.microbatch_idx))
    return done.get((act.stage_idx + 1, "B", act.microbatch_idx))


def _run(
    act: Action,
    start: float,
    rank: int,
    times: StageTimes,
    num_stages: int,
    spans: list[TimelineEvent],
) -> float:
    """Append the spans of one action from ``start``; return when the rank is free again."""
    half_send = times.send_s / 2 if act.stage_idx < num_stages - 1 else 0.0
    if act.kind == "F":
        parts: tuple[tuple[EventKind, float], ...] = (
            ("forward", times.forward_s),
            ("send", half_send),
        )
    else:
        parts = (("send", half_send), ("backward", times.backward_s))
    t = start
    for kind, duration in parts:
        if duration > 0:
            spans.append(
                TimelineEvent(
                    pp_rank=rank,
                    kind=kind,
                    start_s=t,
                    end_s=t + duration,
                    stage_idx=act.stage_idx,
                    microbatch_idx=act.microbatch_idx,
                )
            )
            t += duration
    return t


def _with_idle(spans: list[TimelineEvent], p: int, end_s: float) -> tuple[TimelineEvent, ...]:
    """The spans plus an ``idle`` event for every gap of each rank up to ``end_s``."""
    out: list[TimelineEvent] = []
    # Gaps shorter than this are float noise from summing durations, not idle time.
    eps = 1e-12 * max(end_s, 1.0)
    by_rank: list[list[TimelineEvent]] = [[] for _ in range(p)]
    for event in spans:
        by_rank[event.pp_rank].append(event)
    for r in range(p):
        t = 0.0
        for event in sorted(by_rank[r], key=lambda e: e.start_s):
            if event.start_s - t > eps:
                out.append(TimelineEvent(pp_rank=r, kind="idle", start_s=t, end_s=event.start_s))
            out.append(event)
            t = max(t, event.end_s)
        if end_s - t > eps:
            out.append(TimelineEvent(pp_rank=r, kind="idle", start_s=t, end_s=end_s))
    return tuple(out)


def timeline_of(estimate: Estimate, plan: PlanLike) -> Timeline:
    """Simulate one step of ``plan`` with the per-stage times of its cost-model ``estimate``.

    Forward and backward include the stage's tensor-parallel collectives and exposed ZeRO-3
    gathers (the cost model's critical path per micro-batch); sends are the stage's pipeline
    communication per micro-batch; tails are the ranks' exposed DP sync and optimizer step.
    """
    m = plan.num_micro_batches
    stage_times = [
        StageTimes(forward_s=s.forward_s, backward_s=s.backward_s, send_s=s.pp_comm_s / m)
        for s in estimate.stages
    ]
    return simulate(
        plan.schedule,
        stage_times,
        pp_degree=plan.pp_degree,
        num_micro_batches=m,
        virtual_stages=plan.virtual_stages,
        tail_s=[r.tail_s for r in estimate.ranks],
    )
