"""How a training stack cuts a model into pipeline stages when nobody states the cut.

Expects a traced `ModelProfile` (units: an embedding, blocks, a head) and a number of stages.
Returns the first unit of each stage, or ``None`` where the stack's rule does not apply (the
caller keeps its own split); raises `StageSplitError` where the stack's cut falls inside one of
autoplan's units. A framework profile names its stack's rule (`FrameworkProfile.pipeline_split`):

- ``layers``: Megatron-LM's default (``megatron/core/transformer/transformer_block.py``,
  ``get_num_layers_to_build``): the blocks evenly over the stages, the embedding with the first
  and the head with the last; ``None`` when the stages do not divide the blocks (Megatron asserts
  that they do unless uneven first and last stages are given). Megatron-DeepSpeed's
  ``partition_method="type:transformer"`` balances the same layers (and, where they do not
  divide, one more or fewer a stage, which the caller's even split of the units stands in for).
- ``layers-with-edges``: Megatron-LM's ``--account-for-embedding-in-pipeline-split`` and
  ``--account-for-loss-in-pipeline-split``: the embedding and the loss each count as a layer,
  so the first and last stages hold one block fewer.
- ``nanotron``: nanotron's compute-balanced split (`nanotron_stage_starts`).
"""

from __future__ import annotations

from typing import Literal

from cost_model.workload import ModelProfile

PipelineSplit = Literal["layers", "layers-with-edges", "nanotron"]
PIPELINE_SPLITS: tuple[PipelineSplit, ...] = ("layers", "layers-with-edges", "nanotron")


class StageSplitError(ValueError):
    """The stack's cut falls where autoplan cannot cut (inside a unit), or leaves a stage
    empty."""


def stage_starts(
    profile: ModelProfile, num_stages: int, rule: PipelineSplit
) -> tuple[int, ...] | None:
    """The first unit of each of ``num_stages`` stages under ``rule`` (see the module)."""
    if rule == "nanotron":
        return nanotron_stage_starts(profile, num_stages)
    return megatron_stage_starts(profile, num_stages, edges_as_layers=rule == "layers-with-edges")


def own_stage_starts(
    profile: ModelProfile, num_stages: int, rule: PipelineSplit | None
) -> tuple[int, ...]:
    """The first unit of each stage of a stack that cuts its stages itself: ``rule``'s cut
    where it applies, else autoplan's even split of the units (`even_stage_starts`), which
    `autoplan.manual_plan` and the search build alike; `StageSplitError` where ``rule`` cuts
    inside a unit."""
    starts = stage_starts(profile, num_stages, rule) if rule is not None else None
    return starts if starts is not None else even_stage_starts(profile.num_units, num_stages)


def even_stage_starts(num_units: int, num_stages: int) -> tuple[int, ...]:
    """The first unit of each of autoplan's even stages: sizes differing by at most one, the
    larger first (`autoplan.contract.plan.even_stages`); `StageSplitError` for more stages
    than units."""
    if num_stages > num_units:
        raise StageSplitError(
            f"{num_stages} pipeline stages need at least {num_stages} units, the model has "
            f"{num_units}"
        )
    base, extra = divmod(num_units, num_stages)
    return tuple(s * base + min(s, extra) for s in range(num_stages))


def megatron_stage_starts(
    profile: ModelProfile, num_stages: int, *, edges_as_layers: bool = False
) -> tuple[int, ...] | None:
    """Megatron-LM's split: the blocks evenly, the embedding with the first stage and the head
    with the last; with ``edges_as_layers`` the embedding and the loss count as one layer
    each. ``None`` when the layers do not divide evenly or a first or last stage would hold no
    block."""
    blocks = [i for i, unit in enumerate(profile.units) if unit.kind == "block"]
    slots = len(blocks) + (2 if edges_as_layers else 0)
    if not blocks or slots % num_stages:
        return None
    per = slots // num_stages
    if edges_as_layers and per < 2 and num_stages > 1:
        return None
    shift = 1 if edges_as_layers else 0
    return (0, *(blocks[s * per - shift] for s in range(1, num_stages)))


