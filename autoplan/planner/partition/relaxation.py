"""A proven lower bound on a stage-partition problem's optimum: its linear relaxation over
unit counts, with the schedule's paths as cutting planes (`lp_bound`).

Expects a problem whose units between the first and the last are interchangeable
(`problem._uniform_middle`: a traced Transformer's blocks). Guarantees: no partition that fits
in memory has a simulated step (`problem.evaluate`) below the returned bound.

Why it holds: a partition is a count of middle units per stage (at least one in each stage but
the first and the last, which hold the first and the last unit) and a recompute mode per stage.
Relax both: ``y[s][mode]`` middle units of stage ``s`` in that mode, fractional, and the first
and last units' modes as mixes. Every stage time, rank tail term and held activation bytes is
linear in them, and equals the partition's own at its integer point. The step is at least the
length of every path through the schedule's action graph (the solver's own argument,
`autoplan.planner.partition.solve`), each linear in the stage times and one rank's tail; every
rank must fit at each of its candidate peak points (`held_microbatches`). Minimising ``z`` over
any subset of those constraints is a relaxation, so its value bounds every fitting partition;
Kelley's cutting planes add the critical paths of each LP solution's simulation until the
simulation agrees with ``z`` (then no path is missing), the value passes the caller's cutoff,
or the rounds run out (still a bound). The link time of a boundary is taken at its least over
the units a stage can end with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from autoplan.planner.partition.problem import PartitionProblem
from autoplan.planner.work import ACTION_S, LP_ROUND_BASE_S, LP_ROW_S, Work
from cost_model.schedule_memory import held_microbatches
from cost_model.schedules import (
    CriticalPath,
    StageTimes,
    critical_path,
    path_key,
    path_length,
    rank_paths,
    simulate,
)
from cost_model.stage_terms import stage_time

# Kelley rounds at most (each adds each rank's critical path); stopping early only weakens it.
MAX_ROUNDS = 25
# Stop when the simulation of the LP's solution is within this fraction of its value.
_TOLERANCE = 1e-3
# Peak points per rank in the LP when it has more (any subset is a relaxation): the most held
# in all, then the most held by each stage of the rank, then the most retained.
_MAX_POINTS = 12

# a linear expression of the LP (OR-tools' own types, loaded with the solver)
Expr = Any


def lp_bound(
    problem: PartitionProblem,
    *,
    cutoff_s: float = math.inf,
    work: Work | None = None,
    stop_at_s: float = math.inf,
) -> float:
    """A lower bound on the least simulated step of any fitting partition of ``problem``
    (module docstring): inf when no partition fits; it stops once the bound reaches
    ``cutoff_s``, or ``work`` reaches ``stop_at_s`` (charging ``work`` each round)."""
    from ortools.linear_solver import pywraplp

    relaxed = _Relaxation(problem)
    spec = problem.spec
    if work is not None:
        work.schedule(spec)
    bound = 0.0
    for path in rank_paths(spec):
        relaxed.add(path)
    for _ in range(MAX_ROUNDS):
        if work is not None:
            if work.exhausted(stop_at_s):
                break
            work.charge(
                LP_ROUND_BASE_S
                + LP_ROW_S * relaxed.solver.NumConstraints()
                + ACTION_S * spec.num_actions * (1 + spec.pp_degree)
            )
        status = relaxed.solver.Solve()
        if status == pywraplp.Solver.INFEASIBLE:
            return math.inf
        if status != pywraplp.Solver.OPTIMAL:
            break
        value = relaxed.z.solution_value()
        # GLOP's feasibility tolerance: give back a little so rounding never overstates it
        bound = max(bound, value * (1.0 - 1e-6))
        if bound >= cutoff_s:
            break
        sim = simulate(spec, relaxed.stage_times(), relaxed.tails())
        if sim.step_time_s <= value * (1.0 + _TOLERANCE):
            break
        if not sum(relaxed.add(critical_path(spec, sim, r)) for r in range(spec.pp_degree)):
            break
    return bound


class _Relaxation:
    """The LP of `lp_bound` with its paths so far."""

    def __init__(self, problem: PartitionProblem) -> None:
        self.problem = problem
        spec = problem.spec
        S, n = spec.num_stages, problem.num_units
        from ortools.linear_solver import pywraplp

        solver = pywraplp.Solver.CreateSolver("GLOP")
        assert solver is not None, "OR-tools ships GLOP"
        self.solver = solver
        infinity = solver.infinity()
        tables = list(problem.modes.values())
        M = range(len(tables))
        y = [[solver.NumVar(0.0, infinity, f"y{s}_{k}") for k in M] for s in range(S)]
        mixes = {
            0: [solver.NumVar(0.0, 1.0, f"first{k}") for k in M],
            n - 1: [solver.NumVar(0.0, 1.0, f"last{k}") for k in M],
        }
        for mix in mixes.values():
            solver.Add(sum(mix) == 1.0)
        solver.Add(sum(v for row in y for v in row) == n - 2)
        for s in range(1, S - 1):
            solver.Add(sum(y[s]) >= 1.0)

        def stage_sum(s: int, column: Sequence[Sequence[float]]) -> Expr:
            """Stage ``s``'s sum of a per-unit table (``column[k]``: mode k's)."""
            expr: Expr = sum(y[s][k] * column[k][1] for k in M)
            if s == 0:
                expr += sum(mixes[0][k] * column[k][0] for k in M)
            if s == S - 1:
                expr += sum(mixes[n - 1][k] * column[k][n - 1] for k in M)
            return expr

        self.forward = [stage_sum(s, [t.forward_s for t in tables]) for s in range(S)]
        self.backward = [stage_sum(s, [t.backward_s for t in tables]) for s in range(S)]
        self.weight = [stage_sum(s, [t.weight_s for t in tables]) for s in range(S)]
        # the boundary after stage s ends with unit 0 or a middle unit: the least of their links
        self.transfer = [
            min(problem.transfer_s[s][: n - 1]) if s < S - 1 else 0.0 for s in range(S)
        ]
        self.tail = [solver.NumVar(0.0, infinity, f"tail{r}") for r in range(spec.pp_degree)]
        for r, tail in enumerate(self.tail):
            for j, constant in enumerate(problem.tail_constants_s):
                terms = [t.tail_s[j] for t in tables]
                solver.Add(tail >= constant + sum(stage_sum(s, terms) for s in spec.rank_stages(r)))
        static = [problem.static_bytes] * len(tables)
        activation = [t.activation_bytes for t in tables]
        retained = [t.retained_bytes for t in tables]
        for held in held_microbatches(spec):
            rank_static = sum(stage_sum(s, static) for s in held.stages)
            acts = [stage_sum(s, activation) for s in held.stages]
            kept = [
                acts[i] if s == 0 else stage_sum(s, retained) for i, s in enumerate(held.stages)
            ]
            for point, sends in _points(held.points, held.sends):
                solver.Add(
                    rank_static
                    + sends * problem.send_bytes
                    + sum(h * acts[i] + k * kept[i] for i, (h, k) in enumerate(point) if h or k)
                    <= problem.memory_capacity_bytes
                )
        self.z = solver.NumVar(0.0, infinity, "z")
        solver.Minimize(self.z)
        self._seen: set[tuple[object, ...]] = set()

    def add(self, path: CriticalPath) -> bool:
        """``z >= the path's length`` (False if the path is in already)."""
        key = path_key(path)
        if key in self._seen:
            return False
        self._seen.add(key)
        expr = path_length(
            path,
            self.forward,
            self.backward,
            self.weight,
            message=self.problem.message_s,
            transfer=self.transfer,
            tail=self.tail,
        )
        self.solver.Add(self.z >= expr)
        return True

    def stage_times(self) -> list[StageTimes]:
        """The LP solution's stage times (`cost_model.stage_terms.stage_time`)."""
        problem, message = self.problem, self.problem.message_s
        return [
            stage_time(
                max(0.0, self.forward[s].solution_value()),
                max(0.0, self.backward[s].solution_value()),
                max(0.0, self.weight[s].solution_value()),
                message_s=message[s],
                previous_message_s=message[s - 1] if s > 0 else 0.0,
                transfer_s=self.transfer[s],
                splits_backward=problem.spec.splits_backward,
            )
            for s in range(problem.num_stages)
        ]

    def tails(self) -> list[float]:
        """The LP solution's rank tails."""
        return [max(0.0, tail.solution_value()) for tail in self.tail]


def _points(
    points: Sequence[tuple[tuple[int, int], ...]], sends: Sequence[int]
) -> list[tuple[tuple[tuple[int, int], ...], int]]:
    """At most ``_MAX_POINTS`` of a rank's candidate peak points (see the constant)."""
    items = list(zip(points, sends, strict=True))
    if len(items) <= _MAX_POINTS:
        return items
    Point = tuple[tuple[tuple[int, int], ...], int]
    chosen: list[Point] = []

    def total(item: Point) -> int:
        return sum(h + k for h, k in item[0])

    keys: list[Callable[[Point], tuple[int, int]]] = [lambda item: (total(item), item[1])]
    for i in range(len(items[0][0])):
        keys.append(lambda item, i=i: (item[0][i][0], total(item)))  # type: ignore[misc]
    keys.append(lambda item: (sum(k for _, k in item[0]), total(item)))
    for key in keys:
        best = max(items, key=key)
        if best not in chosen:
            chosen.append(best)
    return chosen[:_MAX_POINTS]
