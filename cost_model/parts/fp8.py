"""fp8 recipes' own work: which linears run fp8 GEMMs, the kernels that cast their operands,
the collectives that synchronise tensor-wise scales, and the parameters gathered in fp8.

Expects a unit and a strategy whose dtype is an fp8 recipe (`cost_model.precision`); every
function returns zero (or nothing) under a plain dtype. Guarantees: per micro-batch on one
device unless a name says per step. The converted GEMMs themselves are priced by
`cost_model.compute.op_time` at the device's fp8 rate.

A linear's three GEMMs (output, input gradient, weight gradient) take fp8 copies of its input
(M x K elements per micro-batch on this device), weight (K x N) and output gradient (M x N),
each made by a cast kernel from the bf16 tensor. What one cast moves, per element:

- torch eager (torchao without torch.compile; torchao/float8/float8_utils.py and
  float8_training_tensor.py): ``abs`` (read 2, write 2), ``max`` (read 2), the fp32 upcast
  (read 2, write 4), the scale multiply (read 4, write 4), the saturating clamp (read 4, write
  4) and the fp8 cast (read 4, write 1): 33 bytes in 6 kernels, plus 4 one-element kernels
  for the scale. torchao's ``matmul_with_hp_or_float8_args`` saves the bf16 input and weight
  and casts each operand again for the backward's GEMMs: input and weight once forward and
  once backward, the output gradient twice (its two layouts), six casts a linear.
- fused (Transformer Engine; torchao under torch.compile): an amax pass and a cast that writes
  both layouts at once, as torchao's float8 roofline counts them (pytorch/ao
  torchao/testing/float8/roofline_utils.py, get_tensor_memory_traffic_ovhd_s): tensor-wise,
  input and output gradient 2 + (2 + 2 x 1) = 6 bytes in 2 kernels, the weight 2 + 2 x (2 + 1)
  = 8 in 3; row-wise 8, 10 and 8 (a bf16 transpose between the two layouts); MX 4, 6 and 4.

Scales: one per tensor needs the amax of the whole tensor, so a tensor-wise cast of a tensor
split over the TP group (a TP-sharded weight, a sequence-parallel activation) all-reduces one
number over the group first (torchao's DTensor amax; Transformer Engine's amax reduction over
the TP group); per-row and per-block scales are local. Under FSDP2 with fp8 all-gather the
weights are cast on their shards before the gather (half the bytes of a bf16 gather), and
``precompute_float8_dynamic_scale_for_fsdp`` all-reduces the shards' amaxes once per step
(torchao/float8/fsdp_utils.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cost_model.communication import collective_time_s
from cost_model.hardware import Cluster
from cost_model.parts.fusion import compiles
from cost_model.precision import FP8_GEMM_MULTIPLE
from cost_model.strategy import GroupPlacement, Strategy
from cost_model.workload import ModelProfile, OpProfile, UnitProfile

# torch eager's cast of one bf16 element (module docstring): bytes, and kernels per cast
_EAGER_CAST_BYTES = 33.0
_EAGER_CAST_KERNELS = 10
# fused casts' bytes per element and kernels, by granularity: input, weight, output gradient
_FUSED_CASTS: dict[str, tuple[tuple[float, int], tuple[float, int], tuple[float, int]]] = {
    "tensorwise": ((6.0, 2), (8.0, 3), (6.0, 2)),
    "rowwise": ((8.0, 2), (10.0, 3), (8.0, 2)),
    "mx": ((4.0, 1), (6.0, 2), (4.0, 1)),
}


def is_converted(op: OpProfile, unit: UnitProfile, exclude: tuple[str, ...]) -> bool:
    """Whether ``op`` is a linear an fp8 recipe runs in fp8: a GEMM with weights (not
    attention's, not a MoE layer's routed experts, which stay bf16 in torchao's
    ``convert_to_float8_training``: it swaps ``nn.Linear`` only), outside ``exclude``: "head"
    (the output projection's unit), "router" (a MoE layer's linear whose outputs are its
    experts), or a module name (``blocks.0.mlp.gate_proj``, or a prefix such as ``blocks.0``),
    which the trace names with dots as underscores."""
    if op.kind != "matmul" or op.gemm is None or op.param_bytes_read <= 0:
        return False
    if unit.moe is not None and op.name == unit.moe.experts_op:
        return False
    for name in exclude:
        if name == "head":
            if unit.kind == "head":
                return False
        elif name == "router":
            if unit.moe is not None and op.gemm.n == unit.moe.num_experts:
                return False
        else:
            node = name.replace(".", "_")
            if op.name == node or op.name.startswith(node + "_"):
                return False
    return True


def converted_ops(unit: UnitProfile, strategy: Strategy) -> Iterator[OpProfile]:
    """The unit's linears that run fp8 GEMMs under ``strategy`` (none under a plain dtype)."""
    if strategy.fp8 is None:
        return
    for op in unit.ops:
        if is_converted(op, unit, strategy.fp8_exclude):
            yield op


