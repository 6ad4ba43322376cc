"""The optimizer step: memory-bound Adam over the parameters a device updates."""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.hardware import Cluster
from cost_model.offload import OptimizerOffloadOverlap
from cost_model.parts.offload import NO_OFFLOAD, OffloadCost, offload_cost
from cost_model.precision import PrecisionPolicy, precision_policy
from cost_model.strategy import Strategy


def adam_traffic_bytes(policy: PrecisionPolicy) -> float:
    """Adam's step memory traffic per locally-updated parameter under a precision policy:
    read the gradient (g, the compute dtype's width), the master weight (w) and both moments
    (s each); write the master weight, both moments and, where the master is a copy, the
    working weight (c); plus one read of the gradients for the global-norm clip:
    2g + 2w + 4s (+ c). Mixed precision (fp32 master and moments): 2+4+4+4 + 4+4+4+2 + 2 = 30
    bytes; fp32: 32; bf16 master and moments (no copy): 16; fp32 master, bf16 moments (Megatron's
    precision-aware optimizer, --exp-avg-dtype bf16): 22."""
    g = policy.compute_bytes
    copy = policy.compute_bytes if policy.master_copy else 0
    return 2.0 * g + 2.0 * policy.master_bytes + 4.0 * policy.optimizer_state_bytes + copy


# The default policies' traffic (`adam_traffic_bytes`), by precision.
ADAM_TRAFFIC_BYTES_PER_PARAM = {
    "mixed": adam_traffic_bytes(precision_policy("bf16")),
    "fp32": adam_traffic_bytes(precision_policy("fp32")),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerCost:
    """One unit's share of the optimizer step, per step: the device's step, or under
    optimizer offload the longer of the device's share and the host's (`parts.offload`)."""

    step_s: float
    offload: OffloadCost = NO_OFFLOAD


def optimizer_cost(
    local_params: float,
    strategy: Strategy,
    cluster: Cluster,
    overlap: OptimizerOffloadOverlap = "pipelined",
) -> OptimizerCost:
    """Adam over the parameters of a unit this device updates: its ``local_params`` (before
    data-parallel sharding), divided over the data-parallel ranks from ZeRO-1 on; one kernel's
    launch overhead when there are any. Under ``strategy.optimizer_offload`` the device steps
    the rest while the host steps its share (`parts.offload`), the two copies ordered as the
    stack orders them (``overlap``, `OffloadCost.step_s`)."""
    cal = cluster.calibration
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    # (ZeRO shards the step over dp, or under HSDP over a shard group)
    shard, zero = strategy.shard_degree, strategy.runtime_zero_stage
    updated = local_params / shard if zero >= 1 else local_params
    traffic = cal.optimizer_bytes_per_param or adam_traffic_bytes(strategy.precision)
    offload = offload_cost(updated, strategy, cluster)
    step_s = updated * (1.0 - strategy.optimizer_offload) * traffic / bandwidth
    if updated > 0:
        step_s += cal.kernel_overhead_s
    return OptimizerCost(step_s=offload.step_s(step_s, overlap), offload=offload)
