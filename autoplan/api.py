"""`manual_plan` and `estimate`: a hand-chosen plan and the cost model's verdict on it.

Expects a model as an ``nn.Module`` (traced with `autoplan.trace`), a ``ModelGraph`` (anything
with a ``.profile``) or a cost-model ``ModelProfile``, and a `Cluster`. Guarantees: impossible
plans raise `PlanError` naming the numbers (degrees that do not multiply to the cluster's
devices, a TP degree that does not divide the heads, a batch that does not divide evenly);
`estimate` is the pure `cost_model.estimate` of the validated plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, overload

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import (
    CP_RANK_LAYOUT,
    MESH_AXES,
    DTypeName,
    MeshAxis,
    ModelRef,
    Plan,
    Recompute,
    Schedule,
    StagePlan,
    even_stages,
    plan_estimate,
)
from autoplan.planner.search import DEFAULT_BUDGET_S, SearchProgress, search_plans
from cost_model.degrees import degree_product, is_whole
from cost_model.estimate import Estimate
from cost_model.estimate import estimate as _estimate
from cost_model.frameworks import DEFAULT_FRAMEWORK, framework_profile
from cost_model.hardware import Cluster, as_cluster
from cost_model.headroom import DEFAULT_MEMORY_HEADROOM, check_memory_headroom
from cost_model.precision import (
    DEFAULT_MASTER_DTYPE,
    DEFAULT_OPTIMIZER_STATE_DTYPE,
    GradReduceDtype,
    MasterDtype,
    OptimizerStateDtype,
)
from cost_model.stage_splits import StageSplitError, stage_starts
from cost_model.uncertainty import DEFAULT_OBJECTIVE, check_range_level, with_ranges
from cost_model.workload import ModelProfile

__all__ = ["default_dp", "estimate", "manual_plan", "profile_of", "search"]


def profile_of(model_or_graph: Any) -> ModelProfile:
    """The cost model's view of a model: a ModelProfile as is, a graph's ``.profile``, or the
    profile of an ``nn.Module`` traced with `autoplan.trace` (on meta: no memory needed)."""
    if isinstance(model_or_graph, ModelProfile):
        return model_or_graph
    profile = getattr(model_or_graph, "profile", None)
    if isinstance(profile, ModelProfile):
        return profile
    # Tracing imports torch (seconds): only when given a module, so the CLI's file commands and
    # `import autoplan` stay fast.
    import torch

    from autoplan.tracing import trace

    if isinstance(model_or_graph, torch.nn.Module):
        graph = trace(model_or_graph)
        traced: ModelProfile = graph.profile
        return traced
    raise TypeError(
        f"expected an nn.Module, a ModelGraph or a ModelProfile, got "
        f"{type(model_or_graph).__name__}"
    )


def manual_plan(
    model_or_graph: Any,
    cluster: Cluster | str,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    ep_folding: bool = False,
    etp: int = 1,
    micro_batch: int = 1,
    global_batch: int,
    recompute: Recompute = "none",
    zero: int = 0,
    schedule: Schedule = "1f1b",
    virtual_stages: int = 1,
    sequence_parallel: bool = False,
    tp_comm_overlap: bool = False,
    dtype: DTypeName | None = None,
    master_dtype: MasterDtype = DEFAULT_MASTER_DTYPE,
    grad_reduce_dtype: GradReduceDtype | None = None,
    optimizer_state_dtype: OptimizerStateDtype = DEFAULT_OPTIMIZER_STATE_DTYPE,
    rank_layout: Sequence[MeshAxis] = MESH_AXES,
    allow_cross_node_tp: bool = False,
    framework: str = DEFAULT_FRAMEWORK,
    compile: bool = False,
    dp_shard: int | None = None,
    optimizer_offload: float = 0.0,
    activation_offload: int = 0,
) -> Plan:
    """A plan with the given degrees and ``pp * v`` stages cut as the framework's stack cuts
    them when no cut is stated (`FrameworkProfile.pipeline_split`: Megatron-LM's even layers,
    nanotron's compute-balanced blocks), else evenly over the units.

    ``dp`` defaults to ``cluster.num_devices / (tp * pp * cp)``; ``cp`` is the context-parallel
    degree, ``ep`` the expert-parallel one (carved out of dp, or with ``ep_folding`` out of the
    dp x cp x tp ranks as Megatron-Core folds it: `Plan.ep_folding`), ``etp`` the ranks each
    routed expert is split over (`Plan.etp_degree`). ``rank_layout`` defaults to
    ``[pp, dp, tp]``, or ``[pp, dp, cp, tp]`` when cp > 1. ``dtype`` to the device's fastest
    (`DeviceSpec.fastest_training_dtype`). The plan is validated against the
    model and the cluster and carries the cost model's estimate. ``cluster`` may be a spec
    string (`as_cluster`). ``framework``: the training stack the plan is priced for (autoplan's
    runtime, or one of `autoplan export`'s; `cost_model.frameworks`), recorded in the plan.
    ``master_dtype``, ``grad_reduce_dtype`` and ``optimizer_state_dtype``: the precision policy
    (`Plan.master_dtype`, ...; `cost_model.precision`).
    ``tp_comm_overlap``: the sequence-parallel TP collectives pipelined with their GEMMs
    (`Plan.tp_comm_overlap`).
    ``compile``: torch.compile every unit (`Plan.compile`). ``dp_shard``: HSDP, the weights
    sharded within groups of that many consecutive dp ranks and replicated across them
    (`Plan.dp_shard_degree`; None: over all of dp). ``optimizer_offload``: the share (0 to 1)
    of the optimizer step kept and run on the host (`Plan.optimizer_offload`).
    ``activation_offload``: N, each stage's first N blocks its recompute does not cover keep
    their saved activations on the host (`StagePlan.activation_offload`; Megatron-LM's one
    ``--cpu-offloading-num-layers``).
    """
    profile = profile_of(model_or_graph)
    cluster = as_cluster(cluster)
    for name, value in (
        ("tp", tp),
        ("pp", pp),
        ("cp", cp),
        ("ep", ep),
        ("micro_batch", micro_batch),
        ("global_batch", global_batch),
        ("virtual_stages", virtual_stages),
    ):
        if not is_whole(value):
            raise PlanError(f"{name} = {value!r} must be a whole number >= 1")
    if cp > 1 and rank_layout is MESH_AXES:
        rank_layout = CP_RANK_LAYOUT  # the default layout, with cp placed
    if isinstance(rank_layout, str) or not isinstance(rank_layout, Sequence):
        raise PlanError(
            f"rank_layout = {rank_layout!r} must be a list of the axes pp, dp, tp, outermost "
            f"first, e.g. {list(MESH_AXES)}"
        )
    if dp is None:
        dp = default_dp(cluster, tp, pp, cp)
    elif not is_whole(dp):
        raise PlanError(f"dp = {dp!r} must be a whole number >= 1")
    elif (product := degree_product(dp, tp, pp, cp, suffix=""))[2] != cluster.num_devices:
        default_dp(cluster, tp, pp, cp)  # tp x pp (x cp) must divide the devices first
        names, values, devices = product
        raise PlanError(
            f"{names} = {values} = {devices}, but cluster "
            f"{cluster.name!r} has {cluster.num_devices} devices; with tp = {tp} and pp = {pp}"
            f"{f' and cp = {cp}' if cp > 1 else ''} use dp = "
            f"{cluster.num_devices // (tp * pp * cp)} (or leave dp out)"
        )
    per_step = micro_batch * dp
    if global_batch % per_step != 0:
        lower = global_batch // per_step * per_step
        choices = " or ".join(str(b) for b in (lower, lower + per_step) if b >= per_step)
        other = (
            f", or a micro_batch that divides {global_batch // dp}"
            if global_batch % dp == 0
            else ""
        )
        raise PlanError(
            f"global_batch = {global_batch} is not a multiple of micro_batch x dp = "
            f"{micro_batch} x {dp} = {per_step}; use a global batch of {choices}{other}"
        )
    plan = Plan(
        model=ModelRef.of(profile),
        dp_degree=dp,
        tp_degree=tp,
        pp_degree=pp,
        cp_degree=cp,
        ep_degree=ep,
        ep_folding=ep_folding,
        etp_degree=etp,
        virtual_stages=virtual_stages,
        stages=_offloaded(
            even_stages(profile.num_units, pp * virtual_stages, recompute), activation_offload
        ),
        micro_batch_size=micro_batch,
        num_micro_batches=global_batch // per_step,
        global_batch_size=global_batch,
        schedule=schedule,
        zero_stage=zero,
        dp_shard_degree=dp_shard,
        sequence_parallel=sequence_parallel,
        tp_comm_overlap=tp_comm_overlap,
        dtype=dtype or cluster.device.fastest_training_dtype(),  # type: ignore[arg-type]
        master_dtype=master_dtype,
        grad_reduce_dtype=grad_reduce_dtype,
        optimizer_state_dtype=optimizer_state_dtype,
        compile=compile,
        optimizer_offload=optimizer_offload,
        rank_layout=tuple(rank_layout),
        framework=framework,
    )
    # the plan's own problems first (its degrees, ...), then the stack's cut, then its limits
    # (which refuse another cut where the stack takes none)
    plan.validate(profile, cluster, allow_cross_node_tp=allow_cross_node_tp, stack=False)
    stages = framework_stages(profile, framework, pp * virtual_stages, recompute)
    if stages is not None:
        plan = dataclasses.replace(plan, stages=_offloaded(stages, activation_offload))
    if stages is not None or plan.framework != DEFAULT_FRAMEWORK:
        plan.validate(profile, cluster, allow_cross_node_tp=allow_cross_node_tp)
    return plan.with_estimate(plan_estimate(_estimate(profile, cluster, plan), cluster))


def _offloaded(stages: tuple[StagePlan, ...], count: int) -> tuple[StagePlan, ...]:
    """``stages`` with ``activation_offload`` ``count`` each (unchanged at 0)."""
    if not count:
        return stages
    return tuple(dataclasses.replace(stage, activation_offload=count) for stage in stages)


def framework_stages(
    profile: ModelProfile, framework: str, num_stages: int, recompute: Recompute
) -> tuple[StagePlan, ...] | None:
    """The ``num_stages`` stages ``framework``'s stack cuts the model into when no cut is
    stated (`cost_model.stage_splits`), or None where it has no rule of its own or its rule
    does not apply; `PlanError` where its cut falls inside one of autoplan's units."""
    rule = framework_profile(framework).pipeline_split
    if rule is None or num_stages == 1:
        return None
    try:
        starts = stage_starts(profile, num_stages, rule)
    except StageSplitError as err:
        raise PlanError(
            f"{err}; price another pipeline degree, or a plan with its own stages "
            "(autoplan plan, or a plan file's stages)"
        ) from err
    if starts is None:
        return None
    ends = [*starts[1:], profile.num_units]
    return tuple(
        StagePlan(first_unit=first, last_unit=end - 1, recompute=recompute)
        for first, end in zip(starts, ends, strict=True)
    )


def default_dp(cluster: Cluster, tp: int, pp: int, cp: int = 1) -> int:
    """``cluster.num_devices / (tp * pp * cp)``; raises `PlanError` when it does not divide."""
    used = tp * pp * cp
    if tp < 1 or pp < 1 or cp < 1 or cluster.num_devices % used != 0:
        divisors = [d for d in range(1, cluster.num_devices + 1) if cluster.num_devices % d == 0]
        shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
        names, values = (
            ("tp x pp", f"{tp} x {pp}") if cp == 1 else ("tp x pp x cp", f"{tp} x {pp} x {cp}")
        )
        choose = " and ".join(names.rsplit(" x ", 1)).replace(" x ", ", ")  # tp, pp and cp
        raise PlanError(
            f"{names} = {values} = {used} does not divide the {cluster.num_devices} "
            f"devices of cluster {cluster.name!r}; choose {choose} whose product is one of "
            f"{shown}"
        )
    return cluster.num_devices // used


def estimate(
    model_or_graph: Any,
    cluster: Cluster | str,
    plan: Plan,
    *,
    allow_cross_node_tp: bool = False,
    range_level: float = 0.8,
    memory_headroom: float | None = None,
) -> Estimate:
    """The cost model's prediction for ``plan``: step time, throughput, MFU, memory per stage.

    The step time and peak memory carry ``range_level`` ranges (default 80%: the measured value
    falls inside in 8 of 10 cases; docs/cost-model.md, "How far off a figure may be").

    Validates the plan against the model and the cluster first (raises `PlanError`). A plan
    that does not fit in memory still gets an estimate with ``fits=False``; call
    ``Estimate.require_fits()`` to turn that into an error listing the numbers. ``fits`` keeps
    ``memory_headroom`` of each device free beyond the upper end of the peak's range (a fraction
    in [0, 0.9); None: the plan's recorded ``memory_headroom``, else the default, 0.1;
    `MemoryHeadroomError` otherwise).
    """
    profile = profile_of(model_or_graph)
    cluster = as_cluster(cluster)
    if not isinstance(plan, Plan):
        raise PlanError(
            f"plan must be a Plan (e.g. Plan.from_yaml(path)), got {type(plan).__name__}"
        )
    level = check_range_level(range_level)
    if memory_headroom is not None:
        check_memory_headroom(memory_headroom)
    plan.validate(profile, cluster, allow_cross_node_tp=allow_cross_node_tp)
    result = _estimate(profile, cluster, plan, memory_headroom=memory_headroom)
    return result if level == result.range_level else with_ranges(result, result.features, level)


@overload
def search(
    model_or_graph: Any,
    cluster: Cluster | str,
    *,
    global_batch: int,
    top_k: None = None,
    time_limit_s: float = ...,
    budget_s: float | None = ...,
    progress: Callable[[SearchProgress], None] | None = ...,
    framework: str = ...,
    objective: str = ...,
    memory_headroom: float = ...,
    **constraints: Any,
) -> Plan: ...


@overload
def search(
    model_or_graph: Any,
    cluster: Cluster | str,
    *,
    global_batch: int,
    top_k: int,
    time_limit_s: float = ...,
    budget_s: float | None = ...,
    progress: Callable[[SearchProgress], None] | None = ...,
    framework: str = ...,
    objective: str = ...,
    memory_headroom: float = ...,
    **constraints: Any,
) -> list[Plan]: ...


def search(
    model_or_graph: Any,
    cluster: Cluster | str,
    *,
    global_batch: int,
    top_k: int | None = None,
    time_limit_s: float = 10.0,
    budget_s: float | None = DEFAULT_BUDGET_S,
    progress: Callable[[SearchProgress], None] | None = None,
    framework: str = DEFAULT_FRAMEWORK,
    objective: str = DEFAULT_OBJECTIVE,
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
    **constraints: Any,
) -> Plan | list[Plan]:
    """The fastest plan for ``model_or_graph`` on ``cluster`` that fits in memory.

    ``model_or_graph``: an ``nn.Module`` (traced on the fly), a ``ModelGraph`` or a
    ``ModelProfile``. Keyword constraints fix or bound any dimension: ``tp``, ``pp``, ``dp``,
    ``micro_batch`` (an int or a collection of allowed values), ``max_tp``, ``max_pp``,
    ``max_micro_batch``, ``virtual_stages``, ``schedules``, ``zero``, ``recompute``,
    ``sequence_parallel``, ``rank_layouts``, ``dtype``, ``allow_cross_node_tp``. With
    ``top_k`` it returns the ``top_k`` best plans, ranked. Each plan carries its estimate.
    ``framework``: price the plans for that training stack (`manual_plan`). ``objective``:
    "pessimistic" (default) ranks plans by the upper end of their step's 80% range, "expected"
    by the predicted step; plans within 2% of the best tie, and ties go to the plan with fewer
    unvalidated features, then more memory headroom. ``memory_headroom``: the share of each
    device every plan leaves free beyond the upper end of its peak's range (a fraction in
    [0, 0.9), default 0.1; docs/guide.md, "Memory headroom"); each plan records it.
    ``budget_s``: reference seconds of deterministic work the search may spend (the same plan
    on every machine; None: until proven), ``time_limit_s`` those of one solve (docs/guide.md,
    "The same answer every time"). Ctrl-C returns the best plan found so far.
    """
    result = search_plans(
        profile_of(model_or_graph),
        as_cluster(cluster),
        global_batch=global_batch,
        top_k=top_k or 1,
        time_limit_s=time_limit_s,
        budget_s=budget_s,
        progress=progress,
        framework=framework,
        objective=objective,
        memory_headroom=memory_headroom,
        **constraints,
    )
    return list(result.plans) if top_k is not None else result.plans[0]
