"""`autoplan.search`: the fastest plan that fits, under the cost model.

Expects a traced model (or a module to trace), a Cluster and a global batch. Three phases:

1. Outer enumeration (`space.strategies`) of degrees, micro-batching, schedule, ZeRO level,
   sequence parallelism and rank layout. A memory bound drops what cannot fit; the rest get
   their per-unit costs and proven lower bounds on the simulated step (the busiest rank's work
   and tail, `cost_model.schedules.pipeline_lower_bound_s`, communication, the memory the
   recompute modes must buy back) and are ordered by an even-split estimate with
   communication, ``max(m, p) T + (min(m, p) - 1) T / v`` plus the tail, with the recompute
   an even cut needs to fit (order only, not a bound).
2. The first few get a heuristic partition (`partition.heuristic`: even splits and local
   search on the simulation): a strong incumbent before any proof.
3. Visit in order: skip a candidate when a proven bound cannot beat the k-th best (for several
   stages per rank also `bounds.pipeline_factor`, from the schedule's own paths); else a
   CP-SAT model (`partition.solve`) chooses the stage cuts and per-stage recompute that
   minimise the simulated step of the schedule torch runs (lazy longest-path cuts), with the
   k-th best as cutoff.

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
needs.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Literal

from autoplan.contract.errors import NoFeasiblePlanError
from autoplan.contract.plan import (
    ModelRef,
    Plan,
    Recompute,
    StagePlan,
    plan_estimate,
    runtime_refusal,
)
from autoplan.planner.bounds import pipeline_factor, share_range
from autoplan.planner.partition import (
    ModeCosts,
    Partition,
    PartitionProblem,
    SolveStats,
    evaluate,
    even_splits,
    fastest_fitting,
    heuristic,
    min_peak_memory,
    solve,
)
from autoplan.planner.space import (
    ConstraintError,
    SearchSpace,
    recompute_modes,
    shown,
    strategies,
)
from cost_model.estimate import (
    CostModel,
    MemoryConstants,
    UnitCost,
    boundary_send_bytes,
    memory_constants,
)
from cost_model.frameworks import (
    DEFAULT_FRAMEWORK,
    FrameworkProfile,
    Refusal,
    framework_profile,
)
from cost_model.hardware import Cluster
from cost_model.headroom import (
    DEFAULT_MEMORY_HEADROOM,
    plan_memory_headroom,
    usable_capacity_bytes,
)
from cost_model.memory import activation_bytes, activation_scale, local_num_params, static_bytes
from cost_model.schedules import even_held, least_held, pipeline_lower_bound_s, sends_at_end
from cost_model.stage_splits import StageSplitError
from cost_model.strategy import Strategy
from cost_model.uncertainty import (
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    TIE_FRACTION,
    objective_factor,
    step_interval,
    strategy_features,
)
from cost_model.workload import ModelProfile

logger = logging.getLogger(__name__)

# A stage partition within this fraction of the proven optimum of its outer choice counts as
# optimal (the lazy path loop's last rounds often move the step by less than this).
RELATIVE_GAP = 5e-4
# Seconds the search may spend visiting candidates before it returns its best with the
# proven gap (`SearchStats.optimality_gap`); None visits until every candidate is proven.
DEFAULT_BUDGET_S = 10.0
# The largest global batch a search takes (sequences): far above any published run (~10^4).
MAX_GLOBAL_BATCH = 2**24
# Phase 2 (the first incumbent): without a budget, the even split of this many candidates
# (first in the visiting order); with one, as many as fit in this share of what is left of it
# after phase 1 (at most _MAX_SEEDS). Then local search from the best _IMPROVED of them, until
# _IMPROVE_SHARE of it is spent.
_SEEDS = 8
_MAX_SEEDS = 256
_SEED_SHARE = 0.3
_IMPROVED = 4
_IMPROVE_SHARE = 0.6
# Outer choices enumerated between two progress reports (`SearchProgress`).
_REPORT_EVERY = 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One outer choice: its per-unit costs under each recompute mode and its bounds."""

    strategy: Strategy
    by_mode: dict[Recompute, tuple[UnitCost, ...]]
    constants: MemoryConstants
    time_lower_bound_s: float
    memory_lower_bound_bytes: float  # tensor bytes (before buffers and allocator overhead)
    usable_bytes: float
    order_key_s: float  # the visiting order: an even-split estimate (heuristic, not a bound)
    work_s: float  # least per-micro-batch work of the units (memory-forced recompute included)
    fixed_s: float  # the loop's fixed overhead per step
    forward_cells: tuple[int, int]  # the units' forward shares (`bounds.share_range`)
    weight_cells: tuple[int, int]  # the units' weight shares of their backward

    def schedule_bound_s(self, deadline: float = math.inf) -> float:
        """A proven lower bound on the step from the schedule's own paths
        (`bounds.pipeline_factor`): costlier than ``time_lower_bound_s``, computed on demand
        and shared by every candidate with the same schedule, degrees and shares (weaker if
        cut short at ``deadline``)."""
        spec = self.strategy.schedule_spec
        factor = pipeline_factor(spec, self.forward_cells, self.weight_cells, deadline=deadline)
        return self.work_s * factor + self.fixed_s


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
    pruned_schedule: int = 0  # by the bound from the schedule's paths (`bounds.py`)
    bounds_s: float = 0.0  # time spent on those bounds
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
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
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
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise NoFeasiblePlanError(f"top_k={top_k!r} must be a whole number >= 1")
    if not isinstance(time_limit_s, (int, float)) or not 0 < time_limit_s < math.inf:
        raise NoFeasiblePlanError(f"time_limit_s={time_limit_s!r} must be a number of seconds > 0")
    if budget_s is not None and (
        not isinstance(budget_s, (int, float)) or not 0 <= budget_s < math.inf
    ):
        raise NoFeasiblePlanError(
            f"budget_s={budget_s!r} must be a number of seconds >= 0, or None (until proven)"
        )
    space = SearchSpace.from_constraints(**constraints)
    stack = framework_profile(framework)
    if stack.name == DEFAULT_FRAMEWORK:
        space = _within_runtime(space, profile)
    space = space.for_cluster(cluster)
    space.check_cluster(cluster, profile, global_batch)
    missing = cluster.device.missing_rate(space.dtype or "")
    if missing is not None:
        raise ConstraintError(f"dtype={space.dtype}: {missing}; pass dtype='fp16' (--dtype fp16)")
    space = _within_stack(space, stack, cluster, dtype_given="dtype" in constraints)
    if space.ep_folding is None:
        # where the framework's stack puts an ep group (`FrameworkProfile.expert_layout`);
        # autoplan's runtime runs both
        layout = framework_profile(framework).expert_layout
        folding = {"folded": (True,), "dp": (False,)}.get(layout or "", (False, True))
        space = replace(space, ep_folding=folding)
    stats = SearchStats()
    start = time.perf_counter()

    model = CostModel(profile, cluster, framework, memory_headroom=headroom)
    tables = _BoundTables(model)
    own_cuts = _OwnCuts(profile, framework)

    def stack_cuts(candidate: Candidate, problem: PartitionProblem) -> list[Partition]:
        """The stack's own cut under each recompute mode; for a stack whose engine re-times
        the whole step (`FrameworkProfile.engine`: DeepSpeed's pipeline engine), at that step,
        the one its plans report and the search must rank by."""
        cuts = own_cuts.splits(problem)
        if model.stack.engine is None:
            return cuts
        return [
            replace(
                cut,
                step_time_s=model.estimate(
                    _plan_of(model, candidate, cut, global_batch)
                ).step_time_s,
            )
            for cut in cuts
        ]

    # Phase 1: every outer choice gets a memory bound and two cheap floors from compute alone
    # (shared by all choices with the same TP degree, sequence parallelism, micro-batch and
    # dtype): a proven lower bound on its step, and a floor under its order key. Per-unit
    # costs are computed lazily, in order of that floor, when the visit needs them
    # (`_Frontier`): the visit order is the order key's, without costing every choice.
    memory_infeasible: list[Strategy] = []
    # the largest predicted peak a plan may have (the headroom and the peak's range taken off)
    capacity = model.usable_capacity_bytes()
    pending: list[_Pending] = []
    # the stack's rule -> the first plan it refused so, and how many
    refusals: dict[str, tuple[Refusal, int]] = {}
    for enumerated, (strategy, refusal) in enumerate(
        _stack_strategies(space, stack, profile, cluster, global_batch), start=1
    ):
        if progress is not None and enumerated % _REPORT_EVERY == 0:
            progress(
                SearchProgress(
                    visited=enumerated, total=0, best_step_time_s=None, phase="enumerate"
                )
            )
        if refusal is not None:
            first, count = refusals.get(refusal.rule, (refusal, 0))
            refusals[refusal.rule] = (first, count + 1)
            continue
        stats.candidates += 1
        modes = tuple(recompute_modes(space, strategy.schedule))
        if tables.memory_bound(strategy, modes) > capacity:
            stats.pruned_memory += 1
            memory_infeasible.append(strategy)
            continue
        # a stack with one recompute setting for the model: each mode is its own choice
        alone = [(mode,) for mode in modes] if stack.recompute_scope == "global" else [modes]
        fitting = [
            c for c in alone if len(alone) == 1 or tables.memory_bound(strategy, c) <= capacity
        ]
        if not fitting:
            stats.pruned_memory += 1
            memory_infeasible.append(strategy)
        for choice in fitting:
            order_floor, time_floor = tables.floors(strategy, choice)
            pending.append(_Pending(order_floor, time_floor, len(pending) + 1, strategy, choice))
    if refusals and not pending and not memory_infeasible:
        raise ConstraintError(
            f"{stack.name} runs none of the plans the constraints allow: "
            + "; ".join(
                f"{rule} ({count} plans, e.g. {first.value}: {first.fix})"
                for rule, (first, count) in refusals.items()
            )
            + "; allow what the parentheses name"
        )
    frontier = _Frontier(pending, tables, stats, memory_infeasible)
    stats.enumerate_s = time.perf_counter() - start
    deadline = math.inf if budget_s is None else start + budget_s

    # The objective is the step times a factor of the plan's features (1: "expected"; the
    # upper end of its 80% range: "pessimistic"), at least 1, so a step bound bounds it too.
    factors: dict[tuple[Strategy, frozenset[Recompute]], float] = {}

    def factor(strategy: Strategy, modes: Iterable[Recompute]) -> float:
        key = (strategy, frozenset(modes))
        if key not in factors:
            features = strategy_features(strategy, key[1], framework)
            factors[key] = objective_factor(features, objective)
        return factors[key]

    def least_of(strategy: Strategy, modes: tuple[Recompute, ...]) -> float:
        """The least factor of any mix of ``modes`` a partition of ``strategy`` uses."""
        return min(
            factor(strategy, mix)
            for size in range(1, len(modes) + 1)
            for mix in itertools.combinations(modes, size)
        )

    def least_factor(candidate: Candidate) -> float:
        return least_of(candidate.strategy, tuple(candidate.by_mode))

    # max-heap on the objective: the top_k; every candidate's best partition, for the ties
    best: list[tuple[float, int, Candidate, Partition]] = []
    offered: dict[int, tuple[float, Candidate, Partition]] = {}

    def kth() -> float:
        """The objective a candidate must beat, widened by the tie band: a plan within it of
        the best is still visited, for the ties."""
        return -best[0][0] * (1.0 + TIE_FRACTION) if len(best) == top_k else math.inf

    def offer(order: int, candidate: Candidate, found: Partition) -> None:
        value = found.step_time_s * factor(candidate.strategy, found.modes)
        if order in offered and offered[order][0] <= value:
            return  # the same outer choice: keep its better partition
        offered[order] = (value, candidate, found)
        for index, entry in enumerate(best):
            if entry[1] == order:
                best[index] = (-value, order, candidate, found)
                heapq.heapify(best)
                return
        if len(best) < top_k:
            heapq.heappush(best, (-value, order, candidate, found))
        elif value < -best[0][0]:
            heapq.heapreplace(best, (-value, order, candidate, found))

    # Phase 2: a strong incumbent before any proof. The even split of each candidate in the
    # visiting order (a few simulations each) until the seed share of the budget is spent,
    # then local search (`partition.improve`) from the best few. Without a budget: a fixed
    # number of each, so the result does not depend on the machine's speed.
    t0 = time.perf_counter()
    seed_end = t0 + _SEED_SHARE * (deadline - t0)
    seeded: list[tuple[float, int, Candidate]] = []  # (even-split step, order, candidate)
    # by order: each seeded candidate's problem and its evaluated even splits (reused below)
    problems: dict[int, PartitionProblem] = {}
    splits: dict[int, list[Partition]] = {}
    while True:
        if budget_s is None:
            if len(seeded) >= max(_SEEDS, top_k):
                break
        elif seeded and (len(seeded) >= _MAX_SEEDS or time.perf_counter() > seed_end):
            break
        entry = frontier.pop(kth())
        if entry is None:
            break
        order, candidate = entry
        problem = problems[order] = _problem(candidate, model)
        splits[order] = stack_cuts(candidate, problem) if own_cuts.only else even_splits(problem)
        found = fastest_fitting(problem, splits[order])
        if found is not None:
            offer(order, candidate, found)
        seeded.append((found.step_time_s if found else math.inf, order, candidate))
        if progress is not None:
            progress(
                SearchProgress(
                    visited=len(seeded),
                    total=len(seeded) + frontier.remaining(),
                    best_step_time_s=-max(best)[0] if best else None,
                    phase="seed",
                )
            )
    seeded.sort(key=lambda item: (item[0], item[1]))
    improve_end = t0 + _IMPROVE_SHARE * (deadline - t0)
    for _, order, candidate in seeded[: 0 if own_cuts.only else max(_IMPROVED, top_k)]:
        if best and time.perf_counter() > improve_end:
            break
        found, _ = heuristic(problems[order], deadline=improve_end, splits=splits[order])
        if found is not None:
            offer(order, candidate, found)
    stats.seed_s = time.perf_counter() - t0
    stats.seed_step_time_s = min((-entry[0] for entry in best), default=None)

    # Phase 3: visit the seeded candidates (best even split first), then the rest in order;
    # skip what a proven bound says cannot beat the k-th best, and solve the stage cuts of
    # the rest exactly.
    unproven: list[float] = []  # lower bounds of candidates the solver did not finish
    solved: dict[tuple[object, ...], tuple[Partition | None, SolveStats]] = {}
    visited = 0
    while True:
        if seeded:
            _, order, candidate = seeded.pop(0)
        else:
            entry = frontier.pop(kth())
            if entry is None:
                break
            order, candidate = entry
        visited += 1
        strategy = candidate.strategy
        bound = candidate.time_lower_bound_s
        # the candidate's cutoff on its step: no partition of it beats the objective to beat
        least = least_factor(candidate)
        if bound * least >= kth():
            stats.pruned_bound += 1
            continue
        cutoff = kth() / least if len(best) == top_k else None
        if cutoff is not None and strategy.virtual_stages > 1 and time.perf_counter() < deadline:
            # Several stages per rank: totals cannot see the bubble; the schedule's paths can.
            t0 = time.perf_counter()
            bound = max(bound, candidate.schedule_bound_s(deadline))
            stats.bounds_s += time.perf_counter() - t0
            if bound >= cutoff:
                stats.pruned_schedule += 1
                continue
        if time.perf_counter() > deadline and best:
            # Out of time: the rest are unproven; their bounds give the gap.
            # on the objective: each bound times its choice's least factor
            rest = (
                [bound * least]
                + [c.time_lower_bound_s * least_factor(c) for _, _, c in seeded]
                + frontier.floors(least_of)
            )
            stats.unvisited = len(rest)
            unproven.extend(rest)
            break
        problem = problems.pop(order) if order in problems else _problem(candidate, model)
        key = (problem.content_key(), least)
        t0 = time.perf_counter()
        if own_cuts.only:
            # the stack's own cut, one recompute mode throughout: nothing to solve
            found = fastest_fitting(
                problem, splits.pop(order, []) or stack_cuts(candidate, problem)
            )
            solve_stats = SolveStats(
                status="OPTIMAL" if found else "INFEASIBLE", wall_time_s=0.0, num_variables=0
            )
        elif key in solved:
            # Another outer choice with identical tables (e.g. a rank layout that places every
            # group alike) was solved already; the cutoff only ever falls, so a cutoff verdict
            # still holds.
            found, solve_stats = solved[key]
            stats.solver_reused += 1
        else:
            limit = time_limit_s
            if budget_s is not None:
                # until a first plan is found the search goes on past its budget, one budget
                # per solve at most
                remaining = deadline - time.perf_counter()
                limit = max(0.05, min(limit, remaining if best else max(remaining, budget_s)))
            found, solve_stats = solve(
                problem,
                time_limit_s=limit,
                cutoff_s=cutoff,
                relative_gap=RELATIVE_GAP,
            )
            solved[key] = (found, solve_stats)
            stats.solver_calls += 1
        stats.solver_s += time.perf_counter() - t0
        if solve_stats.status == "CUTOFF":
            stats.solver_cutoff += 1  # proven unable to beat the k-th best
        elif solve_stats.status == "INFEASIBLE":
            stats.solver_infeasible += 1
            memory_infeasible.append(strategy)
        elif solve_stats.status in ("UNKNOWN", "FEASIBLE"):
            stats.solver_timeouts += 1
            # what the solver proved, or at least the candidate's own proven bound
            unproven.append(least * max(solve_stats.lower_bound_s, candidate.time_lower_bound_s))
            logger.info("CP-SAT hit its time limit (%s) for %s", solve_stats.status, strategy)
        if found is not None:
            offer(order, candidate, found)
        if progress is not None:
            progress(
                SearchProgress(
                    visited=visited,
                    total=visited + len(seeded) + frontier.remaining(),
                    best_step_time_s=-max(best)[0] if best else None,
                )
            )
    if not best:
        stats.total_s = time.perf_counter() - start
        raise _no_feasible_plan(
            profile, cluster, global_batch, memory_infeasible, space, tables, stats, time_limit_s
        )
    if unproven:
        worst = -best[0][0]
        stats.optimality_gap = max(0.0, max((worst - low) / worst for low in unproven))
    stats.best_objective_s = min(value for value, _, _ in offered.values())
    plans = _ranked(model, offered, top_k, global_batch)
    stats.total_s = time.perf_counter() - start
    return SearchResult(plans=plans, stats=stats)


