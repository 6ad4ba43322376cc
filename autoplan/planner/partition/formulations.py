"""The CP-SAT models of a partition problem, one builder each (data, model, variables,
constraints, objective, as in the OR-tools samples; each returns a record of its model,
variables and read-back): `_cut_model`, element constraints on prefix sums at each cut (any
units); `_count_model`, block counts per stage when the middle units are identical (embedding,
blocks, head), which keeps the model small for 100-layer models; `_runs_model`, each cut as a
run and a place in it, for units in a few runs of interchangeable ones (thousands of units);
`_peak_model`, any of them with the least peak memory as the objective (`min_peak_memory`,
for the no-feasible-plan error). `_step_model` picks the formulation.

Expects a `PartitionProblem` with 1 <= stages <= units. Guarantees every partition that fits
in memory is a solution of a step model (up to the integer scaling of
`autoplan.planner.partition.scaled`), and its ``z`` is bounded below by no path yet (`solve`
adds the path cuts). OR-tools is imported by the builders, not at import time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from autoplan.contract.plan import Recompute
from autoplan.planner.partition.problem import (
    Cuts,
    ModelKind,
    PartitionProblem,
    _block_counts,
    _starts_from_counts,
    _uniform_middle,
    unit_runs,
)
from autoplan.planner.partition.scaled import _scale, _Scaled, _worst_bytes
from cost_model.schedule_memory import held_microbatches
from cost_model.schedules import ScheduleSpec

# OR-tools' CP-SAT (with pandas, which it imports) takes about 0.4 s to import: the functions
# that solve import it, so a training process that is handed its plan never loads it.
if TYPE_CHECKING:
    from ortools.sat.python import cp_model

# The cut formulation's element tables hold every unit for every stage: above this many
# (stages x units), the runs formulation models the same problem in the size of its runs.
# (Every model of a few hundred units in up to a hundred stages stays with the cut one.)
_CUT_MODEL_ENTRIES = 2**16

# A CP-SAT linear expression. OR-tools' stubs type these as unions with numpy integers that
# mypy cannot add or subtract, so expressions are untyped here.
Expr = Any


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


# -------------------------------------------------------------- shared pieces


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


# --------------------------------------------------------------- formulations


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
        """The partition of the solver's solution: under partial recompute, a stage whose mode
        covers some of its blocks recomputes that many (the first ones)."""
        counts = [solver.value(c) for c in self.count]
        starts = _starts_from_counts(counts)
        modes = _read_modes(solver, self.use, self.scaled.mode_names)
        names = self.scaled.mode_names
        if "none" not in names or len(names) == 1:
            return Cuts(starts, modes)
        units: list[int | None] = []
        for s, mode in enumerate(modes):
            covered = solver.value(self.split[s][names.index(mode)])
            units.append(covered if 0 < covered < counts[s] and mode != "none" else None)
        partial = tuple(units) if any(u is not None for u in units) else ()
        return Cuts(starts, modes, partial)


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
    # (count[s] itself with one mode); under partial recompute (`PartitionProblem.partial`)
    # the blocks its mode does not cover run under 'none': any of them may (the blocks are
    # interchangeable, so which ones does not change a sum; the plan names the first ones)
    split: list[list[Expr]] = [[count[s]] for s in range(S)]
    free = {names.index("none")} if problem.partial else set()
    if len(names) > 1:
        split = [[model.new_int_var(0, blocks, f"split[{s},{k}]") for k in names] for s in range(S)]
        for s in range(S):
            model.add(sum(split[s]) == count[s])
            for k_idx, var in enumerate(split[s]):
                if k_idx not in free:
                    model.add(var == 0).only_enforce_if(use[s][k_idx].Not())
        if free:
            _add_partial_cover(model, use, count, split, free)
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


def _add_partial_cover(
    model: cp_model.CpModel,
    use: Sequence[Sequence[Expr]],
    count: Sequence[Expr],
    split: Sequence[Sequence[Expr]],
    free: set[int],
) -> None:
    """A stage that holds blocks and runs a recompute mode covers at least one of them (a
    stage covering none runs 'none': one partition, one solution, as `brute_force` counts)."""
    last = len(count) - 1
    for s in range(len(count)):
        holds: list[Expr] = []
        if s in (0, last):
            # has[s]: stage s holds a block (the first and last stage may hold none)
            has = model.new_bool_var(f"holds_block[{s}]")
            model.add(count[s] >= 1).only_enforce_if(has)
            model.add(count[s] == 0).only_enforce_if(has.Not())
            holds = [has]
        for k_idx, var in enumerate(split[s]):
            if k_idx not in free:
                model.add(var >= 1).only_enforce_if([use[s][k_idx], *holds])


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
    # (partial recompute is offered only where the count formulation applies: `partial`)
    assert kind == "count" or not problem.partial, "partial recompute needs the count model"
    if kind == "cut":
        return _cut_model(problem)
    return _count_model(problem) if kind == "count" else _runs_model(problem)


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
