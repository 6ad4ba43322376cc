"""The search's frontier and its statistics: the outer choices not visited yet, costed on
demand (`Frontier`), and the counters every phase updates (`SearchStats`).

Expects `Pending` choices with their floors from `candidates.BoundTables.floors`, and a
`work.Work` to charge each costing to. Guarantees: `Frontier.pop` yields choices in ascending
order key, as costing every choice up front would, and drops only choices whose proven floor
reaches the cutoff; `Frontier.floors` bounds every choice not popped yet.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoplan.contract.plan import Recompute
from autoplan.planner.candidates import BoundTables, Candidate, costed_candidate
from autoplan.planner.work import COST_S, Work
from cost_model.strategy import Strategy

__all__ = ["Frontier", "Pending", "SearchStats"]


@dataclass(kw_only=True, slots=True)
class SearchStats:
    """What the search did (for `bench/search.py` and the CLI)."""

    candidates: int = 0
    pruned_memory: int = 0
    pruned_bound: int = 0
    solver_calls: int = 0
    solver_infeasible: int = 0
    solver_cutoff: int = 0  # proven unable to beat the k-th best plan
    solver_reused: int = 0  # identical problems answered from an earlier solve
    solver_timeouts: int = 0  # stopped at the time limit without a proof
    unvisited: int = 0  # candidates left when the search ran out of its budget
    # shapes of outer choices (`space.Shape`) listed, and those never expanded (their members
    # not enumerated: left when the budget ran out, or proven unable to beat the best by
    # their floors); their members are not among ``candidates``
    shapes: int = 0
    shapes_left: int = 0
    pruned_schedule: int = 0  # by the bound from the schedule's paths (`bounds.py`)
    bounds_s: float = 0.0  # time spent on those bounds
    # the reference seconds of work spent (`planner.work`: what the budget counts; the same
    # on every machine), and whether the wall-clock cap cut the search (then it may not be)
    work_s: float = 0.0
    wall_capped: bool = False
    # Ctrl-C (KeyboardInterrupt) ended the search: the plans are the best found so far and the
    # gap covers every candidate not proven
    interrupted: bool = False
    seed_s: float = 0.0  # heuristic partitions of the first candidates (the first incumbent)
    # the best step those found (None: none fits): how good the visiting order's first guesses
    # are, the incumbent every proof starts from
    seed_step_time_s: float | None = None
    # How much faster than the returned best an unfinished candidate might still be, as a
    # fraction of the best step time (0: the result is proven optimal in the space).
    optimality_gap: float = 0.0
    # the least objective of the plans found (the objective's optimum when the gap is 0): the
    # returned best is within `TIE_FRACTION` of it (a tie gone to fewer unvalidated features)
    best_objective_s: float | None = None
    enumerate_s: float = 0.0
    costs_s: float = 0.0
    solver_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Pending:
    """An outer choice not yet costed, with its floors from compute alone."""

    order_floor_s: float  # at most its order key (`Candidate.order_key_s`)
    time_floor_s: float  # a proven lower bound on its simulated step
    index: int  # enumeration order (ties)
    strategy: Strategy
    modes: tuple[Recompute, ...]


class Frontier:
    """The outer choices in the visiting order (ascending order key), costed on demand.

    A choice is costed (`costed_candidate`) only once no costed choice has an order key below its
    floor, so the order is the one costing every choice up front would give, at the price of
    the few hundred nearest the front. Choices whose proven floor cannot beat the cutoff are
    dropped uncosted."""

    def __init__(
        self,
        pending: list[Pending],
        tables: BoundTables,
        stats: SearchStats,
        infeasible: list[Strategy],
        work: Work,
        offload: Callable[[Strategy, tuple[Recompute, ...]], Sequence[Strategy]] | None = None,
    ) -> None:
        # popped from the end: largest floor first in the list
        self._pending = sorted(pending, key=lambda e: (e.order_floor_s, e.index), reverse=True)
        self._ready: list[tuple[float, int, Candidate]] = []  # heap on the order key
        self._tables = tables
        self._stats, self._infeasible, self._work = stats, infeasible, work
        # a choice that cannot fit, with its optimizer or activations on the host (in the
        # order tried; None: none to try)
        self._offload = offload

    @property
    def tables(self) -> BoundTables:
        """The bound tables its choices are costed with."""
        return self._tables

    def pop(self, cutoff: float) -> tuple[int, Candidate] | None:
        """The next choice in order (None when none is left)."""
        pending, ready = self._pending, self._ready
        while pending and (not ready or pending[-1].order_floor_s < ready[0][0]):
            entry = pending.pop()
            if entry.time_floor_s >= cutoff:
                self._stats.pruned_bound += 1
                continue
            candidate = self.cost(entry)
            if candidate is not None:
                heapq.heappush(ready, (candidate.order_key_s, entry.index, candidate))
        if not ready:
            return None
        _, index, candidate = heapq.heappop(ready)
        return index, candidate

    def extend(self, pending: list[Pending]) -> None:
        """Add choices not costed yet (a shape just expanded)."""
        self._pending = sorted(
            self._pending + pending, key=lambda e: (e.order_floor_s, e.index), reverse=True
        )

    def cost(self, entry: Pending) -> Candidate | None:
        """``entry`` costed (its work charged), or None when its memory bound cannot fit."""
        self._work.charge(COST_S)
        t0 = time.perf_counter()
        candidate = costed_candidate(entry.strategy, entry.modes, self._tables)
        if candidate.memory_lower_bound_bytes > candidate.usable_bytes and self._offload:
            # where memory binds: the same choice with its optimizer step or its blocks'
            # activations on the host, whose floors the choice's bound
            # (`Enumeration.offload_twins`)
            for offloaded in self._offload(entry.strategy, entry.modes):
                twin = costed_candidate(offloaded, entry.modes, self._tables)
                if twin.memory_lower_bound_bytes <= twin.usable_bytes:
                    candidate = twin
                    break
        self._stats.costs_s += time.perf_counter() - t0
        if candidate.memory_lower_bound_bytes > candidate.usable_bytes:
            self._stats.pruned_memory += 1
            self._infeasible.append(entry.strategy)
            return None
        return candidate

    def drain(self) -> tuple[list[Pending], list[tuple[int, Candidate]]]:
        """Every choice not popped yet, uncosted and costed (with its order), and none left."""
        pending, ready = self._pending, [(order, c) for _, order, c in self._ready]
        self._pending, self._ready = [], []
        return pending, ready

    def floors(
        self, least: Callable[[Strategy, tuple[Recompute, ...]], float] | None = None
    ) -> list[float]:
        """Proven lower bounds on the step of every choice not popped yet (on the objective:
        each times ``least(strategy, modes)``, its least objective factor)."""

        def factor(strategy: Strategy, modes: tuple[Recompute, ...]) -> float:
            return 1.0 if least is None else least(strategy, modes)

        return [e.time_floor_s * factor(e.strategy, e.modes) for e in self._pending] + [
            c.time_lower_bound_s * factor(c.strategy, tuple(c.by_mode)) for _, _, c in self._ready
        ]

    def remaining(self) -> int:
        return len(self._pending) + len(self._ready)