def nanotron_stage_starts(profile: ModelProfile, num_stages: int) -> tuple[int, ...]:
    """nanotron's split: its pipeline blocks in module order, each on the current rank, which
    moves on to the next once the running compute cost exceeds that rank's share.

    From huggingface/nanotron at 67c5ebb6 (branch nouamane/bench2, 2024-12-27, the Ultra-Scale
    Playbook's benchmark stack; main has the same rule at 01de8d94, 2024-02, and at 2411b022,
    2026-04):

    - `build_model` (src/nanotron/models/base.py): with the cumulative cost ``c_i`` after block
      ``i`` and the total ``C``, block ``i`` goes to the current rank ``r`` (starting at 0), and
      ``r`` advances by one when ``c_i > C (r + 1) / pp`` (strictly; at most one rank a block);
    - `LlamaModel.get_block_compute_costs` (src/nanotron/models/llama.py): a decoder layer costs
      ``4 a (h // a) h + 3 f h`` (a heads, hidden h, ffn f), the lm_head ``V h``; every other
      block 0;
    - the pipeline blocks of `LlamaForTraining`, in module order: the embedding, the decoder
      layers, the final norm, the lm_head, the cast of the logits to fp32, the loss.

    autoplan's units are the embedding, the blocks and the head (final norm and lm_head; the
    loss is priced with the head): the last four nanotron blocks are the head's. The ffn size
    comes from a block's parameters (a Llama block: the attention projections, two norms and
    the three MLP matrices). Raises `StageSplitError` when nanotron would put the head's parts
    on two ranks (the 1.3B model on 8 stages puts the cast and the loss alone on the last rank)
    or leave a rank without a block, and for a model that is not a dense Llama.
    """
    h, a, v = profile.hidden_size, profile.num_heads, profile.vocab_size
    kinds = [unit.kind for unit in profile.units]
    blocks = [unit for unit in profile.units if unit.kind == "block"]
    if (
        a is None
        or v is None
        or not blocks
        or any(unit.moe is not None for unit in blocks)
        or set(kinds) != {"embedding", "block", "head"}
    ):
        raise StageSplitError(
            f"nanotron's pipeline split is defined for its dense Llama models (an embedding, "
            f"decoder layers and an lm_head); model {profile.name!r} has units {sorted(set(kinds))}"
        )
    d = round(profile.head_dim)
    kv = profile.num_kv_heads or a
    attention = 2 * h * a * d + 2 * h * kv * d
    mlp = blocks[0].num_params - attention - 2 * h
    if mlp <= 0 or mlp % (3 * h):
        raise StageSplitError(
            f"nanotron's pipeline split needs a Llama block (q, k, v, o, two norms, gate, up and "
            f"down without biases); model {profile.name!r} has {blocks[0].num_params} parameters "
            "a block"
        )
    f = mlp // (3 * h)
    decoder_cost = 4 * a * (h // a) * h + 3 * f * h
    costs: list[tuple[int, int]] = []  # (autoplan unit, nanotron block cost)
    for idx, kind in enumerate(kinds):
        if kind == "embedding":
            costs.append((idx, 0))
        elif kind == "block":
            costs.append((idx, decoder_cost))
        else:  # final norm, lm_head, fp32 cast, loss
            costs += [(idx, c) for c in (0, v * h, 0, 0)]

    total = sum(cost for _, cost in costs)
    ranks: dict[int, set[int]] = {}
    rank, cumulative = 0, 0
    for unit, cost in costs:
        ranks.setdefault(unit, set()).add(rank)
        cumulative += cost
        # nanotron's threshold, in floating point as it computes it: C * ((r + 1) / pp)
        if cumulative > total * ((rank + 1) / num_stages):
            rank += 1
    model = f"{len(blocks)} layers, hidden {h}, ffn {f}, vocab {v}"
    if split := [profile.units[u].name for u, on in ranks.items() if len(on) > 1]:
        raise StageSplitError(
            f"nanotron's split of {model} over {num_stages} stages puts parts of unit(s) "
            f"{split} on different ranks, a cut inside what autoplan prices as one unit"
        )
    firsts: dict[int, int] = {}
    for unit, (on,) in sorted(ranks.items()):
        firsts.setdefault(on, unit)
    if len(firsts) != num_stages:
        raise StageSplitError(
            f"nanotron's split of {model} over {num_stages} stages fills only {len(firsts)} "
            "ranks (nanotron refuses a rank without parameters)"
        )
    return tuple(firsts[s] for s in range(num_stages))
