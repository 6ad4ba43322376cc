"""A pipeline rank's memory: the cut-independent terms (`memory_constants`), the activations
held at the rank's peak point of the schedule (`peak_activations`: `held_peak` of each stage's
`stage_held_bytes`, which the planner's partition uses too) and the rank's total
(`rank_memory`), from its units' `UnitCost` bytes.

memory of rank r = (1 + allocator overhead) * (static bytes + activations held at the rank's
peak point of the schedule + constant buffers) + reserved bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from cost_model.calibration import Calibration
from cost_model.hardware import Cluster
from cost_model.memory import RECOMPUTABLE_KINDS
from cost_model.parts.data_parallel import grad_reduce_bytes
from cost_model.results import MemoryBreakdown, MemoryConstants
from cost_model.schedule_memory import HeldProfile
from cost_model.strategy import DTYPE_BYTES, Strategy
from cost_model.unit_cost import UnitCost


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
        # into a reduce buffer in the reduction dtype (fp32 by default: `grad_reduce_bytes`)
        # before the reduce-scatter (all-reduce for replicate),
        # during every backward without a pipeline.
        width = DTYPE_BYTES[strategy.dtype]
        block = max((c.local_params for c in costs if c.kind == "block"), default=0.0)
        root = sum(c.local_params for c in costs if c.kind != "block")
        if strategy.pp_degree == 1:
            # (torch's pipeline schedules defer the gradient reduction to each stage's last
            # backward, when the rank's activations are mostly freed: no reduce at the peak)
            buffers += (width + grad_reduce_bytes(strategy)) * max(block, root)
        if strategy.runtime_zero_stage >= 3:
            # ZeRO-3 gathers the weights it freed: the stage's other units for the whole
            # backward (the head runs first, the embedding last), the running block and the
            # prefetched next one; converted linears' weights in fp8 under fp8 all-gather.
            def gathered(c: UnitCost) -> float:
                fp8 = c.fp8_params if strategy.fp8_all_gather else 0.0
                return width * (c.local_params - fp8) + fp8

            block_gathered = max((gathered(c) for c in costs if c.kind == "block"), default=0.0)
            buffers += sum(gathered(c) for c in costs if c.kind != "block") + 2 * block_gathered
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
    """The largest activation total over the rank's candidate peak points (`held_peak` of its
    stages' `stage_held_bytes`)."""
    per_stage = [
        stage_held_bytes(
            s,
            [u.activation_bytes for u in stage_units[s]],
            [u.retained_bytes for u in stage_units[s]],
        )
        for s in held.stages
    ]
    return held_peak(per_stage, held, send_bytes)


def stage_held_bytes(
    stage_idx: int, activation_bytes: Sequence[float], retained_bytes: Sequence[float]
) -> tuple[float, float]:
    """Stage ``stage_idx``'s bytes per micro-batch from its units' activation and retained
    bytes: what an in-flight micro-batch holds, and what one holds between a split backward's
    two halves. The first stage has no input gradient: torch skips its backward-input and
    runs its whole backward at W (stage.py, backward_one_chunk), keeping only activations."""
    act = sum(activation_bytes)
    return act, act if stage_idx == 0 else sum(retained_bytes)


def held_peak(
    per_stage: Sequence[tuple[float, float]], held: HeldProfile, send_bytes: float
) -> HeldActivations:
    """The largest activation total over a rank's candidate peak points (the schedule's held
    and retained micro-batches per stage, `cost_model.schedule_memory.held_microbatches`), from each
    of its stages' `stage_held_bytes` in ``held.stages`` order, with ``send_bytes`` for each
    boundary tensor its pending sends hold (`boundary_send_bytes`)."""
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
