"""`autoplan.search`: the fastest plan that fits, under the cost model.

Expects a traced model (or a module to trace), a Cluster and a global batch. Three phases:

1. Outer enumeration of degrees, micro-batching, schedule, ZeRO level, sequence parallelism
   and rank layout, streamed by shape (`enumeration`: the degrees and micro-batching, each
   with a proven floor) within `_ENUMERATE_SHARE` of the budget; the visit expands the shapes
   left when their floors are the least bounds. A memory bound drops what cannot fit; the rest get
   their per-unit costs and proven lower bounds on the simulated step (the busiest rank's work
   and tail, `cost_model.schedules.pipeline_lower_bound_s`, whole units per rank with each
   rank's fill, drain and tail, `bounds.whole_unit_bound`, communication, the memory the
   recompute modes must buy back) and are ordered by an even-split estimate with
   communication, ``max(m, p) T + (min(m, p) - 1) T / v`` plus the tail, with the recompute
   an even cut needs to fit (order only, not a bound).
2. The first few get a heuristic partition (`partition.heuristic`: even splits and local
   search on the simulation): a strong incumbent before any proof.
3. Best bound first: every other candidate waits in one queue by its proven bound on the
   objective; the lowest is raised one step (costed, then each rank's memory,
   `bounds.memory_unit_bound`, then for several stages per rank `bounds.pipeline_factor`, from
   the schedule's own paths), or, past those, solved: a CP-SAT model (`partition.solve`, its LP
   relaxation first) chooses the stage cuts and per-stage recompute that minimise the
   simulated step of the schedule torch runs (lazy longest-path cuts), with the k-th best as
   cutoff. A candidate whose bound reaches the k-th best is dropped, and when the least bound
   does, the search is done.

The budget counts deterministic work (`planner.work`, reference seconds charged by each step's
size, CP-SAT's deterministic time with one worker and a fixed seed), never a clock: the same
question gets the same plans and statistics on every machine, unless the wall-clock cap
(`SearchStats.wall_capped`) cuts it. Ctrl-C returns the best plans so far
(`SearchStats.interrupted`).

Exactness: the objective is the simulated step of the schedule torch runs, never a closed
form. Candidates are skipped only by proven lower bounds, and each partition solve stops within
``RELATIVE_GAP`` of its proven optimum, so with ``budget_s=None`` no plan of the space is faster
by more than that gap. With a budget (the default, for interactive use) the visit stops when
it runs out and ``stats.optimality_gap`` says how much faster an unvisited or unfinished
candidate might still be (0: proven). Compute-only bounds are weak for schedules with several
stages per rank (uneven chunks can shrink their bubble), so on large spaces the budget is
what usually ends the visit.

Guarantees: the returned plans carry the cost model's own `estimate` of themselves (checked to
equal the solver's simulated step), are valid for the cluster, and are ranked by step time.
No plan fits: `NoFeasiblePlanError` with the least memory per device any plan in the space
needs (`diagnosis`).

Seams: `stack_filter` cuts the space to what the framework's stack runs; `candidates` costs
and bounds the outer choices (its tables keyed by `strategy_keys`); `incumbents` holds the
top k and the cutoff; `readback` turns partitions into ranked plans; this module enumerates,
seeds and visits.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from autoplan.contract.errors import NoFeasiblePlanError
from autoplan.contract.plan import Plan
from autoplan.planner.candidates import (
    BoundTables,
    Candidate,
    boundary_crossings,
    costed_candidate,
    partition_problem,
    refined_candidate,
)
from autoplan.planner.diagnosis import no_feasible_plan
from autoplan.planner.enumeration import Enumeration, ShapeEntry
from autoplan.planner.frontier import Frontier as _Frontier
from autoplan.planner.frontier import Pending as _Pending
from autoplan.planner.frontier import SearchStats
from autoplan.planner.incumbents import Incumbents
from autoplan.planner.partition import (
    Partition,
    PartitionProblem,
    SolveStats,
    evaluate,
    even_splits,
    fastest_fitting,
    heuristic,
    path_bound,
    solve,
)
from autoplan.planner.readback import plan_of, ranked
from autoplan.planner.space import ConstraintError, SearchSpace, shown
from autoplan.planner.stack_filter import (
    within_model,
    within_stack,
)
from autoplan.planner.work import ACTION_S, COST_S, PROBLEM_STAGE_S, Work
from cost_model.degrees import is_whole
from cost_model.estimate import CostModel
from cost_model.frameworks import DEFAULT_FRAMEWORK, framework_profile
from cost_model.hardware import Cluster
from cost_model.headroom import DEFAULT_MEMORY_HEADROOM, plan_memory_headroom
from cost_model.precision import fp8_recipe
from cost_model.stage_splits import StageSplitError
from cost_model.strategy import Strategy
from cost_model.uncertainty import (
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
)
from cost_model.workload import ModelProfile

__all__ = [
    "DEFAULT_BUDGET_S",
    "MAX_GLOBAL_BATCH",
    "RELATIVE_GAP",
    "Candidate",
    "SearchProgress",
    "SearchResult",
    "SearchStats",
    "_BoundTables",
    "_Frontier",
    "_Pending",
    "_candidate",
    "_problem",
    "boundary_crossings",
    "search_plans",
]

logger = logging.getLogger(__name__)

# (the names tests/test_search_limits.py reaches these by, from before `candidates` held them)
_BoundTables = BoundTables
_candidate = costed_candidate
_problem = partition_problem

# A stage partition within this fraction of the proven optimum of its outer choice counts as
# optimal (the lazy path loop's last rounds often move the step by less than this).
RELATIVE_GAP = 5e-4
# Reference seconds of work (`planner.work`: deterministic, the same on every machine) the
# search may spend before it returns its best with the proven gap
# (`SearchStats.optimality_gap`); None visits until every candidate is proven.
DEFAULT_BUDGET_S = 10.0
# The largest global batch a search takes (sequences): far above any published run (~10^4).
MAX_GLOBAL_BATCH = 2**24
# Phase 2 (the first incumbent): without a budget, the even split of this many candidates
# (first in the visiting order); with one, as many as fit in this share of what is left of it
# after phase 1 (at most _MAX_SEEDS). Then local search from the best _IMPROVED of them, until
# _IMPROVE_SHARE of it is spent.
_SEEDS = 8
_MAX_SEEDS = 256
_SEED_SHARE = 0.1
_IMPROVED = 4
_IMPROVE_SHARE = 0.3
# Phase 1: the most of the budget enumeration may take before the first plans (the shapes
# it leaves are expanded by the visit, when their floors are the least bounds).
_ENUMERATE_SHARE = 0.5
# Phase 3: the most of what is left one solve may take once a plan is known.
_SOLVE_SHARE = 0.25
# Outer choices enumerated between two progress reports (`SearchProgress`).
_REPORT_EVERY = 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchProgress:
    """How far the search is: reported every `_REPORT_EVERY` outer choices while it enumerates
    them (``visited`` of them so far, ``total`` 0: not known yet), after each candidate it
    splits evenly for a first plan (``phase`` "seed") and after each one it visits."""

    visited: int
    total: int
    best_step_time_s: float | None
    phase: Literal["enumerate", "seed", "visit"] = "visit"


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """Ranked plans (best first) and statistics."""

    plans: tuple[Plan, ...]
    stats: SearchStats = field(compare=False)


def search_plans(
    profile: ModelProfile,
    cluster: Cluster,
    *,
    global_batch: int,
    top_k: int = 1,
    time_limit_s: float = 10.0,
    budget_s: float | None = DEFAULT_BUDGET_S,
    progress: Callable[[SearchProgress], None] | None = None,
    framework: str = DEFAULT_FRAMEWORK,
    objective: str = DEFAULT_OBJECTIVE,
    memory_headroom: float | None = DEFAULT_MEMORY_HEADROOM,
    **constraints: Any,
) -> SearchResult:
    """The ``top_k`` best plans that fit (see the module docstring). ``time_limit_s`` caps
    one stage-partition solve; ``budget_s`` the whole visit (None: visit until proven).
    ``framework``: the training stack the plans are priced for (`cost_model.frameworks`).
    ``objective``: what "best" minimises, "pessimistic" (the upper end of the step's 80%
    range, the default) or "expected" (the predicted step); plans within `TIE_FRACTION` of the
    best tie, and ties go to fewer unvalidated features, then more memory headroom.
    ``memory_headroom``: the share of each device kept free beyond the upper end of a plan's
    peak range (`cost_model.headroom`; None: the default); every plan returned fits with it and
    records it."""
    # Every bound, floor and table below reads the cluster as the framework's stack runs on it.
    cluster = framework_profile(framework).cluster_for(profile, cluster)
    headroom = _checked_arguments(
        global_batch, objective, memory_headroom, top_k, time_limit_s, budget_s
    )
    space = _space_for(profile, cluster, global_batch, framework, constraints)
    stats = SearchStats()
    start = time.perf_counter()
    work = Work(budget_s)
    model = CostModel(profile, cluster, framework, memory_headroom=headroom)
    tables = BoundTables(model)
    enumeration = Enumeration(
        space,
        tables,
        cluster,
        global_batch,
        stats,
        work,
        report=None if progress is None else _enumeration_report(progress),
        report_every=_REPORT_EVERY,
    )
    stats.shapes = len(enumeration.left)
    # Phase 1 takes at most its share of the budget (more only until some choice may fit);
    # the shapes left wait in the visit's queue by their floors.
    until = None if budget_s is None else work.spent_s + _ENUMERATE_SHARE * work.left_s()
    pending = enumeration.run(until)
    enumeration.check_refused()
    infeasible = enumeration.infeasible
    stats.enumerate_s = time.perf_counter() - start
    run = _Run(
        model=model,
        own_cuts=_OwnCuts(profile, framework),
        global_batch=global_batch,
        incumbents=Incumbents(top_k, framework, objective),
        frontier=_Frontier(
            pending, tables, stats, infeasible, work, offload=enumeration.offload_twins
        ),
        enumeration=enumeration,
        infeasible=infeasible,
        stats=stats,
        progress=progress,
        work=work,
        budget_s=budget_s,
        time_limit_s=time_limit_s,
    )
    try:
        _seed(run)
        _visit(run)
    except KeyboardInterrupt:
        if not run.incumbents:
            raise
        stats.interrupted = True
        run.unproven.extend(run.left_unproven())
    unproven = run.unproven
    stats.work_s, stats.wall_capped = work.spent_s, work.capped
    incumbents = run.incumbents
    if not incumbents:
        stats.total_s = time.perf_counter() - start
        raise no_feasible_plan(
            profile,
            cluster,
            global_batch,
            infeasible,
            space,
            tables,
            stats.candidates,
            time_limit_s,
        )
    if unproven:
        worst = incumbents.worst()
        stats.optimality_gap = max(0.0, max((worst - low) / worst for low in unproven))
    stats.best_objective_s = min(value for value, _, _ in incumbents.offered.values())
    plans = ranked(model, incumbents.offered, top_k, global_batch)
    stats.total_s = time.perf_counter() - start
    return SearchResult(plans=plans, stats=stats)


def _checked_arguments(
    global_batch: int,
    objective: str,
    memory_headroom: float | None,
    top_k: int,
    time_limit_s: float,
    budget_s: float | None,
) -> float:
    """The memory headroom the search plans with; `NoFeasiblePlanError` for an argument out
    of range (in the order the arguments are checked)."""
    if not is_whole(global_batch):
        raise NoFeasiblePlanError(f"global_batch={global_batch!r} must be a whole number >= 1")
    if global_batch > MAX_GLOBAL_BATCH:
        raise NoFeasiblePlanError(
            f"global_batch={global_batch:,} sequences is more than the {MAX_GLOBAL_BATCH:,} "
            "autoplan plans for; give a real batch size"
        )
    if objective not in OBJECTIVES:
        raise NoFeasiblePlanError(
            f"objective={shown(objective)} is not one autoplan knows; use one of "
            f"{', '.join(OBJECTIVES)}"
        )
    headroom = plan_memory_headroom(None, memory_headroom)  # (None: the default)
    if not is_whole(top_k):
        raise NoFeasiblePlanError(f"top_k={top_k!r} must be a whole number >= 1")
    if not isinstance(time_limit_s, (int, float)) or not 0 < time_limit_s < math.inf:
        raise NoFeasiblePlanError(f"time_limit_s={time_limit_s!r} must be a number of seconds > 0")
    if budget_s is not None and (
        not isinstance(budget_s, (int, float)) or not 0 <= budget_s < math.inf
    ):
        raise NoFeasiblePlanError(
            f"budget_s={budget_s!r} must be a number of seconds >= 0, or None (until proven)"
        )
    return headroom


def _space_for(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    framework: str,
    constraints: dict[str, Any],
) -> SearchSpace:
    """The search space of ``constraints`` for the cluster, cut to what the framework's stack
    runs (`stack_filter`); `ConstraintError` when the constraints leave nothing or ask for a
    dtype the device has no rate for."""
    space = SearchSpace.from_constraints(**constraints)
    stack = framework_profile(framework)
    space = within_model(space, stack, profile)
    space = space.for_cluster(cluster)
    space.check_cluster(cluster, profile, global_batch)
    for dtype in space.dtype or ():
        missing = cluster.device.missing_rate(dtype)
        if missing is not None and fp8_recipe(dtype) is not None:
            raise ConstraintError(missing)
        if missing is not None:
            raise ConstraintError(f"dtype={dtype}: {missing}; pass dtype='fp16' (--dtype fp16)")
    space = space.within_policy(dtype_given="dtype" in constraints)
    space = within_stack(space, stack, profile, cluster, dtype_given="dtype" in constraints)
    if space.ep_folding is None:
        # where the framework's stack puts an ep group (`FrameworkProfile.expert_layout`);
        # autoplan's runtime runs both
        layout = stack.expert_layout
        folding = {"folded": (True,), "dp": (False,)}.get(layout or "", (False, True))
        space = replace(space, ep_folding=folding)
    if stack.expert_tensor_parallel:
        # etp 1 and tp tried, the degrees between when asked for (`space.etp_choices`)
        space = replace(space, expert_tensor_parallel=True)
    elif space.etp is not None and max(space.etp) > 1:
        raise ConstraintError(
            f"etp={shown(space.etp)}: {stack.name} does not split routed experts over "
            "tensor-parallel ranks; drop the etp constraint, or search for megatron-lm"
        )
    if space.hsdp and stack.hsdp_zero_stages:
        # HSDP shard groups fill a scale-up domain (`space.hsdp_shards`)
        space = replace(space, hsdp_domain=cluster.scale_up_domain)
    return space


@dataclass(kw_only=True, slots=True)
class _Run:
    """One search's state between its seed and visit steps."""

    model: CostModel
    own_cuts: _OwnCuts
    global_batch: int
    incumbents: Incumbents
    frontier: _Frontier
    enumeration: Enumeration  # the shapes phase 1 left (the visit expands them)
    infeasible: list[Strategy]  # outer choices proven unable to fit (for the diagnosis)
    stats: SearchStats
    progress: Callable[[SearchProgress], None] | None
    work: Work
    budget_s: float | None
    time_limit_s: float
    # (even-split step, order, candidate) of the seeded candidates (phase 3 queues them)
    seeded: list[tuple[float, int, Candidate]] = field(default_factory=list)
    # by order: each seeded candidate's problem and its evaluated even splits (reused)
    problems: dict[int, PartitionProblem] = field(default_factory=dict)
    splits: dict[int, list[Partition]] = field(default_factory=dict)
    # identical problems (and least factors) answered once
    solved: dict[tuple[object, ...], tuple[Partition | None, SolveStats]] = field(
        default_factory=dict
    )
    # lower bounds (on the objective) of the candidates left unproven
    unproven: list[float] = field(default_factory=list)
    # phase 3's queue: (bound on the objective, order, stage, the `Pending` or `Candidate`)
    queue: list[tuple[float, int, int, object]] = field(default_factory=list)
    # the bound (on the objective) of the candidate being seeded or visited (None: none)
    current: float | None = None

    def left_unproven(self) -> list[float]:
        """The bounds (on the objective) of every candidate not finished: the one in hand,
        the seeded ones not visited yet and the frontier's."""
        return (
            ([] if self.current is None else [self.current])
            + [self.incumbents.least_bound(c) for _, _, c in self.seeded]
            + [entry[0] for entry in self.queue]
            + self.frontier.floors(self.incumbents.least_of)
            + [entry.floor_s for entry in self.enumeration.left]
        )

    def stack_cuts(self, candidate: Candidate, problem: PartitionProblem) -> list[Partition]:
        """The stack's own cut under each recompute mode; for a stack whose engine re-times
        the whole step (`FrameworkProfile.engine`: DeepSpeed's pipeline engine), at that step,
        the one its plans report and the search must rank by."""
        model = self.model
        cuts = self.own_cuts.splits(problem)
        self.work.simulation(problem.spec, len(cuts))
        if model.stack.engine is None:
            return cuts
        self.work.charge(len(cuts) * COST_S)
        return [
            replace(
                cut,
                step_time_s=model.estimate(
                    plan_of(model, candidate, cut, self.global_batch)
                ).step_time_s,
            )
            for cut in cuts
        ]

    def problem(self, candidate: Candidate) -> PartitionProblem:
        """The candidate's stage-partition problem (its work charged)."""
        self.work.schedule(candidate.strategy.schedule_spec)
        self.work.charge(PROBLEM_STAGE_S * candidate.strategy.num_stages)
        return partition_problem(candidate, self.model)

    def report(self, visited: int, phase: Literal["seed", "visit"]) -> None:
        """A `SearchProgress` after ``visited`` candidates of ``phase``."""
        if self.progress is None:
            return
        left = self.frontier.remaining() + len(self.queue)
        self.progress(
            SearchProgress(
                visited=visited,
                total=visited + left,
                best_step_time_s=self.incumbents.best(),
                phase=phase,
            )
        )


