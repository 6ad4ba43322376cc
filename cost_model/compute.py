"""Time of one operator on one device: a roofline with shape-dependent efficiency.

Expects an `OpProfile` (per-sample FLOPs and bytes at the traced dtype) and returns its forward
and backward time for one micro-batch on one device, after tensor parallelism (and sequence
parallelism) split it. Guarantees: times are positive, grow with the micro-batch, and never
shrink when the device gets slower.

Model (Williams et al. 2009, "Roofline"): ``time = max(flops / (peak * eff), bytes / (bw *
mem_eff)) + kernel_overhead``. For GEMMs and attention the compute efficiency saturates with the
kernel's size, ``eff(W) = eff_max * W / (W + W_half)``: a large GEMM runs near its maximum
achievable rate, a small one cannot fill the device's SMs (wave quantisation and launch latency;
cf. NVIDIA "Matrix Multiplication Background User's Guide", sections on tile and wave
quantization). A GEMM's efficiency also falls with its depth (the inner dimension k):
``eff *= k / (k + k_half)``, since every output tile pays a fixed software-pipeline fill and
epilogue on top of its k-loop (Calibration.gemm_half_efficiency_depth); the backward's data
gradient has depth n, its weight gradient the token count (deep). Skinny GEMMs are also caught by
the roofline's byte term. Element-wise, reduction and embedding ops are memory-bound and use the
memory-bandwidth efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.calibration import Calibration
from cost_model.hardware import DeviceSpec
from cost_model.precision import Fp8Recipe, compute_dtype
from cost_model.strategy import DTYPE_BYTES
from cost_model.workload import OpProfile

# Backward of an op reads the saved inputs and the output gradient and writes the input (and
# weight) gradients: about twice the forward's traffic (dgrad + wgrad GEMMs for a linear).
BACKWARD_BYTES_FACTOR = 2.0

_TP_SPLIT_ROLES = ("column", "row", "sharded", "vocab")


@dataclass(frozen=True, kw_only=True, slots=True)
class OpTime:
    """Forward and backward time of one op for one micro-batch on one device."""

    forward_s: float
    backward_s: float
    forward_flops: float  # per device, per micro-batch
    backward_flops: float
    # Of backward_s, the weight gradient, which a split backward (zero-bubble schedules) runs
    # later as its own action: a linear's wgrad GEMM, an embedding's whole backward.
    weight_backward_s: float = 0.0


def tp_divisor(op: OpProfile, tp_degree: int, sequence_parallel: bool) -> int:
    """How many ways tensor (and sequence) parallelism split the op's work.

    Megatron-LM (Shoeybi et al. 2019, section 3): column/row linears, the attention core between
    them and the vocab-parallel embedding/head are split over the TP group; the rest (norms,
    residual adds, dropout) is replicated, unless sequence parallelism splits it along the
    sequence (Korthikanti et al. 2022, section 4.2.2).
    """
    if op.tp in _TP_SPLIT_ROLES:
        return tp_degree
    return tp_degree if sequence_parallel else 1


def saturating_efficiency(work_flops: float, max_efficiency: float, half_flops: float) -> float:
    """``max_efficiency * W / (W + W_half)``: efficiency of a kernel doing ``W`` FLOPs."""
    if work_flops <= 0:
        return max_efficiency
    return max_efficiency * work_flops / (work_flops + half_flops)


def depth_efficiency(depth: float, half_depth: float) -> float:
    """``k / (k + k_half)``: the share of a GEMM tile's time spent in its k-loop (1 when off)."""
    if half_depth <= 0 or depth <= 0:
        return 1.0
    return depth / (depth + half_depth)


def _epilogue_passes_s(
    op: OpProfile,
    calibration: Calibration,
    bandwidth: float,
    dtype: str,
    micro_batch_size: int,
    tp_degree: int,
    sequence_parallel: bool,
    traced_dtype_bytes: int,
) -> tuple[float, float]:
    """A linear's passes after its GEMM where the stack runs them as kernels of their own
    (`Calibration.separate_bias_add`, `separate_output_dropout`), forward and backward, over its
    output on this device: a column-parallel output split by TP, a row-parallel one whole after
    its all-reduce (split by sequence after a reduce-scatter). At ``b`` bytes per element:

    - bias add: read and write the output (2 b); backward, the bias gradient reads the output's
      gradient (b);
    - dropout (row-parallel outputs): read the output, write it and a 1-byte mask (2 b + 1);
      backward, read the gradient and the mask, write (2 b + 1).
    """
    assert op.gemm is not None
    gemm = op.gemm
    split_by_tp = op.tp in ("column", "vocab") or (op.tp == "row" and sequence_parallel)
    split = tp_degree if split_by_tp else 1
    elements = gemm.m_per_sample * gemm.n * gemm.batch * micro_batch_size / split
    b = DTYPE_BYTES[dtype]
    weight_bytes = gemm.k * gemm.n * traced_dtype_bytes
    forward = backward = 0.0
    kernels = 0
    if calibration.separate_bias_add and op.param_bytes_read > weight_bytes:
        forward += calibration.separate_bias_add * 2 * b * elements
        backward += calibration.separate_bias_add * b * elements
        kernels += 1
    if calibration.separate_output_dropout and op.tp == "row":
        forward += calibration.separate_output_dropout * (2 * b + 1) * elements
        backward += calibration.separate_output_dropout * (2 * b + 1) * elements
        kernels += 1
    overhead = kernels * calibration.kernel_overhead_s
    return forward / bandwidth + overhead, backward / bandwidth + overhead


