"""The schedule simulation's inputs as sums over units, each stated once: a stage's
per-micro-batch times (`stage_time`, `stage_times`) and a rank's tail after its last action
(`rank_tail_s`, and the linear terms `rank_tail_terms` whose `tail_of_terms` is the same tail
for the planner's solver).

Expects sums of `UnitCost` fields (the estimate sums its units; the planner's partition,
`autoplan.planner.partition`, sums its per-unit tables of the same fields). Guarantees both
build their stage times and tails with these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.parts.pipeline import Boundary
from cost_model.schedules import ScheduleSpec, StageTimes
from cost_model.unit_cost import UnitCost


def stage_time(
    forward_s: float,
    backward_s: float,
    weight_s: float,
    *,
    message_s: float,
    previous_message_s: float,
    transfer_s: float,
    splits_backward: bool,
) -> StageTimes:
    """One stage's per-micro-batch times for the schedule simulation from its units' sums
    (``forward_s``, ``backward_s``, ``weight_s``): the host time of the forward message to the
    next stage (``message_s``) on the forward, of the gradient message to the previous stage
    (``previous_message_s``, that boundary's message; 0 for the first stage) on the backward;
    under a split backward, the weight gradients as the deferred part; ``transfer_s`` the link
    time of the boundary after the stage."""
    return StageTimes(
        forward_s=forward_s + message_s,
        backward_s=backward_s + previous_message_s,
        weight_s=weight_s if splits_backward else 0.0,
        transfer_s=transfer_s,
    )


def stage_times(
    stage_units: Sequence[Sequence[UnitCost]],
    boundaries: Sequence[Boundary],
    spec: ScheduleSpec,
) -> list[StageTimes]:
    """Per-micro-batch times of each stage of a plan (`stage_time` of its units' sums and
    its boundaries)."""
    return [
        stage_time(
            sum(u.forward_s for u in units),
            sum(u.backward_s for u in units),
            sum(u.weight_s for u in units),
            message_s=boundaries[idx].message_s,
            previous_message_s=boundaries[idx - 1].message_s if idx > 0 else 0.0,
            transfer_s=boundaries[idx].transfer_s,
            splits_backward=spec.splits_backward,
        )
        for idx, units in enumerate(stage_units)
    ]


def rank_tail_s(rank_units: Sequence[UnitCost], dp_overlap_fraction: float) -> float:
    """Work of one pipeline rank after its last backward: gradient sync not hidden behind that
    backward, then non-overlappable communication and the optimizer step.

    ``max(0, sum dp_sync - overlap * sum backward) + sum post_sync + sum optimizer``: the
    gradient buckets of the last micro-batch's backward start as soon as they are ready (torch
    DDP, Li et al. 2020, section 3.2.3), so only what outlasts that backward is exposed.
    """
    sync = sum(u.dp_sync_s for u in rank_units)
    window = dp_overlap_fraction * sum(u.backward_s for u in rank_units)
    return (
        max(0.0, sync - window)
        + sum(u.post_sync_s for u in rank_units)
        + sum(u.optimizer_s for u in rank_units)
    )


def rank_tail_terms(unit: UnitCost, dp_overlap_fraction: float) -> tuple[float, float]:
    """A unit's share of each of the two linear terms of `rank_tail_s`: since
    ``max(0, a) + b = max(b, a + b)``, the tail is ``max(post + optimizer, post + optimizer +
    sync - overlap * backward)`` summed over the rank's units (`tail_of_terms`), equal to
    `rank_tail_s` up to rounding: linear in the units, as the planner's solver needs."""
    fixed = unit.post_sync_s + unit.optimizer_s
    return fixed, fixed + unit.dp_sync_s - dp_overlap_fraction * unit.backward_s


def tail_of_terms(term_sums: Sequence[float]) -> float:
    """A rank's tail from its sums of `rank_tail_terms` (each with its share of the loop's
    fixed overhead): the largest, and never below 0."""
    return max([0.0, *term_sums])