def _ranked(
    model: CostModel,
    offered: dict[int, tuple[float, Candidate, Partition]],
    top_k: int,
    global_batch: int,
) -> tuple[Plan, ...]:
    """The ``top_k`` best of the offered plans: by objective, except that plans within
    `TIE_FRACTION` of the best tie and go first by fewer unvalidated features, then by more
    memory left at the upper end of their peak's range (then objective, then visiting order:
    deterministic)."""
    by_value = sorted(offered.items(), key=lambda item: (item[1][0], item[0]))
    best = by_value[0][1][0]
    tied = [item for item in by_value if item[1][0] <= best * (1.0 + TIE_FRACTION)]
    rest = by_value[len(tied) :][: max(0, top_k - len(tied))]

    def plan_of(item: tuple[int, tuple[float, Candidate, Partition]]) -> Plan:
        _, (_, candidate, partition) = item
        return _to_plan(model, candidate, partition, global_batch)

    def tie_key(item: tuple[int, tuple[float, Candidate, Partition]]) -> Any:
        # from the partition's own numbers (no estimate per tied plan): its unvalidated
        # features, then the tensor bytes it leaves of its budget (the device bytes left
        # beyond the range's upper end, up to the factors every candidate shares)
        order, (value, candidate, partition) = item
        features = strategy_features(candidate.strategy, partition.modes, model.framework)
        room = candidate.usable_bytes - partition.peak_memory_bytes
        return (len(step_interval(features).unvalidated), -room, value, order)

    ties = sorted(tied, key=tie_key)[:top_k]
    return tuple(plan_of(item) for item in ties) + tuple(plan_of(item) for item in rest)


