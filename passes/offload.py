"""Activation-offload pass: keep the saved activations of a stage's first blocks in host memory,
as the plan says (`StagePlan.activation_offload`).

Expects a `StageModule` after `apply_recompute` (its checkpointed blocks wrapped), the stage's
``activation_offload`` N and the plan's recompute policy (which unit kinds are blocks), and a
CUDA device: on a CPU worker the device is the host, so nothing would move (the plan's host-link
rule refuses such a plan before any pass runs: `cost_model.offload.host_link_problem`).

Guarantees: the first N blocks not checkpointed (the units `cost_model.activation_offload.
offloaded_mask` prices) run their forward under ``torch.autograd.graph.save_on_cpu(pin_memory=
True)``: every tensor autograd saves for their backward is copied into pinned host memory as it
is saved and back to the device when the backward unpacks it, on the compute stream (the
"blocking" offload `cost_model.parts.offload.offloaded_unit_cost` prices). Gradients are
unchanged (the copies are exact). The count of wrapped blocks equals N, checked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from cost_model.strategy import RecomputePolicy
from passes.split import StageModule

__all__ = ["OffloadWrapper", "apply_activation_offload"]


class OffloadWrapper(nn.Module):
    """``module`` whose forward saves its tensors for backward in pinned host memory."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # (the saved weights move too: save_on_cpu packs every saved tensor)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return self.module(*args, **kwargs)


def apply_activation_offload(
    stage: StageModule, count: int, recompute: RecomputePolicy, device: torch.device
) -> int:
    """Wrap the first ``count`` of ``stage``'s blocks that no recompute covers in
    `OffloadWrapper`, in place; returns how many were wrapped."""
    if count <= 0:
        return 0
    if device.type != "cuda":
        raise RuntimeError(
            f"activation offload of {count} block(s) on device {device}: save_on_cpu moves "
            "saved tensors to the host, which a CPU worker already is; it runs on CUDA devices"
        )
    blocks = [
        unit
        for unit in stage.units
        if unit.profile.kind in recompute.unit_kinds
        and not isinstance(stage.unit_module(unit), CheckpointWrapper)
    ][:count]
    for unit in blocks:
        setattr(stage.module, unit.attr, OffloadWrapper(stage.unit_module(unit)))
    wrapped = sum(isinstance(stage.unit_module(unit), OffloadWrapper) for unit in blocks)
    assert wrapped == count, f"stage {stage.stage_idx}: offloaded {wrapped}/{count} blocks"
    return wrapped
