"""Memory: the bytes one unit puts on its device: weights, gradients and optimizer state after
ZeRO sharding, the activations each in-flight micro-batch holds under the unit's recompute
mode, its backward working set, and the tensor it sends to the next stage.

The formulas are `cost_model.memory`'s; a rank's total at the schedule's peak is
`cost_model.rank_memory`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.memory import (
    RECOMPUTABLE_KINDS,
    TRACED_ACTIVATIONS,
    StackActivations,
    activation_bytes,
    activation_scale,
    static_bytes,
    weight_grad_input_bytes,
    working_bytes,
)
from cost_model.strategy import Strategy
from cost_model.workload import UnitProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitBytes:
    """One unit's bytes on one device (see `cost_model.unit_cost.UnitCost` for each)."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    loss_bytes: float
    retained_bytes: float
    working_bytes: float
    extra_bytes: float
    output_bytes: float


def offloaded_master_bytes(local_params: float, strategy: Strategy) -> float:
    """The master weights optimizer offload moves to the host where `static_bytes` counts them
    with the weights (under FSDP-style accounting: the master shard is the parameter; elsewhere
    the master copy is optimizer state, moved with it): ``optimizer_offload`` of the master
    shard when it is a copy of the working weights."""
    share, policy = strategy.optimizer_offload, strategy.precision
    if share <= 0.0 or strategy.dp_wrapper not in ("fsdp", "replicate") or not policy.master_copy:
        return 0.0
    shard = strategy.shard_degree if strategy.dp_wrapper == "fsdp" else 1
    return share * local_params * policy.master_bytes / shard


def unit_bytes(
    unit: UnitProfile,
    strategy: Strategy,
    recompute: str,
    traced_dtype_bytes: int,
    *,
    local_params: float,
    loss_saved_bytes: float,
    stack: StackActivations = TRACED_ACTIVATIONS,
    fp8_params: float = 0.0,
    fp8_transient_bytes: float = 0.0,
    cached_fp8_weights: bool = False,
) -> UnitBytes:
    """The bytes of ``unit`` under ``recompute`` (its own mode), whose device stores
    ``local_params`` parameters before data-parallel sharding; ``loss_saved_bytes``: what the
    loss after it keeps for the backward (`cost_model.parts.compute.loss_cost`); ``stack``:
    what the training stack saves beyond the trace (`cost_model.memory.StackActivations`).

    Under an fp8 recipe, of ``local_params`` the ``fp8_params`` are converted linears' weights
    (`cost_model.parts.fp8`): with ``Strategy.fp8_all_gather`` FSDP2 keeps their unsharded
    copies in fp8 (ZeRO-1/2 keep them for the step); ``cached_fp8_weights`` (Transformer
    Engine) keeps an fp8 copy and its transpose of each for the step, or with fp8 all-gather
    (fp8 parameters) the fp8 weight and its transpose in place of the bf16 one; a cast's transient
    (``fp8_transient_bytes``) joins the backward's working set."""
    state = static_bytes(
        local_params,
        strategy.dtype,
        strategy.runtime_zero_stage,
        # ZeRO shards over dp, or under HSDP over a shard group (`Strategy.shard_degree`)
        strategy.shard_degree,
        strategy.dp_wrapper,
        policy=strategy.precision,
    )
    param_bytes = state.param_bytes - offloaded_master_bytes(local_params, strategy)
    if cached_fp8_weights:
        # Transformer Engine keeps an fp8 copy of each converted weight and its transpose
        # beside the bf16 one; with fp8 parameters (Megatron-LM's --fp8-param-gather: TE's
        # Float8Tensor weights) those two bytes replace the bf16 copy's two
        param_bytes += 0.0 if strategy.fp8_all_gather else 2.0 * fp8_params
    elif (
        strategy.fp8_all_gather
        and strategy.dp_wrapper == "fsdp"
        and strategy.runtime_zero_stage < 3
    ):
        param_bytes -= fp8_params * (strategy.dtype_bytes - 1)
    scale = activation_scale(strategy, traced_dtype_bytes)
    boundary_div = strategy.tp_degree if strategy.sequence_parallel else 1
    held = activation_bytes(unit, strategy, recompute, traced_dtype_bytes, stack) + loss_saved_bytes
    working = (
        working_bytes(unit, strategy, traced_dtype_bytes, stack)
        + loss_saved_bytes
        + fp8_transient_bytes
    )
    # what a split backward keeps from its input half to its weight half: the traced saved
    # tensors and the GEMMs' output gradients; an unfused core's scores and the dropout masks
    # serve the input gradient only, freed by then
    retained = (
        activation_bytes(unit, strategy, "none", traced_dtype_bytes)
        + weight_grad_input_bytes(unit, strategy, traced_dtype_bytes)
        + loss_saved_bytes
    )
    return UnitBytes(
        param_bytes=param_bytes,
        grad_bytes=state.grad_bytes,
        # under optimizer offload that share of the master copy and moments is on the host
        optimizer_bytes=state.optimizer_bytes * (1.0 - strategy.optimizer_offload),
        activation_bytes=held,
        loss_bytes=loss_saved_bytes,
        retained_bytes=retained,
        working_bytes=working,
        # the embedding's and head's working sets travel with those units
        extra_bytes=0.0 if unit.kind in RECOMPUTABLE_KINDS else working,
        output_bytes=unit.output_bytes * scale / boundary_div,
    )
