"""Pipeline pass: wrap this rank's stage modules in ``PipelineStage`` and pick torch's schedule.

Expects the data-parallel-wrapped module of every stage this pipeline rank runs (stage ``i``
runs on pipeline rank ``i % pp_degree``: ``plan.stages_of_pipeline_rank``), the ``pp`` sub-mesh
and a loss function ``loss_fn(output, target) -> scalar`` with mean reduction.

Guarantees: one ``PipelineStage`` per local stage on the ``pp`` group (built here, not by
``pipeline()``'s ``build_stage``, which fails on gloo for some schedules), and the schedule the
plan names: ``gpipe`` -> ``ScheduleGPipe``, ``1f1b`` -> ``Schedule1F1B``, ``interleaved-1f1b``
-> ``ScheduleInterleaved1F1B`` (``virtual_stages`` stages per rank). ``scale_grads=True``: with
a mean loss per micro-batch the accumulated gradients equal the whole batch's. With
``pp_degree == 1`` the single stage is both first and last (plain gradient accumulation over
the micro-batches, through the same schedule code).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule

from autoplan.errors import PlanError
from autoplan.plan import Plan
from passes.mesh import ParallelMesh

__all__ = ["Pipeline", "build_pipeline"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Pipeline:
    """This rank's pipeline stages and the schedule that runs them."""

    stages: tuple[PipelineStage, ...]
    schedule: _PipelineSchedule
    is_first: bool  # holds stage 0: feeds the inputs
    is_last: bool  # holds the last stage: computes the loss


def build_pipeline(
    modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    plan: Plan,
    mesh: ParallelMesh,
    loss_fn: LossFn,
    device: torch.device,
) -> Pipeline:
    """Build the stages and the schedule for this pipeline rank."""
    expected = plan.stages_of_pipeline_rank(mesh.pp_rank)
    if tuple(stage_indices) != expected:
        raise PlanError(
            f"pipeline rank {mesh.pp_rank} holds stages {list(stage_indices)}, the plan places "
            f"{list(expected)} there (stage i on rank i % pp_degree)"
        )
    group = mesh.sub("pp").get_group()
    stages = tuple(
        PipelineStage(module, idx, plan.num_stages, device, group=group)
        for module, idx in zip(modules, stage_indices, strict=True)
    )
    n = plan.num_micro_batches
    schedule: _PipelineSchedule
    if plan.schedule == "interleaved-1f1b":
        schedule = ScheduleInterleaved1F1B(list(stages), n, loss_fn=loss_fn, scale_grads=True)
    elif len(stages) != 1:
        raise PlanError(
            f"schedule {plan.schedule!r} runs one stage per pipeline rank, this rank has "
            f"{len(stages)}; use 'interleaved-1f1b' for virtual stages"
        )
    elif plan.schedule == "gpipe":
        schedule = ScheduleGPipe(stages[0], n, loss_fn=loss_fn, scale_grads=True)
    else:
        schedule = Schedule1F1B(stages[0], n, loss_fn=loss_fn, scale_grads=True)
    last_rank = plan.pipeline_rank_of_stage(plan.num_stages - 1)
    return Pipeline(
        stages=stages,
        schedule=schedule,
        is_first=mesh.pp_rank == plan.pipeline_rank_of_stage(0),
        is_last=mesh.pp_rank == last_rank,
    )