# ------------------------------------------------------------------------------ visit order


@dataclass(frozen=True, slots=True)
class _Pending:
    """An outer choice not yet costed, with its floors from compute alone."""

    order_floor_s: float  # at most its order key (`Candidate.order_key_s`)
    time_floor_s: float  # a proven lower bound on its simulated step
    index: int  # enumeration order (ties)
    strategy: Strategy
    modes: tuple[Recompute, ...]


class _Frontier:
    """The outer choices in the visiting order (ascending order key), costed on demand.

    A choice is costed (`_candidate`) only once no costed choice has an order key below its
    floor, so the order is the one costing every choice up front would give, at the price of
    the few hundred nearest the front. Choices whose proven floor cannot beat the cutoff are
    dropped uncosted."""

    def __init__(
        self,
        pending: list[_Pending],
        tables: _BoundTables,
        stats: SearchStats,
        infeasible: list[Strategy],
    ) -> None:
        # popped from the end: largest floor first in the list
        self._pending = sorted(pending, key=lambda e: (e.order_floor_s, e.index), reverse=True)
        self._ready: list[tuple[float, int, Candidate]] = []  # heap on the order key
        self._tables = tables
        self._stats, self._infeasible = stats, infeasible

    def pop(self, cutoff: float) -> tuple[int, Candidate] | None:
        """The next choice in order (None when none is left)."""
        pending, ready = self._pending, self._ready
        while pending and (not ready or pending[-1].order_floor_s < ready[0][0]):
            entry = pending.pop()
            if entry.time_floor_s >= cutoff:
                self._stats.pruned_bound += 1
                continue
            t0 = time.perf_counter()
            candidate = _candidate(entry.strategy, entry.modes, self._tables)
            self._stats.costs_s += time.perf_counter() - t0
            if candidate.memory_lower_bound_bytes > candidate.usable_bytes:
                self._stats.pruned_memory += 1
                self._infeasible.append(entry.strategy)
                continue
            heapq.heappush(ready, (candidate.order_key_s, entry.index, candidate))
        if not ready:
            return None
        _, index, candidate = heapq.heappop(ready)
        return index, candidate

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


