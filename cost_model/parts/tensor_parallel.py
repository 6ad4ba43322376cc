"""Tensor parallelism: the Megatron collectives of a unit's forward and backward (and those a
full recompute re-runs), and the modules TP wraps (their host time is `host.host_cost`'s).

Expects a unit, the strategy and the placements of its TP groups. Guarantees: per micro-batch
on one device; zero without tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.calibration import Calibration
from cost_model.communication import collective_time_s
from cost_model.hardware import Cluster
from cost_model.memory import activation_scale
from cost_model.parts.data_parallel import grad_reduce_bytes
from cost_model.parts.fp8 import scale_sync_s
from cost_model.strategy import GroupPlacement, Strategy
from cost_model.workload import UnitProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class TpCost:
    """TP collectives of one unit per micro-batch."""

    forward_s: float
    backward_s: float  # the backward's, and the forward's again when full recompute re-runs it


def tp_cost(
    unit: UnitProfile,
    strategy: Strategy,
    cluster: Cluster,
    traced_dtype_bytes: int,
    tp_groups: Sequence[GroupPlacement],
    recompute: str,
    *,
    shared_expert_whole: bool = False,
) -> TpCost:
    """The unit's TP collectives under ``recompute`` (the unit's own mode); with
    ``shared_expert_whole`` a MoE unit's shared expert runs whole on the rank's own tokens, its
    region without a collective (`CostModel.shared_expert_whole`)."""
    forward_s, backward_s = _tp_times(
        unit, strategy, cluster, traced_dtype_bytes, tp_groups, shared_expert_whole
    )
    # a tensor-wise fp8 recipe's amax all-reduces (`cost_model.parts.fp8`)
    sync_forward, sync_backward = scale_sync_s(unit, strategy, cluster, tp_groups)
    forward_s += sync_forward
    backward_s += sync_backward
    if recompute == "full":
        # Re-run the forward, its TP all-reduces included (Megatron recomputes through the
        # f/g operators), less those of the row-parallel linears an early stop skips.
        cal: Calibration = cluster.calibration
        backward_s += forward_s * (1.0 - cal.full_recompute_early_stop * tail_tp_share(unit))
    return TpCost(forward_s=forward_s, backward_s=backward_s)


def _tp_times(
    unit: UnitProfile,
    strategy: Strategy,
    cluster: Cluster,
    traced_dtype_bytes: int,
    tp_groups: Sequence[GroupPlacement],
    shared_expert_whole: bool,
) -> tuple[float, float]:
    if strategy.tp_degree == 1:
        return 0.0, 0.0
    n_fwd, n_bwd = tp_collective_counts(unit)
    size = _hidden_bytes_per_sample(unit) * activation_scale(strategy, traced_dtype_bytes)
    if shared_expert_whole and unit.moe is not None and unit.moe.shared_expert_params:
        # the shared expert runs whole on the rank's own tokens: its region has no collective
        # (passes/moe_sequence_parallel.py)
        n_fwd, n_bwd = max(0, n_fwd - 1), max(0, n_bwd - 1)
    if strategy.sequence_parallel:
        # Korthikanti et al. 2022, section 4.2.2: each all-reduce becomes a reduce-scatter and
        # an all-gather of the same buffer (same bytes, twice the latency).
        one = collective_time_s("reduce_scatter", size, tp_groups, cluster) + collective_time_s(
            "all_gather", size, tp_groups, cluster
        )
    else:
        one = collective_time_s("all_reduce", size, tp_groups, cluster)
    return n_fwd * one, n_bwd * one


def _hidden_bytes_per_sample(unit: UnitProfile) -> float:
    """The activation a TP collective of this unit moves: the hidden state (b, s, h)."""
    return unit.input_bytes if unit.kind == "head" else unit.output_bytes


def tp_collective_counts(unit: UnitProfile) -> tuple[int, int]:
    """(forward, backward) all-reduces a unit needs under Megatron tensor parallelism.

    Shoeybi et al. 2019, section 3 (f and g operators): every column...row region ends with an
    all-reduce in the forward (g) and starts with one in the backward (f): 2 + 2 per transformer
    layer. The vocab-parallel embedding all-reduces its output (forward); the vocab-parallel
    head's input needs the backward all-reduce.
    """
    linears = unit.tp.linears
    if linears:
        rows = sum(1 for lin in linears if lin.style == "row")
        embeds = sum(1 for lin in linears if lin.style == "vocab_embedding")
        heads = sum(1 for lin in linears if lin.style == "vocab_head")
        return rows + embeds, rows + heads
    rows = sum(1 for op in unit.ops if op.tp == "row" and op.kind == "matmul")
    vocab = sum(1 for op in unit.ops if op.tp == "vocab")
    if unit.kind == "head":
        return 0, max(rows, 1) if unit.num_params_tp_sharded else 0
    return rows + min(vocab, 1), rows


def tp_module_count(unit: UnitProfile, sequence_parallel: bool) -> int:
    """Modules tensor parallelism wraps in this unit: linears, embedding and head, and with
    sequence parallelism the norms too (they run on sequence-sharded distributed tensors)."""
    if unit.tp.linears:
        count = len(unit.tp.linears)
    else:
        count = sum(
            1 for op in unit.ops if op.tp in ("column", "row", "vocab") and op.param_bytes_read
        )
    if sequence_parallel:
        count += sum(1 for op in unit.ops if op.kind == "reduction" and op.param_bytes_read)
    return count


def tail_tp_share(unit: UnitProfile) -> float:
    """Share of the unit's forward TP collectives that follow ops in its recompute tail (one
    per row-parallel linear there)."""
    if not unit.recompute_skip_ops:
        return 0.0
    n_fwd, _ = tp_collective_counts(unit)
    tail = unit.ops[len(unit.ops) - unit.recompute_skip_ops :]
    rows = sum(1 for op in tail if op.tp == "row" and op.kind == "matmul")
    return min(1.0, rows / n_fwd) if n_fwd else 0.0


def replicated_grad_sum_s(
    unit: UnitProfile, strategy: Strategy, cluster: Cluster, tp_groups: Sequence[GroupPlacement]
) -> float:
    """Per step: the all-reduce over tp of the gradients of a MoE layer's router (hidden x
    experts) and shared expert when the layer runs on its TP rank's own sequence shard
    (autoplan's runtime under sequence parallelism, passes/moe_sequence_parallel.py):
    `ReplicatedGradientSum` runs it after the backward, on each rank's gradient shard (a
    data-parallel shard from ZeRO-1 on, `Strategy.runtime_zero_stage`). The routed experts'
    sum over tp is part of their data-parallel reduction (`Strategy.expert_dp_degree` spans
    tp then). Zero without a MoE layer, TP or SP."""
    moe = unit.moe
    if moe is None or strategy.tp_degree == 1 or not strategy.sequence_parallel:
        return 0.0
    params = float(moe.hidden_size * moe.num_experts + moe.shared_expert_params)
    weights = strategy.weights_view
    if weights.runtime_zero_stage >= 1:
        params /= weights.shard_degree
    size = params * grad_reduce_bytes(strategy)
    return collective_time_s("all_reduce", size, tp_groups, cluster)
