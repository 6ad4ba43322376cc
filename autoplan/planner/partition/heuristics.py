"""Partitions without a proof, fast: even splits (`balanced_hint`, `rank_balanced_hint`,
`even_splits`: the search's quick seeds and the solver's first hint) and a local search by
single moves (`improve`), combined by `heuristic` into the solver's first incumbent.

Expects a `PartitionProblem`; every partition returned is `evaluate`d. Guarantees nothing
about optimality: that comes from `solve`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from autoplan.contract.plan import Recompute
from autoplan.planner.partition.problem import (
    Cuts,
    HeuristicResult,
    ImproveResult,
    Partition,
    PartitionProblem,
    _starts_from_counts,
    _uniform_middle,
    evaluate,
)
from autoplan.planner.work import Work

# Simulations the local search may spend on the solver's first incumbent.
_LOCAL_EVALUATIONS = 200


def balanced_hint(problem: PartitionProblem, mode: Recompute | None = None) -> Cuts:
    """Greedy cuts that split the work evenly over the stages under one mode (the solver's
    first hint and the source of its first critical path)."""
    k: Recompute = mode if mode is not None else next(iter(problem.modes))
    costs = problem.modes[k]
    times = [f + b for f, b in zip(costs.forward_s, costs.backward_s, strict=True)]
    n, S = problem.num_units, problem.num_stages
    total = sum(times)
    starts = [0]
    running = 0.0
    for u in range(n):
        if len(starts) < S and running >= total * len(starts) / S and u > starts[-1]:
            starts.append(u)
        running += times[u]
    while len(starts) < S:  # too few cuts: split the tail one unit per stage
        starts.append(max(starts[-1] + 1, n - (S - len(starts))))
    # keep every stage non-empty
    for j in range(S - 1, 0, -1):
        starts[j] = min(starts[j], n - (S - j))
        starts[j - 1] = min(starts[j - 1], starts[j] - 1)
    return Cuts(tuple(starts), tuple(k for _ in range(S)))


def rank_balanced_hint(problem: PartitionProblem, mode: Recompute) -> Cuts | None:
    """Cuts that split identical middle units (blocks) evenly over the stages AND over each
    rank's stages, under one mode; None unless the middle units are identical and there are
    enough of them.

    `balanced_hint` evens the stages only: with several stages per rank its rounding can give
    one rank all the larger stages (96 blocks in 64 stages alternate 2, 1, 2, ...: with 8
    ranks, rank 0 gets every 2). Here every stage gets the same share and each leftover
    block goes to the least-loaded rank (the embedding and head counted, in blocks), on its
    stage with the fewest blocks (earliest first)."""
    if not _uniform_middle(problem):
        return None
    spec = problem.spec
    S, p = spec.num_stages, spec.pp_degree
    blocks = problem.num_units - 2
    costs = problem.modes[mode]
    block = costs.forward_s[1] + costs.backward_s[1]
    if blocks < S - 2 or block <= 0:
        return None
    base, leftover = divmod(blocks, S)
    counts = [base] * S
    load = [spec.virtual_stages * base * 1.0 for _ in range(p)]  # per rank, in blocks
    edges = {0: costs.forward_s[0] + costs.backward_s[0]}
    edges[S - 1] = edges.get(S - 1, 0.0) + costs.forward_s[-1] + costs.backward_s[-1]
    for stage, extra in edges.items():
        load[spec.stage_rank(stage)] += extra / block
    # middle stages that hold no block yet come first (every stage needs a unit)
    empty = [s for s in range(1, S - 1) if counts[s] == 0]
    for stage in empty:
        counts[stage] += 1
        load[spec.stage_rank(stage)] += 1
    leftover -= len(empty)
    for _ in range(leftover):
        rank = min(range(p), key=lambda r: (load[r], r))
        stage = min(spec.rank_stages(rank), key=lambda s: (counts[s] + edges.get(s, 0.0), s))
        counts[stage] += 1
        load[rank] += 1
    return Cuts(_starts_from_counts(counts), tuple(mode for _ in range(S)))


def improve(
    problem: PartitionProblem,
    start: Partition,
    *,
    max_evaluations: int,
    work: Work | None = None,
    stop_at_s: float = math.inf,
) -> ImproveResult:
    """Local search from ``start`` by single moves (one cut by one unit, or one stage's mode):
    while memory does not fit, the move that buys memory back cheapest (step added per byte
    of excess removed); then first-improvement descent of the simulated step among moves that
    fit. Returns the best partition that fits (``start`` if none does) and every accepted one
    (their critical paths feed the solver). A heuristic: it gives the solver a strong
    incumbent early; optimality comes from the solver. Each simulation is charged to ``work``;
    it stops with what it has once ``work`` has spent ``stop_at_s`` (or its budget)."""
    n, S = problem.num_units, problem.num_stages
    names = tuple(problem.modes)
    capacity = problem.memory_capacity_bytes
    budget = max_evaluations  # evaluations left (shared by both phases)

    def neighbours(at: Partition) -> Iterator[Partition]:
        """The partitions one move from ``at``, evaluated, while the budget lasts."""
        nonlocal budget
        starts, modes = at.stage_starts, at.modes
        moves = [
            (starts, (*modes[:j], name, *modes[j + 1 :]))
            for j in range(S)
            for name in names
            if name != modes[j]
        ]
        for j in range(1, S):
            upper = starts[j + 1] if j + 1 < S else n
            for moved in (starts[j] - 1, starts[j] + 1):
                if starts[j - 1] < moved < upper:
                    moves.append(((*starts[:j], moved, *starts[j + 1 :]), modes))
        for move in moves:
            if budget <= 0 or (work is not None and work.exhausted(stop_at_s)):
                budget = 0
                return
            budget -= 1
            if work is not None:
                work.simulation(problem.spec)
            yield evaluate(problem, *move)

    current = start
    accepted = [start]
    while current.peak_memory_bytes > capacity and budget > 0:  # repair
        excess = current.peak_memory_bytes - capacity
        choice: tuple[float, Partition] | None = None
        for found in neighbours(current):
            saved = excess - max(0.0, found.peak_memory_bytes - capacity)
            if saved > 0:
                price = (found.step_time_s - current.step_time_s) / saved
                if choice is None or price < choice[0]:
                    choice = (price, found)
        if choice is None:
            break
        current = choice[1]
        accepted.append(current)
    if current.peak_memory_bytes > capacity:
        return ImproveResult(start, accepted)
    improved = True
    while improved and budget > 0:  # descent
        improved = False
        for found in neighbours(current):
            faster = found.step_time_s < current.step_time_s * (1.0 - 1e-9)
            if faster and found.peak_memory_bytes <= capacity:
                current = found
                accepted.append(found)
                improved = True
                break
    return ImproveResult(current, accepted)


def fastest_fitting(problem: PartitionProblem, found: Sequence[Partition]) -> Partition | None:
    """The fastest of ``found`` that fits in memory, or None."""
    fitting = [f for f in found if f.peak_memory_bytes <= problem.memory_capacity_bytes]
    return min(fitting, key=lambda f: f.step_time_s, default=None)


def even_splits(problem: PartitionProblem, work: Work | None = None) -> list[Partition]:
    """`balanced_hint` and `rank_balanced_hint` under each mode, evaluated (one recompute mode
    throughout; they may not fit): the search's quick seeds, a few simulations each (charged
    to ``work``)."""
    found = []
    for mode in problem.modes:
        found.append(evaluate(problem, *balanced_hint(problem, mode)))
        ranked = rank_balanced_hint(problem, mode)
        if ranked is not None and ranked.stage_starts != found[-1].stage_starts:
            found.append(evaluate(problem, *ranked))
    if work is not None:
        work.simulation(problem.spec, len(found))
    return found


def heuristic(
    problem: PartitionProblem,
    *,
    work: Work | None = None,
    stop_at_s: float = math.inf,
    splits: Sequence[Partition] | None = None,
) -> HeuristicResult:
    """A good partition fast, without a proof: the even splits under each mode (``splits``
    if they were evaluated already), then `improve` from the fastest one (repairing its
    memory) and from the best one that fits. Returns the best that fits (None if none was
    found) and every partition met on the way. Simulations are charged to ``work``; the local
    search stops once it has spent ``stop_at_s``."""
    seeds = list(even_splits(problem, work) if splits is None else splits)
    best = fastest_fitting(problem, seeds)
    fastest = min(seeds, key=lambda seed: seed.step_time_s)
    if best is None or fastest.step_time_s < best.step_time_s:
        local, accepted = improve(
            problem, fastest, max_evaluations=_LOCAL_EVALUATIONS, work=work, stop_at_s=stop_at_s
        )
        seeds.extend(accepted[1:])
        if local.peak_memory_bytes <= problem.memory_capacity_bytes and (
            best is None or local.step_time_s < best.step_time_s
        ):
            best = local
    if best is not None:
        best, accepted = improve(
            problem, best, max_evaluations=_LOCAL_EVALUATIONS, work=work, stop_at_s=stop_at_s
        )
        seeds.extend(accepted[1:])
    return HeuristicResult(best, seeds)
