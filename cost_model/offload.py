"""Offload to the host: the share of a device's optimizer step (`Plan.optimizer_offload`) and
the blocks of a stage whose saved activations (`StagePlan.activation_offload`) live in host
memory, and the host figures both are priced and checked with.

What ``optimizer_offload`` means in each stack that has it:
- Megatron-Core's ``HybridDeviceOptimizer`` (megatron/core/optimizer/cpu_offloading/
  hybrid_optimizer.py; ``--optimizer-cpu-offload --optimizer-offload-fraction f``): the first
  ``f`` of the distributed optimizer's parameters by element count get a CPU Adam (fp32 master
  and moments in host memory); each step copies their gradients to the host, steps them there
  while the device steps the rest, and copies the updated parameters back.
- DeepSpeed's ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
  Training", USENIX ATC'21; ``zero_optimization.offload_optimizer``): the whole partition's
  optimizer on the host (``ratio`` < 1 only at ZeRO-3: ZeRO-Offload++'s Twin-Flow).

What ``activation_offload`` N means: of the stage's blocks that its recompute mode does not
cover, the first N keep the tensors autograd saves for their backward in host memory: copied
out as the forward saves them, back before their backward. Megatron-Core's
``--cpu-offloading-num-layers N`` (Transformer Engine's ``get_cpu_offload_context``: the first N
layers, copies on side streams) and torch's ``torch.autograd.graph.save_on_cpu`` (autoplan's
runtime on CUDA: copies on the compute stream).

This module states the fields' rules (no torch, no strategy) for the plan, the strategy and
the stacks; `cost_model.parts.offload` prices them.
"""

from __future__ import annotations

from typing import Literal

from cost_model.degrees import MAX_COUNT, is_whole
from cost_model.schema import shown

# How a stack orders an offloaded optimizer step's three parts (`FrameworkProfile.
# optimizer_offload_overlap`, priced by `cost_model.parts.offload.OffloadCost.step_s`):
# "pipelined", the gradients out, the host's step and the weights back overlapped with each
# other and the device's step (Megatron-Core's overlap_cpu_optimizer_d2h_h2d, ZeRO-Offload);
# "blocking", the gradients out, then the host's step beside the device's, then the weights
# back (autoplan's runtime, passes/optimizer_offload.py).
OptimizerOffloadOverlap = Literal["pipelined", "blocking"]

# The host's DRAM bandwidth per device, used for every GPU cluster (the cluster format states
# the host's memory, `Cluster.host_memory_bytes`, not its bandwidth): a DGX A100's host, 2 AMD
# EPYC 7742 with 8 channels of DDR4-3200 each (2 x 8 x 25.6 GB/s = 409.6 GB/s; NVIDIA DGX A100
# user guide, system specifications), shared by its 8 GPUs. Newer hosts (DDR5-4800 in the DGX
# H100) have more, so the host's Adam priced with it is priced conservatively there.
HOST_MEMORY_BANDWIDTH_PER_DEVICE_BYTES_PER_S = 409.6e9 / 8


def host_memory_per_device_bytes(host_memory_bytes: float, devices_per_node: int) -> float:
    """A device's share of its node's host DRAM (`Cluster.host_memory_bytes`, shared by the
    node's ``devices_per_node`` devices, one training process each)."""
    return host_memory_bytes / devices_per_node


def optimizer_offload_problem(optimizer_offload: object) -> str | None:
    """``optimizer_offload`` against its range: a number from 0 (nothing offloaded: the default)
    to 1 (the whole step on the host), as Megatron-Core's ``optimizer_offload_fraction`` and
    DeepSpeed's ``offload_optimizer.ratio`` are."""
    if isinstance(optimizer_offload, bool) or not isinstance(optimizer_offload, (int, float)):
        return (
            f"optimizer_offload = {shown(optimizer_offload)} must be a number from 0 to 1 (the "
            "share of the optimizer step on the host); leave it out for none"
        )
    if not 0.0 <= float(optimizer_offload) <= 1.0:
        return (
            f"optimizer_offload = {shown(optimizer_offload)} must be from 0 to 1 (the share of "
            "the optimizer step on the host); use 1 for all of it, or leave it out for none"
        )
    return None


def host_link_problem(
    optimizer_offload: float,
    device_name: str,
    device_kind: str,
    host_link_bytes_per_s: float,
    *,
    value: str | None = None,
    moves: str = "gradients and weights",
    fix: str = "optimizer_offload: 0",
) -> str | None:
    """Why offload (``optimizer_offload`` above 0, or another offload named by ``value`` and
    ``fix``, which moves ``moves``) cannot be priced or run on this device, or None: offload
    moves data over the device's host link every step, so a device without a host link figure
    (0: not stated; a CPU worker, which is its own host) has nothing to price it with and
    nothing to offload to."""
    if optimizer_offload <= 0.0 or host_link_bytes_per_s > 0.0:
        return None
    stated = value or f"optimizer_offload = {shown(optimizer_offload)}"
    if device_kind == "cpu":
        return (
            f"{stated} on device {shown(device_name)} (cpu): offload moves {moves} to the host "
            "over the device's host link, and a CPU worker is its own host (no host link: "
            f"nothing to move; offload runs on CUDA devices); set {fix} (leave it out)"
        )
    return (
        f"{stated} on device {shown(device_name)}, which states no host link: offload moves "
        f"{moves} over it every step; set device.host_link_bandwidth_bytes_per_s (cluster "
        f"override host_link_bandwidth=64GB/s for PCIe Gen5 x16), or {fix}"
    )


def activation_offload_problem(count: object) -> str | None:
    """Why ``activation_offload`` = ``count`` cannot be a stage's, without the model (None: it
    can): a whole number of blocks, 0 (not written) for none."""
    if count == 0:
        return None
    if not is_whole(count, None) or count < 0:
        return (
            f"activation_offload = {shown(count)} must be a whole number >= 0 (how many of the "
            "stage's blocks keep their saved activations on the host); leave it out for none"
        )
    if count > MAX_COUNT:
        return f"activation_offload = {count:,} is over {MAX_COUNT:,}; give the stage's block count"
    return None
