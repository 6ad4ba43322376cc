"""The stage-partition problem and its reference, without a solver: the records
(`PartitionProblem` with its per-mode `ModeCosts`, a `Partition`, the solver's results),
`evaluate` (the simulated step and memory of a partition: what the solver optimises),
`brute_force` (the optimum by enumeration, the oracle of small problems) and the structure of
the units (runs of interchangeable units, which pick the formulation).

Expects cost tables as `autoplan.planner.candidates` builds them from the cost model. Imports no
OR-tools. Guarantees `evaluate` is the one definition of a partition's step and memory that the
formulations, the heuristics and `solve` all check their partitions against, built with the
cost model's own functions (`cost_model.stage_terms`, `cost_model.rank_memory.held_peak`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from autoplan.contract.plan import Recompute
from cost_model.rank_memory import held_peak, stage_held_bytes
from cost_model.schedule_memory import held_microbatches
from cost_model.schedules import ScheduleSpec, StageTimes, simulate
from cost_model.stage_terms import stage_time, tail_of_terms


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeCosts:
    """Per-unit costs under one recompute mode (one entry per unit)."""

    forward_s: tuple[float, ...]  # one micro-batch
    backward_s: tuple[float, ...]  # one micro-batch, recompute included
    weight_s: tuple[float, ...]  # of backward_s, the deferred weight gradient (split schedules)
    activation_bytes: tuple[float, ...]  # held per in-flight micro-batch
    retained_bytes: tuple[float, ...]  # held between a split backward's two halves
    tail_s: tuple[tuple[float, ...], ...] = ()  # per tail term j, each unit's contribution


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionProblem:
    """One stage-partition problem: the cost tables of a fixed outer configuration."""

    spec: ScheduleSpec
    modes: Mapping[Recompute, ModeCosts]
    static_bytes: tuple[float, ...]
    # transfer_s[s][u]: link time of the boundary after stage s when its last unit is u (0 for
    # the last stage and between stages on one rank).
    transfer_s: tuple[tuple[float, ...], ...]
    # message_s[s]: host time of one message over the boundary after stage s (the forward's
    # output, busy on stage s's rank; the gradient back, busy on stage s + 1's rank).
    message_s: tuple[float, ...]
    memory_capacity_bytes: float
    # bytes each pending send holds (`cost_model.estimate.boundary_send_bytes`)
    send_bytes: float = 0.0
    # the rank tail: max(0, max_j (sum over the rank's units of tail_s[j] + constant j))
    tail_constants_s: tuple[float, ...] = ()
    # recomputable[u]: a stage's recompute mode applies to unit u (a block); given (one entry
    # per unit), a stage may recompute only its first few such units, the rest under 'none'
    # (partial recompute, `cost_model.partial_recompute`). Empty: whole stages only.
    recomputable: tuple[bool, ...] = ()
    unit_names: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        n, S = self.num_units, self.num_stages
        assert 1 <= S <= n, (S, n)
        assert len(self.transfer_s) == S and all(len(row) == n for row in self.transfer_s)
        assert len(self.message_s) == S
        assert self.modes, "at least one recompute mode"
        for costs in self.modes.values():
            for table in (
                costs.forward_s,
                costs.backward_s,
                costs.weight_s,
                costs.activation_bytes,
                costs.retained_bytes,
            ):
                assert len(table) == n
            assert len(costs.tail_s) == len(self.tail_constants_s)
            assert all(len(t) == n for t in costs.tail_s)
        assert not self.recomputable or len(self.recomputable) == n

    @property
    def num_units(self) -> int:
        return len(self.static_bytes)

    @property
    def num_stages(self) -> int:
        return self.spec.num_stages

    @property
    def num_tail_terms(self) -> int:
        return len(self.tail_constants_s)

    @property
    def partial(self) -> bool:
        """Whether a stage may recompute only its first few recomputable units: offered where
        the count formulation models it exactly, the middle units (blocks) recomputable and
        interchangeable, the first and last (embedding, head) not, and 'none' a mode."""
        r = self.recomputable
        return (
            bool(r)
            and "none" in self.modes
            and len(self.modes) > 1
            and not r[0]
            and not r[-1]
            and all(r[1:-1])
            and _uniform_middle(self)
        )

    def content_key(self) -> tuple[object, ...]:
        """Equal for problems with the same tables (outer choices that cost the same)."""
        # transfer_s as its distinct rows and each stage's index among them: equal for equal
        # tables, and hashed in the time of the few distinct rows (stages share rows)
        by_id = {id(row): row for row in self.transfer_s}
        by_value: dict[tuple[float, ...], int] = {}
        index = {key: by_value.setdefault(tuple(row), len(by_value)) for key, row in by_id.items()}
        return (
            self.spec,
            tuple(self.modes.items()),
            self.static_bytes,
            tuple(by_value),
            tuple(index[id(row)] for row in self.transfer_s),
            self.message_s,
            self.memory_capacity_bytes,
            self.send_bytes,
            self.tail_constants_s,
            self.recomputable,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """Stage cuts and modes with their simulated step and memory."""

    stage_starts: tuple[int, ...]  # first unit of each stage; stage s ends at the next start
    modes: tuple[Recompute, ...]
    step_time_s: float
    rank_memory_bytes: tuple[float, ...]
    # per stage: how many of its recomputable units its mode covers (None: all); empty: all
    recompute_units: tuple[int | None, ...] = ()

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.rank_memory_bytes)

    def stage_units(self, num_units: int) -> list[range]:
        ends = (*self.stage_starts[1:], num_units)
        return [range(a, b) for a, b in zip(self.stage_starts, ends, strict=True)]


# ------------------------------------------------------------------ reference


Counts = Sequence[int | None]


def _count(counts: Counts, s: int) -> int | None:
    """Stage ``s``'s recompute count (None: all its recomputable units; ``counts`` empty:
    every stage whole)."""
    return counts[s] if counts else None


def _split_point(problem: PartitionProblem, start: int, end: int, count: int | None) -> int:
    """The unit after the ``count``-th recomputable unit of units ``start..end-1``: those
    before it run under the stage's mode, the others under 'none' (a unit the mode does not
    apply to costs the same under both); ``end`` when the mode covers them all."""
    if count is None:
        return end
    seen = 0
    for u in range(start, end):
        seen += problem.recomputable[u]
        if seen == count:
            return u + 1
    return end


def _units(
    problem: PartitionProblem,
    start: int,
    end: int,
    mode: Recompute,
    count: int | None,
    pick: Callable[[ModeCosts], Sequence[float]],
) -> Sequence[float]:
    """Each unit's value of table ``pick`` in units ``start..end-1`` under its own mode (the
    stage's, or 'none' for its recomputable units past the first ``count``, as
    `cost_model.partial_recompute.unit_modes` prices them), in order: summed in the order the
    estimate sums a stage's units."""
    point = _split_point(problem, start, end, count) if mode != "none" else end
    table = pick(problem.modes[mode])
    if point == end:
        return table[start:end]
    rest = pick(problem.modes["none"])
    recomputable = problem.recomputable
    return [
        *table[start:point],
        *(rest[u] if recomputable[u] else table[u] for u in range(point, end)),
    ]


