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

Formulations: element constraints on prefix sums at each cut (any units), or block counts per
stage when the middle units are identical (embedding, blocks, head), which keeps the model
small for 100-layer models.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ortools.sat.python import cp_model

from autoplan.plan import Recompute
from cost_model.schedules import (
    CriticalPath,
    ScheduleSpec,
    StageTimes,
    critical_path,
    held_microbatches,
    rank_paths,
    simulate,
)

# Integer resolution of the CP-SAT model: times and bytes are scaled so that the total over all
# units is this many integer units. A path sums rounded unit times, each off by at most half a
# unit, so its relative rounding error is at most (units on it) / (2 * resolution). Finer
# scales make CP-SAT much slower (larger coefficients weaken its propagation).
_RESOLUTION = 10**6
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
        return (
            self.spec,
            tuple(self.modes.items()),
            self.static_bytes,
            self.transfer_s,
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


# ------------------------------------------------------------------------------ model


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveStats:
    """What one `solve` did."""

    # OPTIMAL (proven), FEASIBLE (time or round limit: best found, not proven), INFEASIBLE
    # (memory), CUTOFF (nothing beats the cutoff), UNKNOWN (time limit, nothing found)
    status: str
    wall_time_s: float
    num_variables: int
    rounds: int = 0  # CP-SAT solves (one per batch of path cuts)
    num_paths: int = 0  # path cuts in the final model
    lower_bound_s: float = 0.0  # proven lower bound on the step time (inf if infeasible)


@dataclass(frozen=True, slots=True)
class _StageExprs:
    """Per-stage model expressions (integer-scaled): F, B, W times, link time after the
    stage, activation, retained and static bytes, tail terms."""

    forward: list[Expr]
    backward: list[Expr]
    weight: list[Expr]
    transfer: list[Expr]
    act: list[Expr]
    kept: list[Expr]
    static: list[Expr]
    tail: list[list[Expr]]  # [term j][stage s]


class _Model:
    """The CP-SAT model of one problem: stages (by a formulation), rank tails, memory at every
    candidate peak point, and the objective ``z`` bounded below by path cuts."""

    def __init__(self, problem: PartitionProblem) -> None:
        self.problem = problem
        spec = problem.spec
        self.model = cp_model.CpModel()
        self.mode_names: tuple[Recompute, ...] = tuple(problem.modes)
        self._scale(problem)
        S, p = spec.num_stages, spec.pp_degree
        # use[s][k]: stage s runs recompute mode k (exactly one per stage)
        self.use: list[list[Expr]] = []
        for s in range(S):
            if len(self.mode_names) == 1:
                self.use.append([1])
                continue
            row = [self.model.new_bool_var(f"use[{s},{k}]") for k in self.mode_names]
            self.model.add_exactly_one(row)
            self.use.append(list(row))
        self.stage = self._stage_exprs()
        # tail[r]: rank r's work after its last action, max(0, max_j (terms + constant j))
        self.tail = [self.model.new_int_var(0, self.time_bound, f"tail[{r}]") for r in range(p)]
        for r in range(p):
            stages = spec.rank_stages(r)
            for j, constant in enumerate(self.tail_constants):
                self.model.add(
                    self.tail[r] >= sum(self.stage.tail[j][s] for s in stages) + constant
                )
        # memory: every candidate peak point of every rank fits
        self.memory: list[list[Expr]] = []
        for held in held_microbatches(spec):
            static = sum(self.stage.static[s] for s in held.stages)
            points = []
            for point, sends in zip(held.points, held.sends, strict=True):
                # (one expression: OR-tools' += may extend the shared `static` in place)
                expr = (
                    static
                    + sends * self.send_int
                    + sum(
                        h * self.stage.act[s] + k * self.stage.kept[s]
                        for (h, k), s in zip(point, held.stages, strict=True)
                    )
                )
                self.model.add(expr <= self.memory_capacity)
                points.append(expr)
            self.memory.append(points)
        # z: the objective, at least the length of every path cut added
        self.z = self.model.new_int_var(0, self.path_bound, "z")
        self.paths: list[CriticalPath] = []
        self.path_keys: set[object] = set()
        # ceiling: z may not exceed it (each round of `solve` sets its domain to one value)
        self.ceiling = self.model.new_int_var(0, self.path_bound, "ceiling")
        self.model.add(self.z <= self.ceiling)

    def set_ceiling(self, value: int) -> None:
        value = max(0, min(value, self.path_bound))
        domain = self.ceiling.proto.domain  # a fixed variable: domain [value, value]
        domain[0] = value
        domain[1] = value

    # ----------------------------------------------------------------- scaling to integers

    def _scale(self, problem: PartitionProblem) -> None:
        n, spec = problem.num_units, problem.spec
        worst = sum(
            max(c.forward_s[u] + c.backward_s[u] for c in problem.modes.values()) for u in range(n)
        )
        worst += sum(max(row) for row in problem.transfer_s) + 2 * sum(problem.message_s)
        worst_tail = sum(
            sum(max(abs(c.tail_s[j][u]) for c in problem.modes.values()) for u in range(n))
            + abs(problem.tail_constants_s[j])
            for j in range(problem.num_tail_terms)
        )
        self.time_unit_s = max(worst, worst_tail, 1e-30) / _RESOLUTION
        self.time_bound = 4 * _RESOLUTION
        # a path runs at most every action and crossing once: m (2 or 3) actions per stage
        self.path_bound = (3 * spec.num_micro_batches + 2) * self.time_bound
        worst_bytes = _worst_bytes(problem)
        self.byte_unit = max(worst_bytes, problem.memory_capacity_bytes, 1.0) / _RESOLUTION

        def ints(values: Sequence[float], unit: float) -> list[int]:
            return [round(value / unit) for value in values]

        t, b = self.time_unit_s, self.byte_unit
        modes = problem.modes
        self.forward_int = {k: ints(c.forward_s, t) for k, c in modes.items()}
        self.backward_int = {k: ints(c.backward_s, t) for k, c in modes.items()}
        split = spec.splits_backward
        self.weight_int = {
            k: ints(c.weight_s if split else (0.0,) * n, t) for k, c in modes.items()
        }
        self.act_int = {k: ints(c.activation_bytes, b) for k, c in modes.items()}
        self.kept_int = {k: ints(c.retained_bytes, b) for k, c in modes.items()}
        self.static_int = ints(problem.static_bytes, b)
        self.send_int = round(problem.send_bytes / b)
        self.tail_int = [
            {k: ints(c.tail_s[j], t) for k, c in modes.items()}
            for j in range(problem.num_tail_terms)
        ]
        self.tail_constants = [round(c / t) for c in problem.tail_constants_s]
        self.transfer_int = [ints(row, t) for row in problem.transfer_s]
        self.message_int = ints(problem.message_s, t)
        self.memory_capacity = math.floor(problem.memory_capacity_bytes / b)

    # ----------------------------------------------------------------- paths

    def add_path(self, path: CriticalPath) -> None:
        """``z >= the path's length`` (a valid lower bound on every partition's step)."""
        key = (
            tuple(sorted(path.slots.items())),
            tuple(sorted(path.transfers.items())),
            path.tail_rank,
        )
        if key in self.path_keys:
            return
        self.path_keys.add(key)
        self.paths.append(path)
        self.model.add(self.z >= self.path_expr(path))

    def path_expr(self, path: CriticalPath) -> Expr:
        S = self.problem.num_stages
        st = self.stage
        expr: Expr = self.tail[path.tail_rank]
        for slot, count in path.slots.items():
            s, kind = divmod(slot, 4)
            send_f = self.message_int[s]  # the forward posts its output's message
            send_b = self.message_int[s - 1] if s > 0 else 0  # the backward its gradient's
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

    # ----------------------------------------------------------------- formulation

    def _stage_exprs(self) -> _StageExprs:
        raise NotImplementedError

    def add_hint(self, stage_starts: Sequence[int], modes: Sequence[Recompute]) -> None:
        self.model.clear_hints()  # type: ignore[no-untyped-call]
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


class _CutModel(_Model):
    """Any units: one integer variable per cut, element constraints on prefix-sum tables."""

    def _stage_exprs(self) -> _StageExprs:
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
        self._reads: dict[tuple[int, int], Expr] = {}

        def per_mode(tables: Mapping[Recompute, Sequence[int]], name: str) -> list[Expr]:
            prefix = {k: _prefix(v) for k, v in tables.items()}
            return [self._stage_value(prefix, s, f"{name}[{s}]") for s in range(S)]

        static_prefix = _prefix(self.static_int)
        act = per_mode(self.act_int, "act")
        # transfer_table[s][c]: link time of stage s ending just before unit c (at unit c - 1)
        transfer_table = [[0, *row] for row in self.transfer_int]
        return _StageExprs(
            forward=per_mode(self.forward_int, "fwd"),
            backward=per_mode(self.backward_int, "bwd"),
            weight=per_mode(self.weight_int, "wgt"),
            transfer=[self._read(transfer_table[s], s + 1) if s < S - 1 else 0 for s in range(S)],
            act=act,
            kept=[act[0], *per_mode(self.kept_int, "kept")[1:]],  # (see `rank_memory`)
            static=[
                self._read(static_prefix, s + 1) - self._read(static_prefix, s) for s in range(S)
            ],
            tail=[per_mode(table, f"tail{j}") for j, table in enumerate(self.tail_int)],
        )

    def _read(self, table: Sequence[int], j: int) -> Expr:
        """table[cut[j]] as a model expression (a constant at the fixed ends)."""
        cut = self.cut[j]
        if isinstance(cut, int):
            return table[cut]
        if min(table) == max(table):
            return table[0]
        value = self.model.new_int_var(min(table), max(table), "")
        self.model.add_element(cut, list(table), value)
        return value

    def _stage_value(self, prefix: Mapping[Recompute, Sequence[int]], s: int, name: str) -> Expr:
        """Stage s's sum of a per-unit quantity under the stage's chosen mode."""
        per_mode = [
            self._read(prefix[k], s + 1) - self._read(prefix[k], s) for k in self.mode_names
        ]
        if len(per_mode) == 1:
            return per_mode[0]
        low = min(min(t) for t in prefix.values())
        high = max(max(t) for t in prefix.values())
        value = self.model.new_int_var(low - high, high - low, name)
        for k_idx, expr in enumerate(per_mode):
            self.model.add(value == expr).only_enforce_if(self.use[s][k_idx])
        return value

    def _hint_cuts(self, stage_starts: Sequence[int]) -> None:
        for j in range(1, self.problem.num_stages):
            self.model.add_hint(self.cut[j], stage_starts[j])

    def _read_starts(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        return tuple(c if isinstance(c, int) else solver.value(c) for c in self.cut[:-1])


class _CountModel(_Model):
    """First unit, a run of identical units, last unit (embedding, blocks, head): a partition
    is the number of blocks per stage, so the model is linear in small integers and its size
    does not grow with the number of units."""

    def _stage_exprs(self) -> _StageExprs:
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

        transfer: list[Expr] = []
        for s in range(S):
            if s == last:
                transfer.append(0)
            elif s > 0:
                transfer.append(self.transfer_int[s][1])  # a middle stage ends with a block
            else:
                # stage 0 ends with a block if it holds any, else with unit 0
                first, block = self.transfer_int[0][0], self.transfer_int[0][1]
                if first == block:
                    transfer.append(first)
                    continue
                has_block: Expr = self.model.new_bool_var("stage0_has_block")
                self.model.add(self.count[0] >= 1).only_enforce_if(has_block)
                self.model.add(self.count[0] == 0).only_enforce_if(has_block.Not())
                transfer.append(first + has_block * (block - first))
        static = []
        for s in range(S):
            expr = self.count[s] * self.static_int[1]
            if s == 0:
                expr += self.static_int[0]
            if s == last:
                expr += self.static_int[n - 1]
            static.append(expr)

        def stages(table: Mapping[Recompute, Sequence[int]]) -> list[Expr]:
            return [per_mode(table, s) for s in range(S)]

        act = stages(self.act_int)
        return _StageExprs(
            forward=stages(self.forward_int),
            backward=stages(self.backward_int),
            weight=stages(self.weight_int),
            transfer=transfer,
            act=act,
            kept=[act[0], *stages(self.kept_int)[1:]],  # (see `rank_memory`)
            static=static,
            tail=[stages(table) for table in self.tail_int],
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


def _uniform_middle(problem: PartitionProblem) -> bool:
    """Whether units 1..n-2 are interchangeable (same value in every table)."""
    n = problem.num_units
    if n < 3 or problem.num_stages == 1:
        return False
    rows: list[Sequence[float]] = [problem.static_bytes, *problem.transfer_s]
    for costs in problem.modes.values():
        rows += [
            costs.forward_s,
            costs.backward_s,
            costs.weight_s,
            costs.activation_bytes,
            costs.retained_bytes,
            *costs.tail_s,
        ]
    return all(len(set(row[1 : n - 1])) == 1 for row in rows)


ModelKind = Literal["cut", "count"]


def _build(problem: PartitionProblem, kind: ModelKind | None = None) -> _Model:
    if kind is None:
        kind = "count" if _uniform_middle(problem) else "cut"
    return {"cut": _CutModel, "count": _CountModel}[kind](problem)


def balanced_hint(
    problem: PartitionProblem, mode: Recompute | None = None
) -> tuple[tuple[int, ...], tuple[Recompute, ...]]:
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
    return tuple(starts), tuple(k for _ in range(S))


def rank_balanced_hint(
    problem: PartitionProblem, mode: Recompute
) -> tuple[tuple[int, ...], tuple[Recompute, ...]] | None:
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
    return _starts_from_counts(counts), tuple(mode for _ in range(S))


def improve(
    problem: PartitionProblem,
    start: Partition,
    *,
    max_evaluations: int,
    deadline: float = math.inf,
) -> tuple[Partition, list[Partition]]:
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
        return start, accepted
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
    return current, accepted


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
        if ranked is not None and ranked[0] != found[-1].stage_starts:
            found.append(evaluate(problem, *ranked))
    return found


def heuristic(
    problem: PartitionProblem,
    *,
    deadline: float = math.inf,
    splits: Sequence[Partition] | None = None,
) -> tuple[Partition | None, list[Partition]]:
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
    return best, seeds


# ------------------------------------------------------------------------------ solve


def solve(
    problem: PartitionProblem,
    *,
    time_limit_s: float = 10.0,
    num_workers: int = 1,
    model: ModelKind | None = None,
    cutoff_s: float | None = None,
    relative_gap: float = 0.0,
) -> tuple[Partition | None, SolveStats]:
    """The partition with the least simulated step that fits in memory, or None if none fits.

    ``cutoff_s``: only partitions faster than this are of interest (the search passes its
    incumbent); None then also means "none beats the cutoff" (status ``CUTOFF``).
    ``relative_gap``: stop (status ``OPTIMAL``) once the best simulated partition is within
    this fraction of a proven lower bound; 0 asks for the exact optimum. ``model``
    forces a formulation (tests compare each with brute force); by default the smallest exact
    one for the problem is used. See the module docstring for the method.
    """
    start = time.perf_counter()
    built = _build(problem, model)
    spec = problem.spec
    for path in rank_paths(spec):
        built.add_path(path)
    best, seeds = heuristic(problem, deadline=start + time_limit_s)
    for seed in seeds:
        for path in _critical_paths_of(problem, seed.stage_starts, seed.modes):
            built.add_path(path)
    if best is not None:
        built.add_hint(best.stage_starts, best.modes)
    built.model.minimize(built.z)
    # Rounding: a path sums at most (3 m + 2) stage terms of at most n rounded units each.
    slack = (3 * spec.num_micro_batches + 2) * problem.num_units // 2 + 1
    unit = built.time_unit_s
    bound = 0.0  # proven: no partition's simulated step is below it
    status = "UNKNOWN"
    rounds = 0
    wall = 0.0
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
        built.set_ceiling(
            math.floor(limit / unit) - 1 + slack if math.isfinite(limit) else built.path_bound
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
        starts, modes = built.read(solver)
        found = evaluate(problem, starts, modes)
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
        for path in _critical_paths_of(problem, starts, modes):
            built.add_path(path)
        built.add_hint(best.stage_starts, best.modes)
    else:
        status = "FEASIBLE" if best is not None else "UNKNOWN"
    stats = SolveStats(
        status=status,
        wall_time_s=wall,
        num_variables=len(built.model.proto.variables),
        rounds=rounds,
        num_paths=len(built.paths),
        lower_bound_s=bound,
    )
    if best is not None and cutoff_s is not None and best.step_time_s >= cutoff_s:
        best = None
    if status in ("INFEASIBLE", "CUTOFF", "UNKNOWN"):
        best = None
    return best, stats


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


def min_peak_memory(
    problem: PartitionProblem, *, time_limit_s: float = 10.0, model: ModelKind | None = None
) -> float | None:
    """The least per-device peak memory any partition of this problem needs (bytes), or None
    if the solver could not finish in ``time_limit_s``."""
    bound = _worst_bytes(problem)
    built = _build(replace(problem, memory_capacity_bytes=bound * 1.01 + 1.0), model)
    peak = built.model.new_int_var(0, 2**60, "peak")
    for points in built.memory:
        for expr in points:
            built.model.add(peak >= expr)
    built.model.minimize(peak)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    status = solver.solve(built.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    starts, modes = built.read(solver)
    return evaluate(problem, starts, modes).peak_memory_bytes
