"""Step time and memory of a plan: per-unit costs, assembled through the schedule simulation.

Expects a `ModelProfile`, a `Cluster` and a plan (`PlanLike`: ``autoplan.Plan`` or anything with
its fields). Guarantees: `estimate` is a pure function built only from the public blocks below,
in this exact structure, so the planner can reproduce it (its CP-SAT model cuts with the
simulation's longest paths, `autoplan.planner.partition`):

- `unit_costs(profile, cluster, strategy, recompute)`: for fixed outer choices, every unit's
  per-micro-batch forward and backward time (compute, recompute, TP collectives, exposed ZeRO-3
  gathers) and the weight-gradient part of the backward, per-step data-parallel and optimizer
  time, and bytes (static, activations per in-flight micro-batch).
- per stage (`stage_times`): the sums over its units, the host time of its messages, and the
  link time of its boundary (`boundary_costs`: the last unit's output to the next stage's rank).
- tail after a rank's last action: ``max(0, dp_sync - overlap * backward_window) + post_sync +
  optimizer`` (`rank_tail_s`) plus the loop's fixed `step_overhead_s`.
- step time: `cost_model.schedules.simulate` of the schedule's own action orders (torch's) with
  those times: ``max over ranks of (end of the rank's last action + its tail)``.
- memory of rank r = (1 + allocator overhead) * (static bytes + activations held at the rank's
  peak point of the schedule + constant buffers) + reserved bytes (`rank_memory`,
  `peak_activations`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from cost_model.calibration import Calibration
from cost_model.communication import collective_time_s, p2p_time_s
from cost_model.compute import OpTime, op_time
from cost_model.errors import InputError
from cost_model.hardware import Cluster
from cost_model.memory import (
    RECOMPUTABLE_KINDS,
    activation_bytes,
    activation_scale,
    local_num_params,
    static_bytes,
    weight_grad_input_bytes,
    working_bytes,
)
from cost_model.schedules import (
    HeldProfile,
    ScheduleSpec,
    StageTimes,
    held_microbatches,
    simulate,
)
from cost_model.strategy import (
    DTYPE_BYTES,
    GroupPlacement,
    PlanLike,
    Strategy,
    group_placements,
    pipeline_link_crosses_nodes,
)
from cost_model.units import format_bytes
from cost_model.workload import ModelProfile, OpProfile, UnitProfile

# Adam step memory traffic per locally-updated parameter (read grad, master weight, momentum,
# variance; write master, momentum, variance and the low-precision copy), plus one read of the
# gradients for the global-norm clip: 2+4+4+4 + 4+4+4+2 + 2 = 30 bytes in mixed precision,
# 4+4+4+4 + 4+4+4 + 4 = 32 bytes in fp32.
ADAM_TRAFFIC_BYTES_PER_PARAM = {"mixed": 30.0, "fp32": 32.0}


def grad_reduce_bytes(dtype: str) -> int:
    """Bytes per gradient element that data-parallel (and tied-weight) collectives move.

    bf16 training reduces gradients in fp32: Megatron-LM forces its fp32 main-grad buffers
    for bf16 (``accumulate_allreduce_grads_in_fp32``), torchtitan's FSDP2 policy and
    autoplan's (`passes/data_parallel.py`) set ``reduce_dtype=float32``. fp16 reduces fp16
    gradients, Megatron-LM's default for fp16 (autoplan's runtime reduces those in fp32 too,
    which this under-prices by half). fp32 and tf32 train in fp32 throughout.
    """
    return 2 if dtype == "fp16" else 4


# torch DDP's gradient buckets: the first holds 1 MiB (torch.distributed's
# _DEFAULT_FIRST_BUCKET_BYTES, so the all-reduce starts early in the backward), the rest
# bucket_cap_mb = 25 MiB each; each bucket is one all-reduce.
DDP_FIRST_BUCKET_BYTES = 2**20
DDP_BUCKET_CAP_BYTES = 25 * 2**20


class MemoryCapacityError(InputError):
    """A plan needs more device memory than the cluster has (the message lists the numbers)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitCost:
    """Costs of one pipeline unit on one device under fixed outer choices and recompute mode.

    Times are per micro-batch unless they say per step; bytes are per device. `unit_costs`
    returns one per unit, in unit order; identical units share one object.
    """

    kind: str
    recompute: str
    # --- per micro-batch
    forward_compute_s: float
    backward_compute_s: float
    recompute_s: float  # forward compute re-run in the backward
    tp_forward_s: float  # TP collectives of the forward
    tp_backward_s: float  # TP collectives of the backward (incl. re-run forward ones)
    zero3_forward_s: float  # ZeRO-3 parameter all-gather before the forward
    zero3_backward_s: float  # ZeRO-3 all-gather + gradient reduce-scatter of the backward
    zero3_exposed_s: float  # the part of both not hidden behind this unit's compute
    forward_s: float  # critical path of the forward
    backward_s: float  # critical path of the backward (incl. recompute)
    weight_s: float  # of backward_s, the weight gradient a split backward runs later
    # --- per step
    dp_sync_s: float  # gradient sync that may overlap the last backward (ZeRO 0-2)
    post_sync_s: float  # communication that cannot overlap (ZeRO 1/2 param all-gather, tied grads)
    optimizer_s: float
    # --- bytes
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    local_params: float  # parameters this device stores before data-parallel sharding
    activation_bytes: float  # held per in-flight micro-batch (the loss's included)
    loss_bytes: float  # of those, the loss's (and again as working set: extra_bytes)
    # held per micro-batch between a split backward's input and weight halves: the recompute
    # (if any) has run and torch's stage_backward_input retains the whole graph until then,
    # with the gradients the weight half needs (not in the first stage, which defers it all)
    retained_bytes: float
    working_bytes: float  # transient bytes while its backward runs (one micro-batch)
    extra_bytes: float  # the working set counted with this unit (embedding and head only)
    output_bytes: float  # the tensor sent to the next stage per micro-batch, per device
    forward_flops: float  # per micro-batch on this device (model work, no recompute)

    @property
    def time_s(self) -> float:
        """Forward + backward per micro-batch: the unit's share of its stage's time."""
        return self.forward_s + self.backward_s

    @property
    def static_bytes(self) -> float:
        """Bytes held for the whole step (weights, grads, optimizer state, fixed transients)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.extra_bytes

    @property
    def tp_comm_s(self) -> float:
        return self.tp_forward_s + self.tp_backward_s

    @property
    def compute_s(self) -> float:
        """Forward + backward + recompute compute per micro-batch."""
        return self.forward_compute_s + self.backward_compute_s + self.recompute_s


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConstants:
    """Per-device memory terms that do not depend on the stage cuts."""

    buffer_bytes: float  # working set of one block's backward, p2p and DP/ZeRO-3 buffers
    reserved_bytes: float  # runtime context, library buffers (calibration)
    allocator_overhead_fraction: float
    # of buffer_bytes, the largest block's backward working set: a bound for any cut (the
    # partition's), which `rank_memory` replaces by that of the rank's own blocks
    block_working_bytes: float = 0.0

    def total_bytes(self, tensor_bytes: float) -> float:
        """Device bytes for ``tensor_bytes`` of static + activation bytes of one rank."""
        inner = tensor_bytes + self.buffer_bytes
        return (1.0 + self.allocator_overhead_fraction) * inner + self.reserved_bytes

    def usable_bytes(self, capacity_bytes: float) -> float:
        """The largest static + activation total that still fits ``capacity_bytes``."""
        inner = (capacity_bytes - self.reserved_bytes) / (1.0 + self.allocator_overhead_fraction)
        return inner - self.buffer_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes one device of a pipeline rank holds at its peak."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # held activations: in-flight micro-batches x bytes per micro-batch
    working_bytes: float  # working set of one backward, p2p and pipeline, DP buffers
    reserve_bytes: float  # framework reserve (calibration) and the allocator margin on the rest
    total_bytes: float
    # the loss's fp32 log-probabilities: those its in-flight micro-batches keep for the
    # backward, and one more as its backward's working set (`loss_cost`)
    loss_bytes: float = 0.0
    # of reserve_bytes, the allocator margin (the rest is the framework reserve)
    margin_bytes: float = 0.0

    @property
    def predicted_bytes(self) -> float:
        """Tensors and working set: the total before the reserve and allocator margin."""
        return self.total_bytes - self.reserve_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class StageEstimate:
    """One pipeline stage (model chunk). Times are seconds within one step on one device."""

    stage_idx: int
    pp_rank: int
    first_unit: int
    last_unit: int
    recompute: str
    forward_s: float  # one micro-batch, host time of its sent message included
    backward_s: float  # one micro-batch (incl. recompute and its sent message)
    weight_s: float  # of backward_s, what a split backward defers (0 unless zero-bubble)
    transfer_s: float  # link time of the boundary after the stage (0: last, or same rank)
    compute_s: float  # m x (forward + backward compute, incl. recompute)
    recompute_s: float
    tp_comm_s: float
    pp_comm_s: float  # host time posting pipeline messages (link time delays the peer instead)
    dp_comm_s: float  # gradient sync + ZeRO gathers (all of it, overlapped or not)
    bubble_s: float  # the rank's idle time in the pipeline, split over its stages
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # held at the peak (in-flight micro-batches included)
    inflight_microbatches: float


@dataclass(frozen=True, kw_only=True, slots=True)
class RankEstimate:
    """One pipeline rank (all devices of that rank behave alike)."""

    pp_rank: int
    stages: tuple[int, ...]
    time_per_microbatch_s: float
    busy_s: float
    bubble_s: float
    tail_s: float  # exposed DP sync + post-sync communication + optimizer after the flush
    memory: MemoryBreakdown
    fits: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """The cost model's prediction for one plan on one cluster."""

    cluster: str
    num_devices: int
    global_batch_size: int
    seq_len: int
    step_time_s: float
    pipeline_time_s: float
    tail_s: float
    bubble_fraction: float
    tokens_per_s: float
    model_flops_per_step: float
    model_tflops_per_device: float
    mfu: float
    peak_memory_bytes: float
    memory_capacity_bytes: float
    fits: bool
    stages: tuple[StageEstimate, ...]
    ranks: tuple[RankEstimate, ...]

    def to_data(self) -> dict[str, Any]:
        """Plain data for JSON output."""
        return dataclasses.asdict(self)

    def memory_report(self) -> str:
        """One line per pipeline rank: its memory against the device capacity."""
        gib = 2.0**30
        return "; ".join(
            f"pp rank {r.pp_rank} (stages {', '.join(map(str, r.stages))}): "
            f"{r.memory.total_bytes / gib:.1f} GiB = weights {r.memory.param_bytes / gib:.1f} "
            f"+ grads {r.memory.grad_bytes / gib:.1f} "
            f"+ optimizer {r.memory.optimizer_bytes / gib:.1f} "
            f"+ activations {r.memory.activation_bytes / gib:.1f} "
            f"+ working set {r.memory.working_bytes / gib:.1f} "
            f"+ loss {r.memory.loss_bytes / gib:.1f} "
            f"+ reserve and margin {r.memory.reserve_bytes / gib:.1f}"
            for r in self.ranks
        )

    @property
    def peak_rank(self) -> RankEstimate:
        """The pipeline rank with the largest memory total."""
        return max(self.ranks, key=lambda r: r.memory.total_bytes)

    def require_fits(self) -> None:
        """Raise `MemoryCapacityError` (one line: the rank, its predicted peak, the capacity,
        the largest parts and the cheapest fixes) if any device overflows. The one memory check
        of `autoplan validate`, `autoplan.parallelize` and the search's results."""
        if self.fits:
            return
        raise MemoryCapacityError(self.memory_problem())

    @property
    def fits_without_margin(self) -> bool:
        """Whether every device would fit without the allocator margin (its tensors and the
        framework reserve do): a plan that fits only so runs at the allocator's edge. PyTorch's
        caching allocator frees its unused cached blocks and retries before it reports an
        out-of-memory error (c10/cuda/CUDACachingAllocator.cpp, ``release_cached_blocks``;
        ``num_alloc_retries`` in ``torch.cuda.memory_stats``), so such a run may well train,
        with slower steps; the check does not count on it."""
        return all(
            r.memory.total_bytes - r.memory.margin_bytes <= self.memory_capacity_bytes
            for r in self.ranks
        )

    def memory_problem(self) -> str:
        """What `require_fits` raises, as a line ("" when the plan fits)."""
        if self.fits:
            return ""
        peak = self.peak_rank
        m = peak.memory
        edge = ""
        if self.fits_without_margin:
            edge = (
                f" (over only by the allocator margin, {format_bytes(m.margin_bytes)}: it may "
                "run at the edge, its caching allocator flushing and retrying; "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cuts fragmentation)"
            )
        parts = sorted(
            (
                ("activations in flight", m.activation_bytes),
                ("optimizer state", m.optimizer_bytes),
                ("weights", m.param_bytes),
                ("gradients", m.grad_bytes),
                ("working set", m.working_bytes),
                ("loss", m.loss_bytes),
                ("reserve and allocator margin", m.reserve_bytes),
            ),
            key=lambda part: -part[1],
        )
        largest = ", ".join(f"{name} {format_bytes(size)}" for name, size in parts[:3])
        if parts[0][0] == "activations in flight":
            fixes = (
                "recompute 'selective' or 'full' on its stages, a smaller micro-batch, or more "
                "pipeline stages"
            )
        elif parts[0][0] == "loss":
            fixes = (
                "a smaller micro-batch, tensor parallelism (the head's logits divide by it), or "
                "a fused cross-entropy (Calibration.loss_saved_bytes_per_logit)"
            )
        elif parts[0][0] in ("working set", "reserve and allocator margin"):
            fixes = "a smaller micro-batch, or devices with more memory"
        else:
            fixes = (
                "a higher ZeRO level (3 shards the weights too), more tensor or pipeline "
                "parallelism, or more devices"
            )
        return (
            f"plan does not fit: pipeline rank {peak.pp_rank} needs {format_bytes(m.total_bytes)} "
            f"per device, the device has {format_bytes(self.memory_capacity_bytes)} on "
            f"{self.cluster}{edge} (largest: {largest}); fix: {fixes}; or override the check "
            "(check_memory=False, --allow-over-memory) to run it anyway"
        )