def _seed(run: _Run) -> None:
    """Phase 2: a strong incumbent before any proof. The even split of each candidate in the
    visiting order that each rank's memory does not rule out (`refined_candidate`; a few
    simulations each) until the seed share of the budget is spent, then
    local search (`partition.improve`) from the best few. Without a budget: a fixed number of
    each, so the result does not depend on the machine's speed."""
    incumbents, seeded, stats, work = run.incumbents, run.seeded, run.stats, run.work
    t0 = time.perf_counter()
    spent, left = work.spent_s, work.left_s()
    seed_end = spent + _SEED_SHARE * left
    while True:
        if run.budget_s is None:
            if len(seeded) >= max(_SEEDS, incumbents.top_k):
                break
        elif seeded and (len(seeded) >= _MAX_SEEDS or (incumbents and work.exhausted(seed_end))):
            # (with no plan yet, seeding goes on past its share: the visit would spend the
            # budget raising bounds, and then go on past it until it finds a plan)
            break
        entry = run.frontier.pop(incumbents.cutoff())
        if entry is None and not incumbents and run.enumeration.left:
            # none of the shapes expanded has a plan: the next that may
            run.frontier.extend(run.enumeration.run(work.spent_s))
            continue
        if entry is None:
            break
        order, candidate = entry
        only = run.own_cuts.only
        if not only:
            # each rank's memory first: the visiting order's key does not prove a candidate
            # can fit, and a seed that cannot is work spent for no incumbent
            candidate = refined_candidate(candidate, run.frontier.tables, work)
            if math.isinf(candidate.time_lower_bound_s):
                stats.pruned_memory += 1
                run.infeasible.append(candidate.strategy)
                continue
        run.current = incumbents.least_bound(candidate)
        problem = run.problems[order] = run.problem(candidate)
        run.splits[order] = (
            run.stack_cuts(candidate, problem) if only else even_splits(problem, work)
        )
        found = fastest_fitting(problem, run.splits[order])
        if found is not None:
            incumbents.offer(order, candidate, found)
        seeded.append((found.step_time_s if found else math.inf, order, candidate))
        run.current = None
        run.report(len(seeded), "seed")
    seeded.sort(key=lambda item: (item[0], item[1]))
    improve_end = spent + _IMPROVE_SHARE * left
    for _, order, candidate in seeded[
        : 0 if run.own_cuts.only else max(_IMPROVED, incumbents.top_k)
    ]:
        if incumbents and work.exhausted(improve_end):
            break
        found, _ = heuristic(
            run.problems[order], work=work, stop_at_s=improve_end, splits=run.splits[order]
        )
        if found is not None:
            incumbents.offer(order, candidate, found)
    stats.seed_s = time.perf_counter() - t0
    stats.seed_step_time_s = incumbents.best()


