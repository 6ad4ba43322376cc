"""Offload priced (`cost_model.offload`): optimizer offload (`Plan.optimizer_offload`, the share
``f`` of the parameters a device updates whose optimizer step, master weights and moments are on
the host) and activation offload (`StagePlan.activation_offload`, blocks whose saved activations
are on the host: `offloaded_unit_cost`, after the optimizer's part below).

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
How the three combine with the device's step over its own ``(1 - f) * n`` is the stack's
(`FrameworkProfile.optimizer_offload_overlap`, `OffloadCost.step_s`):
- "pipelined": the link is full duplex and the stacks pipeline the three per parameter
  (Megatron-Core with ``overlap_cpu_optimizer_d2h_h2d``, which `autoplan export` turns on;
  ZeRO-Offload copies the gradients during the backward), while the device steps its own share
  (the hybrid optimizer launches the device's step before the host's): the step takes the
  longest of the device's step, the two copies and the host's step;
- "blocking" (autoplan's runtime, passes/optimizer_offload.py ``OffloadedOptimizer.step``):
  every offloaded gradient is copied out and waited for, then the device's step (launched
  first, on the GPU) runs beside the host's, then the weights are copied back on the compute
  stream before the next forward: out + max(device, host) + back.
The link and the host's DRAM at their datasheet rates: a lower bound.

Memory: ``f`` of the device's optimizer bytes (master copy and moments) move to the host; the
host holds ``f * n`` x (fp32 master + two fp32 moments + the fp32 gradient buffer), and a plan
whose share of its node's host DRAM (`Cluster.host_memory_bytes` over the node's devices) does
not hold it, with the activations offloaded beside it, is refused (`host_memory_problem`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from cost_model.errors import InputError
from cost_model.hardware import Cluster
from cost_model.memory import RECOMPUTABLE_KINDS, activation_bytes
from cost_model.offload import (
    HOST_MEMORY_BANDWIDTH_PER_DEVICE_BYTES_PER_S,
    OptimizerOffloadOverlap,
    host_link_problem,
    host_memory_per_device_bytes,
)
from cost_model.strategy import Strategy
from cost_model.unit_cost import UnitCost
from cost_model.units import format_bytes
from cost_model.workload import ModelProfile

# How a stack moves an offloaded block's saved activations (`FrameworkProfile.activation_offload`):
# "overlapped" on copy streams beside the compute, "blocking" on the compute stream.
OffloadOverlap = Literal["overlapped", "blocking"]

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

    def step_s(self, device_step_s: float, overlap: OptimizerOffloadOverlap) -> float:
        """The optimizer step with the device's own share taking ``device_step_s``, as a stack
        that orders the offloaded share's parts as ``overlap`` says (module doc)."""
        if overlap == "pipelined":
            return max(device_step_s, self.critical_s)
        return self.device_to_host_s + max(device_step_s, self.host_step_s) + self.host_to_device_s


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


def host_memory_problem(
    host_bytes: float, cluster: Cluster, *, what: str = "optimizer_offload puts"
) -> str | None:
    """Why ``host_bytes`` offloaded per device do not fit the device's share of its node's host
    memory (`Cluster.host_memory_bytes` over ``devices_per_node``), or None; a cluster that
    states no host memory has none to offload to."""
    if host_bytes <= 0:
        return None
    per_node = cluster.host_memory_bytes
    if per_node <= 0:
        return (
            f"{what} {format_bytes(host_bytes)} on the host per device, but cluster "
            f"{cluster.name!r} states no host memory; set host_memory_bytes in its file (cluster "
            "override host_memory=2TB for a DGX H100 node), or offload nothing"
        )
    share = host_memory_per_device_bytes(per_node, cluster.devices_per_node)
    if host_bytes <= share:
        return None
    return (
        f"{what} {format_bytes(host_bytes)} on the host per device, over its share of host "
        f"memory ({format_bytes(share)}: {format_bytes(per_node)} a node for "
        f"{cluster.devices_per_node} devices); offload less (lower optimizer_offload or "
        "stages[*].activation_offload), or shard over more ranks (a higher ZeRO stage or dp)"
    )


def optimizer_host_bytes(
    profile: ModelProfile, strategy: Strategy, units_params: int | None = None
) -> float:
    """A device's offloaded optimizer state in host memory: its share of the model's parameters
    (over tp x pp, and over the shard group from ZeRO-1 on; routed experts taken as dense, an
    upper bound) at `HOST_BYTES_PER_PARAM` each, times the offloaded share. ``units_params``:
    `units_params_of` the profile, if the caller has it."""
    if strategy.optimizer_offload <= 0:
        return 0.0
    params: float = units_params if units_params is not None else units_params_of(profile)
    params /= strategy.tp_degree * strategy.pp_degree
    if strategy.runtime_zero_stage >= 1:
        params /= strategy.shard_degree
    return strategy.optimizer_offload * params * HOST_BYTES_PER_PARAM


def units_params_of(profile: ModelProfile) -> int:
    """Every unit's parameters, shared ones counted in each unit that holds them."""
    return sum(unit.num_params for unit in profile.units)


