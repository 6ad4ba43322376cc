"""Every unit's `UnitCost` under fixed outer choices and a recompute mode: each unit's parts
(`cost_model.parts`) summed, then the parts across units (the runtime's grouping of
data-parallel collectives, the routed experts' own sync after it, core sharing).

Expects a `cost_model.estimate.CostModel` for its tables (the unit on one context-parallel
rank, compute times, routed-expert costs, core-sharing factors) and its stack. Guarantees
`compose_unit_costs` is what `CostModel.unit_costs` returns for a strategy and mode it has not
seen, and that units of one class (`unit_classes`) share one object unless data-parallel
grouping gives each its own share.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cost_model.errors import InputError
from cost_model.hardware import Cluster
from cost_model.memory import RECOMPUTABLE_KINDS, StaticBytes, local_num_params, static_bytes
from cost_model.offload import OptimizerOffloadOverlap
from cost_model.parts.compute import ComputeTimes, loss_cost, recompute_s
from cost_model.parts.context_parallel import RingAttentionCost, ring_attention_cost
from cost_model.parts.core_sharing import stretched
from cost_model.parts.data_parallel import (
    DataParallelCost,
    data_parallel_cost,
    deepspeed_zero3_gathers,
    grouped_dp_sync,
)
from cost_model.parts.expert_parallel import ExpertCost, recompute_expert_s
from cost_model.parts.fp8 import converted_ops, fp8_params
from cost_model.parts.host import HostCost, host_cost, host_floor_wait, sync_copies_s
from cost_model.parts.memory import UnitBytes, unit_bytes
from cost_model.parts.optimizer import OptimizerCost, optimizer_cost
from cost_model.parts.pipeline import TiedGradSync, tied_grad_sync, tied_pair_placement
from cost_model.parts.tensor_parallel import TpCost, replicated_grad_sum_s, tp_cost
from cost_model.strategy import GroupPlacement, Strategy, group_placements
from cost_model.unit_cost import UnitCost
from cost_model.workload import ModelProfile, OpProfile, UnitProfile

if TYPE_CHECKING:
    from cost_model.estimate import CostModel

__all__ = ["compose_unit_costs", "unit_classes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Groups:
    """The placements of a strategy's communication groups (`cost_model.strategy.mesh_groups`)."""

    tp: tuple[GroupPlacement, ...]
    # of the dense weights: dp x cp, or under HSDP the shard groups (dp_shard_degree x cp)
    dp: tuple[GroupPlacement, ...]
    # under HSDP, the ranks holding the same shard of the dense weights (size 1 without)
    dp_replicate: tuple[GroupPlacement, ...]
    cp: tuple[GroupPlacement, ...]
    ep: tuple[GroupPlacement, ...]
    edp: tuple[GroupPlacement, ...]  # of the routed experts: dp x cp / ep


