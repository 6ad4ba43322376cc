"""Optimizer offload priced (`Plan.optimizer_offload`, `cost_model.offload`): the share ``f`` of
the parameters a device updates whose optimizer step, master weights and moments are on the host.

Per step, for the ``f * n`` offloaded parameters of a device's ``n`` updated ones:
- their gradients go to the host over the host link (device to host) at the reduction dtype's
  width (Megatron-Core's HybridDeviceOptimizer copies each ``main_grad`` into a pinned host
  buffer, ``_set_sub_optimizer_grads``);
- the host steps them with a CPU Adam, bound by the host's DRAM bandwidth: fp32 gradient, master
  weights and both moments on the host, Adam's 32 bytes a parameter
  (`parts.optimizer.adam_traffic_bytes` of an fp32 policy; ZeRO-Offload's CPU-Adam is a
  vectorised, memory-bound loop: Ren et al., ATC'21, section 5.1);
- the updated weights come back (host to device) at the master dtype's width (the hybrid
  optimizer's post-step hook copies the host's fp32 parameter into the device's).
The link is full duplex and the stacks pipeline the three per parameter (Megatron-Core with
``overlap_cpu_optimizer_d2h_h2d``, which `autoplan export` turns on; ZeRO-Offload copies the
gradients during the backward), while the device steps its own ``(1 - f) * n`` (the hybrid
optimizer launches the device's step before the host's): the step takes the longest of the
device's step, the two copies and the host's step. The link and the host's DRAM at their
datasheet rates: a lower bound.

Memory: ``f`` of the device's optimizer bytes (master copy and moments) move to the host; the
host holds ``f * n`` x (fp32 master + two fp32 moments + the fp32 gradient buffer), and a plan
whose share of the host's DRAM (`cost_model.offload.HOST_MEMORY_PER_DEVICE_BYTES`) does not hold
it is refused (`host_memory_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.errors import InputError
from cost_model.hardware import Cluster
from cost_model.offload import (
    HOST_MEMORY_BANDWIDTH_PER_DEVICE_BYTES_PER_S,
    HOST_MEMORY_PER_DEVICE_BYTES,
    host_link_problem,
)
from cost_model.strategy import Strategy
from cost_model.units import format_bytes

# Adam's step traffic per parameter with everything in fp32 (`parts.optimizer.adam_traffic_bytes`
# of an fp32 policy: 2g + 2w + 4s = 8 + 8 + 16).
HOST_ADAM_TRAFFIC_BYTES_PER_PARAM = 32.0
# A host-side Adam parameter: fp32 master, two fp32 moments and the fp32 gradient buffer.
HOST_BYTES_PER_PARAM = 16.0


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadCost:
    """The offloaded share of one unit's optimizer step, per step."""

    device_to_host_s: float  # the gradients out
    host_step_s: float  # the CPU Adam
    host_to_device_s: float  # the updated weights back
    host_bytes: float  # what the host holds for it

    @property
    def critical_s(self) -> float:
        """The offloaded share's time, its three parts pipelined (the longest of them)."""
        return max(self.device_to_host_s, self.host_step_s, self.host_to_device_s)


NO_OFFLOAD = OffloadCost(device_to_host_s=0.0, host_step_s=0.0, host_to_device_s=0.0, host_bytes=0)


def host_link_bytes_per_s(cluster: Cluster, optimizer_offload: float) -> float:
    """The device's host link, each way; raises InputError naming the value, the rule and the
    fix where offload is asked of a device without one (`cost_model.offload.host_link_problem`)."""
    device = cluster.device
    link = device.host_link_bandwidth_bytes_per_s
    problem = host_link_problem(optimizer_offload, device.name, device.kind, link)
    if problem is not None:
        raise InputError(problem)
    return link


def offload_cost(updated_params: float, strategy: Strategy, cluster: Cluster) -> OffloadCost:
    """The host's share of the step over ``updated_params`` (the parameters this device's
    optimizer updates, after ZeRO sharding) under ``strategy.optimizer_offload``."""
    share = strategy.optimizer_offload
    if share <= 0.0 or updated_params <= 0:
        return NO_OFFLOAD
    link = host_link_bytes_per_s(cluster, share)
    policy = strategy.precision
    offloaded = share * updated_params
    return OffloadCost(
        device_to_host_s=offloaded * policy.grad_reduce_bytes / link,
        host_step_s=offloaded
        * HOST_ADAM_TRAFFIC_BYTES_PER_PARAM
        / HOST_MEMORY_BANDWIDTH_PER_DEVICE_BYTES_PER_S,
        host_to_device_s=offloaded * policy.master_bytes / link,
        host_bytes=offloaded * HOST_BYTES_PER_PARAM,
    )


def host_memory_problem(host_bytes: float) -> str | None:
    """Why the offloaded state does not fit the device's share of host memory, or None."""
    if host_bytes <= HOST_MEMORY_PER_DEVICE_BYTES:
        return None
    return (
        f"optimizer_offload puts {format_bytes(host_bytes)} of optimizer state on the host per "
        f"device, over its share of host memory ({format_bytes(HOST_MEMORY_PER_DEVICE_BYTES)}: "
        "1 TB for 8 devices); lower optimizer_offload, or shard the optimizer over more ranks "
        "(a higher ZeRO stage or dp)"
    )
