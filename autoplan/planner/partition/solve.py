"""Optimal pipeline-stage cuts and per-stage recompute: `solve` (the least simulated step
that fits in memory) and `min_peak_memory` (the least peak any partition needs).

Method: simulation verified by a proven bound, made exact by lazy path cuts. The simulated
step is the longest path through the schedule's action graph; the graph depends only on the
schedule and its degrees, the durations on the cuts. Every path's length is a linear function
of the stages' times (how many forwards, backwards, weight gradients and link crossings of each
stage it passes, plus one rank's tail), so every path is a lower bound on the step of every
partition. The CP-SAT model (`autoplan.planner.partition.formulations`) minimises ``z``
subject to ``z >= path_k`` for a set of paths (at first each rank's full order with its fill
and drain, and the critical paths of the heuristic's partitions); the solution is simulated;
if its simulated step exceeds its ``z``, its critical paths join the set and the model is
solved again, else it is optimal: no partition's simulated step is below its own ``z``, which
is at least the optimum of the model. Each round also demands a strictly better step than the
best partition simulated so far, so a round without a solution proves that partition optimal.
Exact up to the integer scaling (see `autoplan.planner.partition.scaled`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from autoplan.planner.partition.formulations import Expr, _peak_model, _step_model, _StepModel
from autoplan.planner.partition.heuristics import heuristic
from autoplan.planner.partition.problem import (
    Cuts,
    ModelKind,
    Partition,
    PartitionProblem,
    PeakMemory,
    SolveResult,
    SolverStatus,
    SolveStats,
    SolveStatus,
    _uniform_middle,
    evaluate,
    rank_tails,
    stage_times,
)
from autoplan.planner.partition.relaxation import lp_bound
from autoplan.planner.work import CPSAT_UNIT_S, CPSAT_VARIABLE_S, WALL_CAP_FACTOR, Work
from cost_model.schedules import (
    CriticalPath,
    critical_path,
    path_key,
    path_length,
    rank_paths,
    simulate,
)

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

logger = logging.getLogger(__name__)

# Rounds of the lazy path loop before it returns its best simulated partition with a gap.
_MAX_ROUNDS = 60
# The most of a solve's time limit its linear relaxation may take (`relaxation.lp_bound`).
_LP_SHARE = 0.5


# ------------------------------------------------------------------ path cuts


def _path_length(built: _StepModel, path: CriticalPath) -> Expr:
    """The path's length as a model expression (`cost_model.schedules.path_length`): a lower
    bound on every partition's simulated step."""
    st = built.stage
    assert all(boundary < len(st.forward) - 1 for boundary in path.transfers)
    return path_length(
        path,
        st.forward,
        st.backward,
        st.weight,
        message=built.scaled.message,
        transfer=st.transfer,
        tail=built.tail,
    )


def _add_path(built: _StepModel, path: CriticalPath, seen: set[tuple[object, ...]]) -> None:
    """``z >= the path's length``, unless ``seen`` holds the path already (then adds it)."""
    key = path_key(path)
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


class _CtrlC:
    """Ctrl-C during a CP-SAT solve: CP-SAT's own SIGINT catching is off (it would swallow the
    signal: the search would go on to its next solve), and Python's handler runs only when the
    solve returns, so a watcher thread woken by the signal (`signal.set_wakeup_fd`) stops the
    running solve at once; the main thread then raises KeyboardInterrupt as usual."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _pipe: ClassVar[tuple[int, int] | None] = None
    _running: ClassVar[set[cp_model.CpSolver]] = set()

    @classmethod
    @contextmanager
    def stoppable(cls, solver: cp_model.CpSolver) -> Iterator[None]:
        solver.parameters.catch_sigint_signal = False
        if threading.current_thread() is not threading.main_thread():
            yield  # (signals reach the main thread only)
            return
        with cls._lock:
            if cls._pipe is None:
                read, write = os.pipe()
                os.set_blocking(write, False)
                cls._pipe = (read, write)
                threading.Thread(target=cls._watch, name="autoplan-ctrl-c", daemon=True).start()
        previous = signal.set_wakeup_fd(cls._pipe[1], warn_on_full_buffer=False)
        cls._running.add(solver)
        try:
            yield
        finally:
            cls._running.discard(solver)
            signal.set_wakeup_fd(previous)

    @classmethod
    def _watch(cls) -> None:
        assert cls._pipe is not None
        while True:
            if signal.SIGINT in os.read(cls._pipe[0], 64):
                for solver in list(cls._running):
                    solver.stop_search()


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


# ---------------------------------------------------------------------- solve


class _Seeded(NamedTuple):
    """A step model with its first path cuts and hint (see `_seeded_model`)."""

    built: _StepModel
    seen: set[tuple[object, ...]]  # the path cuts in the model
    best: Partition | None  # the heuristic's best partition that fits (the hint)


def _seeded_model(
    problem: PartitionProblem, kind: ModelKind | None, *, work: Work, stop_at_s: float
) -> _Seeded:
    """The step model of ``problem`` in formulation ``kind`` with its first path cuts: each
    rank's full order (`rank_paths`) and the critical paths of every partition the heuristic
    met (its local search stopped once ``work`` has spent ``stop_at_s``), hinted with the
    heuristic's best partition that fits."""
    built = _step_model(problem, kind)
    work.charge(CPSAT_VARIABLE_S * len(built.model.proto.variables))
    seen: set[tuple[object, ...]] = set()
    for path in rank_paths(problem.spec):
        _add_path(built, path, seen)
    best, seeds = heuristic(problem, work=work, stop_at_s=stop_at_s)
    for seed in seeds:
        for path in _critical_paths_of(problem, _cuts_of(seed), work):
            _add_path(built, path, seen)
    if best is not None:
        built.hint(_cuts_of(best))
    return _Seeded(built, seen, best)


