"""Optimal pipeline-stage cuts and per-stage recompute for the schedule that really runs.

Given fixed outer choices (degrees, micro-batching, schedule, ZeRO level), the cost model gives
every pipeline unit, per recompute mode, its per-micro-batch forward, backward and
weight-gradient time, activation bytes and tail coefficients, plus static bytes and the link
time of a cut after it. This module chooses where to cut the units into the schedule's stages
and which recompute mode each stage uses, minimising the step time of the schedule simulation
(`cost_model.schedules.simulate` on torch's own action orders) subject to every rank's memory
at each of its candidate peak points (`cost_model.schedules.held_microbatches`).

Method: simulation verified by a proven bound, made exact by lazy path cuts. The simulated
step is the longest path through the schedule's action graph; the graph depends only on the
schedule and its degrees, the durations on the cuts. Every path's length is a linear function
of the stages' times (how many forwards, backwards, weight gradients and link crossings of each
stage it passes, plus one rank's tail), so every path is a lower bound on the step of every
partition. The CP-SAT model minimises ``z`` subject to ``z >= path_k`` for a set of paths (at
first each rank's full order with its fill and drain, and the critical path of a balanced
split); the solution is simulated; if its simulated step exceeds its ``z``, its critical path
joins the set and the model is solved again, else it is optimal: no partition's simulated step
is below its own ``z``, which is at least the optimum of the model. Each round also demands a
strictly better step than the best partition simulated so far, so a round without a solution
proves that partition optimal. Exact up to the integer scaling (see ``_RESOLUTION``).

Formulations, one builder each (data, model, variables, constraints, objective, as in the
OR-tools samples; each returns a record of its model, variables and read-back): `_cut_model`,
element constraints on prefix sums at each cut (any units); `_count_model`, block counts per
stage when the middle units are identical (embedding, blocks, head), which keeps the model
small for 100-layer models; `_peak_model`, either of them with the least peak memory as the
objective (`min_peak_memory`, for the no-feasible-plan error).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from autoplan.contract.plan import Recompute
from cost_model.schedules import (
    CriticalPath,
    ScheduleSpec,
    StageTimes,
    critical_path,
    held_microbatches,
    rank_paths,
    simulate,
)

logger = logging.getLogger(__name__)

# OR-tools' CP-SAT (with pandas, which it imports) takes about 0.4 s to import: the functions
# that solve import it, so a training process that is handed its plan never loads it.
if TYPE_CHECKING:
    from ortools.sat.python import cp_model

# Integer resolution of the CP-SAT model: times and bytes are scaled so that the total over all
# units is this many integer units. A path sums rounded unit times, each off by at most half a
# unit, so its relative rounding error is at most (units on it) / (2 * resolution). Finer
# scales make CP-SAT much slower (larger coefficients weaken its propagation).
_RESOLUTION = 10**6
# Memory rounding (`_fine_byte_unit`): a byte unit whose rounding could move a rank's memory
# by more than this share of its capacity is refined until it can move it by at most the second.
_COARSE_MEMORY = 0.25
_FINE_MEMORY = 1e-3
# The cut formulation's element tables hold every unit for every stage: above this many
# (stages x units), the runs formulation models the same problem in the size of its runs.
# (Every model of a few hundred units in up to a hundred stages stays with the cut one.)
_CUT_MODEL_ENTRIES = 2**16
# Rounds of the lazy path loop before it returns its best simulated partition with a gap.
_MAX_ROUNDS = 60
# Simulations the local search may spend on the solver's first incumbent.
_LOCAL_EVALUATIONS = 200

# A CP-SAT linear expression. OR-tools' stubs type these as unions with numpy integers that
# mypy cannot add or subtract, so expressions are untyped here.
Expr = Any


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

    @property
    def num_units(self) -> int:
        return len(self.static_bytes)

    @property
    def num_stages(self) -> int:
        return self.spec.num_stages

    @property
    def num_tail_terms(self) -> int:
        return len(self.tail_constants_s)

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
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """Stage cuts and modes with their simulated step and memory."""

    stage_starts: tuple[int, ...]  # first unit of each stage; stage s ends at the next start
    modes: tuple[Recompute, ...]
    step_time_s: float
    rank_memory_bytes: tuple[float, ...]

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.rank_memory_bytes)

    def stage_units(self, num_units: int) -> list[range]:
        ends = (*self.stage_starts[1:], num_units)
        return [range(a, b) for a, b in zip(self.stage_starts, ends, strict=True)]


# ------------------------------------------------------------------------------ reference


def stage_times(
    problem: PartitionProblem, stage_starts: Sequence[int], modes: Sequence[Recompute]
) -> list[StageTimes]:
    """Each stage's times for the simulation, as `cost_model.estimate.stage_times` makes them."""
    n, S = problem.num_units, problem.num_stages
    ends = (*stage_starts[1:], n)
    split = problem.spec.splits_backward
    out = []
    for s, (start, end) in enumerate(zip(stage_starts, ends, strict=True)):
        costs = problem.modes[modes[s]]
        units = range(start, end)
        previous = problem.message_s[s - 1] if s > 0 else 0.0
        out.append(
            StageTimes(
                forward_s=sum(costs.forward_s[u] for u in units) + problem.message_s[s],
                backward_s=sum(costs.backward_s[u] for u in units) + previous,
                weight_s=sum(costs.weight_s[u] for u in units) if split else 0.0,
                transfer_s=problem.transfer_s[s][end - 1] if s < S - 1 else 0.0,
            )
        )
    return out


def rank_tails(
    problem: PartitionProblem, stage_starts: Sequence[int], modes: Sequence[Recompute]
) -> list[float]:
    """Each pipeline rank's tail: ``max(0, max_j sum of its units' tail_s[j] + constant j)``."""
    spec = problem.spec
    ends = (*stage_starts[1:], problem.num_units)
    terms = [list(problem.tail_constants_s) for _ in range(spec.pp_degree)]
    for s, (start, end) in enumerate(zip(stage_starts, ends, strict=True)):
        r = spec.stage_rank(s)
        for j, table in enumerate(problem.modes[modes[s]].tail_s):
            terms[r][j] += sum(table[start:end])
    return [max([0.0, *t]) for t in terms]


