"""Activation-recompute pass: checkpoint a stage's transformer blocks, as the plan says.

Expects a `StageModule` (each unit a real submodule ``unit_<idx>`` of the stage module) and the
stage's recompute mode from ``plan.stages[i].recompute``.

Guarantees:

- ``"full"``: every block unit is wrapped in ``checkpoint_wrapper`` (non-reentrant
  ``torch.utils.checkpoint``): only the block's inputs are kept; its forward runs again in
  backward (Chen et al. 2016);
- ``"selective"``: the same wrapper with a ``context_fn`` policy that saves the outputs of
  matrix multiplications, attention kernels and collectives and recomputes the cheap ops between
  them (norms, activations, softmax inputs, dropout, residual adds), after Korthikanti et al.
  2022, section 4.2;
- ``"none"``: nothing changes.
Embedding and head units are never checkpointed (as Megatron-LM and torchtitan). Gradients are
unchanged (RNG state is restored for recomputed dropout). The count of wrapped units equals the
stage's block count, checked.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autoplan.plan import Recompute
from passes.split import StageModule

__all__ = ["SAVED_OPS", "apply_recompute", "selective_policy"]


def _ops(*names: str) -> set[Any]:
    """The ATen/c10d overload packets that exist in this torch build, by ``namespace.op``."""
    found: set[Any] = set()
    for qualified in names:
        namespace, op = qualified.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.add(packet.default if hasattr(packet, "default") else packet)
    return found


# Outputs worth keeping: expensive to recompute (GEMMs, attention) or needing communication.
SAVED_OPS: frozenset[Any] = frozenset(
    _ops(
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "_c10d_functional.all_reduce",
        "_c10d_functional.reduce_scatter_tensor",
        "_c10d_functional.all_gather_into_tensor",
    )
)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save GEMM/attention/collective outputs; recompute everything else."""
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(selective_policy)  # type: ignore[no-untyped-call]


def apply_recompute(stage: StageModule, mode: Recompute) -> int:
    """Wrap ``stage``'s block units for ``mode`` in place; returns how many were wrapped."""
    if mode == "none":
        return 0
    wrap: Callable[[torch.nn.Module], torch.nn.Module]
    if mode == "full":
        wrap = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    elif mode == "selective":
        wrap = partial(
            checkpoint_wrapper,
            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            context_fn=_selective_context,
        )
    else:  # pragma: no cover - Plan validates the mode
        raise ValueError(f"unknown recompute mode {mode!r}")
    blocks = [unit for unit in stage.units if unit.profile.kind == "block"]
    for unit in blocks:
        setattr(stage.module, unit.attr, wrap(stage.unit_module(unit)))
    wrapped = sum(isinstance(stage.unit_module(unit), CheckpointWrapper) for unit in blocks)
    assert wrapped == len(blocks), f"stage {stage.stage_idx}: wrapped {wrapped}/{len(blocks)}"
    return wrapped
