"""Pipeline parallelism, what it adds to the units' costs: the boundary after a stage (the
link time of its output, and back of its gradient; the host time of posting the message) and
the all-reduce of tied embedding gradients between the first and the last pipeline ranks.

The schedule itself (which rank runs what when) is `cost_model.schedules`'; the stage and rank
assembly is `cost_model.estimate`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cost_model.communication import collective_time_s, p2p_time_s
from cost_model.hardware import Cluster
from cost_model.parts.data_parallel import grad_reduce_bytes
from cost_model.strategy import GroupPlacement, Strategy, pipeline_link_crosses_nodes
from cost_model.workload import ModelProfile, UnitProfile


class Boundary(NamedTuple):
    """What the boundary after a stage costs per micro-batch (`boundary`)."""

    transfer_s: float  # link time of the output (and, back, of its gradient): delays the peer
    message_s: float  # host time to post one message (busy time of the sending rank)


def boundary(output_bytes: float, cluster: Cluster, strategy: Strategy, stage_idx: int) -> Boundary:
    """The boundary after stage ``stage_idx`` whose last unit sends ``output_bytes`` per device:
    the transfer to the next stage's pipeline rank and the schedule's host overhead per
    message. Zero for the last stage and between two stages on one rank (torch hands the
    tensor over locally)."""
    if stage_idx >= strategy.num_stages - 1:
        return Boundary(0.0, 0.0)
    here = strategy.pipeline_rank_of_stage(stage_idx)
    there = strategy.pipeline_rank_of_stage(stage_idx + 1)
    if here == there:
        return Boundary(0.0, 0.0)
    cross = pipeline_link_crosses_nodes(strategy, cluster, here, there)
    return Boundary(
        transfer_s=p2p_time_s(output_bytes, cluster, cross_node=cross),
        message_s=cluster.calibration.pp_message_overhead_s,
    )


def tied_pair_placement(strategy: Strategy, cluster: Cluster) -> GroupPlacement | None:
    """The two devices (the pipeline ranks of the first and the last stage) that share tied
    embedding weights; None when one rank holds both (one pipeline rank, or a V schedule)."""
    last_rank = strategy.pipeline_rank_of_stage(strategy.num_stages - 1)
    if last_rank == 0:
        return None
    first = strategy.global_rank(pp=0, dp=0, tp=0)
    last = strategy.global_rank(pp=last_rank, dp=0, tp=0)
    same = cluster.domain_of(first) == cluster.domain_of(last)
    return GroupPlacement(size=2, num_nodes=1 if same else 2, ranks_per_node=2 if same else 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class TiedGradSync:
    """The tied-gradient all-reduces charged to one unit, per step (no overlap)."""

    own_s: float  # of the unit's own tied parameters (the head's copy of the embedding)
    model_s: float  # of every tied parameter of the model, charged to unit 0


def tied_grad_sync(
    profile: ModelProfile,
    unit_idx: int,
    strategy: Strategy,
    cluster: Cluster,
    pair: GroupPlacement | None,
) -> TiedGradSync:
    """Tied embedding and head on the first and last pipeline ranks all-reduce the shared
    gradient (Megatron-LM's embedding group; Narayanan et al. 2021, sec. 2.2): the last rank's
    copy is charged to the unit that holds it, the first rank's to unit 0. ``pair``:
    `tied_pair_placement`. Zero with one pipeline rank or nothing tied."""
    own = model = 0.0
    if strategy.pp_degree > 1 and pair is not None:
        unit: UnitProfile = profile.units[unit_idx]
        if unit.num_params_shared:
            own = _all_reduce_s(unit.num_params_shared, strategy, cluster, pair)
        if unit_idx == 0:
            tied = sum(u.num_params_shared for u in profile.units)
            if tied:
                model = _all_reduce_s(tied, strategy, cluster, pair)
    return TiedGradSync(own_s=own, model_s=model)


def _all_reduce_s(
    num_params: int, strategy: Strategy, cluster: Cluster, pair: GroupPlacement
) -> float:
    shared = num_params / strategy.tp_degree * grad_reduce_bytes(strategy)
    return collective_time_s("all_reduce", shared, (pair,), cluster)