# ------------------------------------------------------------------------------- unit costs


def _tp_collective_counts(unit: UnitProfile) -> tuple[int, int]:
    """(forward, backward) all-reduces a unit needs under Megatron tensor parallelism.

    Shoeybi et al. 2019, section 3 (f and g operators): every column...row region ends with an
    all-reduce in the forward (g) and starts with one in the backward (f): 2 + 2 per transformer
    layer. The vocab-parallel embedding all-reduces its output (forward); the vocab-parallel
    head's input needs the backward all-reduce.
    """
    linears = unit.tp.linears
    if linears:
        rows = sum(1 for lin in linears if lin.style == "row")
        embeds = sum(1 for lin in linears if lin.style == "vocab_embedding")
        heads = sum(1 for lin in linears if lin.style == "vocab_head")
        return rows + embeds, rows + heads
    rows = sum(1 for op in unit.ops if op.tp == "row" and op.kind == "matmul")
    vocab = sum(1 for op in unit.ops if op.tp == "vocab")
    if unit.kind == "head":
        return 0, max(rows, 1) if unit.num_params_tp_sharded else 0
    return rows + min(vocab, 1), rows


def _tp_module_count(unit: UnitProfile, sequence_parallel: bool) -> int:
    """Modules tensor parallelism wraps in this unit: linears, embedding and head, and with
    sequence parallelism the norms too (they run on sequence-sharded distributed tensors)."""
    if unit.tp.linears:
        count = len(unit.tp.linears)
    else:
        count = sum(
            1 for op in unit.ops if op.tp in ("column", "row", "vocab") and op.param_bytes_read
        )
    if sequence_parallel:
        count += sum(1 for op in unit.ops if op.kind == "reduction" and op.param_bytes_read)
    return count


