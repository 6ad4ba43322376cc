"""`autoplan.search`: the fastest plan that fits, under the cost model.

Expects a traced model (or a module to trace), a Cluster and a global batch. Two levels:

1. Outer enumeration (`space.strategies`) of degrees, micro-batching, schedule, ZeRO level,
   sequence parallelism and rank layout. For each, the cost model's per-unit costs under each
   allowed recompute mode give a lower bound on the step time (perfect balance, no sends) and on
   the memory per device. Memory-infeasible candidates are dropped; the rest are visited in
   order of their bound, and the visit stops once no remaining bound can beat the k-th best.
2. For each visited candidate, a CP-SAT model (`partition.solve`) chooses the stage cuts and
   per-stage recompute exactly under the cost model's pipeline formula, hinted with a balanced
   greedy split.

Guarantees: the returned plans carry the cost model's own `estimate` of themselves (checked to
agree with the solver's objective), are valid for the cluster, and are ranked by step time.
No plan fits: `NoFeasiblePlanError` with the least memory per device any plan in the space needs.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from autoplan.errors import NoFeasiblePlanError
from autoplan.plan import ModelRef, Plan, PlanEstimate, Recompute, StagePlan
from autoplan.planner.partition import (
    ModeCosts,
    Partition,
    PartitionProblem,
    min_peak_memory,
    solve,
)
from autoplan.planner.space import SearchSpace, strategies
from cost_model.estimate import (
    MemoryConstants,
    UnitCost,
    estimate,
    memory_constants,
    stage_p2p_time_s,
    unit_costs,
)
from cost_model.hardware import Cluster
from cost_model.schedules import inflight_microbatches
from cost_model.strategy import Strategy
from cost_model.workload import ModelProfile

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One outer choice: its per-unit costs under each recompute mode and its bounds."""

    strategy: Strategy
    by_mode: dict[Recompute, tuple[UnitCost, ...]]
    constants: MemoryConstants
    time_lower_bound_s: float
    memory_lower_bound_bytes: float  # tensor bytes (before buffers and allocator overhead)
    usable_bytes: float