# ------------------------------------------------------------------------------ cost tables


class _BoundTables:
    """The search's bounds (memory, compute floors) for one model on one cluster, over the
    `CostModel` that prices them; each table is keyed by the strategy fields it reads."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.profile = profile = model.profile
        self.cluster = cluster = model.cluster
        self._params: dict[tuple[int, bool, bool], float] = {}
        self._least_act: dict[tuple[object, ...], float] = {}
        self._memory: dict[tuple[object, ...], tuple[float, float]] = {}
        # the cost model without core sharing: `floors` applies each strategy's own stretch
        self._apart = model
        if cluster.shared_cores_per_node is not None:
            self._apart = CostModel(
                profile, replace(cluster, shared_cores_per_node=None), model.framework
            )
        self._floor_work: dict[tuple[object, ...], tuple[float, float, float, float]] = {}
        # per floor key: the units' recompute curve, alone (`_RecomputeCurve`)
        self._floor_curves: dict[tuple[object, ...], _RecomputeCurve] = {}
        cal = cluster.calibration
        # at least the usable bytes of any plan's device (no buffers counted)
        self._usable_at_most = MemoryConstants(
            buffer_bytes=0.0,
            reserved_bytes=cal.reserved_memory_bytes,
            allocator_overhead_fraction=cal.allocator_overhead_fraction,
        ).usable_bytes(model.usable_capacity_bytes())
        # representative unit -> how many units share its content
        self.class_counts = Counter(model.classes)
        # per sample at the traced dtype: the smallest tensor a pipeline stage can send
        self._smallest_output = min((u.output_bytes for u in profile.units[:-1]), default=0.0)
        # the routed experts' parameters (stored E / ep per device)
        self._expert_params = sum(facts.expert_params for facts in profile.moe_layers)

    def memory_bound(self, strategy: Strategy, modes: Sequence[Recompute]) -> float:
        """A lower bound on the device memory of any plan with these outer choices, plus the
        reserved bytes and the allocator overhead: the larger of (a) weights, gradients,
        optimizer state and the activations of the fewest micro-batches any rank holds (under
        the leanest recompute mode), spread evenly over the pipeline ranks, and (b) at the
        step's end, the same state and the boundary tensors the ranks' pending sends keep
        (`sends_at_end`, each at least the smallest output a stage can end with), spread
        evenly, or the busiest rank's sends alone if more."""
        inflight = least_held(strategy.schedule_spec)
        state, least_act = self._state(strategy, modes)
        p = strategy.pp_degree
        per_rank = (state + inflight * least_act) / p
        # (not cached: the sends depend on the schedule's micro-batches; a few operations)
        sends = sends_at_end(strategy.schedule_spec)
        cal = self.cluster.calibration
        if any(sends):
            scale = activation_scale(strategy, self.profile.traced_dtype_bytes)
            scale /= strategy.tp_degree if strategy.sequence_parallel else 1
            scale /= strategy.cp_degree
            size = self._smallest_output * scale * cal.pipeline_boundary_retention
            per_rank = max(per_rank, (state + sum(sends) * size) / p, max(sends) * size)
        return (1.0 + cal.allocator_overhead_fraction) * per_rank + cal.reserved_memory_bytes

    def _state(self, strategy: Strategy, modes: Sequence[Recompute]) -> tuple[float, float]:
        """`_state_memory`, cached by the strategy fields it reads."""
        whole = (
            strategy.tp_degree,
            strategy.sequence_parallel,
            strategy.micro_batch_size,
            strategy.dtype,
            tuple(modes),
            strategy.pp_degree,
            strategy.dp_degree,
            strategy.zero_stage,
            strategy.dp_wrapper,  # (GPipe with several micro-batches runs no DDP)
            strategy.cp_degree,
            strategy.ep_degree,
            strategy.ep_folding,
        )
        found = self._memory.get(whole)
        if found is None:
            found = self._state_memory(strategy, modes)
            self._memory[whole] = found
        return found

    def _state_memory(self, strategy: Strategy, modes: Sequence[Recompute]) -> tuple[float, float]:
        """(weights, gradients and optimizer state of all ranks; the activations of one
        micro-batch through every unit under the leanest mode), in bytes."""
        key = (strategy.tp_degree, strategy.pp_degree > 1, strategy.sequence_parallel)
        params = self._params.get(key)
        if params is None:
            params = sum(
                local_num_params(
                    unit,
                    strategy.tp_degree,
                    count_shared=key[1],
                    shared_expert_whole=self.model.shared_expert_whole(strategy),
                )
                for unit in self.profile.units
            )
            self._params[key] = params
        # as `CostModel` stores them: dense weights data-parallel over dp x cp, the routed
        # experts E / ep per device over dp x cp / ep
        # (the weights' view decides as the strategy: `Strategy.weights_view`)
        state = static_bytes(
            params - self._expert_params,
            strategy.dtype,
            strategy.runtime_zero_stage,
            strategy.weight_dp_degree,
            strategy.dp_wrapper,
        ).total_bytes
        if self._expert_params:
            experts = strategy.expert_view
            state += static_bytes(
                self._expert_params / strategy.ep_degree,
                strategy.dtype,
                experts.runtime_zero_stage,
                experts.dp_degree,
                experts.dp_wrapper,
            ).total_bytes
        act_key = (
            strategy.tp_degree,
            strategy.sequence_parallel,
            strategy.micro_batch_size,
            strategy.cp_degree,
            strategy.ep_degree,
        )
        least_act = self._least_act.get((*act_key, strategy.dtype, tuple(modes)))
        if least_act is None:
            traced = self.profile.traced_dtype_bytes
            least_act = 0.0
            for rep, count in self.class_counts.items():
                unit = self.model.local_unit(rep, strategy.cp_degree)
                least_act += count * min(
                    activation_bytes(unit, strategy, mode, traced)
                    + (
                        self.model.expert_cost(strategy, rep, mode, ()).activation_bytes
                        if unit.moe is not None
                        else 0.0
                    )
                    for mode in modes
                )
            self._least_act[(*act_key, strategy.dtype, tuple(modes))] = least_act
        return state, least_act

    def floors(self, strategy: Strategy, modes: tuple[Recompute, ...]) -> tuple[float, float]:
        """(a floor under the order key, a proven lower bound on the step) from the units'
        costs with one device per TP group and nothing else: no data or pipeline parallelism
        (their collectives, sharding and host time only add), TP groups on adjacent ranks
        (the fastest links), times stretched by the strategy's own core sharing (CPU rigs).
        The bound counts compute alone (no communication at all)."""
        key = (
            strategy.tp_degree,
            strategy.sequence_parallel,
            strategy.micro_batch_size,
            strategy.dtype,
            modes,
            strategy.cp_degree,
            strategy.ep_degree,
            strategy.ep_folding,
        )
        work = self._floor_work.get(key)
        if work is None:
            # (dp = ep: the experts split as in the strategy, their all-to-all on the nearest
            # ranks; the cp ring on the strategy's own cp degree, its ranks the nearest too)
            alone = replace(
                strategy,
                dp_degree=strategy.ep_degree,
                pp_degree=1,
                virtual_stages=1,
                num_micro_batches=1,
                schedule="1f1b",
                zero_stage=0,
            )
            by_mode = [self._apart.unit_costs(alone, mode) for mode in modes]
            self._floor_curves[key] = _RecomputeCurve.of(
                [
                    (count, [(c[rep].activation_bytes, c[rep].time_s) for c in by_mode])
                    for rep, count in self.class_counts.items()
                ]
            )
            order_work = order_largest = compute_work = compute_largest = 0.0
            for rep, count in self.class_counts.items():
                full = min(costs[rep].time_s for costs in by_mode)
                compute = min(
                    costs[rep].forward_compute_s
                    + costs[rep].backward_compute_s
                    + costs[rep].recompute_s
                    for costs in by_mode
                )
                order_work += count * full
                order_largest = max(order_largest, full)
                compute_work += count * compute
                compute_largest = max(compute_largest, compute)
            work = (order_work, order_largest, compute_work, compute_largest)
            self._floor_work[key] = work
        stretch = self.model.sharing(strategy).pipeline
        order_work, order_largest, compute_work, compute_largest = (w * stretch for w in work)
        p, v, m = strategy.pp_degree, strategy.virtual_stages, strategy.num_micro_batches
        fixed = self.model.step_overhead_s(strategy)
        spec = strategy.schedule_spec
        time_floor = pipeline_lower_bound_s(spec, compute_work, compute_largest) + fixed
        # The recompute the order key's even cut must buy (`_candidate`), from the same units
        # alone: no more state than `_state_memory`'s, no less usable memory than without
        # buffers, times no longer than the strategy's, so it stays under the key.
        held = even_held(spec)
        overflow = 1.0
        if held > least_held(spec):
            state, least_act = self._state(strategy, modes)
            room = p * self._usable_at_most - state
            order_work = stretch * self._floor_curves[key].time_within(room / held, saturate=True)
            overflow = _even_overflow(held, room, least_act)
            if math.isinf(overflow):
                return math.inf, time_floor
        share = max(order_work / p, order_largest)
        order_floor = overflow * (_even_pipeline_s(share, order_work, p, v, m) + fixed)
        return order_floor, time_floor


