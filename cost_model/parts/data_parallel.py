"""Data parallelism and ZeRO: a unit's gradient sync (ZeRO 0-2, overlappable with the last
backward), its ZeRO-1/2 weight all-gather after the step, its ZeRO-3 gathers and
reduce-scatters around every micro-batch (and how much of them the unit's compute hides), and
the runtime's real grouping of those collectives (`grouped_dp_sync`: DDP's buckets, FSDP2's
root group).

Expects the parameters a device stores for the unit and the strategy's decisions
(`cost_model.strategy.decide`: the wrapper and the ZeRO stage that runs). Guarantees: zero
with one data-parallel rank or no parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.communication import collective_time_s
from cost_model.hardware import Cluster
from cost_model.parts.fp8 import shard_cast_s
from cost_model.strategy import GroupPlacement, Strategy
from cost_model.workload import UnitKind

# torch DDP's gradient buckets: the first holds 1 MiB (torch.distributed's
# _DEFAULT_FIRST_BUCKET_BYTES, so the all-reduce starts early in the backward), the rest
# bucket_cap_mb = 25 MiB each; each bucket is one all-reduce.
DDP_FIRST_BUCKET_BYTES = 2**20
DDP_BUCKET_CAP_BYTES = 25 * 2**20


def grad_reduce_bytes(strategy: Strategy) -> int:
    """Bytes per gradient element that data-parallel (and tied-weight) collectives move: the
    plan's gradient reduction dtype (`Strategy.precision`, `cost_model.precision`).

    By default bf16 training reduces gradients in fp32: Megatron-LM forces its fp32 main-grad
    buffers for bf16 (``accumulate_allreduce_grads_in_fp32``), torchtitan's FSDP2 policy
    (``training.mixed_precision_reduce``) and autoplan's (`passes/data_parallel.py`) set
    ``reduce_dtype=float32``; fp16 reduces fp16 gradients, Megatron-LM's default for fp16;
    fp32 and tf32 train in fp32 throughout. A plan's ``grad_reduce_dtype`` states another
    (Megatron-LM's ``--grad-reduce-in-bf16``, FSDP2's ``reduce_dtype=torch.bfloat16``).
    """
    return strategy.precision.grad_reduce_bytes


def runs_ddp(strategy: Strategy) -> bool:
    """Whether autoplan's runtime runs this plan's data parallelism under bucketed DDP (the
    decision's wrapper, `cost_model.strategy.decide`)."""
    return strategy.decisions.dp_wrapper == "ddp"


def per_unit_dp_groups(strategy: Strategy) -> bool:
    """Whether every unit is its own data-parallel group with per-unit hooks (FSDP2's
    ``fully_shard`` or ``replicate``: the decision's wrapper)."""
    return strategy.decisions.dp_wrapper in ("fsdp", "replicate")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataParallelCost:
    """One unit's data-parallel communication."""

    grad_bytes: float  # the unit's gradients a device reduces (unsharded)
    param_bytes: float  # its weights unsharded (what ZeRO-3 gathers, ZeRO-1/2 re-gathers)
    # --- per micro-batch (ZeRO-3)
    zero3_forward_s: float  # parameter all-gather before the forward
    zero3_backward_s: float  # all-gather + gradient reduce-scatter of the backward
    zero3_forward_exposed_s: float  # of the forward's, what the unit's compute does not hide
    zero3_backward_exposed_s: float
    # --- per step (ZeRO 0-2)
    sync_s: float  # gradient sync that may overlap the last backward
    post_sync_s: float  # the ZeRO-1/2 weight all-gather after the optimizer (no overlap)

    @property
    def zero3_exposed_s(self) -> float:
        return self.zero3_forward_exposed_s + self.zero3_backward_exposed_s


# DeepSpeed ZeRO-3's defaults (deepspeed/runtime/zero/config.py): parameters below
# stage3_param_persistence_threshold elements are never partitioned (so never gathered), and
# the coordinator prefetches upcoming modules' parameters in one coalesced all-gather of up to
# stage3_prefetch_bucket_size elements (partitioned_param_coordinator.py, __all_gather_params_).
DEEPSPEED_PERSISTENCE_THRESHOLD_PARAMS = 1e5
DEEPSPEED_PREFETCH_BUCKET_PARAMS = 5e7


def deepspeed_zero3_gathers(module_params: Sequence[float]) -> int:
    """All-gathers DeepSpeed's ZeRO-3 issues for one pass over a unit whose parameterised
    modules hold ``module_params`` elements each (device-local, in execution order): the
    partitioned ones (above the persistence threshold) packed greedily, in order, into
    prefetch buckets; a module larger than a bucket is a collective of its own. FSDP2 issues
    one per unit."""
    gathers, bucket = 0, 0.0
    for numel in module_params:
        if numel < DEEPSPEED_PERSISTENCE_THRESHOLD_PARAMS:
            continue
        if bucket and bucket + numel <= DEEPSPEED_PREFETCH_BUCKET_PARAMS:
            bucket += numel
            continue
        gathers += 1
        bucket = numel
    return gathers


def data_parallel_cost(
    local_params: float,
    strategy: Strategy,
    cluster: Cluster,
    dp_groups: Sequence[GroupPlacement],
    *,
    forward_window_s: float,
    backward_window_s: float,
    zero3_gathers: int = 1,
    fp8_params: float = 0.0,
    fp8_weights: int = 0,
    replicate_groups: Sequence[GroupPlacement] = (),
    replicas_beside: bool = False,
) -> DataParallelCost:
    """The data-parallel collectives of a unit whose device stores ``local_params`` parameters
    (before data-parallel sharding); ZeRO-3's hide behind the unit's forward and backward
    compute (``forward_window_s``, ``backward_window_s``: recompute included). Under ZeRO-3
    the unit's weights are gathered in ``zero3_gathers`` collectives a pass (FSDP2: one;
    DeepSpeed: `deepspeed_zero3_gathers`): the bytes are the same, each extra collective adds
    its latency (the ring's steps over the group, `cost_model.communication`). With
    ``Strategy.fp8_all_gather`` the ``fp8_params`` of them (its converted linears' weights,
    `cost_model.parts.fp8.fp8_params`) are gathered in fp8, one byte each, and the amaxes of
    its ``fp8_weights`` weights' shards all-reduced once per step (torchao's
    precompute_float8_dynamic_scale_for_fsdp).

    Under HSDP (`Strategy.hsdp`) ``dp_groups`` are the shard groups (`Strategy.shard_degree`
    ranks: the gathers and reduce-scatters run there, on the links they span) and
    ``replicate_groups`` the ranks holding the same shard, over which each rank's reduced
    1/shard of the gradients is all-reduced after the reduce-scatter, overlapping the
    backward as the reduce-scatter does. ``replicas_beside``: the stack runs that all-reduce
    on a stream of its own, beside the next groups' gathers and reduce-scatters (FSDP2's
    ``all_reduce_stream``, on the links between the replicas while theirs run inside the
    shard groups), so over a backward of many groups they cost the longer of the two; else
    it follows each reduce-scatter on the same stream (Megatron-Core's partial distributed
    optimizer) and they add."""
    dp, zero = strategy.dp_degree, strategy.runtime_zero_stage
    gathered_fp8 = fp8_params if strategy.fp8_all_gather else 0.0
    # unsharded (ZeRO-3 gathers this)
    param_bytes = (local_params - gathered_fp8) * strategy.dtype_bytes + gathered_fp8
    grad_bytes = local_params * grad_reduce_bytes(strategy)
    zero3_fwd = zero3_bwd = 0.0
    sync = post_sync = 0.0
    if dp > 1 and local_params > 0:
        # under fp8 all-gather each gather first casts this rank's shard to fp8
        shard = strategy.shard_degree
        shard_cast = shard_cast_s(gathered_fp8 / shard, cluster) if gathered_fp8 else 0.0
        # HSDP: the reduce-scattered shard all-reduced over its replicas (FSDP2's
        # foreach_reduce all-reduces it over the replicate mesh dim after the reduce-scatter,
        # torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py; Megatron-Core's partial
        # distributed optimizer all-reduces across instances after the intra-instance
        # reduce-scatter, param_and_grad_buffer.py start_grad_sync); zero without HSDP
        replicas = collective_time_s("all_reduce", grad_bytes / shard, replicate_groups, cluster)
        if zero >= 3:
            # FSDP / ZeRO-3 (Rajbhandari et al. 2020, section 7.2.2): all-gather weights
            # before the forward and again before the backward, reduce-scatter gradients
            # after it, every micro-batch; prefetching hides them behind this unit's compute.
            gather = collective_time_s("all_gather", param_bytes, dp_groups, cluster)
            gather += shard_cast
            if zero3_gathers > 1:
                one_byte = collective_time_s("all_gather", 1.0, dp_groups, cluster)
                gather += (zero3_gathers - 1) * one_byte
            scatter = collective_time_s("reduce_scatter", grad_bytes, dp_groups, cluster)
            zero3_fwd = gather
            zero3_bwd = _with_replicas(gather + scatter, replicas, replicas_beside)
        elif zero >= 1:
            # ZeRO-1/2: reduce-scatter gradients (overlappable), all-gather the updated
            # weights after the optimizer step (Rajbhandari et al. 2020, section 7.2.1).
            sync = collective_time_s("reduce_scatter", grad_bytes, dp_groups, cluster)
            sync = _with_replicas(sync, replicas, replicas_beside)
            post_sync = collective_time_s("all_gather", param_bytes, dp_groups, cluster)
            post_sync += shard_cast
        else:
            sync = collective_time_s("all_reduce", grad_bytes, dp_groups, cluster)
        if gathered_fp8 > 0 and zero >= 1:
            # one fp32 amax per converted weight (priced per unit: torchao all-reduces every
            # weight's at once, so this over-counts the latency by the units)
            post_sync += collective_time_s("all_reduce", 4.0 * fp8_weights, dp_groups, cluster)
    cal = cluster.calibration
    overlap = cal.dp_overlap_fraction
    slowdown = cal.overlapped_comm_slowdown
    return DataParallelCost(
        grad_bytes=grad_bytes,
        param_bytes=param_bytes,
        zero3_forward_s=zero3_fwd,
        zero3_backward_s=zero3_bwd,
        zero3_forward_exposed_s=exposed_s(zero3_fwd, overlap * forward_window_s, slowdown),
        zero3_backward_exposed_s=exposed_s(zero3_bwd, overlap * backward_window_s, slowdown),
        sync_s=sync,
        post_sync_s=post_sync,
    )


def _with_replicas(shard_s: float, replicas_s: float, beside: bool) -> float:
    """A unit's shard-group collectives with HSDP's replica all-reduce: on a stream of its own
    (``beside``) the longer of the two, else one after the other (`data_parallel_cost`)."""
    return max(shard_s, replicas_s) if beside else shard_s + replicas_s


def exposed_s(comm_s: float, window_s: float, slowdown: float) -> float:
    """Time a collective adds to the compute it may hide behind: what outlasts the window is
    exposed, and what hides still slows that compute by the calibrated interference (the
    collective's kernels share the device)."""
    return max(0.0, comm_s - window_s) + slowdown * min(comm_s, window_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class DpSyncShare:
    """A unit's share of a merged data-parallel collective (`grouped_dp_sync`)."""

    unit_idx: int
    sync_s: float
    post_sync_s: float | None  # None: the unit keeps its own


def grouped_dp_sync(
    kinds: Sequence[UnitKind],
    dp_costs: Sequence[DataParallelCost],
    cluster: Cluster,
    strategy: Strategy,
    dp_groups: Sequence[GroupPlacement],
    replicate_groups: Sequence[GroupPlacement] = (),
    replicas_beside: bool = False,
) -> tuple[DpSyncShare, ...]:
    """Price ZeRO-0/1/2 gradient sync by the runtime's real collectives, not one per unit.

    DDP (`per_unit_dp_groups` false) all-reduces the whole model's gradients in buckets
    (`DDP_FIRST_BUCKET_BYTES`, then `DDP_BUCKET_CAP_BYTES`); FSDP2 gives each block its own
    group and puts the embedding and head in the stage's group, so with one pipeline stage
    they share one collective. Each merged collective's time goes to its units in proportion
    to their bytes, which keeps the per-unit costs additive for the planner's ILP. Collective
    time is latency plus bytes over bandwidth, so merging saves only latencies. Empty when
    every unit keeps its own (ZeRO-3, one data-parallel rank, several stages). Under HSDP
    ``dp_groups`` are the shard groups and ``replicate_groups`` the replicas (as in
    `data_parallel_cost`).
    """
    if strategy.dp_degree == 1 or strategy.runtime_zero_stage >= 3:
        return ()
    if not per_unit_dp_groups(strategy):
        # DDP runs only without TP and PP: every unit is on the one stage.
        grads = [c.grad_bytes for c in dp_costs]
        total = sum(grads)
        buckets = [min(total, DDP_FIRST_BUCKET_BYTES)]
        rest = total - buckets[0]
        while rest > 0:
            buckets.append(min(rest, DDP_BUCKET_CAP_BYTES))
            rest -= buckets[-1]
        sync = sum(collective_time_s("all_reduce", b, dp_groups, cluster) for b in buckets)
        return tuple(
            DpSyncShare(unit_idx=i, sync_s=g / total * sync if total > 0 else 0.0, post_sync_s=None)
            for i, g in enumerate(grads)
        )
    if strategy.num_stages > 1:
        return ()
    merged = [i for i, kind in enumerate(kinds) if kind != "block" and dp_costs[i].grad_bytes > 0]
    if len(merged) < 2:
        return ()
    grad_total = sum(dp_costs[i].grad_bytes for i in merged)
    param_total = sum(dp_costs[i].param_bytes for i in merged)
    if strategy.runtime_zero_stage >= 1:
        sync = collective_time_s("reduce_scatter", grad_total, dp_groups, cluster)
        # HSDP: the group's shard all-reduced over its replicas (`data_parallel_cost`)
        shard_total = grad_total / strategy.shard_degree
        replicas = collective_time_s("all_reduce", shard_total, replicate_groups, cluster)
        sync = _with_replicas(sync, replicas, replicas_beside)
        gather = collective_time_s("all_gather", param_total, dp_groups, cluster)
    else:
        sync = collective_time_s("all_reduce", grad_total, dp_groups, cluster)
        gather = 0.0
    # With one stage there are no tied-weight all-reduces: a merged unit's post-sync is only
    # its ZeRO-1/2 weight all-gather, now its share of the group's.
    return tuple(
        DpSyncShare(
            unit_idx=i,
            sync_s=dp_costs[i].grad_bytes / grad_total * sync,
            post_sync_s=dp_costs[i].param_bytes / param_total * gather,
        )
        for i in merged
    )