# What a candidate in the best-first visit has been through: the floors of its enumeration
# (`Pending`), its costed bounds (`costed_candidate`), each rank's memory (`refined_candidate`),
# the schedule's own paths (`Candidate.schedule_bound_s`); then its partition is solved.
_SHAPE, _PENDING, _COSTED, _REFINED, _SCHEDULED = range(5)


def _visit(run: _Run) -> None:
    """Phase 3: best bound first. Every candidate not seeded waits in one queue by its proven
    bound on the objective; the lowest is taken and raised one step (costed, refined by each
    rank's memory, bounded by its schedule's paths: each step costlier and tighter than the
    one before), or, past them all, its stage cuts are solved (`partition.solve`, its LP
    relaxation first, stopped at the k-th best). So each unit of work goes where it can raise
    the least bound, which is what the proven gap reads, and a candidate is costed, refined or
    solved only when nothing cheaper could prune it. A candidate whose bound reaches the k-th
    best is dropped. Adds to ``run.unproven`` the bounds (on the objective) of the candidates
    left unproven: unfinished solves, and every candidate left when the budget ran out."""
    incumbents, stats, work = run.incumbents, run.stats, run.work
    queue = run.queue
    # (the seeds were refined, but under a stack that cuts its stages itself)
    seeded = _COSTED if run.own_cuts.only else _REFINED
    for _, order, candidate in run.seeded:
        queue.append((incumbents.least_bound(candidate), order, seeded, candidate))
    run.seeded.clear()
    pending, ready = run.frontier.drain()
    queue += [
        (
            entry.time_floor_s * incumbents.least_of(entry.strategy, entry.modes),
            entry.index,
            _PENDING,
            entry,
        )
        for entry in pending
    ]
    queue += [(incumbents.least_bound(c), order, _COSTED, c) for order, c in ready]
    # (the shapes' floors on the objective: its factor is at least 1)
    queue += [(e.floor_s, -1 - e.index, _SHAPE, e) for e in run.enumeration.take_left()]
    heapq.heapify(queue)
    visited = 0
    while queue:
        bound, order, stage, item = heapq.heappop(queue)
        if bound >= incumbents.cutoff():
            # the least bound left cannot beat the k-th best: nor can any other
            stats.shapes_left = _shapes_in(queue) + (stage == _SHAPE)
            stats.pruned_bound += 1 + len(queue) - stats.shapes_left
            queue.clear()
            break
        if work.exhausted() and incumbents:
            # out of work: the rest are unproven; their bounds give the gap
            stats.shapes_left = _shapes_in(queue) + (stage == _SHAPE)
            stats.unvisited = 1 + len(queue) - stats.shapes_left
            run.unproven += [bound] + [entry[0] for entry in queue]
            queue.clear()
            break
        run.current = bound
        if stage == _SHAPE:
            assert isinstance(item, ShapeEntry)
            for entry in run.enumeration.expand(item):
                factor = incumbents.least_of(entry.strategy, entry.modes)
                heapq.heappush(queue, (entry.time_floor_s * factor, entry.index, _PENDING, entry))
        elif stage == _PENDING:
            assert isinstance(item, _Pending)
            costed = run.frontier.cost(item)
            if costed is not None:
                heapq.heappush(queue, (incumbents.least_bound(costed), order, _COSTED, costed))
        elif stage < _SCHEDULED:
            assert isinstance(item, Candidate)
            stage, raised = _raised(run, stage, item)
            if raised is not None:
                heapq.heappush(queue, (incumbents.least_bound(raised), order, stage, raised))
        else:
            assert isinstance(item, Candidate)
            visited += 1
            _solve(run, order, item)
            run.report(visited, "visit")
        run.current = None


