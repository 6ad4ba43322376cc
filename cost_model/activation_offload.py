"""Activation offload's units: which of a stage's units keep their saved activations on the
host (`StagePlan.activation_offload` N: the first N blocks its recompute mode does not cover,
`cost_model.offload`), and the refusal of a count the stage cannot hold.

Expects the stage's units' kinds and the recompute mode each is priced under
(`cost_model.partial_recompute.unit_modes`). Guarantees one definition of the offloaded units
that the estimate, the planner's readback and the runtime pass share.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.strategy import RECOMPUTED_UNIT_KINDS

__all__ = ["offloadable_blocks", "offloaded_mask", "stage_activation_offload_problem"]


def offloadable_blocks(unit_kinds: Sequence[str], unit_modes: Sequence[str]) -> int:
    """The blocks of a stage that no recompute mode covers (mode 'none'): those it may
    offload."""
    return sum(
        kind in RECOMPUTED_UNIT_KINDS and mode == "none"
        for kind, mode in zip(unit_kinds, unit_modes, strict=True)
    )


def offloaded_mask(
    unit_kinds: Sequence[str], unit_modes: Sequence[str], count: int
) -> tuple[bool, ...]:
    """Per unit of a stage (kinds and the recompute mode each is priced under, in order):
    whether its saved activations are on the host: the first ``count`` blocks that no recompute
    mode covers (mode 'none')."""
    out: list[bool] = []
    taken = 0
    for kind, mode in zip(unit_kinds, unit_modes, strict=True):
        chosen = kind in RECOMPUTED_UNIT_KINDS and mode == "none" and taken < count
        taken += chosen
        out.append(chosen)
    return tuple(out)


def stage_activation_offload_problem(
    stage_idx: int, count: int, unit_kinds: Sequence[str], unit_modes: Sequence[str]
) -> str | None:
    """Why stage ``stage_idx``'s ``activation_offload`` does not fit its units (None: it fits):
    at most its blocks that its recompute does not cover."""
    free = offloadable_blocks(unit_kinds, unit_modes)
    if count <= free:
        return None
    return (
        f"stages[{stage_idx}].activation_offload = {count}, but the stage holds {free} "
        "block(s) its recompute does not cover (a recomputed block saves only its input; the "
        f"embedding and head are never offloaded); use at most {free}"
    )
