"""Compute: a unit's forward and backward on its device, the parts recompute re-runs, and the
loss after the head (`loss_cost`).

Expects a unit and the strategy's TP degree, sequence parallelism, micro-batch and dtype (the
only strategy fields compute depends on). Guarantees: per micro-batch on one device, kernel by
kernel (`cost_model.compute.op_time`), no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.calibration import Calibration
from cost_model.compute import OpTime, op_time
from cost_model.hardware import Cluster
from cost_model.parts.fp8 import cast_cost, converted_ops
from cost_model.parts.fusion import fused_ops
from cost_model.strategy import Strategy
from cost_model.workload import OpProfile, UnitProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeTimes:
    """One unit's compute per micro-batch, ops and loss (`compute_times`)."""

    forward_s: float
    backward_s: float
    forward_flops: float
    selective_forward_s: float  # the ops selective recompute re-runs
    gemm_forward_s: float
    tail_forward_s: float  # the ops an early-stopping full recompute skips
    weight_backward_s: float  # the weight gradients of the backward
    # the largest bytes one fp8 cast holds at once (`cost_model.parts.fp8.cast_cost`; 0 unless
    # an fp8 recipe), for the backward's working set
    fp8_transient_bytes: float = 0.0
    # per step: the fp8 weight casts a stack that keeps them makes once a step
    fp8_step_s: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LossCost:
    """The cross-entropy after the head (not part of the traced forward), one micro-batch."""

    forward_s: float
    backward_s: float
    saved_bytes: float


def op_cost(
    op: OpProfile,
    cluster: Cluster,
    strategy: Strategy,
    traced_dtype_bytes: int,
    *,
    fp8: bool = False,
    kernels: float = 1.0,
) -> OpTime:
    """One operator on one device under ``strategy`` (`cost_model.compute.op_time`); ``fp8``:
    a linear the strategy's fp8 recipe converts (`cost_model.parts.fp8.is_converted`);
    ``kernels``: the launches it pays (`cost_model.parts.fusion.FusedOp`)."""
    return op_time(
        op,
        device=cluster.device,
        calibration=cluster.calibration,
        dtype=strategy.dtype,
        micro_batch_size=strategy.micro_batch_size,
        tp_degree=strategy.tp_degree,
        sequence_parallel=strategy.sequence_parallel,
        traced_dtype_bytes=traced_dtype_bytes,
        fp8=strategy.fp8 if fp8 else None,
        kernels=kernels,
    )


def compute_times(
    unit: UnitProfile, cluster: Cluster, strategy: Strategy, traced_dtype_bytes: int
) -> ComputeTimes:
    """Forward, backward, forward FLOPs and the forward parts recompute modes re-run or skip,
    of one unit's ops and loss, per micro-batch.

    Leaves out a mixture-of-experts unit's routed experts (`UnitProfile.moe`), which
    `cost_model.parts.expert_parallel` prices. Depends only on the unit, the device and the
    strategy's TP degree, sequence parallelism, micro-batch and dtype (with an fp8 recipe's
    fields: its converted linears' GEMMs at the fp8 rate, and their casts in the forward and
    backward, `cost_model.parts.fp8.cast_cost`) and ``compile`` (a compiled unit's fused ops,
    `cost_model.parts.fusion`), so the planner's many strategies share one computation
    (`cost_model.estimate.CostModel` keeps them).
    """
    fwd_c = bwd_c = flops = selective_fwd = gemm_fwd = tail_fwd = weight = 0.0
    first_tail = len(unit.ops) - unit.recompute_skip_ops
    policy = strategy.decisions.recompute
    # the routed experts' op is priced apart (`parts.expert_parallel`)
    experts_op = unit.moe.experts_op if unit.moe is not None else None
    converted = {op.name for op in converted_ops(unit, strategy)}
    # under torch.compile the fused ops with their groups' traffic (`parts.fusion`)
    for position, fused in enumerate(fused_ops(unit, strategy)):
        op = fused.op
        if op.name == experts_op:
            continue
        ot = op_cost(
            op,
            cluster,
            strategy,
            traced_dtype_bytes,
            fp8=op.name in converted,
            kernels=fused.kernels,
        )
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
    loss = loss_cost(unit, strategy, cluster, traced_dtype_bytes)
    casts = cast_cost(unit, strategy, cluster)
    # (a full recompute re-runs the forward's casts with it: they are part of forward_s)
    return ComputeTimes(
        forward_s=fwd_c + loss.forward_s + casts.forward_s,
        backward_s=bwd_c + loss.backward_s + casts.backward_s,
        forward_flops=flops,
        selective_forward_s=selective_fwd,
        gemm_forward_s=gemm_fwd,
        tail_forward_s=tail_fwd,
        weight_backward_s=weight,
        fp8_transient_bytes=casts.transient_bytes,
        fp8_step_s=casts.step_s,
    )


def recompute_s(unit: UnitProfile, mode: str, cal: Calibration, times: ComputeTimes) -> float:
    """Forward compute that ``mode`` re-runs in the backward of ``unit`` (per micro-batch)."""
    if mode == "full":
        return times.forward_s - cal.full_recompute_early_stop * times.tail_forward_s
    if mode == "selective" and _has_selective_bytes(unit):
        return (
            times.selective_forward_s + cal.selective_gemm_recompute_fraction * times.gemm_forward_s
        )
    return 0.0


def _has_selective_bytes(unit: UnitProfile) -> bool:
    return (unit.saved_bytes_selective_sharded + unit.saved_bytes_selective_replicated) > 0


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

    In fp32 there is no cast (``b + 12`` and ``b + 20`` become 8 and 16). Beyond the cast, a
    stack's loss moves `Calibration.loss_forward_bytes_per_logit` and
    `loss_backward_bytes_per_logit` (8 and 16 here; nanotron's sharded cross-entropy 32 and 8,
    `cost_model.frameworks`). Vocab-parallel (Megatron) it divides by the TP degree.
    Memory-bound. Keeps the fp32 log-probabilities for the backward
    (`Calibration.loss_saved_bytes_per_logit`: 4, or 0 for a fused loss). Zero for units that
    are not the head."""
    if unit.kind != "head":
        return LossCost(forward_s=0.0, backward_s=0.0, saved_bytes=0.0)
    logits = unit.output_bytes / traced_dtype_bytes * strategy.micro_batch_size
    logits /= strategy.tp_degree
    cast = strategy.dtype_bytes + 4.0 if strategy.dtype_bytes != 4 else 0.0
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s * cluster.calibration.memory_efficiency
    overhead = cluster.calibration.kernel_overhead_s
    kernels = 3 if cast else 2  # each way: the cast (in bf16/fp16), log-softmax, NLL
    cal = cluster.calibration
    forward, backward = cal.loss_forward_bytes_per_logit, cal.loss_backward_bytes_per_logit
    return LossCost(
        forward_s=(cast + forward) * logits / bandwidth + kernels * overhead,
        backward_s=(cast + backward) * logits / bandwidth + kernels * overhead,
        saved_bytes=cluster.calibration.loss_saved_bytes_per_logit * logits,
    )