def _shapes_in(queue: list[tuple[float, int, int, object]]) -> int:
    """How many of the queue's entries are shapes not expanded."""
    return sum(1 for entry in queue if entry[2] == _SHAPE)


def _enumeration_report(progress: Callable[[SearchProgress], None]) -> Callable[[int], None]:
    """A `SearchProgress` of phase "enumerate" after ``enumerated`` outer choices."""

    def report(enumerated: int) -> None:
        progress(
            SearchProgress(visited=enumerated, total=0, best_step_time_s=None, phase="enumerate")
        )

    return report


def _raised(run: _Run, stage: int, candidate: Candidate) -> tuple[int, Candidate | None]:
    """A costed candidate's bounds one step further (each rank's memory, then for several
    stages per rank the schedule's paths), with its new stage; None when they prove it cannot
    beat the k-th best. Under a stack that cuts its stages itself, one cut a mode: the bound
    of that cut's own stage times (`_own_cut_bound`), then its simulation is the solve."""
    if run.own_cuts.only:
        if stage == _COSTED:
            bound = _own_cut_bound(run, candidate)
            candidate = replace(
                candidate, time_lower_bound_s=max(candidate.time_lower_bound_s, bound)
            )
            return _REFINED, candidate
        return _SCHEDULED, candidate
    if stage == _COSTED:
        refined = refined_candidate(candidate, run.frontier.tables, run.work)
        if math.isinf(refined.time_lower_bound_s):
            # no recompute lets every rank fit: a memory proof, for the diagnosis
            run.stats.pruned_memory += 1
            run.infeasible.append(candidate.strategy)
            return _REFINED, None
        return _REFINED, refined
    if candidate.strategy.virtual_stages > 1:
        # several stages per rank: totals cannot see the bubble; the schedule's paths can
        t0 = time.perf_counter()
        raised = max(candidate.time_lower_bound_s, candidate.schedule_bound_s(run.work))
        run.stats.bounds_s += time.perf_counter() - t0
        candidate = replace(candidate, time_lower_bound_s=raised)
        if run.incumbents.least_bound(candidate) >= run.incumbents.cutoff():
            run.stats.pruned_schedule += 1
            return _SCHEDULED, None
    return _SCHEDULED, candidate