def _candidate(strategy: Strategy, modes: Sequence[Recompute], tables: _BoundTables) -> Candidate:
    """Per-unit costs of one outer choice and lower bounds on its step time and memory."""
    model, cluster = tables.model, tables.cluster
    by_mode = {mode: model.unit_costs(strategy, mode) for mode in modes}
    first = next(iter(by_mode.values()))
    p, v, m = strategy.pp_degree, strategy.virtual_stages, strategy.num_micro_batches
    constants = memory_constants(first, cluster, strategy)
    usable = constants.usable_bytes(model.usable_capacity_bytes())
    # Identical units share their cost objects: bound over distinct units with multiplicity.
    overlap = model.dp_overlap(strategy)
    largest = tail_a = tail_b = least_act = static_sum = static_max = 0.0
    classes: list[tuple[int, list[tuple[float, float]]]] = []  # (count, [(bytes, time)])
    for rep, count in tables.class_counts.items():
        per_mode = [costs[rep] for costs in by_mode.values()]
        largest = max(largest, min(c.time_s for c in per_mode))
        tail_a += count * min(c.post_sync_s + c.optimizer_s for c in per_mode)
        tail_b += count * min(
            c.post_sync_s + c.optimizer_s + c.dp_sync_s - overlap * c.backward_s for c in per_mode
        )
        least_act += count * min(c.activation_bytes for c in per_mode)
        static_sum += count * per_mode[0].static_bytes
        static_max = max(static_max, per_mode[0].static_bytes)
        classes.append((count, [(c.activation_bytes, c.time_s) for c in per_mode]))
    spec = strategy.schedule_spec
    # Each rank's stages all hold at least this many micro-batches at once at some point.
    least_inflight = least_held(spec)
    memory_bound = max((static_sum + least_inflight * least_act) / p, static_max)
    # Rank r needs static_r + held_r * act_r <= usable, so summed over the ranks the
    # activations held per micro-batch cannot exceed (p * usable - static) / least held:
    # the recompute modes must at least buy that much memory back.
    budget = (p * usable - static_sum) / least_inflight if least_inflight else math.inf
    curve = _RecomputeCurve.of(classes)
    total = curve.time_within(budget)
    if math.isinf(total):  # not even the leanest recompute modes fit: no plan does
        memory_bound = math.inf
    work = total  # the units' own work (what `schedule_bound` scales)
    # Every message of every boundary costs its host time on some rank (busy work), whatever
    # the cut; links only delay (they are not counted).
    # (every crossing boundary posts its messages at the same host cost: count them)
    crossings = boundary_crossings(strategy)
    messages = 2 * crossings * model.boundary(first[0], strategy, 0).message_s if crossings else 0.0
    total += messages
    # Proven: the pipeline's bound (`pipeline_lower_bound_s`), after which some rank's tail
    # (at least the loop's fixed overhead) still runs; and every rank's own work plus its tail
    # (the busiest rank's at least the average).
    fixed = model.step_overhead_s(strategy)
    time_bound = max(
        pipeline_lower_bound_s(spec, total, largest) + fixed,
        m * total / p + max(0.0, tail_a, tail_b) / p + fixed,
    )
    units = [costs[rep] for costs in by_mode.values() for rep in tables.class_counts]
    forward_shares = [c.forward_s / c.time_s for c in units if c.time_s > 0]
    weight_shares = [c.weight_s / c.backward_s for c in units if c.backward_s > 0]
    # Visiting order: evenly cut stages (`_even_pipeline_s`), plus the average tail. The work
    # pays for the recompute an even cut needs: every rank holds its share of the activations
    # as often as its schedule makes it (`even_held`), not as rarely as the bound above may
    # assume (`least_held`, 1 for every schedule but GPipe, as if one stage of each rank could
    # take all of them). Ordered by the bound's work instead, memory-tight pipelines with
    # large micro-batches, whose cuts must recompute nearly everything, came first by up to a
    # third of their step and used up the budget before plans without that recompute (e.g.
    # expert parallelism on one pipeline rank) were reached; and if no even cut fits even
    # under the leanest modes, it goes behind by its overflow (`_even_overflow`).
    held = even_held(spec)
    order_work = total
    if held > least_inflight:
        order_work = messages + curve.time_within((p * usable - static_sum) / held, saturate=True)
    share = max(order_work / p, largest)
    order_key = _even_pipeline_s(share, order_work, p, v, m) + max(0.0, tail_a, tail_b) / p + fixed
    overflow = _even_overflow(held, p * usable - static_sum, least_act)
    order_key = math.inf if math.isinf(overflow) else overflow * order_key
    return Candidate(
        order_key_s=order_key,
        work_s=work,
        fixed_s=fixed,
        forward_cells=share_range(forward_shares or [0.0, 1.0]),
        weight_cells=share_range(weight_shares or [0.0, 1.0]),
        strategy=strategy,
        by_mode=by_mode,
        constants=constants,
        time_lower_bound_s=time_bound,
        memory_lower_bound_bytes=memory_bound,
        usable_bytes=usable,
    )


