"""Proven lower bounds on a schedule's simulated pipeline time for ANY stage cut.

Expects a `ScheduleSpec` and the range of its units' forward shares (forward / (forward +
backward)) and, under a split backward, weight shares (weight / backward). Guarantees: for
every assignment of per-micro-batch stage times whose total work is ``W`` and whose stages'
shares lie in those ranges, the simulated pipeline (`cost_model.schedules.simulate`, links and
messages at zero) lasts at least ``W * pipeline_factor(...)``.

Why it holds: with the orders fixed, the simulated pipeline is the longest path through the
action graph, a maximum of linear functions of the stage times, so it is convex and positively
homogeneous. Its minimum over the polytope of stage times with total work 1 and those shares
is a linear program over all paths: solved exactly with an end time per action for schedules
of up to `ALL_PATHS_MAX_ACTIONS` actions, else from a subset by Kelley's cutting planes (each
rank's full order, then the critical paths of each LP solution's simulation). The LP over a
subset of paths is a relaxation, so its value is a lower bound at every iteration, converged or
not. A
stage's shares are averages of its units' shares, so every real cut lies in the polytope; links,
messages and tails only add time (the simulation is monotone in every duration).

For schedules with several stages per rank this bound sees what compute totals cannot: the
pipeline's fill and drain under the best possible uneven chunking.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from ortools.linear_solver import pywraplp

from autoplan.planner.work import ACTION_S, LP_ROUND_BASE_S, LP_ROW_S, Work
from cost_model.schedule_memory import HeldProfile, held_microbatches
from cost_model.schedules import (
    CriticalPath,
    ScheduleSpec,
    StageTimes,
    compile_schedule,
    critical_path,
    path_length,
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
# Schedules up to this many actions get the exact factor (`_all_paths`), larger ones Kelley's
# rounds. GLOP's solve grows about as the square of the actions: 0.05 s at 768 and 0.9 s at
# 3,072, measured on interleaved 1F1B p 8, m 24, where the exact factor is 2.4-4.9% above what
# 15 rounds reached (their LP solutions are degenerate: at v >= 4 every round stayed at the
# busiest rank's share, m / p). At 4,096 the what-if of gpt3-175b on 128 A100 lost its best
# plan to the budget the factors took (proven gap 7.2% -> 20.8%); at 2,048 no size of the
# 64-8192 what-if lost, and 8192 went from 12.4% to 11.1%.
ALL_PATHS_MAX_ACTIONS = 2048
ALL_PATHS_BASE_S = 5e-3
ALL_PATHS_ACTION_PAIR_S = 1e-7


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
    ``work`` the reference seconds computing it takes the first time that search asks for
    it, also when another search computed it before (a cache must not change what a budget
    buys)."""
    key = (spec, forward, weight)
    found = _FACTORS.get(key)
    if found is None:
        exact = spec.num_actions <= ALL_PATHS_MAX_ACTIONS
        found = _FACTORS[key] = (_all_paths if exact else _kelley)(spec, forward, weight)
    if work is not None:
        work.schedule(spec)
        work.charge_once(("pipeline_factor", key), found[1])
    return found[0]


def _all_paths(
    spec: ScheduleSpec, forward: tuple[int, int], weight: tuple[int, int]
) -> tuple[float, float]:
    """(the factor, the reference seconds it took), from the LP with every path at once: an
    end time per action, at least its rank predecessor's and its input's end plus its own
    duration, the pipeline at least each rank's last end. Its optimum is the longest path's
    least value over the polytope, the limit Kelley's rounds approach."""
    S = spec.num_stages
    solver = pywraplp.Solver.CreateSolver("GLOP")
    assert solver is not None, "OR-tools ships GLOP"
    split = spec.splits_backward
    f, b, w = _stage_shares(solver, S, forward, weight, split)
    compiled = compile_schedule(spec)
    n = len(compiled.actions)
    infinity = solver.infinity()
    end = [solver.NumVar(0.0, infinity, f"e{j}") for j in range(n)]
    durations = [(f[s], b[s], b[s] - w[s], w[s]) for s in range(S)]
    for j in range(n):
        stage, kind = divmod(compiled.slot[j], 4)
        duration = durations[stage][kind]
        for before in {compiled.rank_pred[j], compiled.data_pred[j]}:
            solver.Add(end[j] >= (end[before] if before != n else 0.0) + duration)
    z = solver.NumVar(0.0, infinity, "z")
    for last in compiled.rank_last:
        solver.Add(z >= end[last])
    solver.Minimize(z)
    cost = ALL_PATHS_BASE_S + ALL_PATHS_ACTION_PAIR_S * n * n
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return 0.0, cost  # (no bound rather than a wrong one; GLOP solves these)
    # GLOP's feasibility tolerance: give back a little so rounding never overstates it.
    return z.solution_value() * (1.0 - 1e-7), cost


