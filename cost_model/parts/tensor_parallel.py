"""Tensor parallelism: the Megatron collectives of a unit's forward and backward (and those a
full recompute re-runs), and the modules TP wraps (their host time is `host.host_cost`'s).

Expects a unit, the strategy and the placements of its TP groups. Guarantees: per micro-batch
on one device; zero without tensor parallelism. The collectives are on the critical path
(each all-reduce, or sequence-parallel all-gather and reduce-scatter, between the GEMMs that
need them), except under ``tp_comm_overlap`` with a stack that overlaps them
(`cost_model.tp_overlap`): a block's all-gathers and reduce-scatters then cost what their
stack's split leaves exposed beside the GEMMs they feed or follow (`overlapped_region_s`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.calibration import Calibration
from cost_model.communication import collective_time_s
from cost_model.hardware import Cluster
from cost_model.memory import activation_scale
from cost_model.parts.compute import op_cost
from cost_model.parts.data_parallel import grad_reduce_bytes
from cost_model.parts.fp8 import converted_ops, scale_sync_s
from cost_model.strategy import GroupPlacement, Strategy
from cost_model.tp_overlap import TpCommOverlap, exposed_s
from cost_model.workload import OpProfile, UnitProfile


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
    overlap: TpCommOverlap | None = None,
) -> TpCost:
    """The unit's TP collectives under ``recompute`` (the unit's own mode); with
    ``shared_expert_whole`` a MoE unit's shared expert runs whole on the rank's own tokens, its
    region without a collective (`CostModel.shared_expert_whole`); ``overlap``: the stack's
    overlap of them with the GEMMs, applied under ``strategy.tp_comm_overlap`` on a GPU."""
    forward_s, backward_s = _tp_times(
        unit, strategy, cluster, traced_dtype_bytes, tp_groups, shared_expert_whole
    )
    if overlap is not None and strategy.tp_comm_overlap and cluster.device.kind == "gpu":
        forward_s, backward_s = _overlapped_times(
            unit,
            strategy,
            cluster,
            traced_dtype_bytes,
            tp_groups,
            shared_expert_whole,
            overlap,
            (forward_s, backward_s),
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


def _overlapped_times(
    unit: UnitProfile,
    strategy: Strategy,
    cluster: Cluster,
    traced_dtype_bytes: int,
    tp_groups: Sequence[GroupPlacement],
    shared_expert_whole: bool,
    overlap: TpCommOverlap,
    plain: tuple[float, float],
) -> tuple[float, float]:
    """The forward and backward TP time of a block under the stack's ``overlap``: each
    column/row region's collectives priced beside its GEMMs (`overlapped_region_s`); the
    embedding's and the head's (no stack overlaps them: Megatron-LM's output layer is no
    Transformer Engine module, torchtitan compiles the blocks only) and any region the ops do
    not show stay as ``plain`` prices them."""
    if unit.kind != "block":
        return plain
    n_fwd, n_bwd = tp_collective_counts(unit)
    if shared_expert_whole and unit.moe is not None and unit.moe.shared_expert_params:
        n_fwd, n_bwd = max(0, n_fwd - 1), max(0, n_bwd - 1)
    # (a MoE layer's shared expert, whole on each rank, is its last region: the regions that
    # keep their collectives come first, the attention's)
    regions = tp_regions(unit)[: min(n_fwd, n_bwd)]
    if not regions:
        return plain
    size = _hidden_bytes_per_sample(unit) * activation_scale(strategy, traced_dtype_bytes)
    all_gather = collective_time_s("all_gather", size, tp_groups, cluster)
    reduce_scatter = collective_time_s("reduce_scatter", size, tp_groups, cluster)
    converted = {op.name for op in converted_ops(unit, strategy)}
    forward, backward = plain
    one = all_gather + reduce_scatter
    for columns, row in regions:
        gemms = _region_gemms(columns, row, cluster, strategy, traced_dtype_bytes, converted)
        region_forward, region_backward = overlapped_region_s(
            overlap, all_gather, reduce_scatter, gemms, strategy.tp_degree
        )
        forward += region_forward - one
        backward += region_backward - one
    return forward, backward


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionGemms:
    """The GEMMs of one column/row region on one device, per micro-batch: the column-parallel
    linears' forward, input-gradient and weight-gradient GEMMs, the row-parallel linear's
    forward and input-gradient GEMMs, and how many column-parallel linears there are."""

    num_columns: int = 1
    column_forward_s: float
    column_dgrad_s: float
    column_wgrad_s: float
    row_forward_s: float
    row_dgrad_s: float


def overlapped_region_s(
    overlap: TpCommOverlap,
    all_gather_s: float,
    reduce_scatter_s: float,
    gemms: RegionGemms,
    tp_degree: int,
) -> tuple[float, float]:
    """(forward, backward) time of one region's four sequence-parallel collectives beside
    their GEMMs (`cost_model.tp_overlap.exposed_s`): forward, the input's all-gather beside
    the column-parallel GEMMs it feeds and the output's reduce-scatter beside the row-parallel
    GEMM that makes it; backward, the output gradient's all-gather beside the row-parallel
    input-gradient GEMM and the input gradient's reduce-scatter beside the column-parallel
    input-gradient GEMMs (a ``bulk`` split: their weight-gradient GEMMs; none where the stack
    fuses it with one GEMM only and the region has several,
    `TpCommOverlap.backward_reduce_scatter_needs_one_gemm`)."""
    f = overlap.achieved_fraction
    forward = exposed_s(
        overlap.forward_all_gather, all_gather_s, gemms.column_forward_s, tp_degree, f
    ) + exposed_s(
        overlap.forward_reduce_scatter, reduce_scatter_s, gemms.row_forward_s, tp_degree, f
    )
    backward_rs = overlap.backward_reduce_scatter
    beside = gemms.column_wgrad_s if backward_rs.method == "bulk" else gemms.column_dgrad_s
    if overlap.backward_reduce_scatter_needs_one_gemm and gemms.num_columns > 1:
        beside = 0.0  # a sum of matmuls makes the input gradient: nothing fuses with it
    backward = exposed_s(
        overlap.backward_all_gather, all_gather_s, gemms.row_dgrad_s, tp_degree, f
    ) + exposed_s(backward_rs, reduce_scatter_s, beside, tp_degree, f)
    return forward, backward


def _region_gemms(
    columns: Sequence[OpProfile],
    row: OpProfile,
    cluster: Cluster,
    strategy: Strategy,
    traced_dtype_bytes: int,
    converted: set[str],
) -> RegionGemms:
    """The GEMM times of one region (`cost_model.parts.compute.op_cost`)."""
    column_forward = column_dgrad = column_wgrad = 0.0
    for op in columns:
        t = op_cost(op, cluster, strategy, traced_dtype_bytes, fp8=op.name in converted)
        column_forward += t.forward_s
        column_dgrad += t.backward_s - t.weight_backward_s
        column_wgrad += t.weight_backward_s
    r = op_cost(row, cluster, strategy, traced_dtype_bytes, fp8=row.name in converted)
    return RegionGemms(
        num_columns=len(columns),
        column_forward_s=column_forward,
        column_dgrad_s=column_dgrad,
        column_wgrad_s=column_wgrad,
        row_forward_s=r.forward_s,
        row_dgrad_s=r.backward_s - r.weight_backward_s,
    )


def tp_regions(unit: UnitProfile) -> list[tuple[tuple[OpProfile, ...], OpProfile]]:
    """The unit's column/row regions in op order: the column-parallel GEMMs since the last
    row-parallel one, and the row-parallel GEMM that closes them (Shoeybi et al. 2019,
    section 3: attention's q, k, v then its output projection; the MLP's up (and gate) then
    its down projection)."""
    regions: list[tuple[tuple[OpProfile, ...], OpProfile]] = []
    columns: list[OpProfile] = []
    for op in unit.ops:
        if op.kind != "matmul":
            continue
        if op.tp == "column":
            columns.append(op)
        elif op.tp == "row" and columns:
            regions.append((tuple(columns), op))
            columns = []
    return regions


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
