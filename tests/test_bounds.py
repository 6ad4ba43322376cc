"""`autoplan.planner.bounds`: the schedule-path bound never exceeds a simulated pipeline."""

from __future__ import annotations

import random

import pytest

from autoplan.planner import bounds
from autoplan.planner.bounds import SHARE_GRID, pipeline_factor, share_range
from autoplan.planner.work import Work
from cost_model.schedules import ScheduleSpec, StageTimes, pipeline_lower_bound_s, simulate

SPECS = (
    ("gpipe", 3, 1, 4),
    ("1f1b", 4, 1, 8),
    ("interleaved-1f1b", 2, 3, 4),
    ("interleaved-1f1b", 4, 2, 8),
    ("interleaved-zb", 3, 2, 6),
    ("zbv", 2, 2, 4),
    ("dualpipev", 3, 2, 6),
)


@pytest.mark.parametrize("method", ["all paths", "kelley"])
@pytest.mark.parametrize(("schedule", "p", "v", "m"), SPECS)
def test_bound_holds_for_random_uneven_stage_times(
    schedule: str, p: int, v: int, m: int, method: str
) -> None:
    spec = ScheduleSpec(schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=m)
    forward = share_range([0.25, 0.4])
    weight = share_range([0.3, 0.6])
    solve = bounds._all_paths if method == "all paths" else bounds._kelley
    factor, _ = solve(spec, forward, weight)
    rng = random.Random(f"{schedule}{p}{v}{m}")
    least = float("inf")
    for _ in range(200):
        sizes = [rng.random() ** 3 + 1e-3 for _ in range(spec.num_stages)]
        total = sum(sizes)
        times = []
        for size in sizes:
            share = rng.uniform(0.25, 0.4)
            backward = (1 - share) * size / total
            times.append(
                StageTimes(
                    forward_s=share * size / total,
                    backward_s=backward,
                    weight_s=rng.uniform(0.3, 0.6) * backward if spec.splits_backward else 0.0,
                )
            )
        least = min(least, simulate(spec, times).pipeline_time_s)
    assert factor <= least
    # it sees more than the busiest rank's share of the work
    assert factor >= m / p * (1 - 1e-6)


def test_one_stage_per_rank_reaches_the_textbook_bubble() -> None:
    # v = 1: even stages are optimal, (m + p - 1) / p of the work (Huang et al. 2019)
    spec = ScheduleSpec(schedule="1f1b", pp_degree=4, virtual_stages=1, num_micro_batches=8)
    assert pipeline_factor(spec, share_range([1 / 3]), (0, 0)) == pytest.approx(11 / 4, rel=1e-5)


def test_interleaving_bound_sees_part_of_the_bubble() -> None:
    spec = ScheduleSpec(
        schedule="interleaved-1f1b", pp_degree=4, virtual_stages=2, num_micro_batches=8
    )
    factor = pipeline_factor(spec, share_range([1 / 3]), (0, 0))
    even = (8 + 3 / 2) / 4  # (m + (p - 1) / v) per unit of work per rank
    assert 8 / 4 < factor <= even


@pytest.mark.parametrize(("schedule", "p", "v", "m"), [*SPECS, ("interleaved-1f1b", 8, 4, 24)])
def test_the_exact_factor_is_at_least_kelleys(schedule: str, p: int, v: int, m: int) -> None:
    """Every path at once against Kelley's subset of them. On interleaved 1F1B p 8, v 4, m 24
    Kelley's rounds stall at the busiest rank's share (degenerate LP solutions) where the
    exact factor sees 4.9% of fill and drain beyond it."""
    spec = ScheduleSpec(schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=m)
    forward, weight = share_range([1 / 3]), share_range([0.5])
    exact, _ = bounds._all_paths(spec, forward, weight)
    kelley, _ = bounds._kelley(spec, forward, weight)
    assert exact >= kelley * (1 - 1e-6)
    if (p, v, m) == (8, 4, 24):
        assert kelley == pytest.approx(m / p, rel=1e-6)
        assert exact >= m / p * 1.04
    # the searched factor is the exact one where the schedule is small enough
    assert spec.num_actions <= bounds.ALL_PATHS_MAX_ACTIONS
    assert pipeline_factor(spec, forward, weight) == exact


def test_share_range_rounds_outward() -> None:
    low, high = share_range([0.301, 0.349])
    assert low / SHARE_GRID <= 0.301 and high / SHARE_GRID >= 0.349


def test_a_cached_bound_charges_the_work_it_took() -> None:
    """A budget buys the same work whether a factor was computed before or not: the search's
    decisions may not depend on what an earlier search in the process cached. Within one
    search a factor it asked for before costs nothing more."""
    spec = ScheduleSpec(
        schedule="interleaved-1f1b", pp_degree=4, virtual_stages=3, num_micro_batches=5
    )
    cells = share_range([1 / 3])
    first, again = Work(None), Work(None)
    factor = pipeline_factor(spec, cells, (0, 0), work=first)
    assert pipeline_factor(spec, cells, (0, 0), work=again) == factor
    assert first.spent_s > 0 and again.spent_s == first.spent_s
    pipeline_factor(spec, cells, (0, 0), work=again)
    assert again.spent_s == first.spent_s


@pytest.mark.parametrize(
    ("schedule", "p", "v", "m"), [*SPECS, ("interleaved-1f1b", 4, 2, 2), ("zbv", 4, 2, 1)]
)
def test_the_closed_form_bound_holds_for_random_stage_times(
    schedule: str, p: int, v: int, m: int
) -> None:
    """`pipeline_lower_bound_s` (the busiest rank's share, fill and drain with one stage per
    rank, one micro-batch's chain off the weight halves) never exceeds the simulated
    pipeline, and with fewer micro-batches than ranks the chain is what it reads."""
    spec = ScheduleSpec(schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=m)
    rng = random.Random(f"closed{schedule}{p}{v}{m}")
    for _ in range(200):
        times = [
            StageTimes(
                forward_s=(f := rng.random() ** 2 + 1e-3),
                backward_s=(b := f * rng.uniform(1.5, 2.5)),
                weight_s=rng.uniform(0.3, 0.6) * b if spec.splits_backward else 0.0,
            )
            for _ in range(spec.num_stages)
        ]
        work = sum(t.forward_s + t.backward_s for t in times)
        largest = max(t.forward_s + t.backward_s for t in times)
        chain = min(1 - t.weight_s / (t.forward_s + t.backward_s) for t in times)
        assert pipeline_lower_bound_s(spec, work, largest, chain) <= simulate(
            spec, times
        ).pipeline_time_s * (1 + 1e-12)
    if m < p:
        assert pipeline_lower_bound_s(spec, 1.0, 0.0, 0.75) == (
            0.75 if spec.splits_backward else 1.0
        )
