"""The search's incumbents: the ``top_k`` best partitions found so far, on the objective.

Expects candidates (`candidates.Candidate`) and their partitions as the search finds them.
Guarantees: `Incumbents.cutoff` is the objective a candidate must beat to enter the top
``top_k`` (widened by `TIE_FRACTION`, so plans that would tie are still visited; inf until
``top_k`` plans are held); every candidate keeps its best partition (``offered``), for the
ranking and the ties. The objective is the step time times a factor of the plan's features
(1: "expected"; the upper end of its 80% range: "pessimistic"), at least 1, so a bound on the
step times the least factor bounds the objective.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable

from autoplan.contract.plan import Recompute
from autoplan.planner.candidates import Candidate
from autoplan.planner.partition import Partition
from cost_model.strategy import Strategy
from cost_model.uncertainty import TIE_FRACTION, objective_factor, strategy_features


class Incumbents:
    """The best partitions found so far (see the module docstring)."""

    def __init__(self, top_k: int, framework: str, objective: str) -> None:
        self.top_k = top_k
        self._framework, self._objective = framework, objective
        # max-heap on the objective: the top_k
        self._best: list[tuple[float, int, Candidate, Partition]] = []
        # by visiting order: every candidate's best partition (objective, candidate, partition)
        self.offered: dict[int, tuple[float, Candidate, Partition]] = {}
        # by the whole strategy (every field: the features read most of them) and the modes
        self._factors: dict[tuple[Strategy, frozenset[Recompute]], float] = {}

    def __bool__(self) -> bool:
        return bool(self._best)

    @property
    def full(self) -> bool:
        """Whether ``top_k`` plans are held (the cutoff is finite)."""
        return len(self._best) == self.top_k

    def factor(self, strategy: Strategy, modes: Iterable[Recompute]) -> float:
        """The objective's factor of a plan of ``strategy`` using ``modes``."""
        key = (strategy, frozenset(modes))
        if key not in self._factors:
            features = strategy_features(strategy, key[1], self._framework)
            self._factors[key] = objective_factor(features, self._objective)
        return self._factors[key]

    def least_of(self, strategy: Strategy, modes: tuple[Recompute, ...]) -> float:
        """The least factor of any mix of ``modes`` a partition of ``strategy`` uses."""
        return min(
            self.factor(strategy, mix)
            for size in range(1, len(modes) + 1)
            for mix in itertools.combinations(modes, size)
        )

    def least_factor(self, candidate: Candidate) -> float:
        return self.least_of(candidate.strategy, tuple(candidate.by_mode))

    def least_bound(self, candidate: Candidate) -> float:
        """A proven lower bound on the objective of any partition of ``candidate``: its step
        bound times its least factor."""
        return candidate.time_lower_bound_s * self.least_factor(candidate)

    def cutoff(self) -> float:
        """The objective a candidate must beat, widened by the tie band: a plan within it of
        the best is still visited, for the ties."""
        return -self._best[0][0] * (1.0 + TIE_FRACTION) if self.full else math.inf

    def worst(self) -> float:
        """The objective of the k-th best plan held (some must be held)."""
        return -self._best[0][0]

    def best(self) -> float | None:
        """The least objective held (None: none yet)."""
        return min((-entry[0] for entry in self._best), default=None)

    def offer(self, order: int, candidate: Candidate, found: Partition) -> None:
        """Count ``found``, a partition of the candidate visited ``order``-th."""
        value = found.step_time_s * self.factor(candidate.strategy, found.modes)
        offered, best = self.offered, self._best
        if order in offered and offered[order][0] <= value:
            return  # the same outer choice: keep its better partition
        offered[order] = (value, candidate, found)
        for index, entry in enumerate(best):
            if entry[1] == order:
                best[index] = (-value, order, candidate, found)
                heapq.heapify(best)
                return
        if len(best) < self.top_k:
            heapq.heappush(best, (-value, order, candidate, found))
        elif value < -best[0][0]:
            heapq.heapreplace(best, (-value, order, candidate, found))
