"""The CP-SAT stage partition against brute-force enumeration on random small problems."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from autoplan.planner.partition import (
    ModeCosts,
    PartitionProblem,
    _rank_separable,
    _uniform_middle,
    brute_force,
    evaluate,
    min_peak_memory,
    solve,
)


def random_problem(seed: int, *, uniform: bool = False) -> PartitionProblem:
    """Units with embedding/head-like outliers, 1-3 recompute modes, a tight memory cap.

    ``uniform``: the middle units are identical and the end units cost the same in every mode
    (the shape of a traced Transformer), so the count and rank formulations apply too.
    """
    rng = random.Random(seed)
    n = rng.randint(4, 12)
    p = rng.choice([1, 2, 2, 3, 4])
    v = rng.choice([1, 1, 2]) if p > 1 and 2 * p <= n else 1
    S = p * v
    m = rng.choice([p, 2 * p, 8])

    def per_unit(low: float, high: float) -> list[float]:
        if uniform:
            value = rng.uniform(low, high)
            return [rng.uniform(low, high), *[value] * (n - 2), rng.uniform(low, high)]
        return [rng.uniform(low, high) for _ in range(n)]

    base_time = per_unit(0.5, 2.0)
    base_time[0] *= rng.uniform(0.1, 0.5)  # embedding: cheap
    base_time[-1] *= rng.uniform(1.0, 3.0)  # head: expensive
    act = per_unit(1.0, 4.0)
    tails = (per_unit(0.0, 0.2), per_unit(-0.3, 0.4))  # optimizer-like; sync minus overlap
    names = rng.sample(["none", "selective", "full"], rng.randint(1, 3))
    modes = {}
    for name in names:
        factor_t, factor_a = {"none": (1.0, 1.0), "selective": (1.1, 0.6), "full": (1.35, 0.1)}[
            name
        ]

        def scaled(values: list[float], factor: float) -> tuple[float, ...]:
            if not uniform:
                return tuple(v * factor for v in values)
            return (values[0], *(v * factor for v in values[1:-1]), values[-1])

        modes[name] = ModeCosts(
            time_s=scaled(base_time, factor_t),
            activation_bytes=scaled(act, factor_a),
            tail_s=(
                tuple(tails[0]) if uniform else tuple(rng.uniform(0.0, 0.2) for _ in range(n)),
                scaled(tails[1], 1.0 + 0.1 * factor_t) if uniform else tuple(tails[1]),
            ),
        )
    static = tuple(per_unit(0.5, 3.0))
    if p == 1:
        inflight = tuple(float(min(m, 1)) for _ in range(S))
    else:
        inflight = tuple(float(min(m, p - (s % p))) * (1 + (v - 1) * 0.25) for s in range(S))
    problem = PartitionProblem(
        num_stages=S,
        pp_degree=p,
        virtual_stages=v,
        num_micro_batches=m,
        modes=modes,  # type: ignore[arg-type]
        static_bytes=static,
        boundary_time_s=tuple(tuple(per_unit(0.0, 0.3)) for _ in range(S)),
        inflight=inflight,
        memory_capacity_bytes=1e18,
        tail_constants_s=(0.05, rng.uniform(-0.2, 0.2)),
    )
    # a capacity between the least peak any partition needs and a comfortable one
    least = min_peak_memory(problem, model="cut")
    return replace(problem, memory_capacity_bytes=least * rng.uniform(1.0, 1.6) + 1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_solver_matches_brute_force(seed: int) -> None:
    problem = random_problem(seed)
    expected = brute_force(problem)
    found, stats = solve(problem)
    assert expected is not None  # the capacity is at least the least peak
    assert found is not None, stats
    assert stats.status == "OPTIMAL"
    assert found.peak_memory_bytes <= problem.memory_capacity_bytes
    # ties allowed; the integer model's rounding error is at most n / (2 * 1e6) <= 6e-6 here
    assert found.step_time_s == pytest.approx(expected.step_time_s, rel=1e-5)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("kind", ["cut", "count", "rank"])
def test_every_formulation_matches_brute_force_on_transformer_shapes(seed: int, kind: str) -> None:
    problem = random_problem(1000 + seed, uniform=True)
    if problem.num_stages == 1 and kind != "cut":
        pytest.skip("one stage: only the cut formulation applies")
    assert problem.num_stages == 1 or (_uniform_middle(problem) and _rank_separable(problem))
    expected = brute_force(problem)
    assert expected is not None
    found, stats = solve(problem, model=kind)  # type: ignore[arg-type]
    assert found is not None and stats.status == "OPTIMAL", stats
    assert found.peak_memory_bytes <= problem.memory_capacity_bytes
    assert found.step_time_s == pytest.approx(expected.step_time_s, rel=1e-5)
    assert min_peak_memory(problem, model=kind) == pytest.approx(  # type: ignore[arg-type]
        min_peak_memory(problem, model="cut"), rel=1e-5
    )


def test_infeasible_memory_returns_none() -> None:
    problem = random_problem(3)
    least = min_peak_memory(problem)
    tight = PartitionProblem(
        num_stages=problem.num_stages,
        pp_degree=problem.pp_degree,
        virtual_stages=problem.virtual_stages,
        num_micro_batches=problem.num_micro_batches,
        modes=problem.modes,
        static_bytes=problem.static_bytes,
        boundary_time_s=problem.boundary_time_s,
        inflight=problem.inflight,
        memory_capacity_bytes=least * 0.99,
        tail_constants_s=problem.tail_constants_s,
    )
    found, stats = solve(tight)
    assert found is None and stats.status == "INFEASIBLE"
    assert brute_force(tight) is None


def test_evaluate_by_hand() -> None:
    # 4 units, 2 stages on 2 ranks, m = 4, one mode.
    # stage 0 = units 0-1: time 1 + 2 = 3, plus the send after unit 1 (0.5) -> T_0 = 3.5
    # stage 1 = units 2-3: time 3 + 1 = 4 -> T_1 = 4
    # pipeline = (m - 1) * max + sum = 3 * 4 + 7.5 = 19.5
    # tails: rank 0 = 0.1 + 0.1 + 1 = 1.2 ; rank 1 = 0.3 + 0.3 + 1 = 1.6 -> 1.6; step = 21.1
    # memory: rank 0 = static 1 + 1 + inflight 2 * act (1 + 1) = 6; rank 1 = 2 + 2 + 1 * (2 + 2) = 8
    problem = PartitionProblem(
        num_stages=2,
        pp_degree=2,
        virtual_stages=1,
        num_micro_batches=4,
        modes={
            "none": ModeCosts(
                time_s=(1, 2, 3, 1), activation_bytes=(1, 1, 2, 2), tail_s=((0.1, 0.1, 0.3, 0.3),)
            )
        },
        static_bytes=(1, 1, 2, 2),
        boundary_time_s=((0.5, 0.5, 0.5, 0.5), (9.0, 9.0, 9.0, 9.0)),
        inflight=(2, 1),
        memory_capacity_bytes=100,
        tail_constants_s=(1.0,),
    )
    result = evaluate(problem, (0, 2), ("none", "none"))
    assert result.rank_times_s == (3.5, 4.0)
    assert result.step_time_s == pytest.approx(21.1)
    assert result.rank_memory_bytes == (6.0, 8.0)
    best, _ = solve(problem)
    assert best is not None and best.step_time_s <= result.step_time_s + 1e-12
