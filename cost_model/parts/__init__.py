"""The cost model's parts: one module per technique, each a few functions of plain data that
return a small frozen record for one unit (or one boundary). `cost_model.estimate.CostModel`
composes them into a `UnitCost` per unit.

- `compute`: forward, backward, the parts recompute re-runs, the loss after the head;
- `tensor_parallel`: Megatron TP collectives (and those full recompute re-runs);
- `context_parallel`: a unit on one cp rank, ring attention's exposed K/V exchanges;
- `expert_parallel`: routed experts' GEMMs at the per-expert token count, all-to-alls, routing
  imbalance, expert weights over ep;
- `data_parallel`: gradient sync, ZeRO-1/2 weight gathers, ZeRO-3 gathers and how much of
  them compute hides, the runtime's grouping of those collectives (DDP buckets, FSDP2 groups);
- `pipeline`: the boundary after a stage, tied-embedding gradient all-reduces;
- `optimizer`: the Adam step;
- `host`: the parallel wrappers' host time;
- `memory`: a unit's bytes (state after ZeRO, activations under recompute, working set);
- `core_sharing`: CPU workers sharing cores stretch what runs at once (identity on GPUs).
"""

from __future__ import annotations

from cost_model.parts.compute import ComputeTimes, LossCost, compute_times, loss_cost, recompute_s
from cost_model.parts.context_parallel import RingAttentionCost, local_unit, ring_attention_cost
from cost_model.parts.core_sharing import (
    SharingFactors,
    loop_overhead_s,
    oversubscription_factors,
    stretched,
)
from cost_model.parts.data_parallel import (
    DataParallelCost,
    DpSyncShare,
    data_parallel_cost,
    grad_reduce_bytes,
    grouped_dp_sync,
    per_unit_dp_groups,
    runs_ddp,
)
from cost_model.parts.expert_parallel import ExpertCost, expert_cost
from cost_model.parts.host import HostCost, host_cost
from cost_model.parts.memory import UnitBytes, unit_bytes
from cost_model.parts.optimizer import OptimizerCost, optimizer_cost
from cost_model.parts.pipeline import (
    Boundary,
    TiedGradSync,
    boundary,
    tied_grad_sync,
    tied_pair_placement,
)
from cost_model.parts.tensor_parallel import TpCost, tp_cost

__all__ = [
    "Boundary",
    "ComputeTimes",
    "DataParallelCost",
    "DpSyncShare",
    "ExpertCost",
    "HostCost",
    "LossCost",
    "OptimizerCost",
    "RingAttentionCost",
    "SharingFactors",
    "TiedGradSync",
    "TpCost",
    "UnitBytes",
    "boundary",
    "compute_times",
    "data_parallel_cost",
    "expert_cost",
    "grad_reduce_bytes",
    "grouped_dp_sync",
    "host_cost",
    "local_unit",
    "loop_overhead_s",
    "loss_cost",
    "optimizer_cost",
    "oversubscription_factors",
    "per_unit_dp_groups",
    "recompute_s",
    "ring_attention_cost",
    "runs_ddp",
    "stretched",
    "tied_grad_sync",
    "tied_pair_placement",
    "tp_cost",
    "unit_bytes",
]
