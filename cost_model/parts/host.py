"""Host overhead: the time the parallel wrappers spend on the CPU (DTensor dispatch of TP
modules, FSDP2's per-unit hooks, the sharded optimizer's per-unit work). Calibrated constants
(`Calibration.tp_module_overhead_s` and the like). A CPU worker's core does the wrappers' work
and the compute in turn, so there they add to the device's time; a GPU, fed asynchronously,
waits only where the host's work for a unit takes longer than the device's: a floor under the
unit's time (`host_floor_wait`), with the stack's own floor per tensor-parallel block."""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.calibration import Calibration
from cost_model.errors import InputError
from cost_model.hardware import Cluster
from cost_model.parts.data_parallel import per_unit_dp_groups
from cost_model.parts.tensor_parallel import tp_module_count
from cost_model.strategy import Strategy
from cost_model.workload import UnitProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class HostCost:
    """One unit's wrapper host time (added on a CPU worker, a floor on a GPU)."""

    microbatch_s: float  # per micro-batch, forward + backward (split evenly between them)
    optimizer_s: float  # per step, in the optimizer step


def host_cost(
    unit: UnitProfile, local_params: float, strategy: Strategy, cal: Calibration
) -> HostCost:
    """The wrappers' host time for ``unit``, whose device stores ``local_params`` parameters."""
    microbatch_s = 0.0
    if strategy.tp_degree > 1:
        microbatch_s += tp_module_count(unit, strategy.sequence_parallel) * cal.tp_module_overhead_s
    if unit.num_params > 0 and per_unit_dp_groups(strategy):
        microbatch_s += cal.dp_unit_overhead_s
    optimizer_s = 0.0
    if local_params > 0 and (strategy.tp_degree > 1 or per_unit_dp_groups(strategy)):
        optimizer_s = cal.sharded_optimizer_unit_overhead_s
    if local_params > 0 and cal.optimizer_tensor_overhead_s > 0:
        optimizer_s += parameter_tensors(unit) * cal.optimizer_tensor_overhead_s
    return HostCost(microbatch_s=microbatch_s, optimizer_s=optimizer_s)


def parameter_tensors(unit: UnitProfile) -> int:
    """The parameter tensors an optimizer steps for ``unit``, from its ops: one per op that
    reads parameters, and a linear's bias where it reads more than its weight (a norm's bias
    is not told apart: GPT-2's LayerNorms count 1 of their 2, Llama's RMSNorms exactly)."""
    bytes_per_param = unit.param_bytes / unit.num_params if unit.num_params else 4.0
    count = 0
    for op in unit.ops:
        if op.param_bytes_read <= 0:
            continue
        count += 1
        if op.gemm is not None and op.param_bytes_read > op.gemm.k * op.gemm.n * bytes_per_param:
            count += 1
    return count


def host_floor_wait(forward_s: float, backward_s: float, floor_s: float) -> tuple[float, float]:
    """The device's idle time per micro-batch when its forward and backward of one unit take
    less than the host needs to issue them (``floor_s``): the shortfall, split between the
    forward and the backward in proportion to their times (the host feeds both alike)."""
    total = forward_s + backward_s
    if total >= floor_s:
        return 0.0, 0.0
    if total <= 0.0:
        return floor_s / 3.0, 2.0 * floor_s / 3.0
    short = floor_s - total
    return short * forward_s / total, short * backward_s / total


def sync_copies_s(cluster: Cluster, recompute: str) -> tuple[float, float]:
    """A block's synchronous host-device copies per micro-batch (`Calibration.
    block_sync_copy_bytes`, `checkpoint_sync_copy_bytes`), forward and backward, at the
    device's host link (a CPU worker's own memory). Full recompute re-runs the forward's copies
    in the backward and adds the checkpoint's. The device waits for each copy; the link's
    datasheet rate makes this a lower bound."""
    cal = cluster.calibration
    per_run, checkpoint = cal.block_sync_copy_bytes, cal.checkpoint_sync_copy_bytes
    if per_run == 0 and (checkpoint == 0 or recompute != "full"):
        return 0.0, 0.0
    device = cluster.device
    link = device.host_link_bandwidth_bytes_per_s
    if device.kind == "cpu":
        link = link or device.memory_bandwidth_bytes_per_s
    if link <= 0:
        raise InputError(
            f"device {device.name!r} states no host link, over which its training stack copies "
            f"{per_run:.0f} bytes a block per forward: set device.host_link_bandwidth_bytes_per_s "
            "(cluster override host_link_bandwidth=16GB/s for PCIe Gen3 x16)"
        )
    forward = per_run / link
    backward = (per_run + checkpoint) / link if recompute == "full" else 0.0
    return forward, backward
