"""Async TP pass: torch's overlap of the sequence-parallel TP collectives with the GEMMs, for a
plan with ``tp_comm_overlap`` (as torchtitan's ``_maybe_enable_async_tp`` turns it on,
torchtitan/distributed/compile.py).

Expects the job's device and process-group backend (`async_tp_refusal`, before anything is
built), then the TP process group's name before the first forward of the compiled blocks
(`enable_async_tp`; `passes.compile` compiles them, and inductor reads the flag when it
compiles, on that forward).

Guarantees: `async_tp_refusal` says in one line why this job cannot run it, the same on every
rank (a device other than CUDA, or a backend other than NCCL: inductor's micro-pipeline TP pass
returns without NCCL, and the fused ops run on CUDA streams over symmetric memory);
`enable_async_tp` registers the TP group's symmetric memory and turns on inductor's
micro-pipeline TP pass (``torch._inductor.config._micro_pipeline_tp``), which rewrites each
compiled block's all-gather -> matmul into ``fused_all_gather_matmul`` and matmul ->
reduce-scatter into ``fused_matmul_reduce_scatter`` (torch/_inductor/fx_passes/
micro_pipeline_tp.py, torch/distributed/_symmetric_memory). That CUDA path follows torchtitan's
and is not run by autoplan's tests: this project's machines have no CUDA device.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.distributed_c10d import GroupName

__all__ = ["async_tp_refusal", "enable_async_tp"]


def async_tp_refusal(device: torch.device, backend: str) -> str | None:
    """Why this job cannot overlap its TP communication (None: it can)."""
    if device.type == "cuda" and backend == "nccl":
        return None
    where = f"{device.type} with the {backend} backend"
    return (
        f"tp_comm_overlap: true on {where}: autoplan runs it as torch's async TP (inductor's "
        "micro-pipeline TP pass, fused all-gather/reduce-scatter matmuls over CUDA symmetric "
        "memory), which needs CUDA devices and NCCL; set tp_comm_overlap: false to run this "
        "plan here"
    )


def enable_async_tp(tp_group_name: GroupName) -> None:
    """Turn on torch's async TP for the TP process group ``tp_group_name``."""
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        # deprecated in torch 2.13, yet the micro-pipeline pass still asks
        # is_symm_mem_enabled_for_group, which only this sets
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_group_name)
    inductor_config._micro_pipeline_tp = True