# a dense unit's routed experts: none
_no_experts = ExpertCost(
    forward_compute_s=0.0,
    backward_compute_s=0.0,
    weight_backward_s=0.0,
    forward_flops=0.0,
    all_to_all_forward_s=0.0,
    all_to_all_backward_s=0.0,
    tokens_per_expert=0.0,
    local_params=0.0,
    activation_bytes=0.0,
    all_activation_bytes=0.0,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class _RoutedWeights:
    """The routed experts' weights on one device: their data-parallel cost (None: a dense
    unit), optimizer step and static bytes."""

    dp: DataParallelCost | None
    optimizer_s: float
    state: StaticBytes


@dataclass(frozen=True, kw_only=True, slots=True)
class _UnitParts:
    """One unit's parts under its recompute mode, before they are summed into a `UnitCost`."""

    unit: UnitProfile  # on one context-parallel rank
    mode: str
    n_local: float  # dense parameters this device stores before data-parallel sharding
    fp8_local: float  # of them, in linears an fp8 recipe converts
    compute: ComputeTimes
    rerun_s: float  # recompute of the dense ops and the routed experts
    tp: TpCost
    ring: RingAttentionCost
    experts: ExpertCost
    forward_compute_s: float
    backward_compute_s: float
    dp: DataParallelCost
    routed: _RoutedWeights
    tied: TiedGradSync
    replicated_s: float
    optimizer: OptimizerCost
    host: HostCost
    memory: UnitBytes


# ------------------------------------------------------------------------------- across units


def compose_unit_costs(
    model: CostModel, strategy: Strategy, recompute: str
) -> tuple[UnitCost, ...]:
    """The composition: each unit's parts, then the parts across units (the runtime's
    grouping of data-parallel collectives, core sharing)."""
    cluster = model.cluster
    groups = _Groups(
        tp=group_placements(strategy, cluster, "tp"),
        # dense weights reduce over dp x cp (`Strategy.weights_view`), under HSDP
        # reduce-scattered in their shard groups and all-reduced over the replicas
        dp=group_placements(strategy, cluster, "dp_shard_cp"),
        dp_replicate=group_placements(strategy, cluster, "dp_replicate"),
        cp=group_placements(strategy, cluster, "cp"),
        ep=group_placements(strategy, cluster, "ep"),
        edp=group_placements(strategy, cluster, "edp_cp"),
    )
    pair = tied_pair_placement(strategy, cluster)
    costs: list[UnitCost] = []
    dp_costs: list[DataParallelCost] = []
    # per unit: the routed experts' per-step data-parallel sync (after the dense grouping)
    expert_sync: list[DataParallelCost | None] = []
    for index, unit in enumerate(model.profile.units):
        if model.classes[index] != index:
            # Identical to an earlier unit (repeated blocks): the same costs object.
            costs.append(costs[model.classes[index]])
            dp_costs.append(dp_costs[model.classes[index]])
            expert_sync.append(expert_sync[model.classes[index]])
            continue
        mode = recompute if unit.kind in RECOMPUTABLE_KINDS else "none"
        cost, dp, experts = _unit_cost(model, strategy, index, mode, groups, pair)
        costs.append(cost)
        dp_costs.append(dp)
        expert_sync.append(experts)
    beside = model.stack.engine_behaviour.hsdp_all_reduce_beside
    _group_dp_sync(costs, dp_costs, model.profile, cluster, strategy, groups, beside)
    _add_expert_sync(costs, expert_sync)
    return stretched(costs, model.sharing(strategy))


def _group_dp_sync(
    costs: list[UnitCost],
    dp_costs: list[DataParallelCost],
    profile: ModelProfile,
    cluster: Cluster,
    strategy: Strategy,
    groups: _Groups,
    beside: bool,
) -> None:
    """Replace, in ``costs``, each unit's gradient sync by its share of the runtime's grouped
    data-parallel collectives (`parts.data_parallel.grouped_dp_sync`; ``beside``: the stack
    runs HSDP's replica all-reduce on its own stream)."""
    kinds = [unit.kind for unit in profile.units]
    weights = strategy.weights_view
    shares = grouped_dp_sync(
        kinds, dp_costs, cluster, weights, groups.dp, groups.dp_replicate, beside
    )
    for share in shares:
        own = costs[share.unit_idx]
        post = own.post_sync_s if share.post_sync_s is None else share.post_sync_s
        costs[share.unit_idx] = dataclasses.replace(own, dp_sync_s=share.sync_s, post_sync_s=post)


def _add_expert_sync(costs: list[UnitCost], expert_sync: list[DataParallelCost | None]) -> None:
    """Add, in ``costs``, the routed experts' gradient sync, which reduces over their own
    group after the dense ones."""
    # (units that shared one cost object and one expert sync still share the result: a
    # 4,096-layer mixture of experts would otherwise hold 4,096 objects per plan costed)
    # (keyed by identity; each entry keeps its original alive, so no id is reused)
    synced: dict[tuple[int, int], tuple[UnitCost, UnitCost]] = {}
    for index, experts in enumerate(expert_sync):
        if experts is not None and (experts.sync_s or experts.post_sync_s):
            own = costs[index]
            key = (id(own), id(experts))
            if key not in synced:
                synced[key] = (
                    own,
                    dataclasses.replace(
                        own,
                        dp_sync_s=own.dp_sync_s + experts.sync_s,
                        post_sync_s=own.post_sync_s + experts.post_sync_s,
                    ),
                )
            costs[index] = synced[key][1]


# ------------------------------------------------------------------------------- one unit


def _unit_cost(
    model: CostModel,
    strategy: Strategy,
    index: int,
    mode: str,
    groups: _Groups,
    pair: GroupPlacement | None,
) -> tuple[UnitCost, DataParallelCost, DataParallelCost | None]:
    """One unit's cost under its own recompute ``mode``: the sum of its parts; with it,
    its dense weights' data-parallel cost and its routed experts' (None: a dense unit)."""
    parts = _unit_parts(model, strategy, index, mode, groups, pair)
    return _unit_record(parts, strategy, model.cluster), parts.dp, parts.routed.dp


def _unit_parts(
    model: CostModel,
    strategy: Strategy,
    index: int,
    mode: str,
    groups: _Groups,
    pair: GroupPlacement | None,
) -> _UnitParts:
    """Unit ``index``'s parts, each from its `cost_model.parts` module."""
    profile, cluster, cal = model.profile, model.cluster, model.cluster.calibration
    # the unit on one context-parallel rank (itself when cp = 1)
    unit: UnitProfile = model.local_unit(index, strategy.cp_degree)
    traced = profile.traced_dtype_bytes
    # dense weights: data parallel over dp x cp
    weights = strategy.weights_view
    n_local = _dense_local_params(unit, strategy, model.shared_expert_whole(strategy))
    fp8_local = fp8_params(unit, strategy)
    compute = model.compute_times(strategy, index)
    rerun_s = recompute_s(unit, mode, cal, compute)
    tp = tp_cost(
        unit,
        strategy,
        cluster,
        traced,
        tp_groups=groups.tp,
        recompute=mode,
        shared_expert_whole=model.shared_expert_whole(strategy),
        overlap=model.stack.tp_comm_overlap,
    )
    ring = ring_attention_cost(unit, profile, strategy, cluster, groups.cp, mode)
    experts = _no_experts
    if unit.moe is not None:
        experts = model.expert_cost(strategy, index, mode, groups.ep)
    rerun_s += recompute_expert_s(experts, mode)
    forward_compute_s = compute.forward_s + experts.forward_compute_s
    backward_compute_s = compute.backward_s + experts.backward_compute_s
    dp = data_parallel_cost(
        n_local,
        weights,
        cluster,
        groups.dp,
        forward_window_s=forward_compute_s,
        backward_window_s=backward_compute_s + rerun_s,
        zero3_gathers=_zero3_gathers(model, index, strategy.tp_degree),
        fp8_params=fp8_local,
        fp8_weights=sum(1 for _ in converted_ops(unit, strategy)),
        replicate_groups=groups.dp_replicate,
        replicas_beside=model.stack.engine_behaviour.hsdp_all_reduce_beside,
    )
    routed = _routed_weights(
        unit,
        experts,
        strategy,
        cluster,
        groups.edp,
        forward_compute_s,
        backward_compute_s + rerun_s,
        model.stack.optimizer_offload_overlap,
    )
    tied = tied_grad_sync(profile, index, strategy, cluster, pair)
    replicated_s = (
        replicated_grad_sum_s(unit, strategy, cluster, groups.tp)
        if model.shared_expert_whole(strategy)
        else 0.0
    )
    optimizer = optimizer_cost(n_local, weights, cluster, model.stack.optimizer_offload_overlap)
    host = host_cost(unit, n_local + experts.local_params, strategy, cal)
    memory = _dense_bytes(model, unit, strategy, mode, n_local, fp8_local, compute)
    return _UnitParts(
        unit=unit,
        mode=mode,
        n_local=n_local,
        fp8_local=fp8_local,
        compute=compute,
        rerun_s=rerun_s,
        tp=tp,
        ring=ring,
        experts=experts,
        forward_compute_s=forward_compute_s,
        backward_compute_s=backward_compute_s,
        dp=dp,
        routed=routed,
        tied=tied,
        replicated_s=replicated_s,
        optimizer=optimizer,
        host=host,
        memory=memory,
    )


def _dense_bytes(
    model: CostModel,
    unit: UnitProfile,
    strategy: Strategy,
    mode: str,
    n_local: float,
    fp8_local: float,
    compute: ComputeTimes,
) -> UnitBytes:
    """The bytes of ``unit`` on one device without its routed experts (`parts.memory`), the
    loss's saved bytes among them; ``fp8_local`` of its ``n_local`` parameters in converted
    linears (`parts.fp8`), ``compute`` its compute (with its fp8 casts' transient)."""
    traced = model.profile.traced_dtype_bytes
    loss = loss_cost(unit, strategy, model.cluster, traced)
    cal = model.cluster.calibration
    return unit_bytes(
        unit,
        strategy.weights_view,
        mode,
        traced,
        local_params=n_local,
        loss_saved_bytes=loss.saved_bytes,
        stack=model.stack.saved_activations,
        fp8_params=fp8_local,
        fp8_transient_bytes=compute.fp8_transient_bytes,
        cached_fp8_weights=fp8_local > 0 and cal.fp8_cached_weights >= 0.5,
    )


def _dense_local_params(unit: UnitProfile, strategy: Strategy, shared_expert_whole: bool) -> float:
    """Parameters this device stores: TP-local; tied weights once per device (pp = 1); the
    routed experts apart (`parts.expert_parallel`)."""
    n_local = local_num_params(
        unit,
        strategy.tp_degree,
        count_shared=strategy.pp_degree > 1,
        shared_expert_whole=shared_expert_whole,
    )
    if unit.moe is not None:
        if unit.num_params - unit.num_params_tp_sharded < unit.moe.expert_params:
            raise InputError(
                f"unit {unit.name!r}: its {unit.moe.expert_params:,} routed-expert "
                f"parameters must be among its {unit.num_params - unit.num_params_tp_sharded:,}"
                " parameters tensor parallelism does not split (MoELayerFacts: experts are "
                "split by expert parallelism); fix the trace's TP roles"
            )
        n_local -= unit.moe.expert_params
    return n_local


def _zero3_gathers(model: CostModel, index: int, tp_degree: int) -> int:
    """ZeRO-3 all-gathers a pass over unit ``index`` under the model's stack (FSDP2: one)."""
    if model.stack.zero3_gathers != "per-module":
        return 1
    unit = model.profile.units[index]
    width = model.profile.traced_dtype_bytes
    # a module's weight elements on this device: TP splits the sharded ones
    numels = [
        op.param_bytes_read / width / (tp_degree if op.tp != "replicated" else 1)
        for op in unit.ops
        if op.param_bytes_read > 0
    ]
    return max(1, deepspeed_zero3_gathers(numels))


def _routed_weights(
    unit: UnitProfile,
    experts: ExpertCost,
    strategy: Strategy,
    cluster: Cluster,
    edp_groups: tuple[GroupPlacement, ...],
    forward_window_s: float,
    backward_window_s: float,
    overlap: OptimizerOffloadOverlap = "pipelined",
) -> _RoutedWeights:
    """The routed experts' weights of ``unit``: E / ep per device, data parallel over
    dp x cp / ep (none for a dense unit); their optimizer's offloaded share ordered as
    ``overlap`` says (`OffloadCost.step_s`)."""
    expert_dp: DataParallelCost | None = None
    expert_optimizer_s = 0.0
    expert_state = static_bytes(0.0, strategy.dtype, 0, 1)
    if unit.moe is not None:
        view = strategy.expert_view
        expert_dp = data_parallel_cost(
            experts.local_params,
            view,
            cluster,
            edp_groups,
            forward_window_s=forward_window_s,
            backward_window_s=backward_window_s,
        )
        expert_optimizer_s = optimizer_cost(experts.local_params, view, cluster, overlap).step_s
        expert_state = static_bytes(
            experts.local_params,
            strategy.dtype,
            view.runtime_zero_stage,
            view.dp_degree,
            view.dp_wrapper,
            policy=view.precision,
        )
    return _RoutedWeights(dp=expert_dp, optimizer_s=expert_optimizer_s, state=expert_state)


def _zero3_exposed(dp: DataParallelCost, expert_dp: DataParallelCost | None) -> tuple[float, float]:
    """The ZeRO-3 gathers of the forward and of the backward not hidden behind the unit's
    compute, of its dense weights and its routed experts."""
    zero3_forward_exposed_s = dp.zero3_forward_exposed_s
    zero3_backward_exposed_s = dp.zero3_backward_exposed_s
    if expert_dp is not None:
        zero3_forward_exposed_s += expert_dp.zero3_forward_exposed_s
        zero3_backward_exposed_s += expert_dp.zero3_backward_exposed_s
    return zero3_forward_exposed_s, zero3_backward_exposed_s


def _critical_path(
    parts: _UnitParts, strategy: Strategy, cluster: Cluster, zero3_exposed: tuple[float, float]
) -> tuple[float, float, float]:
    """The unit's forward and backward critical paths per micro-batch, and of them the host's
    share (`UnitCost.host_s`)."""
    p, cal = parts, cluster.calibration
    zero3_forward_exposed_s, zero3_backward_exposed_s = zero3_exposed
    # A CPU worker's core both dispatches and computes, so the wrappers' host time adds to
    # the compute; a GPU's host runs ahead of its asynchronous kernels, so there the same
    # host time is a floor under the unit's time (`host_floor_wait`), paid only where the
    # device would finish first (small units, small micro-batches).
    on_gpu = cluster.device.kind == "gpu"
    added_host_s = 0.0 if on_gpu else p.host.microbatch_s
    forward_s = (
        p.forward_compute_s
        + p.tp.forward_s
        + p.ring.forward_s
        + p.experts.all_to_all_forward_s
        + zero3_forward_exposed_s
        + added_host_s / 2
    )
    backward_s = (
        p.backward_compute_s
        + p.rerun_s
        + p.tp.backward_s
        + p.ring.backward_s
        + p.experts.all_to_all_backward_s
        + zero3_backward_exposed_s
        + added_host_s / 2
    )
    host_s = added_host_s
    if p.unit.kind == "block":
        copy_forward, copy_backward = sync_copies_s(cluster, p.mode)
        forward_s += copy_forward
        backward_s += copy_backward
        host_s += copy_forward + copy_backward
    floor_s = p.host.microbatch_s if on_gpu else 0.0
    if p.unit.kind == "block" and strategy.tp_degree > 1:
        floor_s += cal.tp_block_host_floor_s
    if floor_s > 0.0:
        wait_forward, wait_backward = host_floor_wait(forward_s, backward_s, floor_s)
        forward_s += wait_forward
        backward_s += wait_backward
        host_s += wait_forward + wait_backward
    return forward_s, backward_s, host_s


def _optimizer_s(parts: _UnitParts, cluster: Cluster) -> float:
    """The unit's optimizer step: the device's and the host's, one after the other on a CPU
    worker, the longer of them on a GPU (whose host runs ahead)."""
    # (with the fp8 weight casts a stack makes once a step: device work outside the pipeline)
    device_optimizer_s = (
        parts.optimizer.step_s + parts.routed.optimizer_s + parts.compute.fp8_step_s
    )
    return (
        max(device_optimizer_s, parts.host.optimizer_s)
        if cluster.device.kind == "gpu"
        else device_optimizer_s + parts.host.optimizer_s
    )


def _unit_record(parts: _UnitParts, strategy: Strategy, cluster: Cluster) -> UnitCost:
    """The sum of one unit's parts."""
    p, dp, expert_dp = parts, parts.dp, parts.routed.dp
    zero3_forward_exposed_s, zero3_backward_exposed_s = _zero3_exposed(dp, expert_dp)
    forward_s, backward_s, host_s = _critical_path(
        p, strategy, cluster, (zero3_forward_exposed_s, zero3_backward_exposed_s)
    )
    memory, experts, expert_state = p.memory, p.experts, p.routed.state
    return UnitCost(
        kind=p.unit.kind,
        recompute=p.mode,
        forward_compute_s=p.forward_compute_s,
        backward_compute_s=p.backward_compute_s,
        recompute_s=p.rerun_s,
        tp_forward_s=p.tp.forward_s,
        tp_backward_s=p.tp.backward_s,
        zero3_forward_s=dp.zero3_forward_s + (expert_dp.zero3_forward_s if expert_dp else 0),
        zero3_backward_s=(dp.zero3_backward_s + (expert_dp.zero3_backward_s if expert_dp else 0)),
        zero3_exposed_s=zero3_forward_exposed_s + zero3_backward_exposed_s,
        forward_s=forward_s,
        backward_s=backward_s,
        weight_s=p.compute.weight_backward_s + experts.weight_backward_s,
        dp_sync_s=dp.sync_s,
        post_sync_s=dp.post_sync_s + p.tied.own_s + p.tied.model_s + p.replicated_s,
        optimizer_s=_optimizer_s(p, cluster),
        param_bytes=memory.param_bytes + expert_state.param_bytes,
        grad_bytes=memory.grad_bytes + expert_state.grad_bytes,
        optimizer_bytes=memory.optimizer_bytes
        + expert_state.optimizer_bytes * (1.0 - strategy.optimizer_offload),
        local_params=p.n_local + experts.local_params,
        fp8_params=p.fp8_local,
        activation_bytes=memory.activation_bytes + experts.activation_bytes,
        loss_bytes=memory.loss_bytes,
        retained_bytes=memory.retained_bytes + experts.all_activation_bytes,
        working_bytes=memory.working_bytes + experts.all_activation_bytes,
        extra_bytes=memory.extra_bytes,
        output_bytes=memory.output_bytes,
        forward_flops=p.compute.forward_flops + experts.forward_flops,
        cp_forward_s=p.ring.forward_s,
        cp_backward_s=p.ring.backward_s,
        ep_forward_s=experts.all_to_all_forward_s,
        ep_backward_s=experts.all_to_all_backward_s,
        host_s=host_s,
    )


# ------------------------------------------------------------------------------- unit classes

# A unit's content: every field but the names (op names carry the block index).
_op_content = operator.attrgetter(
    *(f.name for f in dataclasses.fields(OpProfile) if f.name != "name")
)
_unit_content = operator.attrgetter(
    *(f.name for f in dataclasses.fields(UnitProfile) if f.name not in ("name", "ops"))
)


def _unit_key(unit: UnitProfile) -> tuple[object, ...]:
    """A unit's content without its names, as a hashable value (a MoE layer's experts op by
    its place among the ops: its name carries the block index too)."""
    content = _unit_content(unit)
    moe = unit.moe
    if moe is not None:
        place = next((i for i, op in enumerate(unit.ops) if op.name == moe.experts_op), -1)
        anonymous = dataclasses.replace(moe, experts_op=f"#{place}")
        content = tuple(anonymous if value is moe else value for value in content)
    return (content, tuple(_op_content(op) for op in unit.ops))


def unit_classes(profile: ModelProfile) -> tuple[int, ...]:
    """For each unit, the index of the first unit with the same content (its own if unique).

    `CostModel.unit_costs` returns the same object for units of one class, so callers can work
    per class. Unit 0 is kept apart: the tied-gradient sync of the whole model is charged to it.
    """
    first: dict[tuple[object, ...], int] = {}
    classes = []
    for index, unit in enumerate(profile.units):
        classes.append(index if index == 0 else first.setdefault(_unit_key(unit), index))
    return tuple(classes)