def runs_ddp(strategy: Strategy) -> bool:
    """Whether autoplan's runtime runs this plan's data parallelism under bucketed DDP
    (`Strategy.dp_wrapper`)."""
    return strategy.dp_wrapper == "ddp"


def _per_unit_dp_groups(strategy: Strategy) -> bool:
    """Whether every unit is its own data-parallel group with per-unit hooks (FSDP2's
    ``fully_shard`` or ``replicate``, `Strategy.dp_wrapper`)."""
    return strategy.dp_wrapper in ("fsdp", "replicate")


def _host_overhead_s(unit: UnitProfile, strategy: Strategy, cal: Calibration) -> float:
    """Wrapper host time of one unit per micro-batch (forward + backward)."""
    host = 0.0
    if strategy.tp_degree > 1:
        host += _tp_module_count(unit, strategy.sequence_parallel) * cal.tp_module_overhead_s
    if unit.num_params > 0 and _per_unit_dp_groups(strategy):
        host += cal.dp_unit_overhead_s
    return host


def _hidden_bytes_per_sample(unit: UnitProfile) -> float:
    """The activation a TP collective of this unit moves: the hidden state (b, s, h)."""
    return unit.input_bytes if unit.kind == "head" else unit.output_bytes


def _tp_times(
    unit: UnitProfile,
    strategy: Strategy,
    cluster: Cluster,
    traced_dtype_bytes: int,
    tp_groups: Sequence[GroupPlacement],
) -> tuple[float, float]:
    if strategy.tp_degree == 1:
        return 0.0, 0.0
    n_fwd, n_bwd = _tp_collective_counts(unit)
    size = _hidden_bytes_per_sample(unit) * activation_scale(strategy, traced_dtype_bytes)
    if strategy.sequence_parallel:
        # Korthikanti et al. 2022, section 4.2.2: each all-reduce becomes a reduce-scatter and
        # an all-gather of the same buffer (same bytes, twice the latency).
        one = collective_time_s("reduce_scatter", size, tp_groups, cluster) + collective_time_s(
            "all_gather", size, tp_groups, cluster
        )
    else:
        one = collective_time_s("all_reduce", size, tp_groups, cluster)
    return n_fwd * one, n_bwd * one