def op_time(
    op: OpProfile,
    *,
    device: DeviceSpec,
    calibration: Calibration,
    dtype: str,
    micro_batch_size: int,
    tp_degree: int = 1,
    sequence_parallel: bool = False,
    traced_dtype_bytes: int = 4,
    fp8: Fp8Recipe | None = None,
    kernels: float = 1.0,
) -> OpTime:
    """Forward and backward time of ``op`` for one micro-batch on one device (roofline).

    Under an fp8 recipe (``dtype`` names one) the op runs in the recipe's compute dtype, bf16;
    with ``fp8`` (the op is a converted linear, `cost_model.parts.fp8.is_converted`) its GEMMs
    run at the device's fp8 rate for the recipe, at `Calibration.fp8_gemm_efficiency_ratio`
    times the 16-bit GEMMs' efficiency. The casts to fp8 are `cost_model.parts.fp8`'s.
    ``kernels``: the launches it pays each way (a fused group's first op launches the group's
    kernels, the others none: `cost_model.parts.fusion.fused_ops`)."""
    dtype = compute_dtype(dtype)
    div = tp_divisor(op, tp_degree, sequence_parallel)
    scale = DTYPE_BYTES[dtype] / traced_dtype_bytes
    fwd_flops = op.forward_flops * micro_batch_size / div
    bwd_flops = op.backward_flops * micro_batch_size / div
    # Weights are split only by the TP-split linears; replicated weights (norms) are read whole.
    weight_div = tp_degree if op.tp in _TP_SPLIT_ROLES else 1
    fwd_bytes = (
        op.activation_bytes * micro_batch_size * scale / div
        + op.param_bytes_read * scale / weight_div
    )
    bwd_bytes = BACKWARD_BYTES_FACTOR * fwd_bytes
    bandwidth = device.memory_bandwidth_bytes_per_s * calibration.memory_efficiency
    if op.kind in ("matmul", "attention"):
        peak = device.peak_flops_for(dtype)
        if fp8 is not None and op.kind == "matmul" and op.gemm is not None:
            peak = device.peak_flops_for(fp8.device_rate) * calibration.fp8_gemm_efficiency_ratio
            # fp8 operands (1 byte) in, the bf16 output (2) out
            k = op.gemm.k / (tp_degree if op.tp == "row" else 1)
            n = op.gemm.n / (tp_degree if op.tp in ("column", "vocab") else 1)
            m = op.gemm.m_per_sample * op.gemm.batch * micro_batch_size
            fwd_bytes = m * k + 2.0 * m * n + k * n * op.gemm.batch
            bwd_bytes = BACKWARD_BYTES_FACTOR * fwd_bytes
        max_eff = (
            calibration.gemm_efficiency if op.kind == "matmul" else calibration.attention_efficiency
        )
        # One backward GEMM (dgrad or wgrad) has the forward's size: same efficiency.
        eff = saturating_efficiency(fwd_flops, max_eff, calibration.gemm_half_efficiency_flops)
        rate = bwd_rate = peak * eff
        if op.kind == "attention" and calibration.attention_backward_efficiency > 0:
            bwd_rate = rate * calibration.attention_backward_efficiency / max_eff
        weight_share = 0.5 if op.kind == "matmul" and op.param_bytes_read > 0 else 0.0
        if op.kind == "matmul" and op.gemm is not None:
            # Depth of the forward GEMM (k, split by a row-parallel linear) and of the data
            # gradient (n, split by a column-parallel one); the weight gradient reduces over
            # the tokens. Half the backward FLOPs each.
            half = calibration.gemm_half_efficiency_depth
            k = op.gemm.k / (tp_degree if op.tp == "row" else 1)
            n = op.gemm.n / (tp_degree if op.tp in ("column", "vocab") else 1)
            rate = peak * eff * depth_efficiency(k, half)
            bwd_rate = peak * eff / (0.5 / depth_efficiency(n, half) + 0.5)
            if weight_share:
                # the wgrad's share of the backward's GEMM time: 0.5 of the FLOPs at full depth
                weight_share = 0.5 / (0.5 / depth_efficiency(n, half) + 0.5)
    else:
        # Vector (non tensor-core) work: the fp32 peak bounds it; it is almost always the byte
        # term that decides.
        rate = bwd_rate = device.peak_flops_for("fp32")
        weight_share = 1.0 if op.kind == "embedding" and op.param_bytes_read > 0 else 0.0
    overhead = kernels * calibration.kernel_overhead_s
    forward_s = max(fwd_flops / rate, fwd_bytes / bandwidth) + overhead
    backward_s = (
        max(bwd_flops / bwd_rate, bwd_bytes / bandwidth) + overhead
        if (bwd_flops > 0 or bwd_bytes > 0)
        else 0.0
    )
    separate = calibration.separate_bias_add or calibration.separate_output_dropout
    if separate and op.kind == "matmul" and op.gemm is not None and op.param_bytes_read > 0:
        extra_forward, extra_backward = _epilogue_passes_s(
            op, calibration, bandwidth, dtype, micro_batch_size, tp_degree, sequence_parallel,
            traced_dtype_bytes,
        )  # fmt: skip
        forward_s += extra_forward
        backward_s += extra_backward
    return OpTime(
        forward_s=forward_s,
        backward_s=backward_s,
        forward_flops=fwd_flops,
        backward_flops=bwd_flops,
        weight_backward_s=weight_share * backward_s,
    )