def boundary_crossings(strategy: Strategy) -> int:
    """Stage boundaries whose two stages sit on different pipeline ranks: all of them when
    p > 1, but the turn of a V (stage p-1 to p, both on rank p-1)."""
    if strategy.pp_degree == 1:
        return 0
    return strategy.num_stages - 1 - (strategy.schedule_placement == "v")


def _even_pipeline_s(share_s: float, work_s: float, p: int, v: int, m: int) -> float:
    """The visiting order's pipeline time of an even cut: ``max(m, p) T + (min(m, p) - 1) T' / v``
    with ``T`` a rank's share of the per-micro-batch work (``share_s``: ``work_s / p``, or the
    largest unit if more) and ``T' = work_s / p``. One stage per rank: 1F1B's ``(m + p - 1) T``;
    ``v`` stages per rank and ``m >= p``: the bubble shrinks to ``(p - 1) T / v`` (Narayanan
    et al. 2021, section 2.2). With fewer micro-batches than ranks every chunk waits for the
    whole pipeline: one micro-batch runs its ``p v`` stages in turn, ``p T``. (The former key,
    ``(m - 1/v) T + p T / v``, gave one micro-batch ``T + (p - 1) T / v`` and put pipelines of
    one or two micro-batches first at half their step.) Monotone in both times, so the floors
    stay under the keys."""
    return max(m, p) * share_s + (min(m, p) * work_s / p - share_s) / v


def _even_overflow(held: float, room_bytes: float, least_act_bytes: float) -> float:
    """How far an even cut overflows memory under the leanest modes, as a factor >= 1 on the
    visiting order's key: ``held`` rank shares of ``least_act_bytes`` must fit the
    ``room_bytes`` the pipeline ranks' state leaves. When they do not (e.g. a split backward,
    which cannot recompute), only cuts that load the ranks holding fewer micro-batches can
    fit: ordered behind by the overflow, finitely, so that a model no even cut fits keeps an
    order; inf when no room is left at all (the memory bound drops those). Smaller with more
    room and fewer bytes, so the floors (more room, fewer bytes) stay under the keys."""
    need = held * least_act_bytes
    if need <= room_bytes:
        return 1.0
    return need / room_bytes if room_bytes > 0 else math.inf


@dataclass(frozen=True, slots=True)
class _RecomputeCurve:
    """The least summed unit time as a function of the activation bytes the units may hold:
    the LP relaxation of choosing a recompute mode per unit (a multiple-choice knapsack).
    Units start at their fastest mode (``time_s``, holding ``held_bytes``) and buy bytes back
    along the lower convex hull of their modes, cheapest seconds-per-byte first,
    fractionally (``segments``: seconds per byte saved, bytes it can save, ascending)."""

    time_s: float
    held_bytes: float
    segments: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, classes: list[tuple[int, list[tuple[float, float]]]]) -> _RecomputeCurve:
        """From each class of ``count`` identical units and its (bytes, time) per mode."""
        time = 0.0
        held = 0.0
        segments: list[tuple[float, float]] = []
        for count, points in classes:
            start = min(points, key=lambda point: (point[1], point[0]))  # fastest, then smallest
            time += count * start[1]
            held += count * start[0]
            current = start
            while True:
                cheaper = [q for q in points if q[0] < current[0]]
                if not cheaper:
                    break
                nxt = min(cheaper, key=lambda q: ((q[1] - current[1]) / (current[0] - q[0]), q[0]))
                slope = max(0.0, (nxt[1] - current[1]) / (current[0] - nxt[0]))
                segments.append((slope, count * (current[0] - nxt[0])))
                current = nxt
        return cls(time, held, tuple(sorted(segments)))

    def time_within(self, budget: float, *, saturate: bool = False) -> float:
        """A lower bound on the summed unit time when their activation bytes must fit
        ``budget``. Returns inf if even the leanest modes cannot fit (the memory bound rejects
        such candidates anyway), or with ``saturate`` the time of the leanest modes."""
        time = self.time_s
        excess = self.held_bytes - budget
        for slope, saves in self.segments:
            if excess <= 0:
                break
            used = min(saves, excess)
            time += slope * used
            excess -= used
        return time if saturate or excess <= 1e-9 * max(self.held_bytes, 1.0) else math.inf


def _restricted(
    space: SearchSpace, name: str, allowed: Sequence[object] | None, refusal: str
) -> SearchSpace:
    """``space`` with its choices ``name`` cut to ``allowed`` (None: all); `ConstraintError`
    ending in ``refusal`` when none is left."""
    if allowed is None:
        return space
    choices = getattr(space, name)
    kept = tuple(choice for choice in choices if choice in allowed)
    if not kept:
        shown = [list(c) if isinstance(c, tuple) else c for c in choices]
        raise ConstraintError(f"{name}={shown}: {refusal}; allow one of them")
    changes: dict[str, Any] = {name: kept}
    return replace(space, **changes)


def _within_runtime(space: SearchSpace, profile: ModelProfile) -> SearchSpace:
    """``space`` cut to what autoplan's own runtime runs for this model (`runtime_refusal`:
    a torch.export graph only in fp32, without sequence or context parallelism; context
    parallelism only with RoPE tables); `ConstraintError` with the runtime's reason where the
    constraints ask for what it refuses."""
    exported, cp_ok = profile.exported, profile.rope_tables and not profile.exported
    limits: list[tuple[str, Any, Any]] = []  # (axis, what is left, a plan it refuses)
    if exported:
        limits += [("dtype", "fp32", {"dtype": space.dtype or "bf16"})]
        limits += [("sequence_parallel", (False,), {"sequence_parallel": True, "tp_degree": 2})]
    if not cp_ok:
        limits += [("cp", (1,), {"cp_degree": max(space.cp or (2,))})]
    if profile.moe_layers:
        # expert parallelism runs neither on DDP + ZeroRedundancyOptimizer (ZeRO-1) nor with
        # selective recompute around FSDP2's separately wrapped experts: a MoE model's search
        # leaves both out, as parallelize's own always has
        limits += [("zero", (0, 2, 3), None), ("recompute", ("none", "full"), None)]
    for axis, kept, refused in limits:
        asked = getattr(space, axis)
        if axis == "dtype":
            allowed = asked in (None, kept)
        else:
            allowed = asked is None or any(choice in kept for choice in asked)
        if not allowed:
            if refused is None:
                reason = (
                    f"{axis}={shown(asked)}: autoplan's runtime runs a mixture-of-experts model "
                    "without ZeRO-1 and selective recompute (with expert parallelism they break "
                    f"its wrappers); allow {shown(kept)}"
                )
            else:
                plan = {"dtype": "fp32", "sequence_parallel": False, "tp_degree": 1}
                plan |= {"cp_degree": 1, "ep_degree": 1}
                reason = str(runtime_refusal(SimpleNamespace(**{**plan, **refused}), profile))
            raise ConstraintError(f"{reason}; or price it for another stack (--framework)")
        if axis != "dtype" and asked is not None:
            kept = tuple(choice for choice in asked if choice in kept)
        changes: dict[str, Any] = {axis: kept}
        space = replace(space, **changes)
    return space


