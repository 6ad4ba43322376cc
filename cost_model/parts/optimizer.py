"""The optimizer step: memory-bound Adam over the parameters a device updates."""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.hardware import Cluster
from cost_model.strategy import Strategy

# Adam step memory traffic per locally-updated parameter (read grad, master weight, momentum,
# variance; write master, momentum, variance and the low-precision copy), plus one read of the
# gradients for the global-norm clip: 2+4+4+4 + 4+4+4+2 + 2 = 30 bytes in mixed precision,
# 4+4+4+4 + 4+4+4 + 4 = 32 bytes in fp32.
ADAM_TRAFFIC_BYTES_PER_PARAM = {"mixed": 30.0, "fp32": 32.0}


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerCost:
    """One unit's share of the optimizer step, per step."""

    step_s: float


def optimizer_cost(local_params: float, strategy: Strategy, cluster: Cluster) -> OptimizerCost:
    """Adam over the parameters of a unit this device updates: its ``local_params`` (before
    data-parallel sharding), divided over the data-parallel ranks from ZeRO-1 on; one kernel's
    launch overhead when there are any."""
    precision = "fp32" if strategy.dtype_bytes >= 4 else "mixed"
    cal = cluster.calibration
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    dp, zero = strategy.dp_degree, strategy.runtime_zero_stage
    updated = local_params / dp if zero >= 1 else local_params
    traffic = cal.optimizer_bytes_per_param or ADAM_TRAFFIC_BYTES_PER_PARAM[precision]
    step_s = updated * traffic / bandwidth
    if updated > 0:
        step_s += cal.kernel_overhead_s
    return OptimizerCost(step_s=step_s)