def _deterministic_solver(work_s: float, wall_s: float, num_workers: int) -> cp_model.CpSolver:
    """A CP-SAT solver of at most ``work_s`` reference seconds of its deterministic time, and
    ``wall_s`` wall seconds (the cap)."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    # Deterministic: one worker, a fixed seed and a deterministic limit give the same search
    # on every run (CP-SAT's parameters documentation); the wall limit is only the cap.
    solver.parameters.max_deterministic_time = work_s / CPSAT_UNIT_S
    solver.parameters.max_time_in_seconds = wall_s
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = 0
    return solver


def _round_solver(work_s: float, wall_s: float, num_workers: int) -> cp_model.CpSolver:
    """A CP-SAT solver for one round of `solve` (`_deterministic_solver`)."""
    solver = _deterministic_solver(work_s, wall_s, num_workers)
    # Full LP relaxation: the max() terms and memory knapsacks need its bound to prove
    # that a candidate cannot beat the cutoff.
    solver.parameters.linearization_level = 2
    return solver


def solve(
    problem: PartitionProblem,
    *,
    time_limit_s: float = 10.0,
    num_workers: int = 1,
    model: ModelKind | None = None,
    cutoff_s: float | None = None,
    relative_gap: float = 0.0,
    work: Work | None = None,
) -> SolveResult:
    """The partition with the least simulated step that fits in memory (None if none fits)
    and what the solve did (its status, rounds and proven lower bound).

    ``cutoff_s``: only partitions faster than this are of interest (the search passes its
    incumbent); None then also means "none beats the cutoff" (status ``CUTOFF``).
    ``relative_gap``: stop (status ``OPTIMAL``) once the best simulated partition is within
    this fraction of a proven lower bound; 0 asks for the exact optimum. ``model``
    forces a formulation (tests compare each with brute force); by default the smallest exact
    one for the problem is used. See the module docstring for the method.

    ``time_limit_s``: the reference seconds of work the solve may spend (`planner.work`: the
    heuristic's simulations, the model, CP-SAT's deterministic time), charged to ``work`` (by
    default a fresh `Work` of that budget), so the same problem gets the same answer on every
    machine (with ``num_workers=1``); it also stops at ``work``'s wall-clock cap.
    """
    if work is None:
        work = Work(time_limit_s)
    stop_at = work.spent_s + time_limit_s
    spec = problem.spec
    bound = 0.0  # proven: no partition's simulated step is below it
    if model is None and _uniform_middle(problem):
        # the relaxation first (`relaxation.lp_bound`): it often proves the cutoff unreachable
        # (or memory short) at a fraction of the model's cost, and else starts the bound
        bound = lp_bound(
            problem,
            cutoff_s=math.inf if cutoff_s is None else cutoff_s,
            work=work,
            stop_at_s=work.spent_s + _LP_SHARE * time_limit_s,
        )
        if bound == math.inf or (cutoff_s is not None and bound >= cutoff_s):
            # nothing fits in memory, or nothing beats the cutoff
            status: SolveStatus = "INFEASIBLE" if bound == math.inf else "CUTOFF"
            stats = SolveStats(status=status, wall_time_s=0.0, num_variables=0, lower_bound_s=bound)
            return SolveResult(None, stats)
    built, seen, best = _seeded_model(problem, model, work=work, stop_at_s=stop_at)
    # Rounding: a path sums at most (3 m + 2) stage terms of at most n rounded units each.
    slack = (3 * spec.num_micro_batches + 2) * problem.num_units // 2 + 1
    unit = built.scaled.time_unit_s
    status = "UNKNOWN"
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
        remaining = 0.0 if work.wall_capped() else stop_at - work.spent_s
        if remaining <= 0:
            status = "FEASIBLE" if best is not None else "UNKNOWN"
            break
        rounds += 1
        solver = _round_solver(remaining, work.wall_left_s(), num_workers)
        # demand a strictly better step than the limit (up to rounding)
        _set_ceiling(
            built,
            math.floor(limit / unit) - 1 + slack
            if math.isfinite(limit)
            else built.scaled.path_bound,
        )
        with _CtrlC.stoppable(solver):
            result = solver.solve(built.model)
        wall += solver.wall_time
        work.charge(solver.deterministic_time * CPSAT_UNIT_S)
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
        work.simulation(spec)  # (the evaluation above)
        for path in _critical_paths_of(problem, cuts, work):
            _add_path(built, path, seen)
        built.hint(_cuts_of(best))
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


def _cuts_of(partition: Partition) -> Cuts:
    """A partition's cuts, modes and recompute counts."""
    return Cuts(partition.stage_starts, partition.modes, partition.recompute_units)


def _critical_paths_of(problem: PartitionProblem, cuts: Cuts, work: Work) -> list[CriticalPath]:
    """The longest path ending on each rank (the global one among them): adding them all per
    round converges in far fewer rounds than the global one alone. (Charges ``work`` a
    simulation and a path per rank.)"""
    spec = problem.spec
    work.simulation(spec, 1 + spec.pp_degree)
    sim = simulate(spec, stage_times(problem, *cuts), rank_tails(problem, *cuts))
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

    solver = _deterministic_solver(time_limit_s, WALL_CAP_FACTOR * time_limit_s + 1.0, 1)
    with _CtrlC.stoppable(solver):
        status = solver.solve(built.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return PeakMemory(status=_solver_status(status), least_bytes=None)
    cuts = built.read(solver)
    return PeakMemory(
        status=_solver_status(status),
        least_bytes=evaluate(problem, *cuts).peak_memory_bytes,
    )
