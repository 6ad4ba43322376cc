"""One training step of a pipeline schedule as events per rank, for `explain` and its picture.

Expects a plan and its `cost_model.Estimate`. `timeline_of` runs the cost model's own schedule
simulation (`cost_model.schedules.simulate` on torch's action orders, with the estimate's
per-stage times) and turns each action into a timed event, so the picture shows exactly the
step time the estimate reports: there is one schedule model, not a formula beside a
simulation. Each rank's gaps become ``idle`` events; its tail (exposed data-parallel sync and
the optimizer step) follows its own last action. Every message between two pipeline ranks (a
forward's activation to the next stage's rank, a backward's gradient to the previous one's) is
a `TimelineSend` from the producer's end to its arrival (the end plus the boundary's link time;
the host time of posting it is already in the producer's event).

Guarantees: ``Timeline.step_time_s == estimate.step_time_s`` and
``Timeline.pipeline_time_s == estimate.pipeline_time_s`` (same simulation, same times); no two
events of a rank overlap; a send never arrives after its consumer starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cost_model.estimate import Estimate
from cost_model.schedules import (
    Action,
    CompiledSchedule,
    ScheduleSpec,
    Simulation,
    StageTimes,
    compile_schedule,
    duration_slots,
    simulate,
)
from cost_model.strategy import PlanLike, Strategy

EventKind = Literal["forward", "backward", "weight", "tail", "idle"]
SendKind = Literal["activation", "gradient"]
EVENT_KINDS: tuple[EventKind, ...] = ("forward", "backward", "weight", "tail", "idle")
_EVENT_OF_ACTION: dict[str, EventKind] = {
    "F": "forward",
    "B": "backward",
    "I": "backward",
    "W": "weight",
}


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
class TimelineSend:
    """A message between pipeline ranks: it leaves ``src_rank`` when the action of stage
    ``stage_idx`` that produced it ends and reaches ``dst_rank`` after the link time."""

    src_rank: int
    dst_rank: int
    kind: SendKind
    start_s: float
    end_s: float
    stage_idx: int
    microbatch_idx: int

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
    pipeline_time_s: float  # the end of the last action
    step_time_s: float  # max over ranks of (its last action's end + its tail)
    rank_busy_s: tuple[float, ...]  # compute of each rank over the step (its actions)
    sends: tuple[TimelineSend, ...] = ()  # in order of departure

    def rank_events(self, pp_rank: int) -> tuple[TimelineEvent, ...]:
        return tuple(e for e in self.events if e.pp_rank == pp_rank)

    def time_of(self, pp_rank: int, kind: EventKind) -> float:
        """Total seconds rank ``pp_rank`` spends in events of ``kind``."""
        return sum(e.duration_s for e in self.events if e.pp_rank == pp_rank and e.kind == kind)


def simulate_timeline(
    spec: ScheduleSpec, stage_times: list[StageTimes], tail_s: list[float] | None = None
) -> Timeline:
    """Simulate ``spec`` with these stage times and return every action as an event."""
    sim = simulate(spec, stage_times, tail_s)
    compiled = compile_schedule(spec)
    durations = duration_slots(spec, stage_times)
    spans: list[TimelineEvent] = []
    sends: list[TimelineSend] = []
    for j, action in enumerate(compiled.actions):
        end = sim.end_s[j]
        duration = durations[compiled.slot[j]]
        if duration > 0:
            spans.append(_event(compiled.ranks[j], action, end - duration, end))
        if compiled.transfer[j] < spec.num_stages:  # its input crossed a link
            sends.append(_send(compiled, sim, j))
    for r, (end, tail) in enumerate(zip(sim.rank_end_s, sim.tail_s, strict=True)):
        if tail > 0:
            spans.append(TimelineEvent(pp_rank=r, kind="tail", start_s=end, end_s=end + tail))
    return Timeline(
        schedule=spec.schedule,
        pp_degree=spec.pp_degree,
        virtual_stages=spec.virtual_stages,
        num_micro_batches=spec.num_micro_batches,
        events=_with_idle(spans, spec.pp_degree, sim.step_time_s),
        pipeline_time_s=sim.pipeline_time_s,
        step_time_s=sim.step_time_s,
        rank_busy_s=sim.rank_busy_s,
        sends=tuple(sorted(sends, key=lambda send: send.start_s)),
    )


def _send(compiled: CompiledSchedule, sim: Simulation, j: int) -> TimelineSend:
    """The message action ``j`` of ``compiled`` waited for (its input crossed a link)."""
    producer = compiled.data_pred[j]
    start = sim.end_s[producer]
    return TimelineSend(
        src_rank=compiled.ranks[producer],
        dst_rank=compiled.ranks[j],
        kind="activation" if compiled.actions[j].kind == "F" else "gradient",
        start_s=start,
        end_s=start + sim.transfer_s[compiled.transfer[j]],
        stage_idx=compiled.actions[producer].stage_idx,
        microbatch_idx=compiled.actions[j].microbatch_idx,
    )


def _event(rank: int, action: Action, start: float, end: float) -> TimelineEvent:
    return TimelineEvent(
        pp_rank=rank,
        kind=_EVENT_OF_ACTION[action.kind],
        start_s=start,
        end_s=end,
        stage_idx=action.stage_idx,
        microbatch_idx=action.microbatch_idx,
    )


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
    """The events of ``plan``'s step, simulated with the per-stage times of its ``estimate``
    (the same simulation that gave the estimate its step time)."""
    spec = Strategy.of(plan).schedule_spec
    stage_times = [
        StageTimes(
            forward_s=s.forward_s,
            backward_s=s.backward_s,
            weight_s=s.weight_s,
            transfer_s=s.transfer_s,
        )
        for s in estimate.stages
    ]
    return simulate_timeline(spec, stage_times, [r.tail_s for r in estimate.ranks])