def _tail_table(j: int) -> Callable[[ModeCosts], Sequence[float]]:
    """The table of tail term ``j``."""
    return lambda costs: costs.tail_s[j]


def stage_times(
    problem: PartitionProblem,
    stage_starts: Sequence[int],
    modes: Sequence[Recompute],
    counts: Counts = (),
) -> list[StageTimes]:
    """Each stage's times for the simulation: `cost_model.stage_terms.stage_time` of its
    units' sums (each unit under its own mode), as the estimate makes them."""
    S = problem.num_stages
    ends = (*stage_starts[1:], problem.num_units)
    out = []
    for s, (start, end) in enumerate(zip(stage_starts, ends, strict=True)):
        mode, count = modes[s], _count(counts, s)
        out.append(
            stage_time(
                sum(_units(problem, start, end, mode, count, lambda c: c.forward_s)),
                sum(_units(problem, start, end, mode, count, lambda c: c.backward_s)),
                sum(_units(problem, start, end, mode, count, lambda c: c.weight_s)),
                message_s=problem.message_s[s],
                previous_message_s=problem.message_s[s - 1] if s > 0 else 0.0,
                transfer_s=problem.transfer_s[s][end - 1] if s < S - 1 else 0.0,
                splits_backward=problem.spec.splits_backward,
            )
        )
    return out


def rank_tails(
    problem: PartitionProblem,
    stage_starts: Sequence[int],
    modes: Sequence[Recompute],
    counts: Counts = (),
) -> list[float]:
    """Each pipeline rank's tail: `cost_model.stage_terms.tail_of_terms` of its sums of each
    tail term (``tail_s[j]`` over its units, each under its own mode, plus constant j)."""
    spec = problem.spec
    ends = (*stage_starts[1:], problem.num_units)
    terms = [list(problem.tail_constants_s) for _ in range(spec.pp_degree)]
    for s, (start, end) in enumerate(zip(stage_starts, ends, strict=True)):
        r = spec.stage_rank(s)
        for j in range(problem.num_tail_terms):
            terms[r][j] += sum(
                _units(problem, start, end, modes[s], _count(counts, s), _tail_table(j))
            )
    return [tail_of_terms(t) for t in terms]


