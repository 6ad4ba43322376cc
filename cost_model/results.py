"""What `cost_model.estimate.estimate` returns: the step, per stage and per pipeline rank, and
each rank's memory at its peak (`MemoryBreakdown`, from the cut-independent `MemoryConstants`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cost_model.errors import InputError
from cost_model.units import format_bytes


class MemoryCapacityError(InputError):
    """A plan needs more device memory than the cluster has (the message lists the numbers)."""


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
    # m x the exposed ring exchanges of context parallelism, and the all-to-alls of expert
    # parallelism (0 without them)
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    # m x the host's share of forward + backward: its wrappers' time, the device's wait for it
    host_s: float = 0.0
    # m x activation offload's host-link copies that compute does not hide (forward + backward;
    # `cost_model.parts.offload.offloaded_unit_cost`)
    offload_s: float = 0.0


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
    # 80% intervals (`cost_model.uncertainty`): of the step time, and of the peak memory (the
    # same quantity as peak_memory_bytes); (0, 0) until `uncertainty.with_ranges` sets them
    step_time_range_s: tuple[float, float] = (0.0, 0.0)
    peak_memory_range_bytes: tuple[float, float] = (0.0, 0.0)
    range_level: float = 0.8  # the share of outcomes the ranges hold
    # the plan's features by which the ranges are sized, and those fewer than 5 published rows
    # validate ("interleaved-zb without recompute: 0 published rows")
    features: tuple[str, ...] = ()
    unvalidated: tuple[str, ...] = ()
    # the share of the capacity kept free beyond the upper end of the peak's range, and the
    # largest predicted peak that fits with it (`cost_model.headroom.usable_capacity_bytes`;
    # 0: the capacity itself); ``fits`` compares the peak with it
    memory_headroom: float = 0.0
    memory_usable_bytes: float = 0.0

    def to_data(self) -> dict[str, Any]:
        """Plain data for JSON output."""
        return dataclasses.asdict(self)

    def with_step_time(self, step_time_s: float) -> Estimate:
        """This estimate with another step time (a stack whose engine re-times the step,
        `cost_model.frameworks`), and the throughput and MFU that follow from it."""
        scale = self.step_time_s / step_time_s
        low, high = self.step_time_range_s
        return dataclasses.replace(
            self,
            step_time_s=step_time_s,
            step_time_range_s=(low / scale, high / scale),
            tokens_per_s=self.tokens_per_s * scale,
            model_tflops_per_device=self.model_tflops_per_device * scale,
            mfu=self.mfu * scale,
        )

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
    def usable_memory_bytes(self) -> float:
        """The largest predicted peak that fits: the capacity less the headroom and the
        peak's range (the capacity when no headroom was checked)."""
        return self.memory_usable_bytes or self.memory_capacity_bytes

    @property
    def memory_free_bytes(self) -> float:
        """Device memory the predicted peak leaves free (negative: over the capacity)."""
        return self.memory_capacity_bytes - self.peak_memory_bytes

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
        limit = f"; {self._headroom_rule()}" if self.memory_usable_bytes else ""
        if m.total_bytes <= self.memory_capacity_bytes:
            # within the device, not within the headroom: say by how much, and the headroom
            return (
                f"plan does not fit with the memory headroom: pipeline rank {peak.pp_rank} needs "
                f"{format_bytes(m.total_bytes)} per device, {self._headroom_rule()}: over by "
                f"{format_bytes(m.total_bytes - self.usable_memory_bytes)} (largest: {largest}); "
                f"fix: {fixes}; or a smaller headroom (memory_headroom=, --memory-headroom; "
                "0.05 with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), or override the "
                "check (check_memory=False, --allow-over-memory) to run it at the edge"
            )
        return (
            f"plan does not fit: pipeline rank {peak.pp_rank} needs {format_bytes(m.total_bytes)} "
            f"per device, the device has {format_bytes(self.memory_capacity_bytes)} on "
            f"{self.cluster}{edge}{limit} (largest: {largest}); fix: {fixes}; or override the "
            "check (check_memory=False, --allow-over-memory) to run it anyway"
        )

    def _headroom_rule(self) -> str:
        """What the check allows: "with its 80% range (x1.13) and a 10% memory headroom, a
        device of 80 GiB on dgx-a100-80g holds a predicted peak of at most 63.5 GiB"."""
        kept = self.memory_capacity_bytes * (1.0 - self.memory_headroom)
        factor = kept / self.usable_memory_bytes
        return (
            f"with the upper end of its range (x{factor:.2f}) and a {self.memory_headroom:.0%} "
            f"memory headroom, a device of {format_bytes(self.memory_capacity_bytes)} on "
            f"{self.cluster} holds a predicted peak of at most "
            f"{format_bytes(self.usable_memory_bytes)}"
        )