def activation_twin_host_bytes(profile: ModelProfile, strategy: Strategy) -> float:
    """At least what the search's activation twin (`Strategy.activation_offload`) puts on one
    device's host, as `autoplan.Plan`'s host-memory check counts a plan read back from it:
    every block's saved activations under recompute 'none' for `host_held_micro_batches`
    (0 unless ``strategy.activation_offload``; the optimizer's share, `optimizer_host_bytes`,
    adds to it). The search offers no twin this puts over the device's share."""
    if not strategy.activation_offload:
        return 0.0
    return host_held_micro_batches(strategy) * blocks_saved_bytes(profile, strategy)


def host_held_micro_batches(strategy: Strategy) -> int:
    """How many micro-batches' offloaded activations a rank holds at most: all of them under
    GPipe, else at most the pipeline's stages (an upper bound)."""
    m = strategy.num_micro_batches
    return m if strategy.schedule == "gpipe" else min(m, strategy.num_stages)


def blocks_saved_bytes(profile: ModelProfile, strategy: Strategy) -> float:
    """One micro-batch's saved activations of every block under recompute 'none' on one
    device. Reads only `BLOCKS_SAVED_FIELDS` of ``strategy`` (a caller may cache by them)."""
    traced = profile.traced_dtype_bytes
    return sum(
        activation_bytes(unit, strategy, "none", traced) / strategy.cp_degree
        for unit in profile.units
        if unit.kind in RECOMPUTABLE_KINDS
    )


# the strategy fields `blocks_saved_bytes` reads (`cost_model.memory.activation_bytes`)
BLOCKS_SAVED_FIELDS = ("tp_degree", "sequence_parallel", "micro_batch_size", "dtype", "cp_degree")


# ------------------------------------------------------------------------ activation offload


def activation_link_problem(cluster: Cluster, num_offloaded: int, value: str) -> str | None:
    """Why the cluster's device cannot offload ``num_offloaded`` blocks' saved activations
    (no host link figure, a CPU worker), naming ``value`` and the fix; None if it can."""
    device = cluster.device
    return host_link_problem(
        float(num_offloaded),
        device.name,
        device.kind,
        device.host_link_bandwidth_bytes_per_s,
        value=value,
        moves="saved activations",
        fix="stages[*].activation_offload: 0",
    )


def activation_host_link_bytes_per_s(cluster: Cluster, num_offloaded: int) -> float:
    """The device's host link for activation offload; raises InputError naming the value, the
    rule and the fix where the device has none (`activation_link_problem`)."""
    value = f"activation_offload of {num_offloaded} block(s)"
    problem = activation_link_problem(cluster, num_offloaded, value)
    if problem is not None:
        raise InputError(problem)
    return cluster.device.host_link_bandwidth_bytes_per_s


def offloaded_unit_cost(
    cost: UnitCost, link_bytes_per_s: float, overlap: OffloadOverlap
) -> UnitCost:
    """``cost`` (a block under recompute 'none') with its saved activations on the host.

    Per micro-batch its ``activation_bytes`` go out after its forward saves them and come back
    before its backward, each way over the host link at its datasheet rate (a lower bound).
    - "overlapped" (Megatron-Core's ``--cpu-offloading``: Transformer Engine's
      ``AsyncDoubleBufferGroupOffloadHandler``, transformer_engine/pytorch/cpu_offload.py): the
      copy out of block i runs on a device-to-host stream during block i+1's forward, the copy
      back on a host-to-device stream during block i+1's backward ("completely hidden behind
      computation if computation time of a layer is longer than host-device communication
      time", its docstring). Blocks of a Transformer are alike, so block i+1's forward is
      priced as this block's: only ``max(0, copy - forward_s)`` (and the backward's alike)
      shows. The device holds two blocks' saved activations while they move (the one copied
      and the one computed: "at most two activation groups in GPU memory").
    - "blocking" (torch's ``save_on_cpu``, autoplan's runtime: each saved tensor copied as it
      is packed and back as the backward unpacks it, on the compute stream): the whole copy
      shows, each way; the device holds the block's own activations while its backward runs.
    The bytes held through the step leave the device (``activation_bytes`` 0); those held
    while they move join the block's backward working set (``working_bytes``, which the rank
    counts once, for its largest block: `cost_model.rank_memory.rank_memory`).
    """
    copy_s = cost.activation_bytes / link_bytes_per_s
    if overlap == "overlapped":
        out_s = max(0.0, copy_s - cost.forward_s)
        back_s = max(0.0, copy_s - cost.backward_s)
        in_flight = 2.0
    else:
        out_s = back_s = copy_s
        in_flight = 1.0
    return dataclasses.replace(
        cost,
        forward_s=cost.forward_s + out_s,
        backward_s=cost.backward_s + back_s,
        activation_bytes=0.0,
        working_bytes=cost.working_bytes + in_flight * cost.activation_bytes,
        host_link_s=cost.host_link_s + out_s + back_s,
        host_activation_bytes=cost.activation_bytes,
    )