def _stage_shares(
    solver: pywraplp.Solver,
    S: int,
    forward: tuple[int, int],
    weight: tuple[int, int],
    split: bool,
) -> tuple[list[Any], list[Any], list[Any]]:
    """Per stage its forward, backward and (under a split backward) weight time, with total
    work 1 and each stage's shares in the grid cells ``forward`` and ``weight``."""
    f = [solver.NumVar(0.0, 1.0, f"f{s}") for s in range(S)]
    b = [solver.NumVar(0.0, 1.0, f"b{s}") for s in range(S)]
    w: list[Any] = [solver.NumVar(0.0, 1.0, f"w{s}") for s in range(S)] if split else [0.0] * S
    solver.Add(sum(f) + sum(b) == 1.0)
    lo, hi = forward[0] / SHARE_GRID, forward[1] / SHARE_GRID
    for s in range(S):
        solver.Add(f[s] >= lo * (f[s] + b[s]))
        solver.Add(f[s] <= hi * (f[s] + b[s]))
        if split:
            solver.Add(w[s] >= weight[0] / SHARE_GRID * b[s])
            solver.Add(w[s] <= weight[1] / SHARE_GRID * b[s])
    return f, b, w


def _kelley(
    spec: ScheduleSpec, forward: tuple[int, int], weight: tuple[int, int]
) -> tuple[float, float]:
    """(the factor, the reference seconds it took)."""
    S = spec.num_stages
    solver = pywraplp.Solver.CreateSolver("GLOP")
    assert solver is not None, "OR-tools ships GLOP"
    split = spec.splits_backward
    f, b, w = _stage_shares(solver, S, forward, weight, split)
    z = solver.NumVar(0.0, solver.infinity(), "z")

    cost = 0.0  # reference seconds

    def add(path: CriticalPath) -> None:
        solver.Add(z >= path_length(path, f, b, w))

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


# ------------------------------------------------------------ recompute for memory


@dataclass(frozen=True, slots=True)
class RecomputeCurve:
    """The least summed unit time as a function of the activation bytes the units may hold:
    the LP relaxation of choosing a recompute mode per unit (a multiple-choice knapsack).
    Units start at their fastest mode (``time_s``, holding ``held_bytes``) and buy bytes back
    along the lower convex hull of their modes, cheapest seconds-per-byte first,
    fractionally (``segments``: seconds per byte saved, bytes it can save, ascending)."""

    time_s: float
    held_bytes: float
    segments: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, classes: list[tuple[int, list[tuple[float, float]]]]) -> RecomputeCurve:
        """From each class of ``count`` identical units and its (bytes, time) per mode."""
        time = 0.0
        held = 0.0
        segments: list[tuple[float, float]] = []
        for count, points in classes:
            start = min(points, key=lambda point: (point[1], point[0]))  # fastest, then smallest
            time += count * start[1]
            held += count * start[0]
            current = start
            while True:
                cheaper = [q for q in points if q[0] < current[0]]
                if not cheaper:
                    break
                nxt = min(cheaper, key=lambda q: ((q[1] - current[1]) / (current[0] - q[0]), q[0]))
                slope = max(0.0, (nxt[1] - current[1]) / (current[0] - nxt[0]))
                segments.append((slope, count * (current[0] - nxt[0])))
                current = nxt
        return cls(time, held, tuple(sorted(segments)))

    def time_within(self, budget: float, *, saturate: bool = False) -> float:
        """A lower bound on the summed unit time when their activation bytes must fit
        ``budget``. Returns inf if even the leanest modes cannot fit (the memory bound rejects
        such candidates anyway), or with ``saturate`` the time of the leanest modes."""
        time = self.time_s
        excess = self.held_bytes - budget
        for slope, saves in self.segments:
            if excess <= 0:
                break
            used = min(saves, excess)
            time += slope * used
            excess -= used
        return time if saturate or excess <= 1e-9 * max(self.held_bytes, 1.0) else math.inf


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
    first_rank, last_rank = spec.stage_rank(0), spec.stage_rank(spec.num_stages - 1)
    fills = _fills_and_drains(spec, first, middle, last)
    intercepts: list[float] = []
    slopes: list[float] = []
    for r, (fill, drain) in enumerate(fills):
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