def _own_cut_bound(run: _Run, candidate: Candidate) -> float:
    """A lower bound on the step of the stack's own cut of ``candidate`` (its least over the
    recompute modes, one a plan), from that cut's stage times, without the schedule's orders
    (building them is what a first simulation of a large schedule costs most:
    `partition.path_bound`). Not for a stack whose engine re-times the step (the bound is of
    the simulation)."""
    if run.model.stack.engine is not None:
        return candidate.time_lower_bound_s
    # (not kept for the solve: the problems of every candidate waiting in the queue would
    # hold their per-unit tables at once; the few solved build theirs again)
    problem = partition_problem(candidate, run.model)
    run.work.charge(PROBLEM_STAGE_S * candidate.strategy.num_stages)
    starts = run.own_cuts.starts(problem.num_stages)
    if starts is None:
        return candidate.time_lower_bound_s  # (no cut: the solve finds none)
    run.work.charge(ACTION_S * 4 * len(starts) * len(problem.modes))
    return min(path_bound(problem, starts, (mode,) * len(starts)) for mode in problem.modes)


def _solve(run: _Run, order: int, candidate: Candidate) -> None:
    """Solve a visited candidate's stage cuts (with the k-th best as its cutoff once there are
    k) and record what came of it."""
    incumbents, stats = run.incumbents, run.stats
    least = incumbents.least_factor(candidate)
    cutoff = incumbents.cutoff() / least if incumbents.full else None
    found, solve_stats = _partition(run, order, candidate, least, cutoff)
    if solve_stats.status == "CUTOFF":
        stats.solver_cutoff += 1  # proven unable to beat the k-th best
    elif solve_stats.status == "INFEASIBLE":
        stats.solver_infeasible += 1
        run.infeasible.append(candidate.strategy)
    elif solve_stats.status in ("UNKNOWN", "FEASIBLE"):
        stats.solver_timeouts += 1
        # what the solver proved, or at least the candidate's own proven bound
        run.unproven.append(least * max(solve_stats.lower_bound_s, candidate.time_lower_bound_s))
        logger.info("CP-SAT hit its time limit (%s) for %s", solve_stats.status, candidate.strategy)
    if found is not None:
        incumbents.offer(order, candidate, found)