def _within_stack(
    space: SearchSpace, stack: FrameworkProfile, cluster: Cluster, *, dtype_given: bool
) -> SearchSpace:
    """``space`` cut to what ``stack`` runs: its dtypes, schedules, recompute modes, rank
    orders and sequence parallelism (`FrameworkProfile`); `ConstraintError` naming the limit
    where the constraints leave it nothing."""
    name = stack.name
    if stack.dtypes is not None and space.dtype not in stack.dtypes:
        given = "" if dtype_given else f" (the fastest on {cluster.device.name})"
        # the first of the stack's dtypes the device has its own peak for (V100: fp32)
        native = [d for d in stack.dtypes if d in cluster.device.peak_flops]
        fix = (native or list(stack.dtypes))[0]
        raise ConstraintError(
            f"dtype={space.dtype}{given}: {name} trains in {' or '.join(stack.dtypes)}; "
            f"pass dtype={fix!r} (--dtype {fix})"
        )
    space = _restricted(
        space, "schedules", stack.schedules, f"{name} runs only {', '.join(stack.schedules or ())}"
    )
    space = _restricted(
        space,
        "recompute",
        stack.recompute_modes,
        f"{name} has only {' and '.join(stack.recompute_modes or ())} recompute",
    )
    orders = " or ".join(str(list(layout)) for layout in stack.rank_layouts or ())
    space = _restricted(
        space,
        "rank_layouts",
        stack.rank_layouts,
        f"{name} orders its process groups {orders} (outermost first)",
    )
    if stack.sequence_parallel is False:
        if space.sequence_parallel == (True,):
            raise ConstraintError(
                f"sequence_parallel=True: {name} has no Megatron-style sequence parallelism"
            )
        space = replace(space, sequence_parallel=(False,))
    space = _restricted(
        space,
        "zero",
        stack.zero_stages,
        f"{name} runs only ZeRO {', '.join(map(str, stack.zero_stages or ()))}",
    )
    # degrees the stack does not have: 1 only (`FrameworkProfile.refusal` names the same)
    for axis, has, what in (
        ("tp", stack.tensor_parallel, "Megatron-style tensor parallelism"),
        ("pp", stack.pipeline_parallel, "pipeline parallelism"),
        ("cp", stack.context_parallel, "ring-attention context parallelism"),
        ("ep", stack.expert_parallel, "expert parallelism as a plan degree"),
    ):
        if has:
            continue
        allowed = getattr(space, axis)
        if allowed is not None and 1 not in allowed:
            raise ConstraintError(
                f"{axis}={list(allowed)}: {name} has no {what}; allow {axis} 1 (--{axis} 1)"
            )
        changes: dict[str, Any] = {axis: (1,)}
        space = replace(space, **changes)
    return space


def _stack_strategies(
    space: SearchSpace,
    stack: FrameworkProfile,
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
) -> Iterator[tuple[Strategy, Refusal | None]]:
    """The outer choices of ``space``, each with why ``stack`` cannot run it (None: it can).
    Under a pipeline engine's limits (`FrameworkProfile.refusal`) the pipelined choices are
    enumerated again within them, so that a choice the enumeration drops as dominated by one
    the stack refuses (ZeRO-1 by ZeRO-2) is still offered."""
    limited = stack.pipeline_max_zero is not None or not stack.pipeline_tensor_parallel
    moe = bool(profile.moe_layers)
    for strategy in strategies(space, profile, cluster, global_batch):
        refusal = stack.refusal(strategy, moe=moe)
        if not limited or strategy.pp_degree == 1 or refusal is not None:
            yield strategy, refusal
    if not limited:
        return
    top = stack.pipeline_max_zero
    zero = tuple(z for z in space.zero if top is None or z <= top)
    tp = space.tp
    if not stack.pipeline_tensor_parallel:
        tp = (1,) if space.tp is None or 1 in space.tp else ()
    if not zero or tp == ():
        return
    within = replace(space, zero=zero, tp=tp)
    for strategy in strategies(within, profile, cluster, global_batch):
        # (one refused for another reason was counted by the first pass)
        if strategy.pp_degree > 1 and stack.refusal(strategy, moe=moe) is None:
            yield strategy, None


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


def _problem(candidate: Candidate, model: CostModel) -> PartitionProblem:
    """The stage-partition problem of a candidate, in the cost model's own terms."""
    cluster = model.cluster
    strategy = candidate.strategy
    spec = strategy.schedule_spec
    overlap = model.dp_overlap(strategy)
    first = next(iter(candidate.by_mode.values()))
    fixed = model.step_overhead_s(strategy)
    # rank tail = max(0, sync - overlap * backward) + post + optimizer (+ the fixed overhead)
    #           = max(0, post + opt, post + opt + sync - overlap * backward): two tail terms
    tables = {
        mode: ModeCosts(
            forward_s=tuple(c.forward_s for c in costs),
            backward_s=tuple(c.backward_s for c in costs),
            weight_s=tuple(c.weight_s for c in costs),
            activation_bytes=tuple(c.activation_bytes for c in costs),
            retained_bytes=tuple(c.retained_bytes for c in costs),
            tail_s=(
                tuple(c.post_sync_s + c.optimizer_s for c in costs),
                tuple(
                    c.post_sync_s + c.optimizer_s + c.dp_sync_s - overlap * c.backward_s
                    for c in costs
                ),
            ),
        )
        for mode, costs in candidate.by_mode.items()
    }
    # A boundary's cost depends on the stage and its last unit's output bytes only: priced
    # once per stage and distinct size, and stages with equal rows share one row (thousands of
    # stages of thousands of units would otherwise hold millions of floats).
    sizes: dict[float, int] = {}  # output bytes -> index among the distinct sizes
    size_of = [sizes.setdefault(c.output_bytes, len(sizes)) for c in first]
    sample = {c.output_bytes: c for c in reversed(first)}  # a unit of each size
    rows: dict[tuple[float, ...], tuple[float, ...]] = {}
    transfer_s, message_s = [], []
    for s in range(spec.num_stages):
        priced = [model.boundary(sample[size], strategy, s) for size in sizes]
        by_size = tuple(b.transfer_s for b in priced)
        row = rows.get(by_size)
        if row is None:
            row = rows[by_size] = tuple(by_size[k] for k in size_of)
        transfer_s.append(row)
        message_s.append(priced[0].message_s)  # (unit 0's size comes first)
    return PartitionProblem(
        spec=spec,
        modes=tables,
        static_bytes=tuple(c.static_bytes for c in first),
        transfer_s=tuple(transfer_s),
        message_s=tuple(message_s),
        memory_capacity_bytes=candidate.usable_bytes,
        send_bytes=boundary_send_bytes(first, cluster.calibration),
        tail_constants_s=(fixed, fixed),
    )


# ------------------------------------------------------------------------------ read back


