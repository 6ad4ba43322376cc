"""What a pipeline schedule holds in memory: per rank, the micro-batches whose activations
(and, under a split backward, retained gradients) it keeps at each point of its order that can
be its peak (`held_microbatches`, read from the orders `cost_model.schedules` builds), and the
closed forms the search uses before any order is built (`least_held`, `even_held`,
`sends_at_end`). Pure functions of a `ScheduleSpec`, memoised like the orders.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cost_model.schedules import (
    V_SCHEDULES,
    Placement,
    ScheduleName,
    ScheduleSpec,
    _memoised,
    pipeline_order,
    rank_stages,
    stage_rank,
)

__all__ = ["HeldProfile", "even_held", "held_microbatches", "least_held", "sends_at_end"]


def sends_at_end(spec: ScheduleSpec) -> tuple[int, ...]:
    """Per pipeline rank, the boundary tensors it keeps for its transfers at the step's end
    (one of `HeldProfile.sends`, so a lower bound on its most), without building the orders:
    the multi-stage runtime waits for no send before then, so a rank keeps one output per
    micro-batch and stage whose next stage is on another rank, and one input gradient per
    micro-batch and stage whose previous stage is; GPipe keeps the input gradients only;
    1F1B waits for its sends as it goes (a test checks this against `held_microbatches`)."""
    m = spec.num_micro_batches
    return tuple(m * n for n in _crossings(spec.schedule, spec.pp_degree, spec.virtual_stages))


@functools.lru_cache(maxsize=256)
def _crossings(schedule: ScheduleName, p: int, v: int) -> tuple[int, ...]:
    """`sends_at_end` per micro-batch."""
    if p == 1 or schedule == "1f1b":
        return (0,) * p
    # (the rank placement does not depend on the micro-batches)
    placement: Placement = "v" if schedule in V_SCHEDULES else "loop"
    last = p * v - 1
    out = []
    for r in range(p):
        stages = rank_stages(placement, p, v, r)
        backward = sum(1 for s in stages if s > 0 and stage_rank(placement, p, s - 1) != r)
        forward = sum(1 for s in stages if s < last and stage_rank(placement, p, s + 1) != r)
        out.append(backward if schedule == "gpipe" else forward + backward)
    return tuple(out)


def least_held(spec: ScheduleSpec) -> int:
    """A lower bound, without building the orders, on the micro-batches that every stage of
    any rank holds at once at some point (so a rank's peak holds at least that many times its
    whole activation per micro-batch): GPipe runs every forward before any backward, so every
    stage holds all ``m``; in every other schedule each stage holds at least the micro-batch it
    just ran (a test checks this against `held_microbatches`)."""
    return spec.num_micro_batches if spec.schedule == "gpipe" else 1


def even_held(spec: ScheduleSpec) -> float:
    """The most micro-batches a rank holds at its peak when every stage carries the same
    activations, in units of the rank's whole share (its stages' activations of one micro-batch):
    ``max over ranks and points of sum(held) / v`` in `held_microbatches`, in closed form so
    that it costs nothing at any micro-batch count. Exact when ``p`` divides ``m``, else at
    most the orders' count and at least `least_held` (a test checks both against the orders).
    A scale for the search's visiting order, not a bound: an uneven cut may hold less.

    - GPipe: every forward before any backward, all ``m``.
    - 1F1B, its zero-bubble and V variants: the first rank holds ``min(m, p)`` (Narayanan et
      al. 2021, section 2.2: at most p micro-batches in flight; Qi et al.'s ZB-H1 and ZB-V
      keep 1F1B's peak activations; torch's interleaved zero-bubble orders too).
    - Interleaved 1F1B: ``p (1 + (p - 1) / (p v))`` (Korthikanti et al. 2022, section 4.2.3,
      the first rank's extra warm-up chunks), at most ``m``.
    - DualPipeV: one chunk (half a rank's share) more than 1F1B, as torch's orders give.
    """
    p, v, m = spec.pp_degree, spec.virtual_stages, spec.num_micro_batches
    if spec.schedule == "gpipe":
        return float(m)
    if spec.schedule == "interleaved-1f1b":
        return min(m, p + (p - 1) / v)
    if spec.schedule == "dualpipev":
        return min(m, p) + 0.5
    return float(min(m, p))


# ------------------------------------------------------------------------------ memory


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldProfile:
    """What one pipeline rank holds at the points of its order that can be its peak.

    ``stages`` are the rank's stages; each entry of ``points`` gives, per stage, the
    micro-batches whose activations it holds (forward run, backward not yet run) and, under a
    split backward, those past backward-input but not yet backward-weight (``retained``).
    ``sends[i]`` is how many boundary tensors the rank keeps at point ``i`` for its pipeline
    transfers to other ranks: a stage's output, which the stage keeps until its backward
    (``fwd_cache``) and its send until it is waited for, and the gradient of its input, sent
    back. torch's multi-stage runtime (``_PipelineScheduleRuntime``) waits for its sends only
    when the step ends (pytorch/pytorch#194120 would release them early); ``ScheduleGPipe``
    waits for the forward's sends after the last forward and the backward's at the end;
    ``Schedule1F1B`` waits for each send in the next step of its loop. An output passed to a
    stage on the same rank is that stage's input (counted with its activations).
    Points are taken after each forward and after each backward-input (whose micro-batch then
    holds its activations, kept for the weight half, and the gradients that half needs), and
    at the step's end (no activations; the sends not waited for yet).
    Only points not dominated by another are kept (a peak is at one of them whatever the
    stages' activation sizes are).
    """

    stages: tuple[int, ...]
    points: tuple[tuple[tuple[int, int], ...], ...]  # [point][stage of the rank] = (held, retained)
    sends: tuple[int, ...]  # [point]: boundary tensors held by pending sends


@_memoised
def held_microbatches(spec: ScheduleSpec) -> tuple[HeldProfile, ...]:
    """Per pipeline rank, the candidate peak points of held activations (see `HeldProfile`)."""
    orders = pipeline_order(spec)
    last = spec.num_stages - 1
    out = []
    for r, actions in enumerate(orders):
        stages = spec.rank_stages(r)
        index = {s: k for k, s in enumerate(stages)}
        held = [0] * len(stages)
        retained = [0] * len(stages)
        # sends waited for later than the next action: all of them (multi-stage runtime), the
        # forward's until the last forward and the backward's until the end (GPipe)
        late_sends = spec.schedule != "1f1b"
        cached = 0  # outputs sent to another rank whose stage has not run their backward
        unwaited = 0  # outputs sent to another rank whose send is not waited for
        grads = 0  # input gradients sent to another rank whose send is not waited for
        # per held/retained pattern, the most sends seen with it (a point with fewer is dominated)
        points: dict[tuple[tuple[int, int], ...], int] = {}
        # per stage of the rank: whether its output / its input gradient goes to another rank
        forward_out = {s: s < last and spec.stage_rank(s + 1) != r for s in stages}
        backward_out = {s: s > 0 and spec.stage_rank(s - 1) != r for s in stages}
        for a in actions:
            k, s = index[a.stage_idx], a.stage_idx
            sends_forward, sends_backward = forward_out[s], backward_out[s]
            if a.kind == "F":
                held[k] += 1
                cached += sends_forward
                unwaited += sends_forward and late_sends
            else:
                if spec.schedule == "gpipe":
                    unwaited = 0  # waited after the last forward
                if a.kind in ("B", "I"):
                    cached -= sends_forward
                    grads += sends_backward and late_sends
                if a.kind == "B":
                    held[k] -= 1
                elif a.kind == "I":
                    held[k] -= 1
                    retained[k] += 1
                else:
                    retained[k] -= 1
            if a.kind in ("F", "I"):
                # an output both cached and unwaited is one tensor; every unwaited one was cached
                # until its backward, so the live outputs are the larger count
                counts = tuple(zip(held, retained, strict=True))
                points[counts] = max(points.get(counts, 0), max(cached, unwaited) + grads)
        # the step's end: every activation freed, the sends still unwaited (the multi-stage
        # runtime's forward and backward ones; GPipe's backward ones) kept until then
        end = tuple((0, 0) for _ in stages)
        points[end] = max(points.get(end, 0), max(cached, unwaited) + grads)
        kept = _maximal(set(points.items()))
        out.append(
            HeldProfile(
                stages=stages,
                points=tuple(pt for pt, _ in kept),
                sends=tuple(n for _, n in kept),
            )
        )
    return tuple(out)


# a candidate peak point: per stage of the rank (held, retained), and the pending sends
_Point = tuple[tuple[tuple[int, int], ...], int]


def _maximal(points: set[_Point]) -> tuple[_Point, ...]:
    """The points no other point dominates (every held and retained count and the pending
    sends at least as large), in sorted order.

    By bit sets, as a rank of a long interleaved zero-bubble schedule has thousands of points
    (pairwise comparisons took minutes): for each coordinate and value, the points at least
    that large there are the bits of one int; a point is dominated when the intersection of
    its coordinates' sets holds another point (distinct points: that one is larger)."""
    listed = sorted(points)
    flats = [(*(c for pair in pt[0] for c in pair), pt[1]) for pt in listed]
    if not flats:
        return ()
    at_least: list[dict[int, int]] = []  # [coordinate][value]: points with at least the value
    for j in range(len(flats[0])):
        masks: dict[int, int] = {}
        running = 0
        for value, index in sorted(((fp[j], i) for i, fp in enumerate(flats)), reverse=True):
            running |= 1 << index
            masks[value] = running  # (the last of equal values: all of them)
        at_least.append(masks)
    kept = []
    for index, fp in enumerate(flats):
        own = 1 << index
        common = -1
        for masks, value in zip(at_least, fp, strict=True):
            common &= masks[value]
            if common == own:
                break
        if common == own:
            kept.append(listed[index])
    return tuple(kept)
