"""The CP-SAT stage partition against brute-force enumeration of simulated steps on random
small problems, every schedule included (uneven interleaved and V splits, split backwards);
a solver stopped by its time limit is reported, never asserted on."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from dataclasses import astuple, replace
from pathlib import Path

import pytest

from autoplan.contract.errors import NoFeasiblePlanError
from autoplan.planner.candidates import BoundTables, costed_candidate, partition_problem
from autoplan.planner.partition import (
    ModeCosts,
    PartitionProblem,
    _uniform_middle,
    balanced_hint,
    brute_force,
    evaluate,
    min_peak_memory,
    path_bound,
    rank_balanced_hint,
    rank_memory,
    rank_tails,
    solve,
    stage_times,
)
from autoplan.planner.partition.relaxation import lp_bound
from autoplan.planner.readback import plan_of
from autoplan.planner.search import search_plans
from autoplan.planner.space import SearchSpace, recompute_modes, strategies
from cost_model.estimate import CostModel
from cost_model.memory import RECOMPUTABLE_KINDS
from cost_model.schedules import SCHEDULES, ScheduleError, ScheduleSpec, StageTimes, simulate
from cost_model.stage_terms import rank_tail_s, rank_tail_terms, tail_of_terms
from tests.cost_profiles import gpt_profile, round_cluster


def random_spec(rng: random.Random, max_stages: int) -> ScheduleSpec:
    while True:
        schedule = rng.choice(SCHEDULES)
        p = rng.choice([1, 2, 2, 3, 4])
        v = 1 if schedule in ("gpipe", "1f1b") else rng.choice([2, 2, 3])
        m = rng.choice([p, 2 * p, 3, 4, 8])
        if p * v > max_stages:
            continue
        try:
            return ScheduleSpec(
                schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=m
            )
        except ScheduleError:
            continue


def random_problem(seed: int, *, uniform: bool = False) -> PartitionProblem:
    """Units with embedding/head-like outliers, 1-3 recompute modes, a tight memory cap.

    ``uniform``: the middle units are identical (the shape of a traced Transformer), so the
    count formulation applies too.
    """
    rng = random.Random(seed)
    n = rng.randint(4, 9)
    spec = random_spec(rng, max_stages=min(n, 6))
    S = spec.num_stages

    def per_unit(low: float, high: float) -> list[float]:
        if uniform:
            value = rng.uniform(low, high)
            return [rng.uniform(low, high), *[value] * (n - 2), rng.uniform(low, high)]
        return [rng.uniform(low, high) for _ in range(n)]

    forward = per_unit(0.2, 0.7)
    forward[0] *= rng.uniform(0.1, 0.5)  # embedding: cheap
    forward[-1] *= rng.uniform(1.0, 3.0)  # head: expensive
    backward = [f * rng.uniform(1.6, 2.4) for f in forward]
    if uniform:
        backward[1:-1] = [backward[1]] * (n - 2)
    act = per_unit(1.0, 4.0)
    tails = (per_unit(0.0, 0.2), per_unit(-0.3, 0.4))  # optimizer-like; sync minus overlap
    names = rng.sample(["none", "selective", "full"], rng.randint(1, 3))
    modes = {}
    for name in names:
        extra, keep = {"none": (0.0, 1.0), "selective": (0.1, 0.6), "full": (0.35, 0.1)}[name]

        def scaled(values: list[float], factor: float) -> tuple[float, ...]:
            return (values[0], *(v * factor for v in values[1:-1]), values[-1])

        modes[name] = ModeCosts(
            forward_s=tuple(forward),
            backward_s=tuple(b + extra * f for b, f in zip(backward, forward, strict=True)),
            weight_s=tuple(0.4 * b for b in backward),
            activation_bytes=scaled(act, keep),
            retained_bytes=tuple(act),
            tail_s=(tuple(tails[0]), scaled(tails[1], 1.0 + extra)),
        )
    crossing = [
        tuple(per_unit(0.0, 0.1)) if spec.stage_rank(s) != spec.stage_rank(s + 1) else (0.0,) * n
        for s in range(S - 1)
    ]
    transfer = (*crossing, (0.0,) * n)
    message = tuple(
        0.01 if s < S - 1 and spec.stage_rank(s) != spec.stage_rank(s + 1) else 0.0
        for s in range(S)
    )
    problem = PartitionProblem(
        spec=spec,
        modes=modes,  # type: ignore[arg-type]
        static_bytes=tuple(per_unit(0.5, 3.0)),
        transfer_s=transfer,
        message_s=message,
        memory_capacity_bytes=1e18,
        tail_constants_s=(0.05, rng.uniform(-0.2, 0.2)),
    )
    # a capacity between the least peak any partition needs and a comfortable one
    least = min_peak_memory(problem, model="cut").least_bytes
    assert least is not None
    return replace(problem, memory_capacity_bytes=least * rng.uniform(1.0, 1.6) + 1e-9)


@pytest.mark.parametrize("seed", range(48))
def test_solver_matches_brute_force(seed: int) -> None:
    problem = random_problem(seed)
    expected = brute_force(problem)
    found, stats = solve(problem)
    assert expected is not None  # the capacity is at least the least peak
    assert found is not None, stats
    assert stats.status == "OPTIMAL", stats
    assert found.peak_memory_bytes <= problem.memory_capacity_bytes
    # the simulated steps agree (ties allowed); the integer model's rounding is far below 0.1%
    assert found.step_time_s == pytest.approx(expected.step_time_s, rel=1e-3), problem.spec
    assert found.step_time_s >= expected.step_time_s * (1 - 1e-12)


def test_random_cases_cover_every_schedule() -> None:
    seen = {random_problem(seed).spec.schedule for seed in range(48)}
    assert seen == set(SCHEDULES)


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("kind", ["cut", "count"])
def test_every_formulation_matches_brute_force_on_transformer_shapes(seed: int, kind: str) -> None:
    problem = random_problem(1000 + seed, uniform=True)
    if problem.num_stages == 1 and kind != "cut":
        pytest.skip("one stage: only the cut formulation applies")
    assert problem.num_stages == 1 or _uniform_middle(problem)
    expected = brute_force(problem)
    assert expected is not None
    found, stats = solve(problem, model=kind)  # type: ignore[arg-type]
    assert found is not None and stats.status == "OPTIMAL", stats
    assert found.peak_memory_bytes <= problem.memory_capacity_bytes
    assert found.step_time_s == pytest.approx(expected.step_time_s, rel=1e-3)
    peak = min_peak_memory(problem, model=kind)  # type: ignore[arg-type]
    assert peak.status == "OPTIMAL", peak
    assert peak.least_bytes == pytest.approx(
        min_peak_memory(problem, model="cut").least_bytes, rel=1e-5
    )


def test_infeasible_memory_returns_none() -> None:
    problem = random_problem(3)
    least = min_peak_memory(problem).least_bytes
    assert least is not None
    tight = replace(problem, memory_capacity_bytes=least * 0.99)
    result = solve(tight)
    assert result.partition is None and result.stats.status == "INFEASIBLE"
    assert brute_force(tight) is None


def test_cutoff_returns_none_when_nothing_is_faster() -> None:
    problem = random_problem(5)
    best = brute_force(problem)
    assert best is not None
    found, stats = solve(problem, cutoff_s=best.step_time_s * 0.999)
    assert found is None and stats.status == "CUTOFF"
    found, stats = solve(problem, cutoff_s=best.step_time_s * 1.01)
    assert found is not None and found.step_time_s == pytest.approx(best.step_time_s, rel=1e-3)


def test_evaluate_by_hand() -> None:
    # 4 units, 2 stages on 2 ranks (1F1B), m = 2, one mode; forward 1, backward 2 per unit
    # except unit 3 (forward 2, backward 3); the boundary's link takes 0.5 each way.
    # stage 0 = units 0-1: F 2, B 4; stage 1 = units 2-3: F 3, B 5.
    # rank 0: 0F0 [0,2] 0F1 [2,4]; rank 1: 1F0 [2.5,5.5] 1B0 [5.5,10.5] 1F1 [10.5,13.5]
    # 1B1 [13.5,18.5]; rank 0: 0B0 [11,15] (gradient arrives 10.5 + 0.5), 0B1 [19,23].
    # tails: rank 0 = 0.1 + 0.1 + 1 = 1.2 -> 24.2; rank 1 = 0.3 + 0.3 + 1 = 1.6 -> 20.1.
    # memory: rank 0 holds 2 micro-batches at its peak (after 0F1): 1 + 1 + 2 * (1 + 1) = 6;
    # rank 1 holds one: 2 + 2 + (2 + 2) = 8.
    spec = ScheduleSpec(schedule="1f1b", pp_degree=2, num_micro_batches=2)
    problem = PartitionProblem(
        spec=spec,
        modes={
            "none": ModeCosts(
                forward_s=(1, 1, 1, 2),
                backward_s=(2, 2, 2, 3),
                weight_s=(0, 0, 0, 0),
                activation_bytes=(1, 1, 2, 2),
                retained_bytes=(1, 1, 2, 2),
                tail_s=((0.1, 0.1, 0.3, 0.3),),
            )
        },
        static_bytes=(1, 1, 2, 2),
        transfer_s=((0.5, 0.5, 0.5, 0.5), (0.0, 0.0, 0.0, 0.0)),
        message_s=(0.0, 0.0),
        memory_capacity_bytes=100,
        tail_constants_s=(1.0,),
    )
    result = evaluate(problem, (0, 2), ("none", "none"))
    assert result.step_time_s == pytest.approx(24.2)
    assert result.rank_memory_bytes == (6.0, 8.0)
    direct = simulate(
        spec,
        [
            StageTimes(forward_s=2, backward_s=4, transfer_s=0.5),
            StageTimes(forward_s=3, backward_s=5),
        ],
        [1.2, 1.6],
    )
    assert direct.step_time_s == pytest.approx(24.2)
    best, _ = solve(problem)
    assert best is not None and best.step_time_s <= result.step_time_s + 1e-9


@pytest.mark.parametrize(
    ("schedule", "p", "v", "blocks"),
    [
        ("interleaved-1f1b", 8, 8, 96),
        ("interleaved-1f1b", 4, 3, 30),
        ("interleaved-zb", 4, 6, 26),
        ("zbv", 4, 2, 13),
        ("dualpipev", 2, 2, 9),
        ("1f1b", 4, 1, 10),
    ],
)
def test_rank_balanced_hint_evens_every_rank(schedule: str, p: int, v: int, blocks: int) -> None:
    spec = ScheduleSpec(schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=2 * p)  # type: ignore[arg-type]
    n = blocks + 2
    forward = (0.05, *[1.0] * blocks, 0.3)  # embedding, blocks, head
    costs = ModeCosts(
        forward_s=forward,
        backward_s=tuple(2 * f for f in forward),
        weight_s=(0.0,) * n,
        activation_bytes=(1.0,) * n,
        retained_bytes=(1.0,) * n,
    )
    S = spec.num_stages
    problem = PartitionProblem(
        spec=spec,
        modes={"none": costs},
        static_bytes=(1.0,) * n,
        transfer_s=((0.0,) * n,) * S,
        message_s=(0.0,) * S,
        memory_capacity_bytes=1e18,
    )
    hint = rank_balanced_hint(problem, "none")
    assert hint is not None
    starts, modes = hint.stage_starts, hint.modes
    assert modes == ("none",) * spec.num_stages
    assert hint.recompute_units in ((), (None,) * spec.num_stages)  # whole stages
    assert starts[0] == 0 and all(a < b for a, b in zip(starts, (*starts[1:], n), strict=False))
    ends = (*starts[1:], n)
    per_rank = [0.0] * p
    for s, (a, b) in enumerate(zip(starts, ends, strict=True)):
        per_rank[spec.stage_rank(s)] += sum(forward[a:b])
    # no rank holds more than one block above the least-loaded rank (embedding/head aside)
    assert max(per_rank) - min(per_rank) <= 1.0 + 0.3 + 1e-9
    # and it never loses to the stage-only even split on the busiest rank
    plain = balanced_hint(problem, "none").stage_starts
    plain_rank = [0.0] * p
    for s, (a, b) in enumerate(zip(plain, (*plain[1:], n), strict=True)):
        plain_rank[spec.stage_rank(s)] += sum(forward[a:b])
    assert max(per_rank) <= max(plain_rank) + 1e-9


@pytest.mark.parametrize("kind", ["cut", "count"])
def test_min_peak_memory_reports_a_solver_timeout_as_unknown(kind: str) -> None:
    problem = random_problem(1003, uniform=True)
    assert _uniform_middle(problem)
    # a zero time limit stops CP-SAT before it finds anything: a result, not an assertion
    peak = min_peak_memory(problem, time_limit_s=0.0, model=kind)  # type: ignore[arg-type]
    assert peak.status == "UNKNOWN" and peak.least_bytes is None


def test_no_feasible_plan_says_bound_unknown_when_the_solver_times_out() -> None:
    # nothing fits 8 MiB; the least-memory solves behind the error get a near-zero limit
    profile = gpt_profile(num_layers=4, h=1024, s=512)
    tiny = round_cluster(memory_bytes=8 * 2**20)
    with pytest.raises(NoFeasiblePlanError) as info:
        search_plans(profile, tiny, global_batch=8, time_limit_s=1e-9)
    message = str(info.value)
    assert "the least memory per device any of the" in message, message
    assert "bound unknown (CP-SAT found no partition within time_limit_s=1e-09 s" in message
    # no figure is claimed as the least (the what-if table then quotes the message instead)
    assert info.value.least_memory_bytes is None
    assert message.endswith("; use more devices or devices with more memory"), message


# a 1F1B problem of 3 units in 2 stages, priced and brute-forced in a fresh interpreter
_NO_SOLVER = """
import sys
from autoplan.planner.partition import ModeCosts, PartitionProblem, brute_force, evaluate
from cost_model.schedules import ScheduleSpec