@dataclass(frozen=True, slots=True)
class UnitModes:
    """One unit under each recompute mode a plan may use: per mode its (time per micro-batch,
    activation bytes per in-flight micro-batch, bytes retained between a split backward's
    halves); its static bytes; and its `UnitFloor`."""

    modes: tuple[tuple[float, float, float], ...]
    static_bytes: float
    floor: UnitFloor


# Candidate peak points of a rank that `memory_unit_bound` reads (any subset is a valid bound):
# the most held in all and the most held by the rank's least-holding stage, a few of each.
_POINTS_EACH = 2


def memory_unit_bound(
    spec: ScheduleSpec,
    first: UnitModes,
    middle: UnitModes,
    count: int,
    last: UnitModes,
    *,
    capacity_bytes: float,
    send_bytes: float,
) -> UnitsPerRank:
    """`whole_unit_bound` with each rank's memory (see `UnitsPerRank`), for any cut whose
    every rank fits ``capacity_bytes``.

    Why it holds: as in `whole_unit_bound`, rank ``r`` holding ``k`` middle units takes at
    least ``g_r(k) = fill_r + m T_r(k) + max(drain_r, tail_r(k))``, where ``T_r(k)`` is now its
    least per-micro-batch work under any recompute that fits: at each of its candidate peak
    points (`cost_model.schedule_memory.held_microbatches`) its static bytes, pending sends
    and held activations must fit, so ``T_r(k)`` is at least the `RecomputeCurve` of its units
    within the bytes left, each unit's bytes counted at a stage it can be in: the first and
    last units at their own stages, one middle unit in each other stage (no stage is empty),
    the rest at the stage that holds least (per mode), with modes per unit (a relaxation of
    per stage). More units only add time and static bytes, so ``g_r`` does not decrease and
    the least ``max_r g_r(k_r)`` over whole ``k_r`` summing to ``count`` is the ``count``-th
    smallest level. The work of all ranks together is at least the least ``sum_r T_r(k_r)``
    over the same splits (a min-plus convolution)."""
    if count <= 0:
        return UnitsPerRank(0.0, 0.0, 0)
    fills = _fills_and_drains(spec, first.floor, middle.floor, last.floor)
    profiles = held_microbatches(spec)
    m = spec.num_micro_batches
    ks = np.arange(count + 1, dtype=float)
    works, levels, least = [], [], []
    cost = 0
    for r, (fill, drain) in enumerate(fills):
        rank = _RankWork.of(spec, r, profiles[r], first, middle, last, capacity_bytes, send_bytes)
        work = rank.works(ks)
        works.append(work)
        levels.append(fill + m * work + np.maximum(drain, rank.tails(ks)))
        least.append(rank.least)
        cost += len(rank.curves)
    return UnitsPerRank(_least_max(levels, least, count), _least_sum(works, least, count), cost)


class UnitsPerRank(NamedTuple):
    """What `memory_unit_bound` proves of every fitting cut, without the loop's fixed
    overhead: its simulated step is at least ``level_s``, and its units' per-micro-batch work
    summed over the stages at least ``work_s`` (what `pipeline_factor` scales)."""

    level_s: float
    work_s: float
    curves: int  # peak-point curves evaluated, each at every count (its reference cost)


