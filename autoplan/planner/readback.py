"""The search's plans read back: a candidate and its stage partition as a `Plan`, and the
offered partitions ranked.

Expects partitions the search found, each of a `Candidate` (`candidates`). Guarantees: every
plan returned carries the cost model's own `estimate` of itself, checked to equal the solver's
simulated step and to fit; `ranked` orders them by objective, ties (`TIE_FRACTION`) by fewer
unvalidated features, then more memory left, then objective and visiting order.
"""

from __future__ import annotations

import math
from typing import Any

from autoplan.contract.plan import ModelRef, Plan, StagePlan, plan_estimate
from autoplan.planner.candidates import Candidate
from autoplan.planner.partition import Partition
from cost_model.activation_offload import offloadable_blocks
from cost_model.estimate import CostModel
from cost_model.memory import RECOMPUTABLE_KINDS
from cost_model.partial_recompute import unit_modes
from cost_model.uncertainty import TIE_FRACTION, step_interval, strategy_features
from cost_model.workload import ModelProfile


def ranked(
    model: CostModel,
    offered: dict[int, tuple[float, Candidate, Partition]],
    top_k: int,
    global_batch: int,
) -> tuple[Plan, ...]:
    """The ``top_k`` best of the offered plans: by objective, except that plans within
    `TIE_FRACTION` of the best tie and go first by fewer unvalidated features, then by more
    memory left at the upper end of their peak's range (then objective, then visiting order:
    deterministic)."""
    by_value = sorted(offered.items(), key=lambda item: (item[1][0], item[0]))
    best = by_value[0][1][0]
    tied = [item for item in by_value if item[1][0] <= best * (1.0 + TIE_FRACTION)]
    rest = by_value[len(tied) :][: max(0, top_k - len(tied))]

    def plan_at(item: tuple[int, tuple[float, Candidate, Partition]]) -> Plan:
        _, (_, candidate, partition) = item
        return to_plan(model, candidate, partition, global_batch)

    def tie_key(item: tuple[int, tuple[float, Candidate, Partition]]) -> Any:
        # from the partition's own numbers (no estimate per tied plan): its unvalidated
        # features, then the tensor bytes it leaves of its budget (the device bytes left
        # beyond the range's upper end, up to the factors every candidate shares)
        order, (value, candidate, partition) = item
        features = strategy_features(candidate.strategy, partition.modes, model.framework)
        room = candidate.usable_bytes - partition.peak_memory_bytes
        return (len(step_interval(features).unvalidated), -room, value, order)

    ties = sorted(tied, key=tie_key)[:top_k]
    return tuple(plan_at(item) for item in ties) + tuple(plan_at(item) for item in rest)


def plan_of(
    model: CostModel, candidate: Candidate, partition: Partition, global_batch: int
) -> Plan:
    """The plan of an outer choice with its stage cuts (no estimate attached)."""
    profile = model.profile
    s = candidate.strategy
    # the activation-offload twin's blocks (`CostModel.unit_costs`) stage by stage
    twin = s.activation_offload
    ends = (*partition.stage_starts[1:], profile.num_units)
    counts = partition.recompute_units or (None,) * len(partition.modes)
    stages = tuple(
        StagePlan(
            first_unit=a,
            last_unit=b - 1,
            recompute=mode,
            recompute_units=count,
            activation_offload=_twin_offload(profile, a, b, mode, count) if twin else 0,
        )
        for a, b, mode, count in zip(
            partition.stage_starts, ends, partition.modes, counts, strict=True
        )
    )
    plan = Plan(
        model=ModelRef.of(profile),
        dp_degree=s.dp_degree,
        tp_degree=s.tp_degree,
        pp_degree=s.pp_degree,
        cp_degree=s.cp_degree,
        ep_degree=s.ep_degree,
        ep_folding=s.ep_folding,
        etp_degree=s.etp_degree,
        virtual_stages=s.virtual_stages,
        stages=stages,
        micro_batch_size=s.micro_batch_size,
        num_micro_batches=s.num_micro_batches,
        global_batch_size=global_batch,
        schedule=s.schedule,
        zero_stage=s.zero_stage,
        dp_shard_degree=s.dp_shard_degree,
        sequence_parallel=s.sequence_parallel,
        tp_comm_overlap=s.tp_comm_overlap,
        dtype=s.dtype,  # type: ignore[arg-type]
        fp8_all_gather=s.fp8_all_gather,
        fp8_exclude=s.fp8_exclude,
        master_dtype=s.master_dtype,  # type: ignore[arg-type]
        grad_reduce_dtype=s.grad_reduce_dtype,  # type: ignore[arg-type]
        optimizer_state_dtype=s.optimizer_state_dtype,  # type: ignore[arg-type]
        compile=s.compile,
        optimizer_offload=s.optimizer_offload,
        rank_layout=s.rank_layout,
        framework=model.framework,
        memory_headroom=model.memory_headroom,
    )
    return plan


def _twin_offload(profile: ModelProfile, first: int, end: int, mode: str, count: int | None) -> int:
    """The ``activation_offload`` of stage ``first..end - 1`` under the activation-offload
    twin (`Strategy.activation_offload`): its blocks under recompute 'none', less the model's
    last block (never offloaded by the twin), the last of them when the stage holds it."""
    kinds = [unit.kind for unit in profile.units]
    last_block = max((u for u, kind in enumerate(kinds) if kind in RECOMPUTABLE_KINDS), default=-1)
    stage_kinds = kinds[first:end]
    free = offloadable_blocks(stage_kinds, unit_modes(mode, stage_kinds, count))
    return free - (first <= last_block < end and free > 0)


def to_plan(
    model: CostModel,
    candidate: Candidate,
    partition: Partition,
    global_batch: int,
) -> Plan:
    plan = plan_of(model, candidate, partition, global_batch)
    s = candidate.strategy
    result = model.estimate(plan)
    # The solver kept every rank within memory by the same numbers `require_fits` checks.
    assert result.fits, result.memory_problem()
    # The solver optimised the cost model's own simulation: the two must agree.
    assert math.isclose(result.step_time_s, partition.step_time_s, rel_tol=1e-6), (
        result.step_time_s,
        partition.step_time_s,
        s,
    )
    return plan.with_estimate(plan_estimate(result, model.cluster))
