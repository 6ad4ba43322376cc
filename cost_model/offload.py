"""Optimizer offload (`Plan.optimizer_offload`): the share of a device's optimizer step, with its
master weights and moments, that lives and runs on the host CPU.

What the field means in each stack that has it:
- Megatron-Core's ``HybridDeviceOptimizer`` (megatron/core/optimizer/cpu_offloading/
  hybrid_optimizer.py; ``--optimizer-cpu-offload --optimizer-offload-fraction f``): the first
  ``f`` of the distributed optimizer's parameters by element count get a CPU Adam (fp32 master
  and moments in host memory); each step copies their gradients to the host, steps them there
  while the device steps the rest, and copies the updated parameters back.
- DeepSpeed's ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
  Training", USENIX ATC'21; ``zero_optimization.offload_optimizer``): the whole partition's
  optimizer on the host (``ratio`` < 1 only at ZeRO-3: ZeRO-Offload++'s Twin-Flow).

This module states the field's rules (no torch, no strategy) for the plan, the strategy and
the stacks; `cost_model.parts.offload` prices it.
"""

from __future__ import annotations

from cost_model.schema import shown

# The host's DRAM bandwidth and capacity per device, used for every GPU cluster (the cluster
# format has no host-memory fields yet): a DGX A100's host, 2 AMD EPYC 7742 with 8 channels of
# DDR4-3200 each (2 x 8 x 25.6 GB/s = 409.6 GB/s) and 1 TB of DRAM (NVIDIA DGX A100 user guide,
# system specifications), shared by its 8 GPUs. The DGX H100 (2 TB, DDR5-4800) has more of
# both, so offload priced with these is priced conservatively there.
HOST_MEMORY_BANDWIDTH_PER_DEVICE_BYTES_PER_S = 409.6e9 / 8
HOST_MEMORY_PER_DEVICE_BYTES = 1e12 / 8


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
    optimizer_offload: float, device_name: str, device_kind: str, host_link_bytes_per_s: float
) -> str | None:
    """Why ``optimizer_offload`` cannot be priced or run on this device, or None: offload moves
    gradients and weights over the device's host link every step, so a device without a host
    link figure (0: not stated; a CPU worker, which is its own host) has nothing to price it
    with and nothing to offload to."""
    if optimizer_offload <= 0.0 or host_link_bytes_per_s > 0.0:
        return None
    if device_kind == "cpu":
        return (
            f"optimizer_offload = {shown(optimizer_offload)} on device {shown(device_name)} "
            "(cpu): offload moves the optimizer step to the host over the device's host link, "
            "and a CPU worker is its own host (no host link: nothing to move); set "
            "optimizer_offload: 0 (leave it out)"
        )
    return (
        f"optimizer_offload = {shown(optimizer_offload)} on device {shown(device_name)}, which "
        "states no host link: offload moves gradients and weights over it every step; set "
        "device.host_link_bandwidth_bytes_per_s (cluster override host_link_bandwidth=64GB/s "
        "for PCIe Gen5 x16), or optimizer_offload: 0"
    )
