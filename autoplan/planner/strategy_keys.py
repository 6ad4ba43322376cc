"""Cache keys of the search's tables: projections of `Strategy` onto the fields a value reads.

Expects nothing. Guarantees: each `Projection` sorts every field of `Strategy` into the ones
its cached value reads (``reads``, or through ``derived`` values) and the ones it does not
(``ignores``), checked against `dataclasses.fields(Strategy)` when this module is imported: a
field added to `Strategy` stops the import until every cache says whether it reads it, so a
key cannot go stale by a field nobody listed. `tests/test_search.py` checks each ``ignores``
against the uncached values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from cost_model.strategy import Strategy

STRATEGY_FIELDS = frozenset(f.name for f in fields(Strategy))


@dataclass(frozen=True, slots=True)
class Projection:
    """The part of a `Strategy` one cached value depends on.

    ``reads``: fields or properties of `Strategy` the value reads, in key order; ``derived``:
    (name, function) of values computed from the strategy that the value reads in place of
    the fields behind them (e.g. ``pp_degree > 1``); ``ignores``: the fields the value does
    not read except through ``derived``. Every field must be in exactly one of ``reads`` and
    ``ignores``: a key cannot leave out what its value reads."""

    name: str
    reads: tuple[str, ...]
    ignores: frozenset[str]
    derived: tuple[tuple[str, Callable[[Strategy], object]], ...] = ()

    def __post_init__(self) -> None:
        read = STRATEGY_FIELDS & set(self.reads)
        both = read & self.ignores
        missing = STRATEGY_FIELDS - read - self.ignores
        unknown = self.ignores - STRATEGY_FIELDS
        if both or missing or unknown:
            raise TypeError(
                f"the cache key {self.name!r} must sort every Strategy field into one of reads "
                f"and ignores: both {sorted(both)}, none {sorted(missing)}, not fields "
                f"{sorted(unknown)}"
            )

    def key(self, strategy: Strategy, *extra: object) -> tuple[object, ...]:
        """The key of ``strategy`` (and ``extra``: what else the value reads, e.g. modes)."""
        return (
            *(getattr(strategy, name) for name in self.reads),
            *(function(strategy) for _, function in self.derived),
            *extra,
        )


def _pipelined(strategy: Strategy) -> bool:
    return strategy.pp_degree > 1


# The parameters a device holds of the whole model before any data-parallel sharding: the
# TP split, whether the tied embeddings count twice (on different pipeline ranks) and whether
# the shared expert runs whole (`CostModel.shared_expert_whole`).
PARAMS_KEY = Projection(
    "params",
    reads=("tp_degree", "sequence_parallel"),
    derived=(("pipelined", _pipelined),),
    # (``pipelined`` reads pp_degree)
    ignores=frozenset(
        {
            "dp_degree",
            "pp_degree",
            "virtual_stages",
            "micro_batch_size",
            "num_micro_batches",
            "schedule",
            "zero_stage",
            "dtype",
            "rank_layout",
            "cp_degree",
            "ep_degree",
            "ep_folding",
            # (the routed experts' parameters are counted apart, as ep's)
            "etp_degree",
            "fp8_all_gather",
            "fp8_exclude",
            # the precision policy: the bytes of each parameter, not how many
            "master_dtype",
            "grad_reduce_dtype",
            "optimizer_state_dtype",
            "compile",
            # the TP collectives' overlap moves no bytes it holds
            "tp_comm_overlap",
            "dp_shard_degree",
            # offload moves optimizer state, not parameters or activations
            "optimizer_offload",
            "activation_offload",
        }
    ),
)
# The activations of one micro-batch through every unit under the leanest mode (with the
# modes as an extra).
ACTIVATION_KEY = Projection(
    "least activations",
    reads=(
        "tp_degree",
        "sequence_parallel",
        "micro_batch_size",
        "cp_degree",
        "ep_degree",
        "etp_degree",
        "dtype",
        "fp8_exclude",
        # the offloaded blocks hold none on the device
        "activation_offload",
    ),
    ignores=frozenset(
        {
            "dp_degree",
            "pp_degree",
            "virtual_stages",
            "num_micro_batches",
            "schedule",
            "zero_stage",
            "rank_layout",
            "ep_folding",
            "fp8_all_gather",
            # activations are in the compute dtype whatever the precision policy
            "master_dtype",
            "grad_reduce_dtype",
            "optimizer_state_dtype",
            # torch.compile keeps what eager saves (`cost_model.parts.fusion`)
            "compile",
            "tp_comm_overlap",
            "dp_shard_degree",
            # offload moves optimizer state, not parameters or activations
            "optimizer_offload",
        }
    ),
)
# `BoundTables._state`: the state memory and the least activations (modes as an extra);
# ``dp_wrapper`` reads the schedule and the micro-batches (GPipe with several micro-batches
# runs no DDP).
STATE_KEY = Projection(
    "state memory",
    reads=(
        "tp_degree",
        "sequence_parallel",
        "micro_batch_size",
        "dtype",
        "pp_degree",
        "dp_degree",
        "zero_stage",
        "dp_wrapper",
        "cp_degree",
        "ep_degree",
        "ep_folding",
        "etp_degree",
        "fp8_all_gather",
        "fp8_exclude",
        # the bytes per parameter of master weights, gradients and AdamW states
        "master_dtype",
        "grad_reduce_dtype",
        "optimizer_state_dtype",
        # HSDP shards the state over its shard groups only
        "dp_shard_degree",
        # offload moves a share of the optimizer state to the host
        "optimizer_offload",
        # (the least activations read it)
        "activation_offload",
    ),
    ignores=frozenset(
        {
            "virtual_stages",
            "num_micro_batches",
            "schedule",
            "rank_layout",
            "compile",
            "tp_comm_overlap",
        }
    ),
)
# `BoundTables.floors`: the units' costs with one device per TP group (modes as an extra).
FLOOR_KEY = Projection(
    "compute floors",
    reads=(
        "tp_degree",
        "sequence_parallel",
        "micro_batch_size",
        "dtype",
        "cp_degree",
        "ep_degree",
        "ep_folding",
        "etp_degree",
        # the units' costs keep the strategy's rank order: an ep all-to-all or a cp ring is
        # priced on the links its layout gives it, so the order floor differs by layout
        "rank_layout",
        "fp8_all_gather",
        "fp8_exclude",
        # (a policy of the whole search: reading it splits no table)
        "master_dtype",
        "grad_reduce_dtype",
        "optimizer_state_dtype",
        "compile",
        # the TP collectives the units' costs expose (`cost_model.parts.tensor_parallel`)
        "tp_comm_overlap",
        # the optimizer step's host share (read so a floor never comes from a dearer step)
        "optimizer_offload",
        # the offloaded blocks' copies (read likewise)
        "activation_offload",
    ),
    ignores=frozenset(
        {
            "dp_degree",
            "pp_degree",
            "virtual_stages",
            "num_micro_batches",
            "schedule",
            "zero_stage",
            "dp_shard_degree",
        }
    ),
)
