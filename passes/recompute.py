"""Activation-recompute pass: checkpoint a stage's transformer blocks, as the plan says.

Expects a `StageModule` (each unit a real submodule ``unit_<idx>`` of the stage module), the
stage's recompute mode from ``plan.stages[i].recompute`` and the plan's recompute policy
(`Plan.decisions.recompute`, the one the cost model prices).

Guarantees:

- ``"full"``: every unit of the policy's kinds (blocks, and the units of a model traced without
  blocks) is wrapped in ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``): only
  its inputs are kept; its forward runs again in backward (Chen et al. 2016);
- ``"selective"``: the same wrapper with a ``context_fn`` policy that saves the outputs of the op
  categories the policy keeps (matrix multiplications, attention kernels) and of collectives,
  and recomputes the cheap ops between them (norms, activations, softmax inputs, dropout,
  residual adds), after Korthikanti et al. 2022, section 4.2;
- ``"none"``: nothing changes;
- with the stage's ``recompute_units`` N, only its first N blocks are wrapped (the others keep
  their activations), the units `cost_model.partial_recompute.recomputed_mask` prices.
Embedding and head units are never checkpointed (as Megatron-LM and torchtitan). Gradients are
unchanged (RNG state is restored for recomputed dropout). The count of wrapped units equals the
stage's count of those units, checked.
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

from autoplan.contract.ops import is_collective, op_category
from autoplan.contract.plan import Recompute
from cost_model.strategy import RecomputePolicy
from passes.split import StageModule

__all__ = ["apply_recompute", "selective_policy"]


def selective_policy(recompute: RecomputePolicy) -> Callable[..., CheckpointPolicy]:
    """The checkpoint policy of ``recompute`` (`Plan.decisions.recompute`): keep the outputs of
    the op categories it saves (and of collectives), recompute the rest. Ops are categorised
    as the trace categorises them (`autoplan.contract.ops`), so the cost model prices what runs
    again."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op_category(op) in recompute.saved_kinds or (
            recompute.keeps_collectives and is_collective(op)
        ):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_recompute(
    stage: StageModule,
    mode: Recompute,
    recompute: RecomputePolicy,
    recompute_units: int | None = None,
) -> int:
    """Wrap ``stage``'s units of the kinds ``recompute`` names for ``mode`` in place, only the
    first ``recompute_units`` of them when given (the plan's ``stages[i].recompute_units``,
    Megatron-LM's block method); returns how many were wrapped."""
    if mode == "none":
        return 0
    wrap: Callable[[torch.nn.Module], torch.nn.Module]
    if mode == "full":
        wrap = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    elif mode == "selective":
        policy = selective_policy(recompute)
        wrap = partial(
            checkpoint_wrapper,
            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            context_fn=lambda: create_selective_checkpoint_contexts(policy),  # type: ignore[no-untyped-call]
        )
    else:  # pragma: no cover - Plan validates the mode
        raise ValueError(f"unknown recompute mode {mode!r}")
    blocks = [unit for unit in stage.units if unit.profile.kind in recompute.unit_kinds]
    # partial recompute: the first ``recompute_units`` blocks, as the cost model prices them
    # (`cost_model.partial_recompute.recomputed_mask`); the others keep their activations
    blocks = blocks[:recompute_units] if recompute_units is not None else blocks
    for unit in blocks:
        setattr(stage.module, unit.attr, wrap(stage.unit_module(unit)))
    wrapped = sum(isinstance(stage.unit_module(unit), CheckpointWrapper) for unit in blocks)
    assert wrapped == len(blocks), f"stage {stage.stage_idx}: wrapped {wrapped}/{len(blocks)}"
    return wrapped