@dataclass(frozen=True, slots=True)
class _RankWork:
    """One pipeline rank's least per-micro-batch work and tail as functions of the middle
    units it holds (see `memory_unit_bound`)."""

    least: int  # middle units it must hold: one in each stage without the first or last unit
    static_bytes: float  # of the first and last units, where they are on it
    tail_terms: tuple[float, float]  # their tail terms
    middle: UnitModes
    capacity_bytes: float
    send_bytes: float
    # per chosen peak point: the curve of its fixed units, one free middle unit's, the sends
    curves: tuple[tuple[RecomputeCurve, RecomputeCurve, int], ...]

    @classmethod
    def of(
        cls,
        spec: ScheduleSpec,
        r: int,
        profile: HeldProfile,
        first: UnitModes,
        middle: UnitModes,
        last: UnitModes,
        capacity_bytes: float,
        send_bytes: float,
    ) -> _RankWork:
        S = spec.num_stages
        stages = spec.rank_stages(r)
        specials = [(first, stages.index(0))] if spec.stage_rank(0) == r else []
        if spec.stage_rank(S - 1) == r:
            specials.append((last, stages.index(S - 1)))
        taken = {k for _, k in specials}
        own = [k for k in range(len(stages)) if k not in taken]
        curves = []
        for point, sends in _binding_points(profile):
            # per stage: (micro-batches held, retained, whether it is stage 0)
            holds = [(*point[k], stages[k] == 0) for k in range(len(stages))]
            fixed = [(1, _held_curve(unit.modes, holds[k])) for unit, k in specials]
            # stages that hold alike, one class each
            alike = Counter(holds[k] for k in own)
            fixed += [(n, _held_curve(middle.modes, hold)) for hold, n in sorted(alike.items())]
            free = [(min(_held(mode, hold) for hold in holds), mode[0]) for mode in middle.modes]
            curves.append((RecomputeCurve.of(fixed), RecomputeCurve.of([(1, free)]), sends))
        return cls(
            least=len(own),
            static_bytes=sum(unit.static_bytes for unit, _ in specials),
            tail_terms=(
                sum(unit.floor.tail_s[0] for unit, _ in specials),
                sum(unit.floor.tail_s[1] for unit, _ in specials),
            ),
            middle=middle,
            capacity_bytes=capacity_bytes,
            send_bytes=send_bytes,
            curves=tuple(curves),
        )

    def works(self, ks: np.ndarray) -> np.ndarray:
        """The least per-micro-batch work with each of ``ks`` middle units (inf below
        ``least`` or where no recompute fits): `RecomputeCurve.time_within` of the fixed
        units' curve plus ``k - least`` free ones, for every ``k`` at once (the segments'
        order by slope does not depend on ``k``, their sizes are linear in it)."""
        free_k = np.maximum(ks - self.least, 0.0)
        room = self.capacity_bytes - self.static_bytes - ks * self.middle.static_bytes
        out = np.zeros_like(ks)
        for fixed, free, sends in self.curves:
            held = fixed.held_bytes + free_k * free.held_bytes
            excess = held - (room - sends * self.send_bytes)
            merged = sorted(
                [(slope, saves, 0.0) for slope, saves in fixed.segments]
                + [(slope, 0.0, saves) for slope, saves in free.segments]
            )
            time = fixed.time_s + free_k * free.time_s
            if merged:
                slopes, base, per_unit = (np.array(column) for column in zip(*merged, strict=True))
                saves = base[:, None] + per_unit[:, None] * free_k[None, :]  # [segment, k]
                before = np.cumsum(saves, axis=0) - saves  # bytes the cheaper ones save
                used = np.clip(excess[None, :] - before, 0.0, saves)
                time = time + slopes @ used
                excess = excess - used.sum(axis=0)
            fits = excess <= 1e-9 * np.maximum(held, 1.0)
            out = np.maximum(out, np.where(fits, time, np.inf))
        # (the curve is exact per k; the running maximum only guards rounding: more units never
        # take less)
        out[self.least :] = np.maximum.accumulate(out[self.least :])
        out[: self.least] = np.inf
        return out

    def tails(self, ks: np.ndarray) -> np.ndarray:
        """The least tail with each of ``ks`` middle units (both terms, `rank_tail_terms`)."""
        return np.maximum(
            self.tail_terms[0] + ks * self.middle.floor.tail_s[0],
            self.tail_terms[1] + ks * self.middle.floor.tail_s[1],
        )


