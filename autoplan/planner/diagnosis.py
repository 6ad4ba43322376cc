"""The "no feasible plan" diagnosis of a search in which nothing fits.

Expects the outer choices the search found infeasible (memory bound, partition solver) and
its space and tables. Guarantees: a `NoFeasiblePlanError` that names the least memory per
device any plan needs (solved exactly for the most promising choices, or their proven floor),
the device's capacity and usable share, a floor on the devices the model's state alone needs,
and only the fixes that apply to the user's constraints.
"""

from __future__ import annotations

import math

from autoplan.contract.errors import NoFeasiblePlanError
from autoplan.planner.candidates import BoundTables, costed_candidate, partition_problem
from autoplan.planner.partition import min_peak_memory
from autoplan.planner.space import SearchSpace, recompute_modes, shown
from autoplan.planner.stack_filter import stack_recompute_modes
from cost_model.estimate import MemoryConstants
from cost_model.hardware import Cluster
from cost_model.headroom import usable_capacity_bytes
from cost_model.memory import local_num_params, static_bytes
from cost_model.precision import precision_policy
from cost_model.strategy import RecomputeMode, Strategy
from cost_model.workload import ModelProfile


def no_feasible_plan(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    infeasible: list[Strategy],
    space: SearchSpace,
    tables: BoundTables,
    num_candidates: int,
    time_limit_s: float,
) -> NoFeasiblePlanError:
    """Why no plan fits: no outer choice covers the cluster (none enumerated), or the least
    memory per device any plan needs (solved exactly for the outer choices ``infeasible``
    whose bounds are lowest), with the fixes (`memory_fixes`)."""
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
    def modes(strategy: Strategy) -> tuple[RecomputeMode, ...]:
        stack, model = tables.model.stack, tables.model.profile
        space_modes = recompute_modes(space, strategy.schedule)
        return stack_recompute_modes(stack, strategy, model, space_modes)[0]

    infeasible.sort(key=lambda s: tables.memory_bound(s, modes(s)))
    candidates = [costed_candidate(s, modes(s), tables) for s in infeasible[:20]]
    candidates.sort(key=lambda c: c.constants.total_bytes(c.memory_lower_bound_bytes))
    needs = []
    for c in candidates[:5]:
        peak = min_peak_memory(partition_problem(c, tables.model), time_limit_s=time_limit_s)
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
    state = min(
        static_bytes(params, dtype, 0, 1, policy=precision_policy(dtype, *space.policy)).total_bytes
        for dtype in space.dtype
    )
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
        f"the {num_candidates} candidate plans needs is {amount}, the device has "
        f"{capacity / gib:.1f} GiB, of which a predicted peak may use "
        f"{tables.model.usable_capacity_bytes() / gib:.1f} GiB (memory headroom "
        f"{tables.model.memory_headroom:.0%} and the peak's range){devices}; "
        f"{memory_fixes(space, headroom_helps)}",
        least_memory_bytes=least,
        capacity_bytes=float(capacity),
        usable_bytes=tables.model.usable_capacity_bytes(),
    )


def memory_fixes(space: SearchSpace, headroom_helps: bool = False) -> str:
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
    if space.dtype == ("fp32",):
        fixes.append("train in bf16")
    return fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + ", or " + fixes[-1]