def rank_memory(
    problem: PartitionProblem,
    stage_starts: Sequence[int],
    modes: Sequence[Recompute],
    counts: Counts = (),
) -> list[float]:
    """Each rank's static bytes plus its activations at its largest candidate peak point
    (`cost_model.rank_memory.held_peak` of its stages' `stage_held_bytes`, as the estimate
    counts them)."""
    ends = (*stage_starts[1:], problem.num_units)
    static, held_bytes = [], []
    for s, (start, end) in enumerate(zip(stage_starts, ends, strict=True)):
        mode, count = modes[s], _count(counts, s)
        static.append(sum(problem.static_bytes[start:end]))
        held_bytes.append(
            stage_held_bytes(
                s,
                _units(problem, start, end, mode, count, lambda c: c.activation_bytes),
                _units(problem, start, end, mode, count, lambda c: c.retained_bytes),
            )
        )
    out = []
    for held in held_microbatches(problem.spec):
        peak = held_peak([held_bytes[s] for s in held.stages], held, problem.send_bytes)
        out.append(sum(static[s] for s in held.stages) + peak.bytes)
    return out


def evaluate(
    problem: PartitionProblem,
    stage_starts: Sequence[int],
    modes: Sequence[Recompute],
    counts: Counts = (),
) -> Partition:
    """The simulated step and the memory of a partition (``counts``: each stage's recompute
    count, None for all; empty: every stage whole): the reference the solver optimises."""
    sim = simulate(
        problem.spec,
        stage_times(problem, stage_starts, modes, counts),
        rank_tails(problem, stage_starts, modes, counts),
    )
    return Partition(
        stage_starts=tuple(stage_starts),
        modes=tuple(modes),
        step_time_s=sim.step_time_s,
        rank_memory_bytes=tuple(rank_memory(problem, stage_starts, modes, counts)),
        recompute_units=tuple(counts) if any(c is not None for c in counts) else (),
    )


def path_bound(
    problem: PartitionProblem, stage_starts: Sequence[int], modes: Sequence[Recompute]
) -> float:
    """A lower bound on a partition's simulated step from its stage times alone, without the
    schedule's orders: each rank's path (the forwards of stages ``0 .. r-1`` of the first
    micro-batch before its first action, as stage ``r`` is its lowest; all its ``m``
    micro-batches' work; then its own tail, or, without a split backward, the backwards of
    stages ``r-1 .. 0`` and rank 0's tail, as `bounds.whole_unit_bound` argues), and the
    first micro-batch's chain through every stage and back, off the weight halves, then rank
    0's tail (`schedules.pipeline_lower_bound_s`)."""
    spec = problem.spec
    times = stage_times(problem, stage_starts, modes)
    tails = rank_tails(problem, stage_starts, modes)
    work = [0.0] * spec.pp_degree
    for s, t in enumerate(times):
        work[spec.stage_rank(s)] += t.forward_s + t.backward_s
    bound = sum(t.forward_s + t.backward_s - t.weight_s for t in times) + tails[0]
    fill = drain = 0.0
    for r in range(spec.pp_degree):
        end = tails[r] if spec.splits_backward else max(drain + tails[0], tails[r])
        bound = max(bound, fill + spec.num_micro_batches * work[r] + end)
        fill += times[r].forward_s
        drain += times[r].backward_s
    return bound


def brute_force(problem: PartitionProblem) -> Partition | None:
    """The optimum by enumerating every cut set and mode assignment, and under `partial` every
    recompute count of each recomputing stage (small problems only)."""
    best: Partition | None = None
    n, num_stages = problem.num_units, problem.num_stages
    mode_names = tuple(problem.modes)
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        starts = (0, *cuts)
        for modes in itertools.product(mode_names, repeat=num_stages):
            for counts in count_choices(problem, starts, modes):
                candidate = evaluate(problem, starts, modes, counts)
                if candidate.peak_memory_bytes > problem.memory_capacity_bytes:
                    continue
                if best is None or candidate.step_time_s < best.step_time_s:
                    best = candidate
    return best


def count_choices(
    problem: PartitionProblem, stage_starts: Sequence[int], modes: Sequence[Recompute]
) -> Iterator[tuple[int | None, ...]]:
    """Every recompute count per stage: None (all) and, under `partial`, 1 .. k - 1 for a
    recomputing stage of k recomputable units."""
    if not problem.partial:
        yield ()
        return
    ends = (*stage_starts[1:], problem.num_units)
    choices: list[list[int | None]] = []
    for start, end, mode in zip(stage_starts, ends, modes, strict=True):
        k = sum(problem.recomputable[start:end])
        choices.append([None] if mode == "none" else [None, *range(1, k)])
    yield from itertools.product(*choices)