def _plan_of(
    model: CostModel, candidate: Candidate, partition: Partition, global_batch: int
) -> Plan:
    """The plan of an outer choice with its stage cuts (no estimate attached)."""
    profile = model.profile
    s = candidate.strategy
    ends = (*partition.stage_starts[1:], profile.num_units)
    stages = tuple(
        StagePlan(first_unit=a, last_unit=b - 1, recompute=mode)
        for a, b, mode in zip(partition.stage_starts, ends, partition.modes, strict=True)
    )
    plan = Plan(
        model=ModelRef.of(profile),
        dp_degree=s.dp_degree,
        tp_degree=s.tp_degree,
        pp_degree=s.pp_degree,
        cp_degree=s.cp_degree,
        ep_degree=s.ep_degree,
        ep_folding=s.ep_folding,
        virtual_stages=s.virtual_stages,
        stages=stages,
        micro_batch_size=s.micro_batch_size,
        num_micro_batches=s.num_micro_batches,
        global_batch_size=global_batch,
        schedule=s.schedule,
        zero_stage=s.zero_stage,
        sequence_parallel=s.sequence_parallel,
        dtype=s.dtype,  # type: ignore[arg-type]
        rank_layout=s.rank_layout,
        framework=model.framework,
        memory_headroom=model.memory_headroom,
    )
    return plan


def _to_plan(
    model: CostModel,
    candidate: Candidate,
    partition: Partition,
    global_batch: int,
) -> Plan:
    plan = _plan_of(model, candidate, partition, global_batch)
    s = candidate.strategy
    result = model.estimate(plan)
    # The solver kept every rank within memory by the same numbers `require_fits` checks.
    assert result.fits, result.memory_problem()
    # The solver optimised the cost model's own simulation: the two must agree.
    assert math.isclose(result.step_time_s, partition.step_time_s, rel_tol=1e-6), (
        result.step_time_s,
        partition.step_time_s,
        s,
    )
    return plan.with_estimate(plan_estimate(result, model.cluster))


def _no_feasible_plan(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    infeasible: list[Strategy],
    space: SearchSpace,
    tables: _BoundTables,
    stats: SearchStats,
    time_limit_s: float,
) -> NoFeasiblePlanError:
    gib = 2.0**30
    capacity = cluster.device.memory_bytes
    if not infeasible:
        given = [
            f"{key}={shown(value)}"
            for key in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "max_tp", "max_pp")
            if (value := getattr(space, key)) is not None
        ]
        limits = f"; with the constraints {' '.join(given)}" if given else ""
        return NoFeasiblePlanError(
            f"no valid plan for {profile.name!r} on {cluster.name!r} ({cluster.num_devices} "
            f"devices) with global_batch={global_batch}: no dp x tp x pp x cp covers the "
            f"{cluster.num_devices} devices with dp dividing global_batch={global_batch}, tp "
            f"dividing the model's heads within a node and pp at most its "
            f"{profile.num_units} units{limits}; raise the global batch, use fewer devices"
            + (", or relax the constraints" if given else "")
        )
    # The least memory any plan needs: solve exactly for the outer choices whose bounds are
    # lowest (weights and optimizer state first, then the full per-unit bound).
    infeasible.sort(
        key=lambda s: tables.memory_bound(s, recompute_modes(space, s.schedule)),
    )
    candidates = [
        _candidate(s, recompute_modes(space, s.schedule), tables) for s in infeasible[:20]
    ]
    candidates.sort(key=lambda c: c.constants.total_bytes(c.memory_lower_bound_bytes))
    needs = []
    for c in candidates[:5]:
        peak = min_peak_memory(_problem(c, tables.model), time_limit_s=time_limit_s)
        if peak.least_bytes is not None:
            needs.append((c.constants.total_bytes(peak.least_bytes), c.strategy))
    least: float | None = None
    if needs:
        least, best = min(needs, key=lambda item: item[0])
        amount = (
            f"{least / gib:.1f} GiB (e.g. tp={best.tp_degree} pp={best.pp_degree} dp="
            f"{best.dp_degree}"
            + (f" cp={best.cp_degree}" if best.cp_degree > 1 else "")
            + (f" ep={best.ep_degree}" if best.ep_degree > 1 else "")
            + f" micro_batch={best.micro_batch_size} zero={best.zero_stage})"
        )
    else:  # the solver found no partition of any of them in time: their floors, if finite
        floor = min(c.constants.total_bytes(c.memory_lower_bound_bytes) for c in candidates[:5])
        unknown = (
            f"bound unknown (CP-SAT found no partition within time_limit_s={time_limit_s:g} s, "
            "raise it for the least)"
        )
        amount = (
            f"at least {floor / gib:.1f} GiB, {unknown}"
            if math.isfinite(floor)
            else f"not known, {unknown}"
        )
    # A proven floor on the devices any plan needs: one copy of the weights, gradients and
    # optimizer state, sharded over every device (ZeRO-3 x TP x PP), before any activation.
    params = sum(local_num_params(unit, 1, count_shared=False) for unit in profile.units)
    assert space.dtype is not None  # resolved by `search_plans`
    state = static_bytes(params, space.dtype, 0, 1).total_bytes
    cal = cluster.calibration
    usable = MemoryConstants(
        buffer_bytes=0.0,
        reserved_bytes=cal.reserved_memory_bytes,
        allocator_overhead_fraction=cal.allocator_overhead_fraction,
    ).usable_bytes(tables.model.usable_capacity_bytes())
    floor = math.ceil(state / usable)
    # the least plan would fit with no headroom (the peak's range still counted)
    headroom_helps = least is not None and least <= usable_capacity_bytes(capacity, 0.0)
    devices = (
        f"; its weights, gradients and optimizer state alone need at least {floor} devices of "
        f"this type ({state / gib:,.0f} GiB)"
        if floor > cluster.num_devices
        else ""
    )
    return NoFeasiblePlanError(
        f"no plan for {profile.name!r} fits {cluster.name!r}: the least memory per device any of "
        f"the {stats.candidates} candidate plans needs is {amount}, the device has "
        f"{capacity / gib:.1f} GiB, of which a predicted peak may use "
        f"{tables.model.usable_capacity_bytes() / gib:.1f} GiB (memory headroom "
        f"{tables.model.memory_headroom:.0%} and the peak's range){devices}; "
        f"{_memory_fixes(space, headroom_helps)}",
        least_memory_bytes=least,
        capacity_bytes=float(capacity),
        usable_bytes=tables.model.usable_capacity_bytes(),
    )


def _memory_fixes(space: SearchSpace, headroom_helps: bool = False) -> str:
    """The fixes for a search in which nothing fits: more or larger devices, a lower memory
    headroom if one would let the least plan fit, and lifting the constraints the user set that
    keep memory-saving choices out (only those)."""
    fixes = ["use more devices or devices with more memory"]
    if headroom_helps:
        fixes.append("lower the memory headroom (memory_headroom=, --memory-headroom)")
    if "full" not in space.recompute:
        fixes.append("allow recompute 'full'")
    if 3 not in space.zero:
        fixes.append("allow ZeRO level 3")
    if space.micro_batch is not None and min(space.micro_batch) > 1:
        fixes.append("allow micro_batch 1")
    if space.tp is not None or space.max_tp is not None:
        fixes.append("allow larger tensor-parallel degrees")
    if space.pp is not None or space.max_pp is not None:
        fixes.append("allow more pipeline stages")
    if space.dtype == "fp32":
        fixes.append("train in bf16")
    return fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + ", or " + fixes[-1]