@dataclass(kw_only=True, slots=True)
class SearchStats:
    """What the search did (for `bench/search.py` and the CLI)."""

    candidates: int = 0
    pruned_memory: int = 0
    pruned_bound: int = 0
    solver_calls: int = 0
    solver_infeasible: int = 0
    enumerate_s: float = 0.0
    costs_s: float = 0.0
    solver_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchProgress:
    """Reported after each solver call: how far the visit is."""

    visited: int
    total: int
    best_step_time_s: float | None


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
    progress: Callable[[SearchProgress], None] | None = None,
    **constraints: Any,
) -> SearchResult:
    """The ``top_k`` fastest plans that fit (see the module docstring)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise NoFeasiblePlanError(f"global_batch={global_batch!r} must be a whole number >= 1")
    if top_k < 1:
        raise NoFeasiblePlanError(f"top_k={top_k!r} must be >= 1")
    space = SearchSpace.from_constraints(**constraints)
    space.check_cluster(cluster, profile, global_batch)
    stats = SearchStats()
    start = time.perf_counter()

    cache = _CostCache(profile, cluster)
    candidates: list[Candidate] = []
    memory_infeasible: list[Candidate] = []
    for strategy in strategies(space, profile, cluster, global_batch):
        stats.candidates += 1
        candidate = _candidate(strategy, space.recompute, cache, cluster)
        if candidate.memory_lower_bound_bytes > candidate.usable_bytes:
            stats.pruned_memory += 1
            memory_infeasible.append(candidate)
            continue
        candidates.append(candidate)
    stats.costs_s = time.perf_counter() - start
    candidates.sort(key=lambda c: c.time_lower_bound_s)

    # best: max-heap (by negated time) of the top_k partitions found so far
    best: list[tuple[float, int, Candidate, Partition]] = []
    for visited, candidate in enumerate(candidates):
        if len(best) == top_k and candidate.time_lower_bound_s >= -best[0][0]:
            stats.pruned_bound += len(candidates) - visited
            break
        t0 = time.perf_counter()
        found, solve_stats = solve(_problem(candidate, cluster), time_limit_s=time_limit_s)
        stats.solver_s += time.perf_counter() - t0
        stats.solver_calls += 1
        if solve_stats.status not in ("OPTIMAL", "INFEASIBLE"):
            logger.warning("CP-SAT stopped with %s for %s", solve_stats.status, candidate.strategy)
        if found is None:
            stats.solver_infeasible += 1
            memory_infeasible.append(candidate)
        else:
            entry = (-found.step_time_s, visited, candidate, found)
            if len(best) < top_k:
                heapq.heappush(best, entry)
            elif found.step_time_s < -best[0][0]:
                heapq.heapreplace(best, entry)
        if progress is not None:
            progress(
                SearchProgress(
                    visited=visited + 1,
                    total=len(candidates),
                    best_step_time_s=-max(best)[0] if best else None,
                )
            )
    if not best:
        stats.total_s = time.perf_counter() - start
        raise _no_feasible_plan(profile, cluster, global_batch, memory_infeasible, stats)
    ranked = sorted(best, key=lambda e: (-e[0], e[1]))
    plans = tuple(_to_plan(profile, cluster, c, p, global_batch) for _, _, c, p in ranked)
    stats.total_s = time.perf_counter() - start
    return SearchResult(plans=plans, stats=stats)


# ------------------------------------------------------------------------------ cost tables


class _CostCache:
    """Per-unit costs by (strategy, recompute mode); identical requests are computed once."""

    def __init__(self, profile: ModelProfile, cluster: Cluster) -> None:
        self.profile = profile
        self.cluster = cluster
        self._costs: dict[tuple[Strategy, str], tuple[UnitCost, ...]] = {}

    def costs(self, strategy: Strategy, mode: str) -> tuple[UnitCost, ...]:
        key = (strategy, mode)
        found = self._costs.get(key)
        if found is None:
            found = unit_costs(self.profile, self.cluster, strategy, mode)
            self._costs[key] = found
        return found


def _candidate(
    strategy: Strategy, modes: Sequence[Recompute], cache: _CostCache, cluster: Cluster
) -> Candidate:
    """Per-unit costs of one outer choice and lower bounds on its step time and memory."""
    by_mode = {mode: cache.costs(strategy, mode) for mode in modes}
    first = next(iter(by_mode.values()))
    n = len(first)
    p, v, m = strategy.pp_degree, strategy.virtual_stages, strategy.num_micro_batches
    constants = memory_constants(first, cluster, strategy)
    usable = constants.usable_bytes(float(cluster.device.memory_bytes))
    # The per-rank work can at best be spread evenly; each of the S - 1 boundaries costs at
    # least its cheapest send; the busiest rank's tail is at least the average tail.
    num_stages = p * v
    least_time = [min(costs[u].time_s for costs in by_mode.values()) for u in range(n)]
    if num_stages > 1:
        # a send's time grows with its bytes: the smallest boundary output is the cheapest
        smallest = min(first[:-1], key=lambda c: c.output_bytes)
        sends = sum(stage_p2p_time_s(smallest, cluster, strategy, s) for s in range(num_stages - 1))
    else:
        sends = 0.0
    total = sum(least_time) + sends
    longest = max(total / p, max(least_time))
    overlap = cluster.calibration.dp_overlap_fraction
    tail_terms = [0.0, 0.0]
    for u in range(n):
        tail_terms[0] += min(c[u].post_sync_s + c[u].optimizer_s for c in by_mode.values())
        tail_terms[1] += min(
            c[u].post_sync_s + c[u].optimizer_s + c[u].dp_sync_s - overlap * c[u].backward_s
            for c in by_mode.values()
        )
    time_bound = (m - 1 / v) * longest + total / v + max(0.0, *tail_terms) / p
    least_inflight = min(inflight_microbatches(strategy.schedule, p, m, v, r) for r in range(p))
    least_act = sum(min(c[u].activation_bytes for c in by_mode.values()) for u in range(n))
    static = [c.static_bytes for c in first]
    memory_bound = max((sum(static) + least_inflight * least_act) / p, max(static))
    return Candidate(
        strategy=strategy,
        by_mode=by_mode,
        constants=constants,
        time_lower_bound_s=time_bound,
        memory_lower_bound_bytes=memory_bound,
        usable_bytes=usable,
    )


def _problem(candidate: Candidate, cluster: Cluster) -> PartitionProblem:
    """The stage-partition problem of a candidate, in the cost model's own terms."""
    strategy = candidate.strategy
    p, v, m = strategy.pp_degree, strategy.virtual_stages, strategy.num_micro_batches
    num_stages = p * v
    overlap = cluster.calibration.dp_overlap_fraction
    first = next(iter(candidate.by_mode.values()))
    # rank tail = max(0, sync - overlap * backward) + post + optimizer
    #           = max(0, post + opt, post + opt + sync - overlap * backward): two tail terms
    tables = {
        mode: ModeCosts(
            time_s=tuple(c.time_s for c in costs),
            activation_bytes=tuple(c.activation_bytes for c in costs),
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
    return PartitionProblem(
        num_stages=num_stages,
        pp_degree=p,
        virtual_stages=v,
        num_micro_batches=m,
        modes=tables,
        static_bytes=tuple(c.static_bytes for c in first),
        boundary_time_s=tuple(
            tuple(stage_p2p_time_s(c, cluster, strategy, s) for c in first)
            for s in range(num_stages)
        ),
        inflight=tuple(
            inflight_microbatches(strategy.schedule, p, m, v, s % p) for s in range(num_stages)
        ),
        memory_capacity_bytes=candidate.usable_bytes,
        tail_constants_s=(0.0, 0.0),
    )


# ------------------------------------------------------------------------------ read back


def _to_plan(
    profile: ModelProfile,
    cluster: Cluster,
    candidate: Candidate,
    partition: Partition,
    global_batch: int,
) -> Plan:
    s = candidate.strategy
    ends = (*partition.stage_starts[1:], profile.num_units)
    stages = tuple(
        StagePlan(first_unit=a, last_unit=b - 1, recompute=mode)
        for a, b, mode in zip(partition.stage_starts, ends, partition.modes, strict=True)
    )
    plan = Plan(
        model=ModelRef(
            name=profile.name,
            num_units=profile.num_units,
            seq_len=profile.seq_len,
            fingerprint=profile.fingerprint,
        ),
        dp_degree=s.dp_degree,
        tp_degree=s.tp_degree,
        pp_degree=s.pp_degree,
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
    )
    result = estimate(profile, cluster, plan)
    # The solver optimised the cost model's own formula: the two must agree.
    assert math.isclose(result.step_time_s, partition.step_time_s, rel_tol=1e-6), (
        result.step_time_s,
        partition.step_time_s,
        s,
    )
    return plan.with_estimate(
        PlanEstimate(
            cluster=cluster.name,
            num_devices=cluster.num_devices,
            step_time_s=result.step_time_s,
            tokens_per_s=result.tokens_per_s,
            model_tflops_per_device=result.model_tflops_per_device,
            mfu=result.mfu,
            peak_memory_bytes=int(result.peak_memory_bytes),
        )
    )


def _no_feasible_plan(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    infeasible: list[Candidate],
    stats: SearchStats,
) -> NoFeasiblePlanError:
    gib = 2.0**30
    capacity = cluster.device.memory_bytes
    if not infeasible:
        return NoFeasiblePlanError(
            f"no valid plan for {profile.name!r} on {cluster.name!r} ({cluster.num_devices} "
            f"devices) with global_batch={global_batch}: no degrees/batching combination "
            "satisfies the constraints; relax them or change the batch or device count"
        )
    # The least memory any plan needs: solve exactly for the candidates with the lowest bounds.
    infeasible.sort(key=lambda c: c.memory_lower_bound_bytes)
    least = min(
        c.constants.total_bytes(min_peak_memory(_problem(c, cluster))) for c in infeasible[:5]
    )
    best = infeasible[0].strategy
    return NoFeasiblePlanError(
        f"no plan for {profile.name!r} fits {cluster.name!r}: the least memory per device any of "
        f"the {stats.candidates} candidate plans needs is {least / gib:.1f} GiB (e.g. tp="
        f"{best.tp_degree} pp={best.pp_degree} dp={best.dp_degree} micro_batch="
        f"{best.micro_batch_size} zero={best.zero_stage}), the device has {capacity / gib:.1f} "
        "GiB; use more devices, allow recompute='full', a higher ZeRO level, a smaller "
        "micro-batch, or devices with more memory"
    )


# ------------------------------------------------------------------------------ public API


@overload
def search(
    model_or_graph: Any,
    cluster: Cluster,
    *,
    global_batch: int,
    top_k: None = None,
    time_limit_s: float = ...,
    progress: Callable[[SearchProgress], None] | None = ...,
    **constraints: Any,
) -> Plan: ...


@overload
def search(
    model_or_graph: Any,
    cluster: Cluster,
    *,
    global_batch: int,
    top_k: int,
    time_limit_s: float = ...,
    progress: Callable[[SearchProgress], None] | None = ...,
    **constraints: Any,
) -> list[Plan]: ...


def search(
    model_or_graph: Any,
    cluster: Cluster,
    *,
    global_batch: int,
    top_k: int | None = None,
    time_limit_s: float = 10.0,
    progress: Callable[[SearchProgress], None] | None = None,
    **constraints: Any,
) -> Plan | list[Plan]:
    """The fastest plan for ``model_or_graph`` on ``cluster`` that fits in memory.

    ``model_or_graph``: an ``nn.Module`` (traced on the fly), a ``ModelGraph`` or a
    ``ModelProfile``. Keyword constraints fix or bound any dimension: ``tp``, ``pp``, ``dp``,
    ``micro_batch`` (an int or a collection of allowed values), ``max_tp``, ``max_pp``,
    ``max_micro_batch``, ``virtual_stages``, ``schedules``, ``zero``, ``recompute``,
    ``sequence_parallel``, ``rank_layouts``, ``dtype``, ``allow_cross_node_tp``. With
    ``top_k`` it returns the ``top_k`` best plans, ranked. Each plan carries its estimate.
    """
    from autoplan.api import profile_of

    result = search_plans(
        profile_of(model_or_graph),
        cluster,
        global_batch=global_batch,
        top_k=top_k or 1,
        time_limit_s=time_limit_s,
        progress=progress,
        **constraints,
    )
    return list(result.plans) if top_k is not None else result.plans[0]