def rank_memory(
    problem: PartitionProblem, stage_starts: Sequence[int], modes: Sequence[Recompute]
) -> list[float]:
    """Each rank's static bytes plus its activations at its largest candidate peak point."""
    ends = (*stage_starts[1:], problem.num_units)
    static, act, kept = [], [], []
    for s, (start, end) in enumerate(zip(stage_starts, ends, strict=True)):
        costs = problem.modes[modes[s]]
        static.append(sum(problem.static_bytes[start:end]))
        act.append(sum(costs.activation_bytes[start:end]))
        # the first stage has no input gradient: torch runs its whole backward at W
        kept.append(act[-1] if s == 0 else sum(costs.retained_bytes[start:end]))
    out = []
    for held in held_microbatches(problem.spec):
        peak = max(
            sends * problem.send_bytes
            + sum(h * act[s] + k * kept[s] for (h, k), s in zip(point, held.stages, strict=True))
            for point, sends in zip(held.points, held.sends, strict=True)
        )
        out.append(sum(static[s] for s in held.stages) + peak)
    return out


def evaluate(
    problem: PartitionProblem, stage_starts: Sequence[int], modes: Sequence[Recompute]
) -> Partition:
    """The simulated step and the memory of a partition: the reference the solver optimises."""
    sim = simulate(
        problem.spec,
        stage_times(problem, stage_starts, modes),
        rank_tails(problem, stage_starts, modes),
    )
    return Partition(
        stage_starts=tuple(stage_starts),
        modes=tuple(modes),
        step_time_s=sim.step_time_s,
        rank_memory_bytes=tuple(rank_memory(problem, stage_starts, modes)),
    )


def brute_force(problem: PartitionProblem) -> Partition | None:
    """The optimum by enumerating every cut set and mode assignment (small problems only)."""
    best: Partition | None = None
    n, num_stages = problem.num_units, problem.num_stages
    mode_names = tuple(problem.modes)
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        starts = (0, *cuts)
        for modes in itertools.product(mode_names, repeat=num_stages):
            candidate = evaluate(problem, starts, modes)
            if candidate.peak_memory_bytes > problem.memory_capacity_bytes:
                continue
            if best is None or candidate.step_time_s < best.step_time_s:
                best = candidate
    return best


# ------------------------------------------------------------------------------ results


# OPTIMAL (proven), FEASIBLE (time or round limit: best found, not proven), INFEASIBLE
# (memory), CUTOFF (nothing beats the cutoff), UNKNOWN (time limit, nothing found)
SolveStatus = Literal["OPTIMAL", "FEASIBLE", "INFEASIBLE", "CUTOFF", "UNKNOWN"]
# CP-SAT's own status of one solve
SolverStatus = Literal["OPTIMAL", "FEASIBLE", "INFEASIBLE", "MODEL_INVALID", "UNKNOWN"]
ModelKind = Literal["cut", "count", "runs"]


class Cuts(NamedTuple):
    """A partition before evaluation: where each stage starts and its recompute mode."""

    stage_starts: tuple[int, ...]  # first unit of each stage; stage s ends at the next start
    modes: tuple[Recompute, ...]


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


# ------------------------------------------------------------------------------ model data


@dataclass(frozen=True, kw_only=True, slots=True)
class _Scaled:
    """A problem's tables as the model's integers: times in units of ``time_unit_s``, bytes in
    units of ``byte_unit`` (per-mode tables are indexed [mode][unit])."""

    mode_names: tuple[Recompute, ...]
    time_unit_s: float
    byte_unit: float
    time_bound: int  # above any rank's tail
    path_bound: int  # above any path's length
    forward: Mapping[Recompute, tuple[int, ...]]
    backward: Mapping[Recompute, tuple[int, ...]]
    weight: Mapping[Recompute, tuple[int, ...]]  # zeros unless the schedule splits backwards
    act: Mapping[Recompute, tuple[int, ...]]
    kept: Mapping[Recompute, tuple[int, ...]]
    static: tuple[int, ...]
    send: int
    tail: tuple[Mapping[Recompute, tuple[int, ...]], ...]  # [term j][mode][unit]
    tail_constants: tuple[int, ...]
    transfer: tuple[tuple[int, ...], ...]  # [stage][its last unit]
    message: tuple[int, ...]
    memory_capacity: int


def _ints(values: Sequence[float], unit: float) -> tuple[int, ...]:
    return tuple(round(value / unit) for value in values)


def _shared_ints(rows: Sequence[Sequence[float]], unit: float) -> tuple[tuple[int, ...], ...]:
    """`_ints` of each row, rows that are one object scaled once and shared again."""
    scaled: dict[int, tuple[int, ...]] = {}
    out = []
    for row in rows:
        found = scaled.get(id(row))
        if found is None:
            found = scaled[id(row)] = _ints(row, unit)
        out.append(found)
    return tuple(out)


def _scale(problem: PartitionProblem) -> _Scaled:
    """The problem's tables rounded to integers so that the worst total over all units is
    `_RESOLUTION` units (times and bytes separately)."""
    n, spec = problem.num_units, problem.spec
    modes = problem.modes
    worst = sum(max(c.forward_s[u] + c.backward_s[u] for c in modes.values()) for u in range(n))
    distinct = {id(row): row for row in problem.transfer_s}  # (stages share rows)
    largest = {key: max(row) for key, row in distinct.items()}
    worst += sum(largest[id(row)] for row in problem.transfer_s) + 2 * sum(problem.message_s)
    worst_tail = sum(
        sum(max(abs(c.tail_s[j][u]) for c in modes.values()) for u in range(n))
        + abs(problem.tail_constants_s[j])
        for j in range(problem.num_tail_terms)
    )
    t = max(worst, worst_tail, 1e-30) / _RESOLUTION
    b = max(_worst_bytes(problem), problem.memory_capacity_bytes, 1.0) / _RESOLUTION
    b, margin = _fine_byte_unit(problem, b)
    time_bound = 4 * _RESOLUTION
    split = spec.splits_backward
    return _Scaled(
        mode_names=tuple(modes),
        time_unit_s=t,
        byte_unit=b,
        time_bound=time_bound,
        # a path runs at most every action and crossing once: m (2 or 3) actions per stage
        path_bound=(3 * spec.num_micro_batches + 2) * time_bound,
        forward={k: _ints(c.forward_s, t) for k, c in modes.items()},
        backward={k: _ints(c.backward_s, t) for k, c in modes.items()},
        weight={k: _ints(c.weight_s if split else (0.0,) * n, t) for k, c in modes.items()},
        act={k: _ints(c.activation_bytes, b) for k, c in modes.items()},
        kept={k: _ints(c.retained_bytes, b) for k, c in modes.items()},
        static=_ints(problem.static_bytes, b),
        send=round(problem.send_bytes / b),
        tail=tuple(
            {k: _ints(c.tail_s[j], t) for k, c in modes.items()}
            for j in range(problem.num_tail_terms)
        ),
        tail_constants=_ints(problem.tail_constants_s, t),
        transfer=_shared_ints(problem.transfer_s, t),
        message=_ints(problem.message_s, t),
        memory_capacity=math.floor((problem.memory_capacity_bytes - margin) / b),
    )