def unit_costs(
    profile: ModelProfile, cluster: Cluster, strategy: Strategy, recompute: str
) -> tuple[UnitCost, ...]:
    """Every unit's costs on one device, with ``recompute`` applied to the units it covers."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute mode {recompute!r}; use none, selective or full")
    traced = profile.traced_dtype_bytes
    cal = cluster.calibration
    device = cluster.device
    dtype = strategy.dtype
    t, dp = strategy.tp_degree, strategy.dp_degree
    zero = strategy.runtime_zero_stage
    tp_groups = group_placements(strategy, cluster, "tp")
    dp_groups = group_placements(strategy, cluster, "dp")
    width = DTYPE_BYTES[dtype]
    mixed = "fp32" if width >= 4 else "mixed"
    mem_bw = device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    pp_shared_pair = tied_pair_placement(strategy, cluster)
    classes = _unit_classes(profile)
    costs: list[UnitCost] = []
    # Per unit: the gradient and unsharded weight bytes its data-parallel collectives move.
    dp_bytes: list[tuple[float, float]] = []
    for index, unit in enumerate(profile.units):
        if classes[index] != index:
            # Identical to an earlier unit (repeated blocks): the same costs object.
            costs.append(costs[classes[index]])
            dp_bytes.append(dp_bytes[classes[index]])
            continue
        mode = recompute if unit.kind in RECOMPUTABLE_KINDS else "none"
        times = _compute_times(profile, cluster, strategy, index)
        fwd_c, bwd_c, flops = times.forward_s, times.backward_s, times.forward_flops
        tp_fwd, tp_bwd = _tp_times(unit, strategy, cluster, traced, tp_groups)
        recompute_s = _recompute_s(unit, mode, cal, times)
        if mode == "full":
            # Re-run the forward, its TP all-reduces included (Megatron recomputes through the
            # f/g operators), less those of the row-parallel linears an early stop skips.
            tp_bwd += tp_fwd * (1.0 - cal.full_recompute_early_stop * _tail_tp_share(unit))

        # Parameters this device stores: TP-local; tied weights once per device (pp = 1).
        n_local = local_num_params(unit, t, count_shared=strategy.pp_degree > 1)
        state = static_bytes(n_local, dtype, zero, dp, strategy.dp_wrapper)
        param_full_bytes = n_local * width  # unsharded (ZeRO-3 gathers this)
        grad_full_bytes = n_local * grad_reduce_bytes(dtype)
        dp_bytes.append((grad_full_bytes, param_full_bytes))

        zero3_fwd = zero3_bwd = 0.0
        dp_sync = post_sync = 0.0
        if dp > 1 and n_local > 0:
            if zero >= 3:
                # FSDP / ZeRO-3 (Rajbhandari et al. 2020, section 7.2.2): all-gather weights
                # before the forward and again before the backward, reduce-scatter gradients
                # after it, every micro-batch; prefetching hides them behind this unit's compute.
                gather = collective_time_s("all_gather", param_full_bytes, dp_groups, cluster)
                scatter = collective_time_s("reduce_scatter", grad_full_bytes, dp_groups, cluster)
                zero3_fwd = gather
                zero3_bwd = gather + scatter
            elif zero >= 1:
                # ZeRO-1/2: reduce-scatter gradients (overlappable), all-gather the updated
                # weights after the optimizer step (Rajbhandari et al. 2020, section 7.2.1).
                dp_sync = collective_time_s("reduce_scatter", grad_full_bytes, dp_groups, cluster)
                post_sync = collective_time_s("all_gather", param_full_bytes, dp_groups, cluster)
            else:
                dp_sync = collective_time_s("all_reduce", grad_full_bytes, dp_groups, cluster)
        if unit.num_params_shared and strategy.pp_degree > 1 and pp_shared_pair is not None:
            # Tied embedding and head on the first and last pipeline ranks all-reduce the
            # shared gradient (Megatron-LM's embedding group; Narayanan et al. 2021, sec. 2.2).
            shared = unit.num_params_shared / t * grad_reduce_bytes(dtype)
            post_sync += collective_time_s("all_reduce", shared, (pp_shared_pair,), cluster)
        if index == 0 and strategy.pp_degree > 1 and pp_shared_pair is not None:
            tied = sum(u.num_params_shared for u in profile.units)
            if tied:
                shared = tied / t * grad_reduce_bytes(dtype)
                post_sync += collective_time_s("all_reduce", shared, (pp_shared_pair,), cluster)

        # Optimizer step: memory-bound Adam over the parameters this device updates.
        updated = n_local / dp if zero >= 1 else n_local
        optimizer_s = updated * ADAM_TRAFFIC_BYTES_PER_PARAM[mixed] / mem_bw
        if updated > 0:
            optimizer_s += cal.kernel_overhead_s

        # Host time of the wrappers (split evenly between forward and backward).
        host = _host_overhead_s(unit, strategy, cal)
        if n_local > 0 and (t > 1 or _per_unit_dp_groups(strategy)):
            optimizer_s += cal.sharded_optimizer_unit_overhead_s
        overlap = cal.dp_overlap_fraction
        slowdown = cal.overlapped_comm_slowdown
        zero3_fwd_exposed = _exposed_s(zero3_fwd, overlap * fwd_c, slowdown)
        zero3_bwd_exposed = _exposed_s(zero3_bwd, overlap * (bwd_c + recompute_s), slowdown)
        zero3_exposed = zero3_fwd_exposed + zero3_bwd_exposed
        scale = activation_scale(strategy, traced)
        boundary_div = t if strategy.sequence_parallel else 1
        forward_s = fwd_c + tp_fwd + zero3_fwd_exposed + host / 2
        backward_s = bwd_c + recompute_s + tp_bwd + zero3_bwd_exposed + host / 2
        loss_saved = loss_cost(unit, strategy, cluster, traced).saved_bytes
        held = activation_bytes(unit, strategy, mode, traced) + loss_saved
        working = working_bytes(unit, strategy, traced) + loss_saved
        retained = (
            activation_bytes(unit, strategy, "none", traced)
            + weight_grad_input_bytes(unit, strategy, traced)
            + loss_saved
        )
        costs.append(
            UnitCost(
                kind=unit.kind,
                recompute=mode,
                forward_compute_s=fwd_c,
                backward_compute_s=bwd_c,
                recompute_s=recompute_s,
                tp_forward_s=tp_fwd,
                tp_backward_s=tp_bwd,
                zero3_forward_s=zero3_fwd,
                zero3_backward_s=zero3_bwd,
                zero3_exposed_s=zero3_exposed,
                forward_s=forward_s,
                backward_s=backward_s,
                weight_s=times.weight_backward_s,
                dp_sync_s=dp_sync,
                post_sync_s=post_sync,
                optimizer_s=optimizer_s,
                param_bytes=state.param_bytes,
                grad_bytes=state.grad_bytes,
                optimizer_bytes=state.optimizer_bytes,
                local_params=n_local,
                activation_bytes=held,
                loss_bytes=loss_saved,
                retained_bytes=retained,
                working_bytes=working,
                extra_bytes=0.0 if unit.kind in RECOMPUTABLE_KINDS else working,
                output_bytes=unit.output_bytes * scale / boundary_div,
                forward_flops=flops,
            )
        )
    if dp > 1 and zero < 3:
        costs = _grouped_dp_sync(costs, dp_bytes, profile, cluster, strategy, dp_groups)
    pipe_factor, tail_factor = oversubscription_factors(strategy, cluster)
    if pipe_factor != 1.0 or tail_factor != 1.0:
        costs = _stretched(costs, pipe_factor, tail_factor)
    return tuple(costs)


# UnitCost times that run inside the pipeline schedule, and after its flush (the rank tail).
_PIPELINE_TIMES = (
    "forward_compute_s",
    "backward_compute_s",
    "recompute_s",
    "tp_forward_s",
    "tp_backward_s",
    "zero3_forward_s",
    "zero3_backward_s",
    "zero3_exposed_s",
    "forward_s",
    "backward_s",
    "weight_s",
)
_TAIL_TIMES = ("dp_sync_s", "post_sync_s", "optimizer_s")


def oversubscription_factors(strategy: Strategy, cluster: Cluster) -> tuple[float, float]:
    """How much longer the pipeline and the rank tail take when CPU workers share cores.

    Processor sharing: ``a`` runnable workers on ``C`` cores each run at ``min(1, C / a)`` of
    their own speed, and a worker blocked on a receive uses no core. The pipeline advances in
    ``n = m v + p - 1`` waves of one chunk per micro-batch, forward and backward; wave ``d``
    keeps ``a_d = min(d + 1, p, n - d, m v)`` pipeline ranks busy, each replicated over the
    ``dp x tp`` workers of its stage, so it takes ``max(1, a_d dp tp / C)`` times as long.
    The pipeline factor is the mean over the waves (exact for uniform stages); the tail runs on
    every worker at once: ``max(1, p dp tp / C)``. Without pipelining both reduce to the even
    share ``P / C``. (1, 1) when devices do not share cores (GPUs).
    """
    if cluster.shared_cores_per_node is None:
        return 1.0, 1.0
    return _sharing_factors(
        strategy.pp_degree,
        strategy.virtual_stages,
        strategy.num_micro_batches,
        strategy.dp_degree * strategy.tp_degree,
        cluster.shared_cores_per_node,
        cluster.devices_per_node,
    )


@functools.lru_cache(maxsize=4096)
def _sharing_factors(
    p: int, v: int, m: int, replicas: int, cores_per_node: int, devices_per_node: int
) -> tuple[float, float]:
    # Memoised: the planner asks once per stage boundary and unit of every candidate.
    workers = p * replicas
    nodes = max(1, -(-workers // devices_per_node))  # nodes the job occupies
    cores = float(cores_per_node * nodes)
    waves = m * v + p - 1
    pipe = sum(max(1.0, min(d + 1, p, waves - d, m * v) * replicas / cores) for d in range(waves))
    return pipe / waves, max(1.0, workers / cores)


def step_overhead_s(strategy: Strategy, cluster: Cluster) -> float:
    """The training loop's fixed time per step (``calibration.step_overhead_s``), which every
    worker spends at once after its tail (so CPU workers sharing cores stretch it too)."""
    _, tail_factor = oversubscription_factors(strategy, cluster)
    return cluster.calibration.step_overhead_s * tail_factor


def _stretched(costs: list[UnitCost], pipe_factor: float, tail_factor: float) -> list[UnitCost]:
    done: dict[int, UnitCost] = {}
    out = []
    for c in costs:
        if id(c) not in done:
            changes = {name: getattr(c, name) * pipe_factor for name in _PIPELINE_TIMES}
            changes.update({name: getattr(c, name) * tail_factor for name in _TAIL_TIMES})
            done[id(c)] = dataclasses.replace(c, **changes)
        out.append(done[id(c)])
    return out


def _grouped_dp_sync(
    costs: list[UnitCost],
    dp_bytes: Sequence[tuple[float, float]],
    profile: ModelProfile,
    cluster: Cluster,
    strategy: Strategy,
    dp_groups: Sequence[GroupPlacement],
) -> list[UnitCost]:
    """Price ZeRO-0/1/2 gradient sync by the runtime's real collectives, not one per unit.

    DDP (`_per_unit_dp_groups` false) all-reduces the whole model's gradients in buckets
    (`DDP_FIRST_BUCKET_BYTES`, then `DDP_BUCKET_CAP_BYTES`); FSDP2 gives each block its own
    group and puts the embedding and head in the stage's group, so with one pipeline stage
    they share one collective. Each merged collective's time goes to its units in proportion
    to their bytes, which keeps the per-unit costs additive for the planner's ILP. Collective
    time is latency plus bytes over bandwidth, so merging saves only latencies.
    """
    units = profile.units
    if not _per_unit_dp_groups(strategy):
        # DDP runs only without TP and PP: every unit is on the one stage.
        grads = [g for g, _ in dp_bytes]
        total = sum(grads)
        buckets = [min(total, DDP_FIRST_BUCKET_BYTES)]
        rest = total - buckets[0]
        while rest > 0:
            buckets.append(min(rest, DDP_BUCKET_CAP_BYTES))
            rest -= buckets[-1]
        sync = sum(collective_time_s("all_reduce", b, dp_groups, cluster) for b in buckets)
        shares = [(i, g / total * sync if total > 0 else 0.0) for i, g in enumerate(grads)]
        return _with_dp_sync(costs, shares, post={})
    if strategy.num_stages > 1:
        return costs
    merged = [i for i, u in enumerate(units) if u.kind != "block" and dp_bytes[i][0] > 0]
    if len(merged) < 2:
        return costs
    grad_total = sum(dp_bytes[i][0] for i in merged)
    param_total = sum(dp_bytes[i][1] for i in merged)
    if strategy.runtime_zero_stage >= 1:
        sync = collective_time_s("reduce_scatter", grad_total, dp_groups, cluster)
        gather = collective_time_s("all_gather", param_total, dp_groups, cluster)
    else:
        sync = collective_time_s("all_reduce", grad_total, dp_groups, cluster)
        gather = 0.0
    shares = [(i, dp_bytes[i][0] / grad_total * sync) for i in merged]
    # With one stage there are no tied-weight all-reduces: a merged unit's post-sync is only
    # its ZeRO-1/2 weight all-gather, now its share of the group's.
    post = {i: dp_bytes[i][1] / param_total * gather for i in merged}
    return _with_dp_sync(costs, shares, post=post)


def _with_dp_sync(
    costs: list[UnitCost], shares: Sequence[tuple[int, float]], *, post: dict[int, float]
) -> list[UnitCost]:
    out = list(costs)
    for i, sync in shares:
        out[i] = dataclasses.replace(
            costs[i], dp_sync_s=sync, post_sync_s=post.get(i, costs[i].post_sync_s)
        )
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class LossCost:
    """The cross-entropy after the head (not part of the traced forward), one micro-batch."""

    forward_s: float
    backward_s: float
    saved_bytes: float


def loss_cost(
    unit: UnitProfile, strategy: Strategy, cluster: Cluster, traced_dtype_bytes: int
) -> LossCost:
    """Cross-entropy on the head's logits in fp32 (``F.cross_entropy(logits.float(), y)``, as
    autoplan's runtime and autocast recipes compute it), kernel by kernel (the ATen ops it
    dispatches; tests/test_cost_formulas.py counts them). Per logit element, at ``b`` bytes per
    training-dtype element:

    - forward: the cast to fp32 (read b, write 4), log-softmax (read 4, write 4: its row
      passes re-read the row from L2), the target gather (negligible): ``b + 12``;
    - backward: the NLL gradient (a zero-filled fp32 tensor, write 4, and a scatter),
      log-softmax's backward (read the gradient and the saved output, write 4: 12) and the
      cast's backward to the training dtype (read 4, write b): ``b + 20``.

    In fp32 there is no cast (``b + 12`` and ``b + 20`` become 8 and 16). Vocab-parallel
    (Megatron) it divides by the TP degree. Memory-bound. Keeps the fp32 log-probabilities for
    the backward (`Calibration.loss_saved_bytes_per_logit`: 4, or 0 for a fused loss). Zero
    for units that are not the head."""
    if unit.kind != "head":
        return LossCost(forward_s=0.0, backward_s=0.0, saved_bytes=0.0)
    logits = unit.output_bytes / traced_dtype_bytes * strategy.micro_batch_size
    logits /= strategy.tp_degree
    cast = strategy.dtype_bytes + 4.0 if strategy.dtype_bytes != 4 else 0.0
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s * cluster.calibration.memory_efficiency
    overhead = cluster.calibration.kernel_overhead_s
    kernels = 3 if cast else 2  # each way: the cast (in bf16/fp16), log-softmax, NLL
    return LossCost(
        forward_s=(cast + 8.0) * logits / bandwidth + kernels * overhead,
        backward_s=(cast + 16.0) * logits / bandwidth + kernels * overhead,
        saved_bytes=cluster.calibration.loss_saved_bytes_per_logit * logits,
    )


def _recompute_s(unit: UnitProfile, mode: str, cal: Calibration, times: _ComputeTimes) -> float:
    """Forward compute that ``mode`` re-runs in the backward of ``unit`` (per micro-batch)."""
    if mode == "full":
        return times.forward_s - cal.full_recompute_early_stop * times.tail_forward_s
    if mode == "selective" and _has_selective_bytes(unit):
        return (
            times.selective_forward_s + cal.selective_gemm_recompute_fraction * times.gemm_forward_s
        )
    return 0.0


def _tail_tp_share(unit: UnitProfile) -> float:
    """Share of the unit's forward TP collectives that follow ops in its recompute tail (one
    per row-parallel linear there)."""
    if not unit.recompute_skip_ops:
        return 0.0
    n_fwd, _ = _tp_collective_counts(unit)
    tail = unit.ops[len(unit.ops) - unit.recompute_skip_ops :]
    rows = sum(1 for op in tail if op.tp == "row" and op.kind == "matmul")
    return min(1.0, rows / n_fwd) if n_fwd else 0.0


def unit_compute_s(
    profile: ModelProfile, cluster: Cluster, strategy: Strategy, recompute: str
) -> tuple[float, ...]:
    """Per-unit compute time of one micro-batch (forward, backward and recompute, without any
    communication): a lower bound on `UnitCost.time_s` that depends only on the strategy's TP
    degree, sequence parallelism, micro-batch and dtype, so it is cheap to get for many
    strategies (the planner bounds candidates with it before costing their communication)."""
    classes = _unit_classes(profile)
    cal = cluster.calibration
    out: list[float] = []
    for index, unit in enumerate(profile.units):
        if classes[index] != index:
            out.append(out[classes[index]])
            continue
        mode = recompute if unit.kind in RECOMPUTABLE_KINDS else "none"
        times = _compute_times(profile, cluster, strategy, index)
        out.append(times.forward_s + times.backward_s + _recompute_s(unit, mode, cal, times))
    return tuple(out)


def _unit_key(unit: UnitProfile) -> UnitProfile:
    """A unit's content without its names (op names carry the block index)."""
    ops = tuple(dataclasses.replace(op, name="") for op in unit.ops)
    return dataclasses.replace(unit, name="", ops=ops)


