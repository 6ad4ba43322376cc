"""Proven lower bounds on a schedule's simulated pipeline time for ANY stage cut.

Expects a `ScheduleSpec` and the range of its units' forward shares (forward / (forward +
backward)) and, under a split backward, weight shares (weight / backward). Guarantees: for
every assignment of per-micro-batch stage times whose total work is ``W`` and whose stages'
shares lie in those ranges, the simulated pipeline (`cost_model.schedules.simulate`, links and
messages at zero) lasts at least ``W * pipeline_factor(...)``.

Why it holds: with the orders fixed, the simulated pipeline is the longest path through the
action graph, a maximum of linear functions of the stage times, so it is convex and positively
homogeneous. Its minimum over the polytope of stage times with total work 1 and those shares
is a linear program over all paths; Kelley's cutting planes solve it from a subset (each rank's
full order, then the critical paths of each LP solution's simulation). The LP over a subset of
paths is a relaxation, so its value is a lower bound at every iteration, converged or not. A
stage's shares are averages of its units' shares, so every real cut lies in the polytope; links,
messages and tails only add time (the simulation is monotone in every duration).

For schedules with several stages per rank this bound sees what compute totals cannot: the
pipeline's fill and drain under the best possible uneven chunking.
"""

from __future__ import annotations

import math

from ortools.linear_solver import pywraplp

from autoplan.planner.work import ACTION_S, LP_ROUND_BASE_S, LP_ROUND_PATH_S, Work, actions
from cost_model.schedules import (
    CriticalPath,
    ScheduleSpec,
    StageTimes,
    critical_path,
    rank_paths,
    simulate,
)

# Shares are rounded outward to this grid so that bounds are shared between candidates.
SHARE_GRID = 50
# Kelley iterations per bound; stopping early only weakens the bound. (A fixed number, not a
# deadline: a bound, and so every pruning decision, is the same on every machine.)
_MAX_ITERATIONS = 40
# Stop when the simulation of the LP's solution is within this fraction of its value.
_TOLERANCE = 1e-3


def share_range(shares: list[float]) -> tuple[int, int]:
    """The grid cells (floor of the least, ceiling of the largest share) of ``shares``."""
    low = math.floor(min(shares) * SHARE_GRID + 1e-9)
    high = math.ceil(max(shares) * SHARE_GRID - 1e-9)
    return max(0, low), min(SHARE_GRID, high)


# Factors by (spec, forward cells, weight cells), with the reference seconds they took.
_FACTORS: dict[tuple[ScheduleSpec, tuple[int, int], tuple[int, int]], tuple[float, float]] = {}


def pipeline_factor(
    spec: ScheduleSpec,
    forward: tuple[int, int],
    weight: tuple[int, int] = (0, 0),
    *,
    work: Work | None = None,
) -> float:
    """The least simulated pipeline time per unit of total work (module docstring); shares as
    grid cells from `share_range` (``weight`` only matters under a split backward). Charges
    ``work`` the reference seconds computing it takes, also when it was computed before (a
    cache must not change what a budget buys)."""
    key = (spec, forward, weight)
    found = _FACTORS.get(key)
    if found is None:
        found = _FACTORS[key] = _kelley(spec, forward, weight)
    if work is not None:
        work.charge(found[1])
    return found[0]


def _kelley(
    spec: ScheduleSpec, forward: tuple[int, int], weight: tuple[int, int]
) -> tuple[float, float]:
    """(the factor, the reference seconds it took)."""
    S = spec.num_stages
    solver = pywraplp.Solver.CreateSolver("GLOP")
    assert solver is not None, "OR-tools ships GLOP"
    f = [solver.NumVar(0.0, 1.0, f"f{s}") for s in range(S)]
    b = [solver.NumVar(0.0, 1.0, f"b{s}") for s in range(S)]
    split = spec.splits_backward
    w = [solver.NumVar(0.0, 1.0, f"w{s}") for s in range(S)] if split else []
    z = solver.NumVar(0.0, solver.infinity(), "z")
    solver.Add(sum(f) + sum(b) == 1.0)
    lo, hi = forward[0] / SHARE_GRID, forward[1] / SHARE_GRID
    for s in range(S):
        solver.Add(f[s] >= lo * (f[s] + b[s]))
        solver.Add(f[s] <= hi * (f[s] + b[s]))
        if split:
            solver.Add(w[s] >= weight[0] / SHARE_GRID * b[s])
            solver.Add(w[s] <= weight[1] / SHARE_GRID * b[s])

    cost = 0.0  # reference seconds

    def add(path: CriticalPath) -> None:
        nonlocal cost
        cost += LP_ROUND_PATH_S * sum(path.slots.values())
        expr = 0.0
        for slot, count in path.slots.items():
            s, kind = divmod(slot, 4)
            if kind == 0:
                expr += count * f[s]
            elif kind == 1:
                expr += count * b[s]
            elif kind == 2:
                expr += count * (b[s] - w[s])
            else:
                expr += count * w[s]
        solver.Add(z >= expr)

    for path in rank_paths(spec):
        add(path)
    solver.Minimize(z)
    bound = 0.0
    for _ in range(_MAX_ITERATIONS):
        cost += LP_ROUND_BASE_S + actions(spec) * ACTION_S
        if solver.Solve() != pywraplp.Solver.OPTIMAL:
            break
        value = z.solution_value()
        bound = max(bound, value)
        times = [
            StageTimes(
                forward_s=max(0.0, f[s].solution_value()),
                backward_s=max(0.0, b[s].solution_value()),
                weight_s=min(max(0.0, w[s].solution_value()), max(0.0, b[s].solution_value()))
                if split
                else 0.0,
            )
            for s in range(S)
        ]
        sim = simulate(spec, times)
        if sim.pipeline_time_s <= value * (1.0 + _TOLERANCE):
            break
        for rank in range(spec.pp_degree):
            add(critical_path(spec, sim, rank))
    # GLOP's feasibility tolerance: give back a little so rounding never overstates it.
    return bound * (1.0 - 1e-7), cost