def _partition(
    run: _Run, order: int, candidate: Candidate, least: float, cutoff: float | None
) -> tuple[Partition | None, SolveStats]:
    """The best stage partition of a visited candidate: the stack's own cut, or CP-SAT's
    (`partition.solve`, stopped at ``cutoff`` on the step), reused for an identical problem."""
    stats = run.stats
    problem = run.problems.pop(order) if order in run.problems else run.problem(candidate)
    key = (problem.content_key(), least)
    t0 = time.perf_counter()
    if run.own_cuts.only:
        # the stack's own cut, one recompute mode throughout: nothing to solve
        found = fastest_fitting(
            problem, run.splits.pop(order, []) or run.stack_cuts(candidate, problem)
        )
        solve_stats = SolveStats(
            status="OPTIMAL" if found else "INFEASIBLE", wall_time_s=0.0, num_variables=0
        )
    elif key in run.solved:
        # Another outer choice with identical tables (e.g. a rank layout that places every
        # group alike) was solved already; the cutoff only ever falls, so a cutoff verdict
        # still holds.
        found, solve_stats = run.solved[key]
        stats.solver_reused += 1
    else:
        limit = run.time_limit_s
        if run.budget_s is not None:
            # until a first plan is found the search goes on past its budget, one budget
            # per solve at most; after, a solve may take a share of what is left (one that
            # cannot close its gap must not take it all from the candidates behind it)
            remaining = run.work.left_s()
            limit = max(
                0.05,
                min(
                    limit,
                    _SOLVE_SHARE * remaining if run.incumbents else max(remaining, run.budget_s),
                ),
            )
        found, solve_stats = solve(
            problem,
            time_limit_s=limit,
            cutoff_s=cutoff,
            relative_gap=RELATIVE_GAP,
            work=run.work,
        )
        run.solved[key] = (found, solve_stats)
        stats.solver_calls += 1
    stats.solver_s += time.perf_counter() - t0
    return found, solve_stats