def unit_classes(profile: ModelProfile) -> tuple[int, ...]:
    """For each unit, the index of the first unit with the same content (its own if unique).

    `unit_costs` returns the same object for units of one class, so callers can work per class.
    """
    return _unit_classes(profile)


def _unit_classes(profile: ModelProfile) -> tuple[int, ...]:
    """For each unit, the index of the first unit with the same content (its own if unique).

    Unit 0 is kept apart: `unit_costs` charges the tied-gradient sync to it.
    """
    cached = _CLASSES.get(id(profile))
    if cached is not None and cached[0] is profile:
        return cached[1]
    first: dict[UnitProfile, int] = {}
    classes = []
    for index, unit in enumerate(profile.units):
        classes.append(index if index == 0 else first.setdefault(_unit_key(unit), index))
    result = tuple(classes)
    if len(_CLASSES) > 64:
        _CLASSES.clear()
    _CLASSES[id(profile)] = (profile, result)
    return result


class _ComputeTimes(NamedTuple):
    """One unit's compute per micro-batch, ops and loss (see `_compute_times`)."""

    forward_s: float
    backward_s: float
    forward_flops: float
    selective_forward_s: float  # the ops selective recompute re-runs
    gemm_forward_s: float
    tail_forward_s: float  # the ops an early-stopping full recompute skips
    weight_backward_s: float  # the weight gradients of the backward