def _fine_byte_unit(problem: PartitionProblem, byte_unit: float) -> tuple[float, float]:
    """(``byte_unit``, 0), or a finer unit and a margin to keep off the capacity, where
    ``byte_unit``'s rounding could move a rank's memory by more than `_COARSE_MEMORY` of the
    capacity: each unit's static, activation and retained bytes round by up to half a unit,
    counted as often as a rank's point holds them, and a rank may hold every unit. Thousands
    of units (4,096 layers) spread `_RESOLUTION` so thin that a block's activations rounded to
    nothing and the solver's cuts overflowed memory by 60%; the finer unit's rounding moves a
    rank by at most `_FINE_MEMORY` of the capacity, and the model keeps that much free, so
    every partition it allows fits. (Models of a few hundred units stay under the threshold:
    their models are as they were.)"""
    held = held_microbatches(problem.spec)
    most = max((h + k for pr in held for pt in pr.points for h, k in pt), default=1)
    sends = max((n for pr in held for n in pr.sends), default=0)
    halves = 0.5 * (problem.num_units * (1 + most) + sends)  # rounding error, in units
    capacity = max(problem.memory_capacity_bytes, 1.0)
    if halves * byte_unit <= _COARSE_MEMORY * capacity:
        return byte_unit, 0.0
    return _FINE_MEMORY * capacity / halves, _FINE_MEMORY * capacity


