"""Optimal pipeline-stage cuts and per-stage recompute, as a CP-SAT model.

Given fixed outer choices (degrees, micro-batching, schedule, ZeRO level), the cost model gives
every pipeline unit a per-micro-batch time, activation bytes per in-flight micro-batch, static
bytes (parameters, gradients, optimizer state) and tail coefficients, each per recompute mode.
This module chooses where to cut the units into ``num_stages`` contiguous stages (stage ``s``
runs on pipeline rank ``s % pp_degree``) and which recompute mode each stage uses, minimising

    step = (m - 1/v) * max_r T_r + (sum_r T_r) / v + max_r tail_r

subject to every rank's memory, where ``T_r`` sums the per-micro-batch times of the stages on
rank ``r`` (plus the send at each stage's end) and ``tail_r = max(0, max_j tail_rj)`` covers
work after the pipeline flush (exposed gradient sync, optimizer step). This is the cost model's
own pipeline formula (cost_model.schedules), so the solver's optimum is the cost model's.

Formulation: one integer variable per cut (the first unit of each stage), and CP-SAT element
constraints that read prefix sums of per-unit tables at the cuts, so any stage quantity is a
difference of two table entries. The model size grows with the number of stages, not with
units x stages, so 96-stage plans of a 100-unit model solve in milliseconds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ortools.sat.python import cp_model

from autoplan.plan import Recompute

# Integer resolution of the CP-SAT model: times and bytes are scaled so that the total over all
# units is this many integer units. A rank's time sums at most n rounded unit times, so its
# relative rounding error is at most n / (2 * resolution): 5e-5 for a 100-unit model. Finer
# scales make CP-SAT much slower (larger coefficients weaken its propagation).
_RESOLUTION = 10**6
_INFLIGHT_SCALE = 1000  # in-flight micro-batch counts may be fractional (interleaving)

# A CP-SAT linear expression. OR-tools' stubs type these as unions with numpy integers that
# mypy cannot add or subtract, so expressions are untyped here.
Expr = Any


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeCosts:
    """Per-unit costs under one recompute mode (one entry per unit)."""

    time_s: tuple[float, ...]  # forward + backward time of one micro-batch
    activation_bytes: tuple[float, ...]  # held per in-flight micro-batch
    tail_s: tuple[tuple[float, ...], ...] = ()  # per tail term j, each unit's contribution


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionProblem:
    """One stage-partition problem: the cost tables of a fixed outer configuration."""

    num_stages: int
    pp_degree: int
    virtual_stages: int
    num_micro_batches: int
    modes: Mapping[Recompute, ModeCosts]
    static_bytes: tuple[float, ...]
    # boundary_time_s[s][u]: per-micro-batch send cost charged to stage s when its last unit
    # is u (it depends on the stage through the link to the next pipeline rank). The last
    # stage sends nothing; its row is ignored.
    boundary_time_s: tuple[tuple[float, ...], ...]
    # inflight[s]: micro-batches whose activations stage s holds at its peak.
    inflight: tuple[float, ...]
    memory_capacity_bytes: float
    tail_constants_s: tuple[float, ...] = ()
    unit_names: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        n = self.num_units
        assert self.num_stages == self.pp_degree * self.virtual_stages
        assert 1 <= self.num_stages <= n, (self.num_stages, n)
        assert len(self.boundary_time_s) == self.num_stages
        assert all(len(row) == n for row in self.boundary_time_s)
        assert len(self.inflight) == self.num_stages
        assert self.modes, "at least one recompute mode"
        for costs in self.modes.values():
            assert len(costs.time_s) == n and len(costs.activation_bytes) == n
            assert len(costs.tail_s) == len(self.tail_constants_s)
            assert all(len(t) == n for t in costs.tail_s)

    @property
    def num_units(self) -> int:
        return len(self.static_bytes)

    def content_key(self) -> tuple[object, ...]:
        """Equal for problems with the same tables (outer choices that cost the same)."""
        return (
            self.num_stages,
            self.pp_degree,
            self.virtual_stages,
            self.num_micro_batches,
            tuple(self.modes.items()),
            self.static_bytes,
            self.boundary_time_s,
            self.inflight,
            self.memory_capacity_bytes,
            self.tail_constants_s,
        )

    @property
    def num_tail_terms(self) -> int:
        return len(self.tail_constants_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """Stage cuts and modes with their exact (floating-point) cost."""

    stage_starts: tuple[int, ...]  # first unit of each stage; stage s ends at the next start
    modes: tuple[Recompute, ...]
    step_time_s: float
    rank_times_s: tuple[float, ...]
    rank_memory_bytes: tuple[float, ...]

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.rank_memory_bytes)

    def stage_units(self, num_units: int) -> list[range]:
        ends = (*self.stage_starts[1:], num_units)
        return [range(a, b) for a, b in zip(self.stage_starts, ends, strict=True)]


def evaluate(
    problem: PartitionProblem, stage_starts: Sequence[int], modes: Sequence[Recompute]
) -> Partition:
    """Exact cost of a partition: the reference that the CP-SAT model reproduces."""
    n, p, v, m = (
        problem.num_units,
        problem.pp_degree,
        problem.virtual_stages,
        problem.num_micro_batches,
    )
    ends = (*stage_starts[1:], n)
    rank_time = [0.0] * p
    rank_memory = [0.0] * p
    rank_tail = [list(problem.tail_constants_s) for _ in range(p)]
    for s, (start, end) in enumerate(zip(stage_starts, ends, strict=True)):
        costs = problem.modes[modes[s]]
        r = s % p
        units = range(start, end)
        rank_time[r] += sum(costs.time_s[u] for u in units)
        if s < problem.num_stages - 1:
            rank_time[r] += problem.boundary_time_s[s][end - 1]
        rank_memory[r] += sum(problem.static_bytes[u] for u in units)
        rank_memory[r] += problem.inflight[s] * sum(costs.activation_bytes[u] for u in units)
        for j, coefficients in enumerate(costs.tail_s):
            rank_tail[r][j] += sum(coefficients[u] for u in units)
    tail = max(max([0.0, *terms]) for terms in rank_tail)
    step = (m - 1 / v) * max(rank_time) + sum(rank_time) / v + tail
    return Partition(
        stage_starts=tuple(stage_starts),
        modes=tuple(modes),
        step_time_s=step,
        rank_times_s=tuple(rank_time),
        rank_memory_bytes=tuple(rank_memory),
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


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveStats:
    """What one CP-SAT call did."""

    status: str  # OPTIMAL, FEASIBLE (time limit), INFEASIBLE, CUTOFF, UNKNOWN (time limit)
    wall_time_s: float
    num_variables: int
    lower_bound_s: float = 0.0  # proven lower bound on the step time (inf if infeasible)


@dataclass(frozen=True, slots=True)
class _RankTerms:
    """Per pipeline rank model expressions (integer-scaled)."""

    time: list[Expr]  # per-micro-batch time, sends included
    tail: list[list[Expr]]  # [term j][rank r]
    memory: list[Expr]  # static * _INFLIGHT_SCALE + inflight * activations


class _Model:
    """The CP-SAT model of one problem (built once, solved for time or for memory).

    Subclasses describe the pipeline ranks (`_rank_terms`), hint and read back the partition;
    this base scales the tables to integers and adds the objective's terms: the longest rank,
    the tail, and the memory limit of every rank.
    """

    def __init__(self, problem: PartitionProblem) -> None:
        self.problem = problem
        self.model = cp_model.CpModel()
        p = problem.pp_degree
        self.mode_names: tuple[Recompute, ...] = tuple(problem.modes)
        self._scale(problem)
        terms = self._rank_terms()
        self.rank_time = terms.time
        self.longest = self.model.new_int_var(0, self.time_bound, "longest_rank_time")
        for r in range(p):
            self.model.add(self.longest >= self.rank_time[r])
        # tail: max over ranks and terms of the rank's tail (never below zero)
        self.tail = self.model.new_int_var(0, self.time_bound, "tail")
        for r in range(p):
            for j, constant in enumerate(self.tail_constants):
                self.model.add(self.tail >= terms.tail[j][r] + constant)
        self.rank_memory = terms.memory
        for r in range(p):
            self.model.add(self.rank_memory[r] <= self.memory_capacity)

    def _rank_terms(self) -> _RankTerms:
        raise NotImplementedError

    def add_hint(self, stage_starts: Sequence[int], modes: Sequence[Recompute]) -> None:
        raise NotImplementedError

    def read(self, solver: cp_model.CpSolver) -> tuple[tuple[int, ...], tuple[Recompute, ...]]:
        raise NotImplementedError

    # ----------------------------------------------------------------- scaling to integers

    def _scale(self, problem: PartitionProblem) -> None:
        n = problem.num_units
        worst_time = sum(max(c.time_s[u] for c in problem.modes.values()) for u in range(n))
        worst_time += sum(max(row) for row in problem.boundary_time_s[:-1])
        worst_tail = sum(
            sum(max(abs(c.tail_s[j][u]) for c in problem.modes.values()) for u in range(n))
            + abs(problem.tail_constants_s[j])
            for j in range(problem.num_tail_terms)
        )
        self.time_unit_s = max(worst_time, worst_tail, 1e-30) / _RESOLUTION
        self.time_bound = 4 * _RESOLUTION
        worst_bytes = sum(problem.static_bytes) + max(problem.inflight) * sum(
            max(c.activation_bytes[u] for c in problem.modes.values()) for u in range(n)
        )
        self.byte_unit = max(worst_bytes, problem.memory_capacity_bytes, 1.0) / _RESOLUTION

        def ints(values: Sequence[float], unit: float) -> list[int]:
            return [round(value / unit) for value in values]

        # per-unit integer tables (per mode where the quantity depends on the mode)
        self.time_int = {k: ints(c.time_s, self.time_unit_s) for k, c in problem.modes.items()}
        self.act_int = {
            k: ints(c.activation_bytes, self.byte_unit) for k, c in problem.modes.items()
        }
        self.static_int = ints(problem.static_bytes, self.byte_unit)
        self.tail_int = [
            {k: ints(c.tail_s[j], self.time_unit_s) for k, c in problem.modes.items()}
            for j in range(problem.num_tail_terms)
        ]
        self.tail_constants = [round(c / self.time_unit_s) for c in problem.tail_constants_s]
        self.boundary_int = [ints(row, self.time_unit_s) for row in problem.boundary_time_s]
        self.inflight = [round(x * _INFLIGHT_SCALE) for x in problem.inflight]
        self.memory_capacity = math.floor(
            problem.memory_capacity_bytes / self.byte_unit * _INFLIGHT_SCALE
        )


@dataclass(frozen=True, slots=True)
class _StageTerms:
    """Per-stage model expressions (integer-scaled)."""

    time: list[Expr]
    send: list[Expr]
    act: list[Expr]
    static: list[Expr]
    tail: list[list[Expr]]  # [term j][stage s]


class _StageModel(_Model):
    """Models with a recompute-mode choice per stage; ranks sum their stages."""

    def _rank_terms(self) -> _RankTerms:
        S, p = self.problem.num_stages, self.problem.pp_degree
        # use[s][k]: stage s runs recompute mode k (exactly one per stage).
        self.use: list[list[Expr]] = []
        for s in range(S):
            if len(self.mode_names) == 1:
                self.use.append([1])
                continue
            row = [self.model.new_bool_var(f"use[{s},{k}]") for k in self.mode_names]
            self.model.add_exactly_one(row)
            self.use.append(list(row))
        terms = self._stage_terms()
        ranks = [range(r, S, p) for r in range(p)]
        return _RankTerms(
            time=[sum(terms.time[s] + terms.send[s] for s in stages) for stages in ranks],
            tail=[[sum(table[s] for s in stages) for stages in ranks] for table in terms.tail],
            memory=[
                sum(
                    terms.static[s] * _INFLIGHT_SCALE + self.inflight[s] * terms.act[s]
                    for s in stages
                )
                for stages in ranks
            ],
        )

    def _stage_terms(self) -> _StageTerms:
        raise NotImplementedError

    def add_hint(self, stage_starts: Sequence[int], modes: Sequence[Recompute]) -> None:
        self._hint_cuts(stage_starts)
        if len(self.mode_names) > 1:
            for s, mode in enumerate(modes):
                for k_idx, k in enumerate(self.mode_names):
                    self.model.add_hint(self.use[s][k_idx], k == mode)

    def _hint_cuts(self, stage_starts: Sequence[int]) -> None:
        raise NotImplementedError

    def read(self, solver: cp_model.CpSolver) -> tuple[tuple[int, ...], tuple[Recompute, ...]]:
        modes: list[Recompute] = []
        for s in range(self.problem.num_stages):
            if len(self.mode_names) == 1:
                modes.append(self.mode_names[0])
                continue
            chosen = [
                k for k_idx, k in enumerate(self.mode_names) if solver.value(self.use[s][k_idx])
            ]
            modes.append(chosen[0])
        return self._read_starts(solver), tuple(modes)

    def _read_starts(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        raise NotImplementedError


def _prefix(values: Sequence[int]) -> list[int]:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return out


class _CutModel(_StageModel):
    """Any units: one integer variable per cut, element constraints on prefix-sum tables."""

    def _stage_terms(self) -> _StageTerms:
        n, S = self.problem.num_units, self.problem.num_stages
        # cut[j]: first unit of stage j (cut[0] = 0 and cut[S] = n are constants). Each stage
        # needs at least one unit, so cut j lies in [j, n - (S - j)].
        self.cut: list[Expr] = [0]
        for j in range(1, S):
            self.cut.append(self.model.new_int_var(j, n - (S - j), f"cut[{j}]"))
        self.cut.append(n)
        # stages are contiguous, in order, and non-empty
        for j in range(1, S - 1):
            self.model.add(self.cut[j] + 1 <= self.cut[j + 1])
        time_prefix = {k: _prefix(v) for k, v in self.time_int.items()}
        act_prefix = {k: _prefix(v) for k, v in self.act_int.items()}
        static_prefix = _prefix(self.static_int)
        tail_prefix = [{k: _prefix(v) for k, v in table.items()} for table in self.tail_int]
        # boundary_table[s][c]: cost of stage s ending just before unit c (at unit c - 1)
        boundary_table = [[0, *row] for row in self.boundary_int]
        return _StageTerms(
            time=[self._stage_value(time_prefix, s, f"time[{s}]") for s in range(S)],
            send=[self._read(boundary_table[s], s + 1) if s < S - 1 else 0 for s in range(S)],
            act=[self._stage_value(act_prefix, s, f"act[{s}]") for s in range(S)],
            static=[
                self._read(static_prefix, s + 1) - self._read(static_prefix, s) for s in range(S)
            ],
            tail=[
                [self._stage_value(table, s, f"tail{j}[{s}]") for s in range(S)]
                for j, table in enumerate(tail_prefix)
            ],
        )

    def _read(self, table: Sequence[int], j: int) -> Expr:
        """table[cut[j]] as a model expression (a constant at the fixed ends)."""
        cut = self.cut[j]
        if isinstance(cut, int):
            return table[cut]
        value = self.model.new_int_var(min(table), max(table), "")
        self.model.add_element(cut, list(table), value)
        return value

    def _stage_value(self, tables: Mapping[Recompute, Sequence[int]], s: int, name: str) -> Expr:
        """Stage s's sum of a per-unit quantity under the stage's chosen mode."""
        per_mode = [
            self._read(tables[k], s + 1) - self._read(tables[k], s) for k in self.mode_names
        ]
        if len(per_mode) == 1:
            return per_mode[0]
        low = min(min(t) for t in tables.values()) - max(max(t) for t in tables.values())
        value = self.model.new_int_var(low, -low, name)
        for k_idx, expr in enumerate(per_mode):
            self.model.add(value == expr).only_enforce_if(self.use[s][k_idx])
        return value

    def _hint_cuts(self, stage_starts: Sequence[int]) -> None:
        for j in range(1, self.problem.num_stages):
            self.model.add_hint(self.cut[j], stage_starts[j])

    def _read_starts(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        return tuple(c if isinstance(c, int) else solver.value(c) for c in self.cut[:-1])


class _CountModel(_StageModel):
    """First unit, a run of identical units, last unit (embedding, blocks, head): a partition
    is just the number of blocks per stage, so the model is linear in small integers and its
    size does not grow with the number of units."""

    def _stage_terms(self) -> _StageTerms:
        n, S = self.problem.num_units, self.problem.num_stages
        blocks = n - 2
        last = S - 1
        # count[s]: blocks in stage s. Stage 0 also holds unit 0 and stage S-1 unit n-1, so
        # they may hold no block; every other stage needs at least one.
        self.count: list[Expr] = [
            self.model.new_int_var(0 if s in (0, last) else 1, blocks, f"count[{s}]")
            for s in range(S)
        ]
        self.model.add(sum(self.count) == blocks)
        # split[s][k]: blocks of stage s under mode k (all of them under its chosen mode)
        split: list[list[Expr]] = []
        for s in range(S):
            if len(self.mode_names) == 1:
                split.append([self.count[s]])
                continue
            row = [self.model.new_int_var(0, blocks, f"split[{s},{k}]") for k in self.mode_names]
            self.model.add(sum(row) == self.count[s])
            for k_idx, var in enumerate(row):
                self.model.add(var == 0).only_enforce_if(self.use[s][k_idx].Not())
            split.append(row)

        def per_mode(table: Mapping[Recompute, Sequence[int]], s: int) -> Expr:
            expr: Expr = sum(
                split[s][k_idx] * table[k][1] for k_idx, k in enumerate(self.mode_names)
            )
            for unit, stage in ((0, 0), (n - 1, last)):
                if s == stage:
                    expr += sum(
                        self.use[s][k_idx] * table[k][unit]
                        for k_idx, k in enumerate(self.mode_names)
                    )
            return expr

        send: list[Expr] = []
        for s in range(S):
            if s == last:
                send.append(0)
            elif s > 0:
                send.append(self.boundary_int[s][1])  # a middle stage ends with a block
            else:
                # stage 0 ends with a block if it holds any, else with unit 0
                has_block: Expr = self.model.new_bool_var("stage0_has_block")
                self.model.add(self.count[0] >= 1).only_enforce_if(has_block)
                self.model.add(self.count[0] == 0).only_enforce_if(has_block.Not())
                first, block = self.boundary_int[0][0], self.boundary_int[0][1]
                send.append(first + has_block * (block - first))
        static = []
        for s in range(S):
            expr = self.count[s] * self.static_int[1]
            if s == 0:
                expr += self.static_int[0]
            if s == last:
                expr += self.static_int[n - 1]
            static.append(expr)
        return _StageTerms(
            time=[per_mode(self.time_int, s) for s in range(S)],
            send=send,
            act=[per_mode(self.act_int, s) for s in range(S)],
            static=static,
            tail=[[per_mode(table, s) for s in range(S)] for table in self.tail_int],
        )

    def _hint_cuts(self, stage_starts: Sequence[int]) -> None:
        for s, count in enumerate(_block_counts(stage_starts, self.problem)):
            self.model.add_hint(self.count[s], count)

    def _read_starts(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        return _starts_from_counts([solver.value(c) for c in self.count])


def _block_counts(stage_starts: Sequence[int], problem: PartitionProblem) -> list[int]:
    """Blocks per stage of a partition of [first unit, blocks..., last unit]."""
    ends = (*stage_starts[1:], problem.num_units)
    last = problem.num_stages - 1
    return [
        b - a - (s == 0) - (s == last)
        for s, (a, b) in enumerate(zip(stage_starts, ends, strict=True))
    ]


def _starts_from_counts(counts: Sequence[int]) -> tuple[int, ...]:
    starts = [0]
    for s, count in enumerate(counts[:-1]):
        starts.append(starts[-1] + count + (s == 0))
    return tuple(starts)


class _RankModel(_Model):
    """Identical blocks whose cost depends only on how many each pipeline rank runs in each
    recompute mode (not on which of its interleaved chunks holds them): the variables are
    blocks per (rank, mode). Exact when the first and last units cost the same in every mode,
    and a rank's chunks share their in-flight count and their blocks' send cost (all true for
    the cost model's tables); the chunks are filled in when the solution is read back. Without
    this, CP-SAT searches every permutation of an interleaved rank's chunks."""

    def _rank_terms(self) -> _RankTerms:
        problem = self.problem
        n, S, p = problem.num_units, problem.num_stages, problem.pp_degree
        blocks = n - 2
        K = len(self.mode_names)
        m = self.model
        # blocks[r][k]: blocks that rank r runs under mode k; used[r][k]: any at all
        self.blocks: list[list[Expr]] = [
            [m.new_int_var(0, blocks, f"blocks[{r},{k}]") for k in self.mode_names]
            for r in range(p)
        ]
        used = [[m.new_bool_var(f"used[{r},{k}]") for k in self.mode_names] for r in range(p)]
        m.add(sum(sum(row) for row in self.blocks) == blocks)
        # first_holds / last_holds: stage 0 / stage S-1 hold blocks besides their own unit
        self.first_holds: Expr = m.new_bool_var("first_holds")
        self.last_holds: Expr = m.new_bool_var("last_holds")
        self.middle = [[s for s in range(r, S, p) if 0 < s < S - 1] for r in range(p)]
        for r in range(p):
            holding: Expr = len(self.middle[r])
            holding += self.first_holds if r == 0 else 0
            holding += self.last_holds if r == p - 1 else 0
            for k in range(K):
                m.add(self.blocks[r][k] >= used[r][k])
                m.add(self.blocks[r][k] <= blocks * used[r][k])
            # every holding chunk needs a block, and runs one mode
            m.add(sum(self.blocks[r]) >= holding)
            m.add(sum(used[r]) <= holding)
        first_send, block_send = self.boundary_int[0][0], self.boundary_int[0][1]

        def rank_sum(table: Mapping[Recompute, Sequence[int]], r: int) -> Expr:
            expr: Expr = sum(
                self.blocks[r][k] * table[name][1] for k, name in enumerate(self.mode_names)
            )
            mode = self.mode_names[0]  # the end units cost the same in every mode
            if r == 0:
                expr += table[mode][0]
            if r == p - 1:
                expr += table[mode][n - 1]
            return expr

        times = []
        memory = []
        for r in range(p):
            time = rank_sum(self.time_int, r)
            time += sum(self.boundary_int[s][1] for s in self.middle[r])
            if r == 0 and S > 1:
                time += first_send + self.first_holds * (block_send - first_send)
            times.append(time)
            static: Expr = sum(self.blocks[r]) * self.static_int[1]
            static += self.static_int[0] if r == 0 else 0
            static += self.static_int[n - 1] if r == p - 1 else 0
            memory.append(static * _INFLIGHT_SCALE + self.inflight[r] * rank_sum(self.act_int, r))
        return _RankTerms(
            time=times,
            tail=[[rank_sum(table, r) for r in range(p)] for table in self.tail_int],
            memory=memory,
        )

    def add_hint(self, stage_starts: Sequence[int], modes: Sequence[Recompute]) -> None:
        counts = _block_counts(stage_starts, self.problem)
        p = self.problem.pp_degree
        for r in range(p):
            for k, name in enumerate(self.mode_names):
                total = sum(c for s, c in enumerate(counts) if s % p == r and modes[s] == name)
                self.model.add_hint(self.blocks[r][k], total)

    def read(self, solver: cp_model.CpSolver) -> tuple[tuple[int, ...], tuple[Recompute, ...]]:
        S, p = self.problem.num_stages, self.problem.pp_degree
        counts = [0] * S
        modes: list[Recompute] = [self.mode_names[0]] * S
        for r in range(p):
            holding = list(self.middle[r])
            if r == 0 and solver.value(self.first_holds):
                holding.insert(0, 0)
            if r == p - 1 and solver.value(self.last_holds):
                holding.append(S - 1)
            left = {k: solver.value(self.blocks[r][i]) for i, k in enumerate(self.mode_names)}
            used = [k for k in self.mode_names if left[k] > 0]
            # one chunk per used mode, then the rest to modes with blocks to spare
            assigned: list[Recompute] = list(used)
            spare = {k: left[k] - 1 for k in used}
            while len(assigned) < len(holding):
                k = max(spare, key=lambda name: spare[name])
                assigned.append(k)
                spare[k] -= 1
            per_mode_chunks = {
                k: [s for s, a in zip(holding, assigned, strict=True) if a == k] for k in used
            }
            for k, chunks in per_mode_chunks.items():
                for s in chunks:
                    counts[s] = 1
                    modes[s] = k
                counts[chunks[0]] += left[k] - len(chunks)
        return _starts_from_counts(counts), tuple(modes)


def _uniform_middle(problem: PartitionProblem) -> bool:
    """Whether units 1..n-2 are interchangeable (same value in every table)."""
    n = problem.num_units
    if n < 3 or problem.num_stages == 1:
        return False
    rows: list[Sequence[float]] = [problem.static_bytes, *problem.boundary_time_s]
    for costs in problem.modes.values():
        rows += [costs.time_s, costs.activation_bytes, *costs.tail_s]
    return all(len(set(row[1 : n - 1])) == 1 for row in rows)


def _rank_separable(problem: PartitionProblem) -> bool:
    """Whether `_RankModel` is exact for this (uniform-middle) problem: the end units cost the
    same under every mode and the chunks of a rank share their in-flight count. (Sends need no
    condition: every middle stage ends with a block, whatever the distribution.)"""
    n, p = problem.num_units, problem.pp_degree
    tables = list(problem.modes.values())

    def end_costs(costs: ModeCosts, u: int) -> tuple[float, ...]:
        return (costs.time_s[u], costs.activation_bytes[u], *(t[u] for t in costs.tail_s))

    if any(end_costs(c, u) != end_costs(tables[0], u) for c in tables for u in (0, n - 1)):
        return False
    return all(problem.inflight[s] == problem.inflight[s % p] for s in range(problem.num_stages))


ModelKind = Literal["cut", "count", "rank"]


def _build(problem: PartitionProblem, kind: ModelKind | None = None) -> _Model:
    if kind is None:
        if _uniform_middle(problem):
            kind = "rank" if _rank_separable(problem) else "count"
        else:
            kind = "cut"
    return {"cut": _CutModel, "count": _CountModel, "rank": _RankModel}[kind](problem)


def balanced_hint(
    problem: PartitionProblem, mode: Recompute | None = None
) -> tuple[tuple[int, ...], tuple[Recompute, ...]]:
    """Greedy cuts that split the per-rank time evenly under one mode (the solver's hint)."""
    k: Recompute = mode if mode is not None else next(iter(problem.modes))
    times = problem.modes[k].time_s
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
    return tuple(starts), tuple(k for _ in range(S))


def solve(
    problem: PartitionProblem,
    *,
    time_limit_s: float = 10.0,
    num_workers: int = 1,
    model: ModelKind | None = None,
    cutoff_s: float | None = None,
) -> tuple[Partition | None, SolveStats]:
    """The minimum-step-time partition that fits in memory, or None if none fits.

    ``cutoff_s``: only partitions faster than this are of interest (the search passes its
    incumbent); None then also means "none beats the cutoff" (status ``CUTOFF``). ``model``
    forces a formulation (tests compare each with brute force); by default the smallest exact
    one for the problem is used.
    """
    built = _build(problem, model)
    v = problem.virtual_stages
    objective = (v * problem.num_micro_batches - 1) * built.longest + sum(built.rank_time)
    objective += v * built.tail
    built.model.minimize(objective)
    if cutoff_s is not None:
        # The integer objective is v * step / time_unit up to rounding: at most half a unit per
        # unit table entry in each of its (v m - 1) + 1 + v weighted terms.
        slack = (v * problem.num_micro_batches + v + 1) * problem.num_units // 2 + 1
        built.model.add(objective <= math.floor(cutoff_s * v / built.time_unit_s) + slack)
    hint_starts, hint_modes = balanced_hint(problem)
    built.add_hint(hint_starts, hint_modes)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    # Full LP relaxation: the max() terms and memory knapsacks need its bound to prove that a
    # candidate cannot beat the cutoff (about 2x faster searches on large interleaved problems).
    solver.parameters.linearization_level = 2
    status = solver.solve(built.model)
    name = solver.status_name(status)
    if status == cp_model.INFEASIBLE and cutoff_s is not None:
        name = "CUTOFF"
    bound = (
        solver.best_objective_bound * built.time_unit_s / v
        if status != cp_model.INFEASIBLE
        else math.inf
    )
    stats = SolveStats(
        status=name,
        wall_time_s=solver.wall_time,
        num_variables=len(built.model.proto.variables),
        lower_bound_s=bound,
    )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        assert status in (cp_model.INFEASIBLE, cp_model.UNKNOWN), name
        return None, stats
    starts, modes = built.read(solver)
    return evaluate(problem, starts, modes), stats


def min_peak_memory(
    problem: PartitionProblem, *, time_limit_s: float = 10.0, model: ModelKind | None = None
) -> float:
    """The least per-device peak memory any partition of this problem needs (bytes)."""
    n = problem.num_units
    bound = sum(problem.static_bytes) + max(problem.inflight) * sum(
        max(c.activation_bytes[u] for c in problem.modes.values()) for u in range(n)
    )
    built = _build(replace(problem, memory_capacity_bytes=bound * 1.01 + 1.0), model)
    peak = built.model.new_int_var(0, 2**60, "peak")
    for r in range(problem.pp_degree):
        built.model.add(peak >= built.rank_memory[r])
    built.model.minimize(peak)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    status = solver.solve(built.model)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE), solver.status_name(status)
    starts, modes = built.read(solver)
    return evaluate(problem, starts, modes).peak_memory_bytes