def _compute_times(
    profile: ModelProfile, cluster: Cluster, strategy: Strategy, index: int
) -> _ComputeTimes:
    """Forward, backward, forward FLOPs and the forward parts recompute modes re-run or skip,
    of one unit's ops and loss, per micro-batch.

    Depends only on the unit, the device and the strategy's TP degree, sequence parallelism,
    micro-batch and dtype, so the planner's many strategies share one computation.
    """
    key = (
        id(profile),
        id(cluster),
        index,
        strategy.tp_degree,
        strategy.sequence_parallel,
        strategy.micro_batch_size,
        strategy.dtype,
    )
    cached = _COMPUTE.get(key)
    if cached is not None and cached[0] is profile and cached[1] is cluster:
        return cached[2]
    unit = profile.units[index]
    fwd_c = bwd_c = flops = selective_fwd = gemm_fwd = tail_fwd = weight = 0.0
    first_tail = len(unit.ops) - unit.recompute_skip_ops
    policy = strategy.decisions.recompute
    for position, op in enumerate(unit.ops):
        ot = _op(op, cluster, strategy, profile.traced_dtype_bytes)
        fwd_c += ot.forward_s
        bwd_c += ot.backward_s
        weight += ot.weight_backward_s
        flops += ot.forward_flops
        if policy.recomputes(op.kind, "selective"):
            selective_fwd += ot.forward_s
        elif op.kind == "matmul":
            gemm_fwd += ot.forward_s
        if position >= first_tail:
            tail_fwd += ot.forward_s
    loss = loss_cost(unit, strategy, cluster, profile.traced_dtype_bytes)
    result = _ComputeTimes(
        forward_s=fwd_c + loss.forward_s,
        backward_s=bwd_c + loss.backward_s,
        forward_flops=flops,
        selective_forward_s=selective_fwd,
        gemm_forward_s=gemm_fwd,
        tail_forward_s=tail_fwd,
        weight_backward_s=weight,
    )
    if len(_COMPUTE) > 65536:
        _COMPUTE.clear()
    _COMPUTE[key] = (profile, cluster, result)
    return result


# Memo tables keyed by object identity; each entry keeps its objects alive so ids stay unique.
_CLASSES: dict[int, tuple[ModelProfile, tuple[int, ...]]] = {}
_COMPUTE: dict[
    tuple[int, int, int, int, bool, int, str], tuple[ModelProfile, Cluster, _ComputeTimes]
] = {}


def _exposed_s(comm_s: float, window_s: float, slowdown: float) -> float:
    """Time a collective adds to the compute it may hide behind: what outlasts the window is
    exposed, and what hides still slows that compute by the calibrated interference (the
    collective's kernels share the device)."""
    return max(0.0, comm_s - window_s) + slowdown * min(comm_s, window_s)


def _op(op: OpProfile, cluster: Cluster, strategy: Strategy, traced: int) -> OpTime:
    return op_time(
        op,
        device=cluster.device,
        calibration=cluster.calibration,
        dtype=strategy.dtype,
        micro_batch_size=strategy.micro_batch_size,
        tp_degree=strategy.tp_degree,
        sequence_parallel=strategy.sequence_parallel,
        traced_dtype_bytes=traced,
    )


def _has_selective_bytes(unit: UnitProfile) -> bool:
    return (unit.saved_bytes_selective_sharded + unit.saved_bytes_selective_replicated) > 0


def tied_pair_placement(strategy: Strategy, cluster: Cluster) -> GroupPlacement | None:
    """The two devices (the pipeline ranks of the first and the last stage) that share tied
    embedding weights; None when one rank holds both (one pipeline rank, or a V schedule)."""
    last_rank = strategy.pipeline_rank_of_stage(strategy.num_stages - 1)
    if last_rank == 0:
        return None
    first = strategy.global_rank(pp=0, dp=0, tp=0)
    last = strategy.global_rank(pp=last_rank, dp=0, tp=0)
    same = cluster.node_of(first) == cluster.node_of(last)
    return GroupPlacement(size=2, num_nodes=1 if same else 2, ranks_per_node=2 if same else 1)


# ------------------------------------------------------------------------------- stages and ranks


class Boundary(NamedTuple):
    """What the boundary after a stage costs per micro-batch (`boundary_costs`)."""

    transfer_s: float  # link time of the output (and, back, of its gradient): delays the peer
    message_s: float  # host time to post one message (busy time of the sending rank)