def _held(mode: tuple[float, float, float], hold: tuple[int, int, bool]) -> float:
    """A unit's bytes at a peak point, in a stage holding ``hold`` (micro-batches held,
    retained, whether it is stage 0), under ``mode`` (time, activation bytes, retained bytes):
    `cost_model.rank_memory.stage_held_bytes` (stage 0 retains its activations)."""
    held, kept, zero = hold
    return held * mode[1] + kept * (mode[1] if zero else mode[2])


def _held_curve(
    modes: tuple[tuple[float, float, float], ...], hold: tuple[int, int, bool]
) -> list[tuple[float, float]]:
    """A unit's (bytes, time) per mode in a stage holding ``hold`` (see `_held`)."""
    return [(_held(mode, hold), mode[0]) for mode in modes]


_Point = tuple[tuple[tuple[int, int], ...], int]
_BINDING: dict[HeldProfile, list[_Point]] = {}


def _binding_points(profile: HeldProfile) -> list[_Point]:
    """A few of the rank's candidate peak points: those holding the most in all and those
    whose least-holding stage holds the most (``_POINTS_EACH`` of each)."""
    found = _BINDING.get(profile)
    if found is None:
        found = _BINDING[profile] = _choose_points(profile)
    return found


def _choose_points(profile: HeldProfile) -> list[_Point]:
    points = list(zip(profile.points, profile.sends, strict=True))
    if len(points) <= 2 * _POINTS_EACH:
        return points

    def total(item: _Point) -> int:
        return sum(h + k for h, k in item[0])

    by_total = sorted(points, key=lambda item: (-total(item), item))
    by_least = sorted(points, key=lambda item: (-min(h for h, _ in item[0]), -total(item), item))
    chosen = by_total[:_POINTS_EACH]
    chosen += [item for item in by_least if item not in chosen][:_POINTS_EACH]
    return chosen


def _least_max(levels: list[np.ndarray], least: list[int], count: int) -> float:
    """``min max_r levels[r][k_r]`` over whole ``k_r >= least[r]`` summing to ``count``, each
    ``levels[r]`` non-decreasing in ``k``: the larger of every rank's level at its least and
    the ``spare``-th smallest of the levels beyond (what giving each spare unit to the rank it
    raises least reaches)."""
    spare = count - sum(least)
    if spare < 0:
        return math.inf
    base = max(float(level[k]) for level, k in zip(levels, least, strict=True))
    if spare == 0:
        return base
    beyond = np.concatenate(
        [level[k + 1 : k + 1 + spare] for level, k in zip(levels, least, strict=True)]
    )
    return max(base, float(np.partition(beyond, spare - 1)[spare - 1]))


def _least_sum(works: list[np.ndarray], least: list[int], count: int) -> float:
    """``min sum_r works[r][k_r]`` over whole ``k_r >= least[r]`` summing to ``count`` (a
    min-plus convolution rank by rank)."""
    n = count + 1
    total = np.full(n, np.inf)
    total[0] = 0.0
    shift = np.arange(n)[:, None] + np.arange(n)[None, :]  # [used, k] -> used + k
    inside = shift < n
    for work in works:
        grid = np.full((n, n), np.inf)
        grid[np.nonzero(inside)[0], shift[inside]] = (total[:, None] + work[None, :])[inside]
        total = grid.min(axis=0)
    return float(total[count])


def _fills_and_drains(
    spec: ScheduleSpec, first: UnitFloor, middle: UnitFloor, last: UnitFloor
) -> list[tuple[float, float]]:
    """Per pipeline rank, the least time before its first action (the forwards of stages
    ``0 .. r-1`` of the first micro-batch) and after its last one (their backwards, then rank
    0's tail; 0 under a split backward), whatever the cut: stage 0 holds at least the first
    unit, every other stage at least one middle unit (see `whole_unit_bound`)."""
    drains = not spec.splits_backward
    last_rank = spec.stage_rank(spec.num_stages - 1)
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
    out = [(0.0, 0.0)]
    for r in range(1, spec.pp_degree):
        fill = first.forward_s + (r - 1) * middle.forward_s
        drain = first.backward_s + (r - 1) * middle.backward_s + rank0_tail if drains else 0.0
        out.append((fill, drain))
    return out


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
