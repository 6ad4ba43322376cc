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

import heapq
import math
from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from autoplan.planner.work import ACTION_S, LP_ROUND_BASE_S, LP_ROW_S, Work
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
# deadline: a bound, and so every pruning decision, is the same on every machine.) 15, not
# 40: p=16 interleaved specs ran all 40 without converging, and at the default budget the
# rounds saved buy solves (llama3-405b on 16384 H100: proven gap 13.1% -> 10.6%, gpt3-175b
# on 1024 A100: 7.9% -> 7.1%; 8 rounds gave the same).
_MAX_ITERATIONS = 15
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
        cost += LP_ROUND_BASE_S + LP_ROW_S * solver.NumConstraints() + spec.num_actions * ACTION_S
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


# ------------------------------------------------------------ whole units per rank


@dataclass(frozen=True, slots=True)
class UnitFloor:
    """One unit's least per-micro-batch times over the recompute modes a plan may use, each
    taken on its own (so every plan's unit takes at least each): its forward, its backward and
    its shares of the two linear rank-tail terms (`cost_model.stage_terms.rank_tail_terms`)."""

    forward_s: float
    backward_s: float
    tail_s: tuple[float, float]


def whole_unit_bound(
    spec: ScheduleSpec, first: UnitFloor, middle: UnitFloor, count: int, last: UnitFloor
) -> float:
    """A lower bound on the simulated step (without the loop's fixed overhead: add it) of any
    cut of a model whose first and last units are ``first`` and ``last`` and whose ``count``
    units between are identical (``middle``), whole units per stage.

    Why it holds: rank ``r``'s lowest stage is ``r`` (both placements), so its first action
    waits for the forwards of stages ``0 .. r-1`` of micro-batch 0 (fill), and, when the
    backward is not split, its last action (the backward of stage ``r`` of the last micro-batch,
    torch's order) is followed by the backwards of stages ``r-1 .. 0`` (drain): that path
    (`cost_model.schedules.rank_paths`) lasts ``fill_r + m W_r + drain_r``, with ``W_r`` its
    per-micro-batch work, and after it rank 0 runs its tail (at least the fixed overhead); rank
    ``r``'s own tail follows its own last action. Stage 0 holds at least the first unit and
    each stage ``1 .. r-1`` at least one middle unit; rank 0 at least one unit per stage. So
    with ``k_r`` middle units on rank ``r`` the step is at least
    ``g_r(k_r) = fill_r + m (k_r T + specials_r) + max(drain_r + rank 0's tail, tail_r)``, and
    over every split of ``count`` units into whole ``k_r`` at least the least possible
    ``max_r g_r(k_r)``: with ``g_r`` linear in ``k_r`` (a line under the max), the ``count``-th
    smallest of the levels ``g_r(1), g_r(2), ...`` over all ranks (what giving each unit to the
    rank it raises least reaches), or the largest ``g_r(0)`` if more. This is what fractional
    bounds miss: a rank holding the last unit (the head) holds whole middle units besides it.
    """
    p, m = spec.pp_degree, spec.num_micro_batches
    per_unit = m * (middle.forward_s + middle.backward_s)
    if count <= 0 or per_unit <= 0:
        return 0.0
    drains = not spec.splits_backward
    first_rank, last_rank = spec.stage_rank(0), spec.stage_rank(spec.num_stages - 1)
    # The drain ends on rank 0 (stage 0's backward), whose tail follows: at least the tail of
    # the units rank 0 must hold (the first unit, the last if its stage is there, a middle unit
    # in each of its other stages), by each tail term whose middle share is not negative
    # (fewer middle units could only lower one that is).
    least_middle = max(0, spec.virtual_stages - 1 - (last_rank == 0))
    rank0_tail = max(
        [0.0]
        + [
            first.tail_s[j]
            + (last.tail_s[j] if last_rank == 0 else 0.0)
            + least_middle * middle.tail_s[j]
            for j in (0, 1)
            if middle.tail_s[j] >= 0
        ]
    )
    intercepts: list[float] = []
    slopes: list[float] = []
    for r in range(p):
        fill = drain = 0.0
        if r > 0:
            fill = first.forward_s + (r - 1) * middle.forward_s
            if drains:
                drain = first.backward_s + (r - 1) * middle.backward_s + rank0_tail
        special = 0.0
        tail = [0.0, 0.0]
        for unit, rank in ((first, first_rank), (last, last_rank)):
            if rank == r:
                special += unit.forward_s + unit.backward_s
                tail = [tail[0] + unit.tail_s[0], tail[1] + unit.tail_s[1]]
        # max(drain, tail) >= drain, and >= the tail term with the larger share per unit (a
        # line in k_r each): take the larger at an even split, a line either way
        share = count / p
        term = max((0, 1), key=lambda j: tail[j] + share * middle.tail_s[j])
        tail_line = (tail[term], middle.tail_s[term])
        if drain >= tail_line[0] + share * tail_line[1]:
            intercepts.append(fill + m * special + drain)
            slopes.append(per_unit)
        else:
            intercepts.append(fill + m * special + tail_line[0])
            slopes.append(per_unit + tail_line[1])
    return _nth_level(intercepts, slopes, count)


def _nth_level(intercepts: list[float], slopes: list[float], count: int) -> float:
    """``max(max_r a_r, the count-th smallest of {a_r + s_r j : j >= 1, every r})``, slopes
    > 0: the least ``max_r (a_r + s_r k_r)`` over whole ``k_r >= 0`` summing to ``count``."""
    # the continuous level (every rank filled to the same height) is at most the answer: start
    # there and take the remaining levels in order
    ranks = range(len(intercepts))
    active = list(ranks)
    level = 0.0
    while active:
        level = (count + sum(intercepts[r] / slopes[r] for r in active)) / sum(
            1.0 / slopes[r] for r in active
        )
        kept = [r for r in active if intercepts[r] < level]
        if len(kept) == len(active):
            break
        active = kept
    # every level at or below it, the smallest ones; the rest come in order from a heap
    taken = [max(0, math.floor((level - intercepts[r]) / slopes[r])) for r in ranks]
    value = level  # (all taken already: the continuous level is met with whole units)
    heap = [(intercepts[r] + slopes[r] * (taken[r] + 1), r) for r in ranks]
    heapq.heapify(heap)
    for _ in range(count - sum(taken)):
        value, r = heapq.heappop(heap)
        taken[r] += 1
        heapq.heappush(heap, (intercepts[r] + slopes[r] * (taken[r] + 1), r))
    return max(max(intercepts), value)