def boundary_costs(
    last_unit: UnitCost, cluster: Cluster, strategy: Strategy, stage_idx: int
) -> Boundary:
    """The boundary after stage ``stage_idx`` (whose last unit is ``last_unit``): the transfer of
    its output to the next stage's pipeline rank, and the schedule's host overhead per message.
    Zero for the last stage and between two stages on one rank (torch hands the tensor over
    locally). Stretched like the pipeline when CPU workers share cores."""
    if stage_idx >= strategy.num_stages - 1:
        return Boundary(0.0, 0.0)
    here = strategy.pipeline_rank_of_stage(stage_idx)
    there = strategy.pipeline_rank_of_stage(stage_idx + 1)
    if here == there:
        return Boundary(0.0, 0.0)
    cross = pipeline_link_crosses_nodes(strategy, cluster, here, there)
    pipe_factor, _ = oversubscription_factors(strategy, cluster)
    return Boundary(
        transfer_s=p2p_time_s(last_unit.output_bytes, cluster, cross_node=cross) * pipe_factor,
        message_s=cluster.calibration.pp_message_overhead_s * pipe_factor,
    )


def stage_times(
    stage_units: Sequence[Sequence[UnitCost]],
    boundaries: Sequence[Boundary],
    spec: ScheduleSpec,
) -> list[StageTimes]:
    """Per-micro-batch times of each stage for the schedule simulation: the units' forward and
    backward; the host time of the forward message to the next stage on the forward, of the
    gradient message to the previous stage on the backward; under a split backward, the
    units' weight gradients as the deferred part."""
    out = []
    for idx, units in enumerate(stage_units):
        previous = boundaries[idx - 1].message_s if idx > 0 else 0.0
        out.append(
            StageTimes(
                forward_s=sum(u.forward_s for u in units) + boundaries[idx].message_s,
                backward_s=sum(u.backward_s for u in units) + previous,
                weight_s=sum(u.weight_s for u in units) if spec.splits_backward else 0.0,
                transfer_s=boundaries[idx].transfer_s,
            )
        )
    return out


def rank_tail_s(rank_units: Sequence[UnitCost], dp_overlap_fraction: float) -> float:
    """Work of one pipeline rank after its last backward: gradient sync not hidden behind that
    backward, then non-overlappable communication and the optimizer step.

    ``max(0, sum dp_sync - overlap * sum backward) + sum post_sync + sum optimizer``: the
    gradient buckets of the last micro-batch's backward start as soon as they are ready (torch
    DDP, Li et al. 2020, section 3.2.3), so only what outlasts that backward is exposed.
    """
    sync = sum(u.dp_sync_s for u in rank_units)
    window = dp_overlap_fraction * sum(u.backward_s for u in rank_units)
    return (
        max(0.0, sync - window)
        + sum(u.post_sync_s for u in rank_units)
        + sum(u.optimizer_s for u in rank_units)
    )


def memory_constants(
    costs: Sequence[UnitCost], cluster: Cluster, strategy: Strategy
) -> MemoryConstants:
    """Memory terms that do not depend on the cuts: the backward working set of the largest
    recomputable unit, p2p receive/send buffers, DP buckets or ZeRO-3 gathered weights."""
    # The embedding's and head's working sets travel with those units (extra_bytes).
    block_working = _block_working_bytes(costs)
    buffers = block_working
    if strategy.pp_degree > 1:
        buffers += 2 * max((c.output_bytes for c in costs), default=0.0)
    wrapper = strategy.dp_wrapper
    if wrapper == "ddp":
        # DDP's reducer keeps every gradient a second time, in its buckets (torch's default
        # gradient_as_bucket_view=False; bench/memory.py reads the bucket sizes)
        buffers += sum(c.grad_bytes for c in costs)
    elif wrapper in ("fsdp", "replicate"):
        # FSDP2 groups (passes/data_parallel.py): each block, and the stage's other units
        # together. A group's backward makes its unsharded gradients (training dtype), copied
        # into an fp32 reduce buffer before the reduce-scatter (all-reduce for replicate),
        # during every backward without a pipeline.
        width = DTYPE_BYTES[strategy.dtype]
        block = max((c.local_params for c in costs if c.kind == "block"), default=0.0)
        root = sum(c.local_params for c in costs if c.kind != "block")
        if strategy.pp_degree == 1:
            # (torch's pipeline schedules defer the gradient reduction to each stage's last
            # backward, when the rank's activations are mostly freed: no reduce at the peak)
            buffers += (width + grad_reduce_bytes(strategy.dtype)) * max(block, root)
        if strategy.runtime_zero_stage >= 3:
            # ZeRO-3 gathers the weights it freed: the stage's other units for the whole
            # backward (the head runs first, the embedding last), the running block and the
            # prefetched next one.
            buffers += width * (root + 2 * block)
    cal = cluster.calibration
    return MemoryConstants(
        buffer_bytes=buffers,
        reserved_bytes=cal.reserved_memory_bytes,
        allocator_overhead_fraction=cal.allocator_overhead_fraction,
        block_working_bytes=block_working,
    )


def _block_working_bytes(costs: Sequence[UnitCost]) -> float:
    """The largest backward working set of the recomputable units among ``costs``."""
    return max((c.working_bytes for c in costs if c.kind in RECOMPUTABLE_KINDS), default=0.0)


class HeldActivations(NamedTuple):
    """A rank's activation bytes at its peak and, per stage of the rank, the micro-batches
    held there then (`peak_activations`)."""

    bytes: float
    microbatches: tuple[int, ...]  # per stage of the rank: held + retained at the peak


def peak_activations(
    stage_units: Sequence[Sequence[UnitCost]], held: HeldProfile, send_bytes: float
) -> HeldActivations:
    """The largest activation total over the rank's candidate peak points (the schedule's
    held and retained micro-batches per stage, `cost_model.schedules.held_microbatches`), with
    ``send_bytes`` for each boundary tensor its pending sends hold (`boundary_send_bytes`)."""
    per_stage = [
        (
            sum(u.activation_bytes for u in stage_units[s]),
            # the first stage has no input gradient: torch skips its backward-input and runs
            # its whole backward at W (stage.py, backward_one_chunk), keeping only activations
            sum(u.activation_bytes if s == 0 else u.retained_bytes for u in stage_units[s]),
        )
        for s in held.stages
    ]
    best = HeldActivations(0.0, tuple(0 for _ in held.stages))
    for point, sends in zip(held.points, held.sends, strict=True):
        total = sends * send_bytes + sum(
            h * act + k * kept for (h, k), (act, kept) in zip(point, per_stage, strict=True)
        )
        if total > best.bytes:
            best = HeldActivations(total, tuple(h + k for h, k in point))
    return best


def boundary_send_bytes(costs: Sequence[UnitCost], cal: Calibration) -> float:
    """Bytes of one boundary tensor a rank keeps for its pipeline transfers
    (`HeldProfile.sends`), for any cut: the largest output of a unit a stage can end with (not
    the last), a boundary's activation, or the gradient sent back, of the same size; times the
    share the training stack keeps (`Calibration.pipeline_boundary_retention`)."""
    largest = max((c.output_bytes for c in costs[:-1]), default=0.0)
    return largest * cal.pipeline_boundary_retention