ones = (1.0, 1.0, 1.0)
costs = ModeCosts(
    forward_s=ones, backward_s=ones, weight_s=ones, activation_bytes=ones, retained_bytes=ones
)
spec = ScheduleSpec(schedule="1f1b", pp_degree=2, virtual_stages=1, num_micro_batches=2)
problem = PartitionProblem(
    spec=spec,
    modes={"none": costs},
    static_bytes=ones,
    transfer_s=(ones, ones),
    message_s=(0.0, 0.0),
    memory_capacity_bytes=100.0,
)
assert brute_force(problem) is not None
evaluate(problem, (0, 2), ("none", "none"))
print(sorted({name.split(".")[0] for name in sys.modules} & {"ortools", "pandas"}))
"""


def test_the_problem_and_its_reference_load_no_solver() -> None:
    # a training process handed its plan, and the brute-force oracle, never import OR-tools
    # (with pandas, ~0.4 s): only the solver's builders do
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _NO_SOLVER], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


# ------------------------------------------------------------------------------ the estimate


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zbv"])
def test_evaluate_agrees_with_the_estimate_of_its_plan(schedule: str) -> None:
    # the solver optimises `evaluate`; the search reports `CostModel.estimate` of the plan:
    # both build stage times and tails from `cost_model.stage_terms` and peaks from
    # `cost_model.rank_memory`, so every stage time is the same float, the tails and steps
    # agree up to the linear tail's rounding, and the memory up to the order of the sums
    profile = gpt_profile(num_layers=6, h=256, s=128, a=8, vocab=1024)
    cluster = round_cluster(num_nodes=2)
    space = SearchSpace.from_constraints(
        pp=(2,), tp=(1,), micro_batch=(1,), schedules=(schedule,), zero=(1,)
    ).for_cluster(cluster)
    model = CostModel(profile, cluster, "autoplan")
    tables = BoundTables(model)
    rng = random.Random(7)
    checked = 0
    for strategy in itertools.islice(strategies(space, profile, cluster, 16), 4):
        candidate = costed_candidate(strategy, recompute_modes(space, schedule), tables)
        problem = partition_problem(candidate, model)
        for _ in range(5):
            cuts = sorted(rng.sample(range(1, problem.num_units), problem.num_stages - 1))
            starts = (0, *cuts)
            modes = tuple(rng.choice(list(problem.modes)) for _ in starts)
            found = evaluate(problem, starts, modes)
            result = model.estimate(plan_of(model, candidate, found, 16))
            assert [
                (s.forward_s, s.backward_s, s.weight_s, s.transfer_s) for s in result.stages
            ] == [astuple(t) for t in stage_times(problem, starts, modes)]
            tails = rank_tails(problem, starts, modes)
            assert [r.tail_s for r in result.ranks] == pytest.approx(tails, rel=1e-9, abs=1e-15)
            assert result.step_time_s == pytest.approx(found.step_time_s, rel=1e-9)
            memory = rank_memory(problem, starts, modes)
            for rank, held in zip(result.ranks, memory, strict=True):
                # the estimate adds the rank's own working set beyond the largest block's
                # (`cost_model.rank_memory.rank_memory`), then the constant terms
                units = [
                    candidate.by_mode[plan_stage.recompute][u]
                    for plan_stage in (result.stages[s] for s in rank.stages)
                    for u in range(plan_stage.first_unit, plan_stage.last_unit + 1)
                ]
                working = [u.working_bytes for u in units if u.kind in RECOMPUTABLE_KINDS]
                own = max(working, default=0.0) - candidate.constants.block_working_bytes
                expected = candidate.constants.total_bytes(held + own)
                assert rank.memory.total_bytes == pytest.approx(expected, rel=1e-12)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("sync_s", [0.0, 1e-4, 1.0])
def test_the_linear_tail_terms_make_the_rank_tail(sync_s: float) -> None:
    # `rank_tail_terms` restate `rank_tail_s` as max(b, a + b) for max(0, a) + b: the solver's
    # tail and the estimate's agree whether the sync hides behind the backward or not
    profile = gpt_profile(num_layers=4, h=256, s=128, a=8, vocab=1024)
    cluster = round_cluster(num_nodes=2)
    space = SearchSpace.from_constraints(pp=(2,), tp=(1,), zero=(1,)).for_cluster(cluster)
    model = CostModel(profile, cluster, "autoplan")
    strategy = next(iter(strategies(space, profile, cluster, 16)))
    units = [replace(u, dp_sync_s=sync_s) for u in model.unit_costs(strategy, "none")]
    overlap = model.dp_overlap(strategy)
    for rank_units in (units[:2], units[2:], units):
        terms = zip(*(rank_tail_terms(u, overlap) for u in rank_units), strict=True)
        sums = [sum(term) for term in terms]
        expected = rank_tail_s(rank_units, overlap)
        assert tail_of_terms(sums) == pytest.approx(expected, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("seed", range(40))
def test_the_lp_bound_is_below_the_optimum(seed: int) -> None:
    """`relaxation.lp_bound` (counts and modes relaxed, the schedule's paths as cuts, each
    rank's memory at its peak points) never exceeds the brute-force optimum, and says inf only
    when nothing fits: with the capacity below the least peak any partition needs."""
    problem = random_problem(2000 + seed, uniform=True)
    if problem.num_stages == 1:
        pytest.skip("one stage: nothing to relax")
    expected = brute_force(problem)
    assert expected is not None
    bound = lp_bound(problem)
    assert bound <= expected.step_time_s * (1 + 1e-9)
    # a bound, not a constant: at least every rank's own work (its full order) or close to it
    assert bound > 0.5 * expected.step_time_s, (bound, expected.step_time_s)
    tight = replace(problem, memory_capacity_bytes=problem.memory_capacity_bytes * 0.5)
    tight_optimum = brute_force(tight)
    if tight_optimum is not None:
        assert lp_bound(tight) <= tight_optimum.step_time_s * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(48))
def test_the_path_bound_of_a_cut_is_below_its_simulated_step(seed: int) -> None:
    """`path_bound` (each rank's fill, work and drain or tail; the first micro-batch's chain)
    reads only a partition's stage times and never exceeds its simulated step, on random cuts
    of random problems of every schedule (these seeds cover them all); and it is not a
    constant (it reaches half the step on every one)."""
    problem = random_problem(seed)
    rng = random.Random(seed)
    n, S = problem.num_units, problem.num_stages
    for _ in range(5):
        starts = (0, *sorted(rng.sample(range(1, n), S - 1)))
        modes = tuple(rng.choice(list(problem.modes)) for _ in range(S))
        step = evaluate(problem, starts, modes).step_time_s
        bound = path_bound(problem, starts, modes)
        assert 0.5 * step <= bound <= step * (1 + 1e-12), (problem.spec, bound, step)