def _local_dims(op: OpProfile, tp_degree: int) -> tuple[float, float]:
    """(K, N) of a linear's weight on one TP rank: a column-parallel (or vocab) linear splits N,
    a row-parallel one K."""
    assert op.gemm is not None
    k, n = float(op.gemm.k), float(op.gemm.n)
    if op.tp in ("column", "vocab"):
        n /= tp_degree
    elif op.tp == "row":
        k /= tp_degree
    return k, n


def fp8_params(unit: UnitProfile, strategy: Strategy) -> float:
    """Parameters of the unit's converted linears on one TP rank (their weights)."""
    total = 0.0
    for op in converted_ops(unit, strategy):
        k, n = _local_dims(op, strategy.tp_degree)
        total += k * n * (op.gemm.batch if op.gemm is not None else 1)
    return total


def fp8_shape_problem(profile: ModelProfile, strategy: Strategy) -> str | None:
    """The first converted linear whose weight on one TP rank has a dimension that is not a
    multiple of 16 (``torch._scaled_mm`` refuses it), in one line naming it, its shape and the
    fix; None when every one fits."""
    for unit in profile.units:
        for op in converted_ops(unit, strategy):
            k, n = _local_dims(op, strategy.tp_degree)
            if k % FP8_GEMM_MULTIPLE or n % FP8_GEMM_MULTIPLE:
                assert op.gemm is not None
                split = f" ({k:g} x {n:g} on each of {strategy.tp_degree} TP ranks)"
                return (
                    f"dtype {strategy.dtype}: linear {op.name!r} in {unit.name!r} has a "
                    f"{op.gemm.k} x {op.gemm.n} weight{split if strategy.tp_degree > 1 else ''}"
                    f", but fp8 GEMMs need both dimensions divisible by {FP8_GEMM_MULTIPLE}; "
                    f"keep it in bf16 (add {op.name.replace('_', '.')!r} or a prefix of it to "
                    "fp8_exclude)"
                )
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8CastCost:
    """One unit's fp8 cast kernels per micro-batch, those a stack runs once a step, and their
    largest transient."""

    forward_s: float
    backward_s: float
    # the largest bytes one cast holds at once (eager: its fp32 copies and the fp8 result)
    transient_bytes: float
    # per step: the weights' casts of a stack that keeps the fp8 weights for the step
    step_s: float = 0.0