def rank_memory(
    rank_units: Sequence[UnitCost],
    activations: float,
    constants: MemoryConstants,
    loss_held: float = 0.0,
) -> MemoryBreakdown:
    """Bytes of one pipeline rank: static + held activations at the peak (``loss_held`` of
    them the loss's) + constants, with the backward working set of the rank's own largest
    block."""
    params = sum(u.param_bytes for u in rank_units)
    grads = sum(u.grad_bytes for u in rank_units)
    optimizer = sum(u.optimizer_bytes for u in rank_units)
    extra = sum(u.extra_bytes for u in rank_units)
    loss_working = sum(u.loss_bytes for u in rank_units)
    own_working = _block_working_bytes(rank_units) - constants.block_working_bytes
    tensor_bytes = params + grads + optimizer + extra + activations + own_working
    total = constants.total_bytes(tensor_bytes)
    working = extra + constants.buffer_bytes + own_working - loss_working
    held = activations - loss_held
    loss = loss_held + loss_working
    return MemoryBreakdown(
        param_bytes=params,
        grad_bytes=grads,
        optimizer_bytes=optimizer,
        activation_bytes=held,
        working_bytes=working,
        loss_bytes=loss,
        reserve_bytes=total - (params + grads + optimizer + held + working + loss),
        margin_bytes=total - constants.reserved_bytes - (tensor_bytes + constants.buffer_bytes),
        total_bytes=total,
    )


# ------------------------------------------------------------------------------- estimate


def estimate(profile: ModelProfile, cluster: Cluster, plan: PlanLike) -> Estimate:
    """Step time, throughput, MFU and per-device memory of ``plan`` (see the module docstring).

    The step time is the simulation of the schedule's own orders (`cost_model.schedules`) with
    the units' costs, so the planner, ``explain`` and the timeline all see one number.
    """
    strategy = Strategy.of(plan)
    stages = tuple(plan.stages)
    if len(stages) != strategy.num_stages:
        raise InputError(
            f"plan has {len(stages)} stages; pp_degree x virtual_stages = {strategy.num_stages}"
        )
    if stages[-1].last_unit != profile.num_units - 1:
        raise InputError(
            f"plan stages cover units 0..{stages[-1].last_unit} but model {profile.name!r} has "
            f"{profile.num_units} units"
        )
    spec = strategy.schedule_spec
    p, m = strategy.pp_degree, strategy.num_micro_batches
    by_mode: dict[str, tuple[UnitCost, ...]] = {}
    for stage in stages:
        if stage.recompute not in by_mode:
            by_mode[stage.recompute] = unit_costs(profile, cluster, strategy, stage.recompute)
    stage_units: list[tuple[UnitCost, ...]] = [
        by_mode[s.recompute][s.first_unit : s.last_unit + 1] for s in stages
    ]
    boundaries = [
        boundary_costs(units[-1], cluster, strategy, idx) for idx, units in enumerate(stage_units)
    ]
    times = stage_times(stage_units, boundaries, spec)
    rank_stages = [spec.rank_stages(r) for r in range(p)]
    cal = cluster.calibration
    rank_units = [tuple(u for s in rank_stages[r] for u in stage_units[s]) for r in range(p)]
    fixed = step_overhead_s(strategy, cluster)
    rank_tail = [rank_tail_s(rank_units[r], cal.dp_overlap_fraction) + fixed for r in range(p)]
    sim = simulate(spec, times, rank_tail)
    t_pipe = sim.pipeline_time_s

    constants = memory_constants(next(iter(by_mode.values())), cluster, strategy)
    send_bytes = boundary_send_bytes(next(iter(by_mode.values())), cluster.calibration)
    capacity = float(cluster.device.memory_bytes)
    held = held_microbatches(spec)
    ranks = []
    stage_estimates: list[StageEstimate | None] = [None] * len(stages)
    for r in range(p):
        peak = peak_activations(stage_units, held[r], send_bytes)
        loss_held = sum(
            count * sum(u.loss_bytes for u in stage_units[s])
            for s, count in zip(held[r].stages, peak.microbatches, strict=True)
        )
        memory = rank_memory(rank_units[r], peak.bytes, constants, loss_held)
        busy = sim.rank_busy_s[r]
        idle = sim.rank_end_s[r] - busy
        ranks.append(
            RankEstimate(
                pp_rank=r,
                stages=rank_stages[r],
                time_per_microbatch_s=busy / m,
                busy_s=busy,
                bubble_s=idle,
                tail_s=rank_tail[r],
                memory=memory,
                fits=memory.total_bytes <= capacity,
            )
        )
        for k, s in enumerate(rank_stages[r]):
            units = stage_units[s]
            inflight = peak.microbatches[k]
            previous = boundaries[s - 1] if s > 0 else Boundary(0.0, 0.0)
            stage_estimates[s] = StageEstimate(
                stage_idx=s,
                pp_rank=r,
                first_unit=stages[s].first_unit,
                last_unit=stages[s].last_unit,
                recompute=stages[s].recompute,
                forward_s=times[s].forward_s,
                backward_s=times[s].backward_s,
                weight_s=times[s].weight_s,
                transfer_s=times[s].transfer_s,
                compute_s=m * sum(u.compute_s for u in units),
                recompute_s=m * sum(u.recompute_s for u in units),
                tp_comm_s=m * sum(u.tp_comm_s for u in units),
                # busy time of its pipeline messages; their link time is not the rank's (it
                # delays the peer, and shows as that peer's idle time where it matters)
                pp_comm_s=m * (boundaries[s].message_s + previous.message_s),
                dp_comm_s=sum(
                    u.dp_sync_s + u.post_sync_s + m * (u.zero3_forward_s + u.zero3_backward_s)
                    for u in units
                ),
                bubble_s=idle / len(rank_stages[r]),
                param_bytes=sum(u.param_bytes for u in units),
                grad_bytes=sum(u.grad_bytes for u in units),
                optimizer_bytes=sum(u.optimizer_bytes for u in units),
                activation_bytes=inflight * sum(u.activation_bytes for u in units),
                inflight_microbatches=float(inflight),
            )

    step = sim.step_time_s
    tokens = strategy.global_batch_size * profile.seq_len
    # Model FLOPs: 3x the forward (forward + backward, no recompute), Chowdhery et al. 2022
    # (PaLM), appendix B; Korthikanti et al. 2022, section 6.3 (MFU).
    model_flops = 3.0 * profile.forward_flops_per_sample * strategy.global_batch_size
    num_devices = strategy.num_devices
    flops_per_device_per_s = model_flops / step / num_devices
    peak_memory = max(r.memory.total_bytes for r in ranks)
    busiest = max(sim.rank_busy_s)
    return Estimate(
        cluster=cluster.name,
        num_devices=num_devices,
        global_batch_size=strategy.global_batch_size,
        seq_len=profile.seq_len,
        step_time_s=step,
        pipeline_time_s=t_pipe,
        tail_s=max(rank_tail),
        bubble_fraction=(t_pipe - busiest) / t_pipe if t_pipe > 0 else 0.0,
        tokens_per_s=tokens / step,
        model_flops_per_step=model_flops,
        model_tflops_per_device=flops_per_device_per_s / 1e12,
        mfu=flops_per_device_per_s / cluster.device.peak_flops_for(strategy.dtype),
        peak_memory_bytes=peak_memory,
        memory_capacity_bytes=capacity,
        fits=peak_memory <= capacity,
        stages=tuple(s for s in stage_estimates if s is not None),
        ranks=tuple(ranks),
    )
