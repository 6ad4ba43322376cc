"""Partial activation recompute: which of a stage's units its recompute mode covers.

A stage's ``recompute`` (selective or full) applies to its recomputable units (blocks,
`cost_model.strategy.RECOMPUTED_UNIT_KINDS`); ``recompute_units`` N limits it to the first N of
them in order, the others keep their activations (mode none). That is Megatron-LM's
``--recompute-granularity full --recompute-method block --recompute-num-layers N``, which
recomputes the first N layers of each pipeline stage (each virtual stage under interleaving:
``transformer_block.py``, ``_checkpointed_forward``, the ``block`` branch checkpoints layer ``l``
while ``l < recompute_num_layers``, counted from the chunk's first layer).

Expects the stage's units' kinds in order. Guarantees one definition of the recomputed units
that the estimate, the planner's partition, the runtime pass and the exporters share, and the
one-line refusals of a bad count (value, rule, fix).
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.degrees import MAX_COUNT, is_whole
from cost_model.messages import shown
from cost_model.strategy import RECOMPUTED_UNIT_KINDS

__all__ = [
    "block_method_count",
    "recompute_units_problem",
    "recomputed_mask",
    "stage_blocks",
    "stage_recompute_units_problem",
    "unit_modes",
]


def recompute_units_problem(mode: str, count: object) -> str | None:
    """Why ``recompute_units`` = ``count`` cannot go with ``recompute`` = ``mode`` in a stage,
    without the model (None: it can): a whole number >= 1, and only under selective or full."""
    if count is None:
        return None
    if not is_whole(count, None):
        return (
            f"recompute_units = {shown(count)} must be a whole number of blocks (or left out: "
            "all of the stage's blocks)"
        )
    if mode == "none":
        return (
            f"recompute_units = {count} with recompute 'none': the count says how many of the "
            "stage's blocks its recompute mode covers; set recompute to 'selective' or 'full', "
            "or leave recompute_units out"
        )
    if count < 1:
        return (
            f"recompute_units = {count} must be >= 1 (the first blocks of the stage are "
            "recomputed); for no recompute set recompute: none and leave recompute_units out"
        )
    if count > MAX_COUNT:
        return f"recompute_units = {count:,} is over {MAX_COUNT:,}; give the stage's block count"
    return None


def stage_recompute_units_problem(
    stage_idx: int, count: int | None, unit_kinds: Sequence[str]
) -> str | None:
    """Why stage ``stage_idx``'s ``recompute_units`` does not fit its units (kinds in order):
    at most its recomputable units (None: it fits)."""
    if count is None:
        return None
    blocks = sum(kind in RECOMPUTED_UNIT_KINDS for kind in unit_kinds)
    if count <= blocks:
        return None
    return (
        f"stages[{stage_idx}].recompute_units = {count}, but the stage holds {blocks} "
        f"recomputable unit(s) (blocks; the embedding and head are never recomputed); use at "
        f"most {blocks}, or leave recompute_units out to recompute all of them"
    )


def recomputed_mask(unit_kinds: Sequence[str], count: int | None) -> tuple[bool, ...]:
    """Per unit of a stage (kinds in order): whether the stage's recompute mode covers it: its
    recomputable units, only the first ``count`` of them when ``count`` is given."""
    out: list[bool] = []
    seen = 0
    for kind in unit_kinds:
        covered = kind in RECOMPUTED_UNIT_KINDS and (count is None or seen < count)
        seen += kind in RECOMPUTED_UNIT_KINDS
        out.append(covered)
    return tuple(out)


def unit_modes(mode: str, unit_kinds: Sequence[str], count: int | None) -> tuple[str, ...]:
    """Per unit of a stage: the recompute mode its costs are priced under: 'none' for the
    recomputable units past the first ``count``, the stage's ``mode`` for every other unit (a
    unit the mode does not apply to, the embedding or head, costs the same under any mode, so
    a stage without ``count`` is priced as before partial recompute)."""
    mask = recomputed_mask(unit_kinds, count)
    return tuple(
        "none" if kind in RECOMPUTED_UNIT_KINDS and not covered else mode
        for kind, covered in zip(unit_kinds, mask, strict=True)
    )


def stage_blocks(first_unit: int, last_unit: int, num_units: int) -> int:
    """Blocks of a stage holding units ``first_unit..last_unit`` of a traced Transformer's
    ``num_units`` (embedding, blocks, head): its units less the embedding and the head."""
    return last_unit - first_unit + 1 - (first_unit == 0) - (last_unit == num_units - 1)


def block_method_count(
    stages: Sequence[tuple[int, int, int | None]], num_units: int
) -> tuple[int | None, str | None]:
    """The one ``--recompute-num-layers`` N of Megatron-LM's block method that recomputes what
    stages (first unit, last unit, ``recompute_units``) state: each stage's first ``min(N,
    its blocks)`` blocks (`transformer_block.py`, ``_checkpointed_forward``: layer ``l`` of a
    chunk checkpointed while ``l < recompute_num_layers``). Returns (N, None), N None when no
    stage is partial, or (None, why) when no single N states them."""
    counts = [count for _, _, count in stages if count is not None]
    if not counts:
        return None, None
    n = max(counts)
    for idx, (first, last, count) in enumerate(stages):
        blocks = stage_blocks(first, last, num_units)
        stated = blocks if count is None else count
        if stated != min(n, blocks):
            return None, (
                f"stage {idx} recomputes {stated} of its {blocks} blocks where one "
                f"--recompute-num-layers {n} recomputes {min(n, blocks)}"
            )
    return n, None