# ------------------------------------------------------------------------------ visit order


class _OwnCuts:
    """The stage cut of a framework that cuts its stages itself (`FrameworkProfile.stage_cuts`
    "own": its `pipeline_split`, else evenly over the units), by number of stages."""

    def __init__(self, profile: ModelProfile, framework: str) -> None:
        self._stack = framework_profile(framework)
        self.only = self._stack.stage_cuts == "own"
        self._profile = profile
        self._starts: dict[int, tuple[int, ...] | None] = {}

    def starts(self, num_stages: int) -> tuple[int, ...] | None:
        """The first unit of each stage (`FrameworkProfile.stage_starts`, the cut
        `FrameworkProfile.plan_refusal` holds a plan to); None where the stack cannot cut the
        model so."""
        if num_stages not in self._starts:
            try:
                starts: tuple[int, ...] | None = self._stack.stage_starts(self._profile, num_stages)
            except StageSplitError:
                starts = None
            self._starts[num_stages] = starts
        return self._starts[num_stages]

    def splits(self, problem: PartitionProblem) -> list[Partition]:
        """That cut under each recompute mode, evaluated (empty where there is none)."""
        starts = self.starts(problem.num_stages)
        if starts is None:
            return []
        return [evaluate(problem, starts, (mode,) * len(starts)) for mode in problem.modes]