# -------------------------------------------------------------------- results


# OPTIMAL (proven), FEASIBLE (time or round limit: best found, not proven), INFEASIBLE
# (memory), CUTOFF (nothing beats the cutoff), UNKNOWN (time limit, nothing found)
SolveStatus = Literal["OPTIMAL", "FEASIBLE", "INFEASIBLE", "CUTOFF", "UNKNOWN"]
# CP-SAT's own status of one solve
SolverStatus = Literal["OPTIMAL", "FEASIBLE", "INFEASIBLE", "MODEL_INVALID", "UNKNOWN"]
ModelKind = Literal["cut", "count", "runs"]


class Cuts(NamedTuple):
    """A partition before evaluation: where each stage starts, its recompute mode and how many
    of its recomputable units that covers."""

    stage_starts: tuple[int, ...]  # first unit of each stage; stage s ends at the next start
    modes: tuple[Recompute, ...]
    recompute_units: tuple[int | None, ...] = ()  # per stage (None: all); empty: all


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveStats:
    """What one `solve` did."""

    status: SolveStatus
    wall_time_s: float
    num_variables: int
    rounds: int = 0  # CP-SAT solves (one per batch of path cuts)
    num_paths: int = 0  # path cuts in the final model
    lower_bound_s: float = 0.0  # proven lower bound on the step time (inf if infeasible)


class SolveResult(NamedTuple):
    """What `solve` returns: the best partition (None if none fits or beats the cutoff)."""

    partition: Partition | None
    stats: SolveStats


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakMemory:
    """What `min_peak_memory` found: the least per-device peak memory a partition needs, when
    the solver found a partition at all."""

    status: SolverStatus  # OPTIMAL: ``least_bytes`` is proven least; FEASIBLE: the best found
    least_bytes: float | None  # None: bound unknown (the solver found no partition in time)


class ImproveResult(NamedTuple):
    """What `improve` returns: the best partition that fits (its start if none does) and
    every accepted one, the start first."""

    best: Partition
    accepted: list[Partition]


class HeuristicResult(NamedTuple):
    """What `heuristic` returns: the best partition that fits (None if none was found) and
    every partition met on the way."""

    best: Partition | None
    seen: list[Partition]


# ------------------------------------------------------------- unit structure


def _block_counts(stage_starts: Sequence[int], num_units: int) -> list[int]:
    """Blocks per stage of a partition of [first unit, blocks..., last unit]."""
    ends = (*stage_starts[1:], num_units)
    last = len(stage_starts) - 1
    return [
        b - a - (s == 0) - (s == last)
        for s, (a, b) in enumerate(zip(stage_starts, ends, strict=True))
    ]


def _starts_from_counts(counts: Sequence[int]) -> tuple[int, ...]:
    """The stage starts of a partition with ``counts`` blocks per stage (see `_block_counts`)."""
    starts = [0]
    for s, count in enumerate(counts[:-1]):
        starts.append(starts[-1] + count + (s == 0))
    return tuple(starts)


def _unit_rows(problem: PartitionProblem) -> list[Sequence[float]]:
    """Every per-unit table of ``problem`` (each distinct transfer row once: stages share
    rows)."""
    rows: list[Sequence[float]] = [problem.static_bytes]
    rows += {id(row): row for row in problem.transfer_s}.values()
    for costs in problem.modes.values():
        rows += [
            costs.forward_s,
            costs.backward_s,
            costs.weight_s,
            costs.activation_bytes,
            costs.retained_bytes,
            *costs.tail_s,
        ]
    return rows


def _uniform_middle(problem: PartitionProblem) -> bool:
    """Whether units 1..n-2 are interchangeable (same value in every table)."""
    n = problem.num_units
    if n < 3 or problem.num_stages == 1:
        return False
    return all(len(set(row[1 : n - 1])) == 1 for row in _unit_rows(problem))


def unit_runs(problem: PartitionProblem) -> tuple[tuple[int, int], ...]:
    """The units as maximal runs of interchangeable ones (the same value in every table), each
    as (its first unit, its length), in order: a traced Transformer's embedding, blocks and
    head are three; a mixture of experts with a dense first layer four."""
    rows = _unit_rows(problem)
    runs: list[tuple[int, int]] = []
    start = 0
    for u in range(1, problem.num_units + 1):
        if u == problem.num_units or any(row[u] != row[start] for row in rows):
            runs.append((start, u - start))
            start = u
    return tuple(runs)