def _worst_bytes(problem: PartitionProblem) -> float:
    """An upper bound on any rank's memory under any partition: every unit's static bytes
    and the most micro-batches any stage holds times every unit's activations, plus the most
    pending sends."""
    held = held_microbatches(problem.spec)
    most = max((h + k for pr in held for pt in pr.points for h, k in pt), default=1)
    sends = max((n for pr in held for n in pr.sends), default=0)
    return (
        sum(problem.static_bytes)
        + sends * problem.send_bytes
        + most
        * sum(
            max(max(c.activation_bytes[u], c.retained_bytes[u]) for c in problem.modes.values())
            for u in range(problem.num_units)
        )
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _StageSums:
    """Each stage's sums under its chosen mode, as model expressions in scaled integers, indexed
    [stage] (``tail`` [term j][stage])."""

    forward: list[Expr]  # one micro-batch's forward
    backward: list[Expr]  # its backward, recompute included
    weight: list[Expr]  # of backward, the deferred weight gradient (0 unless split)
    transfer: list[Expr]  # link time of the boundary after the stage (0 after the last)
    act: list[Expr]  # bytes held per in-flight micro-batch
    kept: list[Expr]  # bytes held between a split backward's halves
    static: list[Expr]  # weights, gradients, optimizer state
    tail: list[list[Expr]]  # [term j][stage]: the stage's share of the rank's tail term j


# ------------------------------------------------------------------------------ shared pieces


def _new_mode_vars(
    model: cp_model.CpModel, num_stages: int, mode_names: Sequence[Recompute]
) -> list[list[Expr]]:
    """use[s][k] for every stage: a new Boolean per mode, exactly one of them true per stage,
    or the constant 1 with one mode."""
    if len(mode_names) == 1:
        return [[1] for _ in range(num_stages)]
    use: list[list[Expr]] = []
    for s in range(num_stages):
        row = [model.new_bool_var(f"use[{s},{k}]") for k in mode_names]
        model.add_exactly_one(row)
        use.append(list(row))
    return use


def _add_rank_tails(
    model: cp_model.CpModel,
    spec: ScheduleSpec,
    scaled: _Scaled,
    stage: _StageSums,
    tail: Sequence[Expr],
) -> None:
    """tail[r] >= each tail term summed over rank r's stages plus its constant (the simulated
    tail is the max of 0 and these terms, see `rank_tails`)."""
    for r in range(spec.pp_degree):
        stages = spec.rank_stages(r)
        for j, constant in enumerate(scaled.tail_constants):
            model.add(tail[r] >= sum(stage.tail[j][s] for s in stages) + constant)


def _add_memory(
    model: cp_model.CpModel, spec: ScheduleSpec, scaled: _Scaled, stage: _StageSums
) -> list[list[Expr]]:
    """Every candidate peak point of every rank fits in memory (as `rank_memory` counts it);
    returns each rank's bytes at each of its points, [rank][point]."""
    memory: list[list[Expr]] = []
    for held in held_microbatches(spec):
        static = sum(stage.static[s] for s in held.stages)
        points = []
        for point, sends in zip(held.points, held.sends, strict=True):
            # (one expression: OR-tools' += may extend the shared `static` in place)
            expr = (
                static
                + sends * scaled.send
                + sum(
                    h * stage.act[s] + k * stage.kept[s]
                    for (h, k), s in zip(point, held.stages, strict=True)
                )
            )
            model.add(expr <= scaled.memory_capacity)
            points.append(expr)
        memory.append(points)
    return memory


def _hint_modes(
    model: cp_model.CpModel,
    use: Sequence[Sequence[Expr]],
    mode_names: Sequence[Recompute],
    modes: Sequence[Recompute],
) -> None:
    """Hint each stage's mode (nothing to hint with one mode)."""
    if len(mode_names) == 1:
        return
    for s, mode in enumerate(modes):
        for k_idx, k in enumerate(mode_names):
            model.add_hint(use[s][k_idx], k == mode)


def _read_modes(
    solver: cp_model.CpSolver, use: Sequence[Sequence[Expr]], mode_names: Sequence[Recompute]
) -> tuple[Recompute, ...]:
    """Each stage's mode in the solver's solution."""
    if len(mode_names) == 1:
        return tuple(mode_names[0] for _ in use)
    return tuple(
        next(k for k_idx, k in enumerate(mode_names) if solver.value(row[k_idx])) for row in use
    )


# ------------------------------------------------------------------------------ formulations


class _StepObjective(NamedTuple):
    tail: list[Expr]  # [rank]
    memory: list[list[Expr]]  # [rank][candidate peak point]
    z: cp_model.IntVar
    ceiling: cp_model.IntVar


def _step_objective(
    model: cp_model.CpModel, spec: ScheduleSpec, scaled: _Scaled, stage: _StageSums
) -> _StepObjective:
    """What both step formulations share once their stage sums exist: each rank's tail, the
    memory of every candidate peak point, and the objective ``z`` under its ``ceiling``."""
    # tail[r]: rank r's work after its last action, max(0, max_j (terms + constant j))
    tail: list[Expr] = [
        model.new_int_var(0, scaled.time_bound, f"tail[{r}]") for r in range(spec.pp_degree)
    ]

    # Constraints.
    # each rank's tail covers each of its tail terms (the simulation's rank tail)
    _add_rank_tails(model, spec, scaled, stage, tail)
    # every candidate peak point of every rank fits in memory
    memory = _add_memory(model, spec, scaled, stage)

    # Objective.
    # z: the step's lower bound to minimise, at least the length of every path cut `solve`
    # adds (each path is a lower bound on every partition's simulated step)
    z = model.new_int_var(0, scaled.path_bound, "z")
    # ceiling: z may not exceed it; each round of `solve` fixes it to one value, to demand a
    # step better than its best so far
    ceiling = model.new_int_var(0, scaled.path_bound, "ceiling")
    model.add(z <= ceiling)
    model.minimize(z)
    return _StepObjective(tail, memory, z, ceiling)


@dataclass(frozen=True, kw_only=True, slots=True)
class _CutModel:
    """The cut formulation's model, variables and read-back (see `_cut_model`)."""

    model: cp_model.CpModel
    scaled: _Scaled
    use: list[list[Expr]]  # [stage][mode]: the stage runs the mode
    cut: list[Expr]  # [j]: the first unit of stage j (and n at j = S)
    stage: _StageSums
    tail: list[Expr]  # [rank]
    memory: list[list[Expr]]  # [rank][candidate peak point]: the rank's bytes there
    z: cp_model.IntVar
    ceiling: cp_model.IntVar

    def hint(self, cuts: Cuts) -> None:
        """Replace the model's hint by ``cuts``."""
        self.model.clear_hints()  # type: ignore[no-untyped-call]
        for j in range(1, len(self.cut) - 1):
            self.model.add_hint(self.cut[j], cuts.stage_starts[j])
        _hint_modes(self.model, self.use, self.scaled.mode_names, cuts.modes)

    def read(self, solver: cp_model.CpSolver) -> Cuts:
        """The partition of the solver's solution."""
        starts = tuple(c if isinstance(c, int) else solver.value(c) for c in self.cut[:-1])
        return Cuts(starts, _read_modes(solver, self.use, self.scaled.mode_names))


def _cut_model(problem: PartitionProblem) -> _CutModel:
    """The cut formulation, for any units: one integer variable per cut, each stage's sums read
    off prefix-sum tables by element constraints. Expects 1 <= stages <= units. Guarantees:
    every partition that fits in memory is a solution (up to rounding), ``z`` is minimised and
    bounded below by no path yet (`solve` adds them)."""
    # Data.
    n, S = problem.num_units, problem.num_stages
    scaled = _scale(problem)
    names = scaled.mode_names

    # Model.
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()

    # Variables, each family with the constraints that define it. (This order is the model's
    # order of variables and of constraints, which steers CP-SAT among equal optima: keep it.)
    # use[s][k]: stage s runs recompute mode k, exactly one per stage (1 with one mode)
    use = _new_mode_vars(model, S, names)
    # cut[j]: the first unit of stage j (cut[0] = 0 and cut[S] = n are constants); each stage
    # needs at least one unit, so cut j lies in [j, n - (S - j)], and the cuts are in order
    cut: list[Expr] = [0]
    cut += [model.new_int_var(j, n - (S - j), f"cut[{j}]") for j in range(1, S)]
    cut.append(n)
    for j in range(1, S - 1):
        model.add(cut[j] + 1 <= cut[j + 1])
    # stage.<quantity>[s]: stage s's sum of a unit quantity under its mode, the difference of
    # the quantity's prefix sums at the stage's two cuts (element constraints, `_element`)
    stage = _cut_stage_sums(model, scaled, use, cut)
    tail, memory, z, ceiling = _step_objective(model, problem.spec, scaled, stage)
    return _CutModel(
        model=model,
        scaled=scaled,
        use=use,
        cut=cut,
        stage=stage,
        tail=tail,
        memory=memory,
        z=z,
        ceiling=ceiling,
    )


def _prefix(values: Sequence[int]) -> list[int]:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return out


def _element(model: cp_model.CpModel, table: Sequence[int], index: Expr) -> Expr:
    """table[index] as a model expression (a constant when ``index`` or ``table`` is)."""
    if isinstance(index, int):
        return table[index]
    if min(table) == max(table):
        return table[0]
    value = model.new_int_var(min(table), max(table), "")
    model.add_element(index, list(table), value)
    return value


def _cut_stage_sums(
    model: cp_model.CpModel, scaled: _Scaled, use: Sequence[Sequence[Expr]], cut: Sequence[Expr]
) -> _StageSums:
    """Each stage's sums between its cuts, under its chosen mode (see `_cut_model`)."""
    S = len(cut) - 1
    names = scaled.mode_names

    def stage_value(prefix: Mapping[Recompute, Sequence[int]], s: int, name: str) -> Expr:
        """Stage s's sum of a per-unit quantity under the stage's chosen mode."""
        per_mode = [
            _element(model, prefix[k], cut[s + 1]) - _element(model, prefix[k], cut[s])
            for k in names
        ]
        if len(per_mode) == 1:
            return per_mode[0]
        low = min(min(t) for t in prefix.values())
        high = max(max(t) for t in prefix.values())
        value = model.new_int_var(low - high, high - low, name)
        for k_idx, expr in enumerate(per_mode):
            model.add(value == expr).only_enforce_if(use[s][k_idx])
        return value

    def per_mode(tables: Mapping[Recompute, Sequence[int]], name: str) -> list[Expr]:
        prefix = {k: _prefix(v) for k, v in tables.items()}
        return [stage_value(prefix, s, f"{name}[{s}]") for s in range(S)]

    static_prefix = _prefix(scaled.static)
    # transfer_table[s][c]: link time of stage s ending just before unit c (at unit c - 1)
    distinct = {id(row): row for row in scaled.transfer}  # (stages share rows)
    shared = {key: [0, *row] for key, row in distinct.items()}
    transfer_table = [shared[id(row)] for row in scaled.transfer]
    # (the order below fixes the order of the model's variables)
    act = per_mode(scaled.act, "act")
    forward = per_mode(scaled.forward, "fwd")
    backward = per_mode(scaled.backward, "bwd")
    weight = per_mode(scaled.weight, "wgt")
    transfer = [
        _element(model, transfer_table[s], cut[s + 1]) if s < S - 1 else 0 for s in range(S)
    ]
    kept = [act[0], *per_mode(scaled.kept, "kept")[1:]]  # (see `rank_memory`)
    static = [
        _element(model, static_prefix, cut[s + 1]) - _element(model, static_prefix, cut[s])
        for s in range(S)
    ]
    tail = [per_mode(table, f"tail{j}") for j, table in enumerate(scaled.tail)]
    return _StageSums(
        forward=forward,
        backward=backward,
        weight=weight,
        transfer=transfer,
        act=act,
        kept=kept,
        static=static,
        tail=tail,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _CountModel:
    """The count formulation's model, variables and read-back (see `_count_model`)."""

    model: cp_model.CpModel
    scaled: _Scaled
    use: list[list[Expr]]  # [stage][mode]: the stage runs the mode
    count: list[Expr]  # [stage]: its blocks
    split: list[list[Expr]]  # [stage][mode]: its blocks under the mode
    stage: _StageSums
    tail: list[Expr]  # [rank]
    memory: list[list[Expr]]  # [rank][candidate peak point]: the rank's bytes there
    z: cp_model.IntVar
    ceiling: cp_model.IntVar

    def hint(self, cuts: Cuts) -> None:
        """Replace the model's hint by ``cuts``."""
        self.model.clear_hints()  # type: ignore[no-untyped-call]
        num_units = len(self.scaled.static)
        for s, count in enumerate(_block_counts(cuts.stage_starts, num_units)):
            self.model.add_hint(self.count[s], count)
        _hint_modes(self.model, self.use, self.scaled.mode_names, cuts.modes)

    def read(self, solver: cp_model.CpSolver) -> Cuts:
        """The partition of the solver's solution."""
        starts = _starts_from_counts([solver.value(c) for c in self.count])
        return Cuts(starts, _read_modes(solver, self.use, self.scaled.mode_names))


def _count_model(problem: PartitionProblem) -> _CountModel:
    """The count formulation, for a first unit, a run of identical units and a last unit
    (embedding, blocks, head): a partition is the number of blocks per stage, so the model is
    linear in small integers and its size does not grow with the number of units. Expects
    `_uniform_middle` (else it models a different problem). Guarantees as `_cut_model`."""
    # Data.
    n, S = problem.num_units, problem.num_stages
    blocks = n - 2
    last = S - 1
    scaled = _scale(problem)
    names = scaled.mode_names
    # stage 0 ends with unit 0 if it holds no block: its link time may then differ
    first_link, block_link = scaled.transfer[0][0], scaled.transfer[0][1]
    first_varies = S > 1 and first_link != block_link

    # Model.
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()

    # Variables, each family with the constraints that define it (as in `_cut_model`).
    # use[s][k]: stage s runs recompute mode k, exactly one per stage (1 with one mode)
    use = _new_mode_vars(model, S, names)
    # count[s]: blocks in stage s, all blocks in all. Stage 0 also holds unit 0 and stage S-1
    # unit n-1, so they may hold no block; every other stage needs at least one.
    count: list[Expr] = [
        model.new_int_var(0 if s in (0, last) else 1, blocks, f"count[{s}]") for s in range(S)
    ]
    model.add(sum(count) == blocks)
    # split[s][k]: blocks of stage s under mode k, all of them under its chosen mode
    # (count[s] itself with one mode)
    split: list[list[Expr]] = [[count[s]] for s in range(S)]
    if len(names) > 1:
        split = [[model.new_int_var(0, blocks, f"split[{s},{k}]") for k in names] for s in range(S)]
        for s in range(S):
            model.add(sum(split[s]) == count[s])
            for k_idx, var in enumerate(split[s]):
                model.add(var == 0).only_enforce_if(use[s][k_idx].Not())
    # has_block: stage 0 holds a block, count[0] >= 1 (only when that changes its link time)
    has_block: Expr = None
    if first_varies:
        has_block = model.new_bool_var("stage0_has_block")
        model.add(count[0] >= 1).only_enforce_if(has_block)
        model.add(count[0] == 0).only_enforce_if(has_block.Not())
    # stage.<quantity>[s]: stage s's sum of a unit quantity under its mode, linear in the
    # split counts and the mode choice (no variable of its own, `_count_stage_sums`)
    stage = _count_stage_sums(scaled, use, count, split, has_block)
    tail, memory, z, ceiling = _step_objective(model, problem.spec, scaled, stage)
    return _CountModel(
        model=model,
        scaled=scaled,
        use=use,
        count=count,
        split=split,
        stage=stage,
        tail=tail,
        memory=memory,
        z=z,
        ceiling=ceiling,
    )


def _count_stage_sums(
    scaled: _Scaled,
    use: Sequence[Sequence[Expr]],
    count: Sequence[Expr],
    split: Sequence[Sequence[Expr]],
    has_block: Expr,
) -> _StageSums:
    """Each stage's sums: its blocks under each mode times the block's value, plus unit 0 in
    stage 0 and unit n - 1 in the last stage under the stage's mode (see `_count_model`;
    ``has_block`` None when stage 0's link time does not depend on it)."""
    S = len(count)
    n = len(scaled.static)
    last = S - 1
    names = scaled.mode_names

    def per_mode(table: Mapping[Recompute, Sequence[int]], s: int) -> Expr:
        expr: Expr = sum(split[s][k_idx] * table[k][1] for k_idx, k in enumerate(names))
        for unit, stage in ((0, 0), (n - 1, last)):
            if s == stage:
                expr += sum(use[s][k_idx] * table[k][unit] for k_idx, k in enumerate(names))
        return expr

    def stages(table: Mapping[Recompute, Sequence[int]]) -> list[Expr]:
        return [per_mode(table, s) for s in range(S)]

    transfer: list[Expr] = []
    for s in range(S):
        if s == last:
            transfer.append(0)
        elif s > 0:
            transfer.append(scaled.transfer[s][1])  # a middle stage ends with a block
        elif has_block is None:
            transfer.append(scaled.transfer[0][0])  # the same whichever unit ends stage 0
        else:  # stage 0 ends with a block if it holds any, else with unit 0
            first, block = scaled.transfer[0][0], scaled.transfer[0][1]
            transfer.append(first + has_block * (block - first))
    static = []
    for s in range(S):
        expr = count[s] * scaled.static[1]
        if s == 0:
            expr += scaled.static[0]
        if s == last:
            expr += scaled.static[n - 1]
        static.append(expr)
    act = stages(scaled.act)
    return _StageSums(
        forward=stages(scaled.forward),
        backward=stages(scaled.backward),
        weight=stages(scaled.weight),
        transfer=transfer,
        act=act,
        kept=[act[0], *stages(scaled.kept)[1:]],  # (see `rank_memory`)
        static=static,
        tail=[stages(table) for table in scaled.tail],
    )


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


@dataclass(frozen=True, kw_only=True, slots=True)
class _RunsModel(_CutModel):
    """The runs formulation's model: the cut formulation's variables and read-back, each cut
    defined by the run its previous unit lies in and its place there (see `_runs_model`)."""

    runs: tuple[tuple[int, int], ...]  # (first unit, length) of each run
    pick: list[list[Expr]]  # [j - 1][run]: the last unit before cut j lies in the run
    offset: list[list[Expr]]  # [j - 1][run]: its place in that run (0 in the others)

    def hint(self, cuts: Cuts) -> None:
        """Replace the model's hint by ``cuts``."""
        self.model.clear_hints()  # type: ignore[no-untyped-call]
        for j in range(1, len(self.cut) - 1):
            last = cuts.stage_starts[j] - 1
            for r, (first, length) in enumerate(self.runs):
                inside = first <= last < first + length
                if not isinstance(self.pick[j - 1][r], int):
                    self.model.add_hint(self.pick[j - 1][r], inside)
                if not isinstance(self.offset[j - 1][r], int):
                    self.model.add_hint(self.offset[j - 1][r], last - first if inside else 0)
        _hint_modes(self.model, self.use, self.scaled.mode_names, cuts.modes)


def _runs_model(problem: PartitionProblem) -> _RunsModel:
    """The runs formulation, for units in a few runs of interchangeable ones (`unit_runs`):
    each cut is the run its previous unit lies in and the place in that run, so a stage's sum
    is linear in those (prefix sums are linear within a run) and the model grows with the
    runs, not the units; the cut formulation's element tables hold every unit for every
    stage (4,096 units in 1,024 stages: millions of entries, gigabytes in CP-SAT). Expects
    1 <= stages <= units. Guarantees as `_cut_model`."""
    # Data.
    n, S = problem.num_units, problem.num_stages
    scaled = _scale(problem)
    names = scaled.mode_names
    runs = unit_runs(problem)
    R = len(runs)

    # Model.
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()

    # Variables, each family with the constraints that define it.
    # use[s][k]: stage s runs recompute mode k, exactly one per stage (1 with one mode)
    use = _new_mode_vars(model, S, names)
    # pick[j-1][r]: the last unit before cut j (the last of stage j - 1) lies in run r, exactly
    # one run per cut (1 with one run); offset[j-1][r]: its place in run r, 0 unless picked
    pick: list[list[Expr]] = []
    offset: list[list[Expr]] = []
    last: list[Expr] = []  # [j - 1]: that unit
    for j in range(1, S):
        row: list[Expr] = [1]
        if R > 1:
            row = [model.new_bool_var(f"pick[{j},{r}]") for r in range(R)]
            model.add_exactly_one(row)
        places: list[Expr] = []
        for r, (_, length) in enumerate(runs):
            if length == 1:
                places.append(0)
                continue
            place = model.new_int_var(0, length - 1, f"offset[{j},{r}]")
            if R > 1:
                model.add(place <= (length - 1) * row[r])
            places.append(place)
        unit = sum(first * p + o for (first, _), p, o in zip(runs, row, places, strict=True))
        # each stage needs at least one unit: cut j lies in [j, n - (S - j)]
        model.add(unit >= j - 1)
        model.add(unit <= n - S + j - 1)
        pick.append(row)
        offset.append(places)
        last.append(unit)
    for j in range(len(last) - 1):
        model.add(last[j] + 1 <= last[j + 1])
    cut: list[Expr] = [0, *(unit + 1 for unit in last), n]
    # stage.<quantity>[s]: stage s's sum of a unit quantity under its mode, the difference of
    # the quantity's prefix sums at its two cuts, each linear in the cut's pick and offset
    stage = _runs_stage_sums(model, scaled, runs, use, pick, offset)
    tail, memory, z, ceiling = _step_objective(model, problem.spec, scaled, stage)
    return _RunsModel(
        model=model,
        scaled=scaled,
        runs=runs,
        use=use,
        pick=pick,
        offset=offset,
        cut=cut,
        stage=stage,
        tail=tail,
        memory=memory,
        z=z,
        ceiling=ceiling,
    )


def _runs_stage_sums(
    model: cp_model.CpModel,
    scaled: _Scaled,
    runs: Sequence[tuple[int, int]],
    use: Sequence[Sequence[Expr]],
    pick: Sequence[Sequence[Expr]],
    offset: Sequence[Sequence[Expr]],
) -> _StageSums:
    """Each stage's sums between its cuts, under its chosen mode (see `_runs_model`)."""
    S = len(pick) + 1
    names = scaled.mode_names

    def through(values: Sequence[int], j: int) -> Expr:
        """The sum of ``values`` over the units before cut j: through the picked run's units
        up to the offset, ``prefix[first] + (offset + 1) * value``."""
        if j == 0:
            return 0
        if j == S:
            return sum(values)
        expr: Expr = 0
        total = 0  # the sum before the run
        for (first, length), p, o in zip(runs, pick[j - 1], offset[j - 1], strict=True):
            value = values[first]
            expr += (total + value) * p + value * o
            total += value * length
        return expr

    def per_mode(tables: Mapping[Recompute, Sequence[int]], name: str) -> list[Expr]:
        prefix = {k: _prefix(v) for k, v in tables.items()}
        low = min(min(t) for t in prefix.values())
        high = max(max(t) for t in prefix.values())
        out: list[Expr] = []
        for s in range(S):
            exprs = [through(tables[k], s + 1) - through(tables[k], s) for k in names]
            if len(exprs) == 1:
                out.append(exprs[0])
                continue
            value = model.new_int_var(low - high, high - low, f"{name}[{s}]")
            for k_idx, expr in enumerate(exprs):
                model.add(value == expr).only_enforce_if(use[s][k_idx])
            out.append(value)
        return out

    # (the order below fixes the order of the model's variables, as in `_cut_stage_sums`)
    act = per_mode(scaled.act, "act")
    forward = per_mode(scaled.forward, "fwd")
    backward = per_mode(scaled.backward, "bwd")
    weight = per_mode(scaled.weight, "wgt")
    # the link after stage s: that of its last unit, the same for every unit of its run
    transfer: list[Expr] = [
        sum(scaled.transfer[s][first] * p for (first, _), p in zip(runs, pick[s], strict=True))
        if s < S - 1
        else 0
        for s in range(S)
    ]
    kept = [act[0], *per_mode(scaled.kept, "kept")[1:]]  # (see `rank_memory`)
    static = [through(scaled.static, s + 1) - through(scaled.static, s) for s in range(S)]
    tail = [per_mode(table, f"tail{j}") for j, table in enumerate(scaled.tail)]
    return _StageSums(
        forward=forward,
        backward=backward,
        weight=weight,
        transfer=transfer,
        act=act,
        kept=kept,
        static=static,
        tail=tail,
    )


# The step model of any formulation: `solve` reads only what all have.
_StepModel = _CutModel | _CountModel | _RunsModel


def _step_model(problem: PartitionProblem, kind: ModelKind | None) -> _StepModel:
    """The step model of ``problem`` in formulation ``kind``; by default the count formulation
    when the middle units are identical, else the cut one, or the runs one where the cut
    one's tables would pass `_CUT_MODEL_ENTRIES` (stages x units)."""
    if kind is None:
        if _uniform_middle(problem):
            kind = "count"
        elif problem.num_stages * problem.num_units > _CUT_MODEL_ENTRIES:
            kind = "runs"
        else:
            kind = "cut"
    if kind == "cut":
        return _cut_model(problem)
    return _count_model(problem) if kind == "count" else _runs_model(problem)


def _path_key(path: CriticalPath) -> tuple[object, ...]:
    """Equal for paths that give the same cut."""
    return (
        tuple(sorted(path.slots.items())),
        tuple(sorted(path.transfers.items())),
        path.tail_rank,
    )


def _path_length(built: _StepModel, path: CriticalPath) -> Expr:
    """The path's length as a model expression: its actions' stage times (each with the host
    time of the message it posts), its link crossings and its rank's tail. The path exists in
    every partition's action graph, so it is a lower bound on every simulated step."""
    st, message = built.stage, built.scaled.message
    S = len(st.forward)
    expr: Expr = built.tail[path.tail_rank]
    for slot, count in path.slots.items():
        s, kind = divmod(slot, 4)
        send_f = message[s]  # the forward posts its output's message
        send_b = message[s - 1] if s > 0 else 0  # the backward its gradient's
        if kind == 0:  # F
            expr += count * (st.forward[s] + send_f)
        elif kind == 1:  # B
            expr += count * (st.backward[s] + send_b)
        elif kind == 2:  # I: the backward without its weight half
            expr += count * (st.backward[s] + send_b - st.weight[s])
        else:  # W
            expr += count * st.weight[s]
    for boundary, count in path.transfers.items():
        assert boundary < S - 1
        expr += count * st.transfer[boundary]
    return expr


def _add_path(built: _StepModel, path: CriticalPath, seen: set[tuple[object, ...]]) -> None:
    """``z >= the path's length``, unless ``seen`` holds the path already (then adds it)."""
    key = _path_key(path)
    if key in seen:
        return
    seen.add(key)
    built.model.add(built.z >= _path_length(built, path))


def _set_ceiling(built: _StepModel, value: int) -> None:
    """Fix ``ceiling`` to ``value`` clamped to [0, path bound]: z may not exceed it."""
    value = max(0, min(value, built.scaled.path_bound))
    domain = built.ceiling.proto.domain  # a fixed variable: domain [value, value]
    domain[0] = value
    domain[1] = value


@dataclass(frozen=True, kw_only=True, slots=True)
class _PeakModel:
    """The least-peak-memory model: a step model with the peak as objective (see
    `_peak_model`)."""

    model: cp_model.CpModel
    stages: _StepModel  # the formulation: its variables, stage sums and read-back
    peak: cp_model.IntVar

    def read(self, solver: cp_model.CpSolver) -> Cuts:
        """The partition of the solver's solution."""
        return self.stages.read(solver)


def _peak_model(problem: PartitionProblem, kind: ModelKind | None) -> _PeakModel:
    """The model of the least per-device peak memory of any partition of ``problem``, in
    formulation ``kind`` (see `_step_model`). Guarantees every partition is a solution (the
    capacity is lifted above any rank's bytes) and the peak is minimised."""
    # Data: a capacity no partition exceeds (memory is the objective here, not a limit)
    relaxed = replace(problem, memory_capacity_bytes=_worst_bytes(problem) * 1.01 + 1.0)

    # Model: the formulation's (its ``z`` and path objective stay unused).
    stages = _step_model(relaxed, kind)
    model = stages.model

    # Variables.
    # peak: the most bytes any rank holds at any of its candidate peak points
    peak = model.new_int_var(0, 2**60, "peak")

    # Constraints.
    # the peak covers every candidate peak point of every rank
    for points in stages.memory:
        for expr in points:
            model.add(peak >= expr)

    # Objective.
    model.minimize(peak)
    return _PeakModel(model=model, stages=stages, peak=peak)


def _solver_status(status: cp_model.CpSolverStatus) -> SolverStatus:
    """CP-SAT's name of ``status``."""
    from ortools.sat.python import cp_model

    if status == cp_model.OPTIMAL:
        return "OPTIMAL"
    if status == cp_model.FEASIBLE:
        return "FEASIBLE"
    if status == cp_model.INFEASIBLE:
        return "INFEASIBLE"
    if status == cp_model.MODEL_INVALID:
        return "MODEL_INVALID"
    return "UNKNOWN"


# ----------------------------------------------------------------------- hints and local search


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
    deadline: float = math.inf,
) -> ImproveResult:
    """Local search from ``start`` by single moves (one cut by one unit, or one stage's mode):
    while memory does not fit, the move that buys memory back cheapest (step added per byte
    of excess removed); then first-improvement descent of the simulated step among moves that
    fit. Returns the best partition that fits (``start`` if none does) and every accepted one
    (their critical paths feed the solver). A heuristic: it gives the solver a strong
    incumbent early; optimality comes from the solver. Stops at ``deadline`` (a
    `time.perf_counter` value) with what it has."""
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
            if budget <= 0 or time.perf_counter() > deadline:
                budget = 0
                return
            budget -= 1
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


def even_splits(problem: PartitionProblem) -> list[Partition]:
    """`balanced_hint` and `rank_balanced_hint` under each mode, evaluated (one recompute mode
    throughout; they may not fit): the search's quick seeds, a few simulations each."""
    found = []
    for mode in problem.modes:
        found.append(evaluate(problem, *balanced_hint(problem, mode)))
        ranked = rank_balanced_hint(problem, mode)
        if ranked is not None and ranked.stage_starts != found[-1].stage_starts:
            found.append(evaluate(problem, *ranked))
    return found


def heuristic(
    problem: PartitionProblem,
    *,
    deadline: float = math.inf,
    splits: Sequence[Partition] | None = None,
) -> HeuristicResult:
    """A good partition fast, without a proof: the even splits under each mode (``splits``
    if they were evaluated already), then `improve` from the fastest one (repairing its
    memory) and from the best one that fits. Returns the best that fits (None if none was
    found) and every partition met on the way."""
    seeds = list(even_splits(problem) if splits is None else splits)
    best = fastest_fitting(problem, seeds)
    fastest = min(seeds, key=lambda seed: seed.step_time_s)
    if best is None or fastest.step_time_s < best.step_time_s:
        local, accepted = improve(
            problem, fastest, max_evaluations=_LOCAL_EVALUATIONS, deadline=deadline
        )
        seeds.extend(accepted[1:])
        if local.peak_memory_bytes <= problem.memory_capacity_bytes and (
            best is None or local.step_time_s < best.step_time_s
        ):
            best = local
    if best is not None:
        best, accepted = improve(
            problem, best, max_evaluations=_LOCAL_EVALUATIONS, deadline=deadline
        )
        seeds.extend(accepted[1:])
    return HeuristicResult(best, seeds)


# ------------------------------------------------------------------------------ solve


def solve(
    problem: PartitionProblem,
    *,
    time_limit_s: float = 10.0,
    num_workers: int = 1,
    model: ModelKind | None = None,
    cutoff_s: float | None = None,
    relative_gap: float = 0.0,
) -> SolveResult:
    """The partition with the least simulated step that fits in memory (None if none fits)
    and what the solve did (its status, rounds and proven lower bound).

    ``cutoff_s``: only partitions faster than this are of interest (the search passes its
    incumbent); None then also means "none beats the cutoff" (status ``CUTOFF``).
    ``relative_gap``: stop (status ``OPTIMAL``) once the best simulated partition is within
    this fraction of a proven lower bound; 0 asks for the exact optimum. ``model``
    forces a formulation (tests compare each with brute force); by default the smallest exact
    one for the problem is used. See the module docstring for the method.
    """
    start = time.perf_counter()
    spec = problem.spec
    built = _step_model(problem, model)
    seen: set[tuple[object, ...]] = set()  # the path cuts in the model
    for path in rank_paths(spec):
        _add_path(built, path, seen)
    best, seeds = heuristic(problem, deadline=start + time_limit_s)
    for seed in seeds:
        for path in _critical_paths_of(problem, seed.stage_starts, seed.modes):
            _add_path(built, path, seen)
    if best is not None:
        built.hint(Cuts(best.stage_starts, best.modes))
    # Rounding: a path sums at most (3 m + 2) stage terms of at most n rounded units each.
    slack = (3 * spec.num_micro_batches + 2) * problem.num_units // 2 + 1
    unit = built.scaled.time_unit_s
    bound = 0.0  # proven: no partition's simulated step is below it
    status: SolveStatus = "UNKNOWN"
    rounds = 0
    wall = 0.0
    from ortools.sat.python import cp_model

    while rounds < _MAX_ROUNDS:
        if best is not None and best.step_time_s <= bound * (1.0 + relative_gap):
            status = "OPTIMAL"
            break
        limit = math.inf if cutoff_s is None else cutoff_s
        if best is not None:
            limit = min(limit, best.step_time_s / (1.0 + relative_gap))
        remaining = time_limit_s - (time.perf_counter() - start)
        if remaining <= 0:
            status = "FEASIBLE" if best is not None else "UNKNOWN"
            break
        rounds += 1
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = remaining
        solver.parameters.num_workers = num_workers
        # Full LP relaxation: the max() terms and memory knapsacks need its bound to prove
        # that a candidate cannot beat the cutoff.
        solver.parameters.linearization_level = 2
        # demand a strictly better step than the limit (up to rounding)
        _set_ceiling(
            built,
            math.floor(limit / unit) - 1 + slack
            if math.isfinite(limit)
            else built.scaled.path_bound,
        )
        result = solver.solve(built.model)
        wall += solver.wall_time
        if result == cp_model.INFEASIBLE:
            if best is not None and (cutoff_s is None or best.step_time_s < cutoff_s):
                status = "OPTIMAL"  # within relative_gap: none is below limit
                bound = max(bound, min(limit, best.step_time_s))
            else:
                # memory, or nothing beats the cutoff (the search counts both as pruned)
                status = "CUTOFF" if cutoff_s is not None else "INFEASIBLE"
                bound = math.inf
            break
        if result not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            status = "FEASIBLE" if best is not None else "UNKNOWN"
            bound = max(bound, (solver.best_objective_bound - slack) * unit)
            break
        cuts = built.read(solver)
        found = evaluate(problem, *cuts)
        if found.peak_memory_bytes > problem.memory_capacity_bytes:
            # the model's rounded bytes let through what the simulation says overflows (never
            # seen since `_fine_byte_unit`): no proof from this model, keep what fits
            logger.info(
                "partition model rounding: a solution needs %.4g bytes of %.4g (%s)",
                found.peak_memory_bytes,
                problem.memory_capacity_bytes,
                spec,
            )
            status = "FEASIBLE" if best is not None else "UNKNOWN"
            break
        if best is None or found.step_time_s < best.step_time_s:
            best = found
        lower = solver.objective_value * unit
        if result == cp_model.OPTIMAL:
            # every partition's simulated step is at least its z (up to rounding)
            bound = max(bound, lower - slack * unit)
            if found.step_time_s <= lower + slack * unit:
                status = "OPTIMAL"
                break
        else:
            bound = max(bound, (solver.best_objective_bound - slack) * unit)
        for path in _critical_paths_of(problem, *cuts):
            _add_path(built, path, seen)
        built.hint(Cuts(best.stage_starts, best.modes))
    else:
        status = "FEASIBLE" if best is not None else "UNKNOWN"
    stats = SolveStats(
        status=status,
        wall_time_s=wall,
        num_variables=len(built.model.proto.variables),
        rounds=rounds,
        num_paths=len(seen),
        lower_bound_s=bound,
    )
    if best is not None and cutoff_s is not None and best.step_time_s >= cutoff_s:
        best = None
    if status in ("INFEASIBLE", "CUTOFF", "UNKNOWN"):
        best = None
    return SolveResult(best, stats)


def _critical_paths_of(
    problem: PartitionProblem, stage_starts: Sequence[int], modes: Sequence[Recompute]
) -> list[CriticalPath]:
    """The longest path ending on each rank (the global one among them): adding them all per
    round converges in far fewer rounds than the global one alone."""
    spec = problem.spec
    sim = simulate(
        spec,
        stage_times(problem, stage_starts, modes),
        rank_tails(problem, stage_starts, modes),
    )
    return [critical_path(spec, sim, rank) for rank in range(spec.pp_degree)]


def min_peak_memory(
    problem: PartitionProblem, *, time_limit_s: float = 10.0, model: ModelKind | None = None
) -> PeakMemory:
    """The least per-device peak memory any partition of ``problem`` needs, whatever the
    solver's status (``time_limit_s`` may be 0). ``least_bytes`` is the simulated peak of the
    partition CP-SAT found (proven least when the status is OPTIMAL), or None when it found
    none: the bound is then unknown (a time limit, or a model the rounding made infeasible)."""
    built = _peak_model(problem, model)
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    status = solver.solve(built.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return PeakMemory(status=_solver_status(status), least_bytes=None)
    cuts = built.read(solver)
    return PeakMemory(
        status=_solver_status(status),
        least_bytes=evaluate(problem, *cuts).peak_memory_bytes,
    )