def cast_cost(unit: UnitProfile, strategy: Strategy, cluster: Cluster) -> Fp8CastCost:
    """The cast kernels of the unit's converted linears (module docstring), memory-bound at the
    device's bandwidth, each kernel with its launch overhead."""
    recipe = strategy.fp8
    zero = Fp8CastCost(forward_s=0.0, backward_s=0.0, transient_bytes=0.0)
    if recipe is None:
        return zero
    cal = cluster.calibration
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    # torch.compile fuses a compiled unit's casts (torchao's float8 under compile: module doc)
    eager = cal.fp8_eager_casts >= 0.5 and not compiles(unit, strategy)
    # under fp8 all-gather the weights are cast on their shards before the gather, priced with
    # it (`shard_cast_s`), and the backward reuses the gathered fp8 weight
    gathered = strategy.fp8_all_gather
    # (a stack that keeps the fp8 weights casts them once a step, `Fp8CastCost.step_s`: not
    # per micro-batch, so a unit's compute does not depend on the micro-batch count)
    per_step = cal.fp8_cached_weights >= 0.5
    weight_share = 0.0 if gathered or per_step else 1.0
    step_share = 1.0 if per_step and not gathered else 0.0
    fwd_bytes = bwd_bytes = step_bytes = 0.0
    fwd_kernels = bwd_kernels = step_kernels = 0.0
    transient = 0.0
    for op in converted_ops(unit, strategy):
        assert op.gemm is not None
        k, n = _local_dims(op, strategy.tp_degree)
        m = float(op.gemm.m_per_sample * strategy.micro_batch_size)
        batch = op.gemm.batch
        inputs, weights, grads = m * k * batch, k * n * batch, m * n * batch
        if strategy.sequence_parallel and strategy.tp_degree > 1:
            # the tensor gathered in fp8 is cast on this rank's share of the sequence
            if op.tp in ("column", "vocab"):
                inputs /= strategy.tp_degree
            elif op.tp == "row":
                grads /= strategy.tp_degree
        if eager:
            b, kernels = _EAGER_CAST_BYTES, _EAGER_CAST_KERNELS
            fwd_bytes += b * (inputs + weights * weight_share)
            bwd_bytes += b * (2 * grads + inputs + weights * weight_share)
            fwd_kernels += kernels * (1 + weight_share)
            bwd_kernels += kernels * (3 + weight_share)
            step_bytes += 2 * b * weights * step_share
            step_kernels += 2 * kernels * step_share
            # the fp32 copy, its scaled copy and the fp8 result of the largest operand
            transient = max(transient, 9.0 * max(inputs, weights, grads))
        else:
            (ib, ik), (wb, wk), (gb, gk) = _FUSED_CASTS[recipe.granularity]
            fwd_bytes += ib * inputs + wb * weights * weight_share
            bwd_bytes += gb * grads
            fwd_kernels += ik + wk * weight_share
            bwd_kernels += gk
            step_bytes += wb * weights * step_share
            step_kernels += wk * step_share
            transient = max(transient, 2.0 * max(inputs, weights, grads))
    overhead = cal.kernel_overhead_s
    return Fp8CastCost(
        forward_s=fwd_bytes / bandwidth + fwd_kernels * overhead,
        backward_s=bwd_bytes / bandwidth + bwd_kernels * overhead,
        transient_bytes=transient,
        step_s=step_bytes / bandwidth + step_kernels * overhead,
    )


def shard_cast_s(shard_params: float, cluster: Cluster) -> float:
    """Casting ``shard_params`` weight elements of this device's shards to fp8 before an fp8
    all-gather (one cast each, at the stack's bytes per element for a weight, forward)."""
    cal = cluster.calibration
    if shard_params <= 0:
        return 0.0
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    if cal.fp8_eager_casts >= 0.5:
        return _EAGER_CAST_BYTES * shard_params / bandwidth + _EAGER_CAST_KERNELS * (
            cal.kernel_overhead_s
        )
    return 8.0 * shard_params / bandwidth + 3 * cal.kernel_overhead_s


def scale_sync_counts(
    unit: UnitProfile, strategy: Strategy, shard_weight_scales: bool = False
) -> tuple[float, float]:
    """One-number all-reduces over the TP group per micro-batch, forward and backward: a
    tensor-wise recipe's amax of each TP-sharded weight it casts (torchao's DTensor weights;
    with ``shard_weight_scales`` each rank scales its own shard and syncs none, as Transformer
    Engine does), and under sequence parallelism of each sequence-split tensor it gathers in
    fp8, which needs one scale: a column-parallel linear's input in the forward, a
    row-parallel one's output gradient in the backward (the reduce-scatter's backward
    gathers it)."""
    recipe = strategy.fp8
    if recipe is None or not recipe.syncs_scales or strategy.tp_degree == 1:
        return 0.0, 0.0
    forward = backward = 0.0
    for op in converted_ops(unit, strategy):
        sharded = op.tp in ("column", "row", "vocab") and not shard_weight_scales
        sp = strategy.sequence_parallel
        forward += float(sharded) + float(sp and op.tp in ("column", "vocab"))
        backward += float(sharded and not strategy.fp8_all_gather) + float(sp and op.tp == "row")
    return forward, backward


def scale_sync_s(
    unit: UnitProfile, strategy: Strategy, cluster: Cluster, tp_groups: Sequence[GroupPlacement]
) -> tuple[float, float]:
    """The tensor-wise scales' all-reduces over the TP group (`scale_sync_counts`), forward and
    backward, per micro-batch; a stack that caches fp8 weights (Transformer Engine) scales
    each weight shard on its own."""
    shard_scales = cluster.calibration.fp8_cached_weights >= 0.5
    forward, backward = scale_sync_counts(unit, strategy, shard_scales)
    if not forward and not backward:
        return 0.0, 0.0
    one = collective_time_s("all_reduce", 4.0, tp_groups, cluster)
    return forward * one, backward * one
