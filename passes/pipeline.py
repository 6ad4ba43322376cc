"""Pipeline pass: wrap this rank's stage modules in ``PipelineStage`` and pick torch's schedule.

Expects the data-parallel-wrapped module of every stage this pipeline rank runs, in stage order
(``plan.stages_of_pipeline_rank``: stage ``i`` on rank ``i % pp_degree`` under torch's "loop"
placement; under the V placement of ``zbv`` and ``dualpipev``, rank ``r`` holds stages ``r`` and
``2 pp_degree - 1 - r``), the ``pp`` sub-mesh and a loss function
``loss_fn(output, target) -> scalar`` with mean reduction.

Guarantees: one ``PipelineStage`` per local stage on the ``pp`` group (built here, not by
``pipeline()``'s ``build_stage``, which fails on gloo for the V schedules: a stage would send to
its own rank), and the torch class the plan's decisions name (`Plan.decisions.schedule_class`,
from the table of `cost_model.schedules`): ``gpipe`` -> ``ScheduleGPipe``, ``1f1b`` ->
``Schedule1F1B``, ``interleaved-1f1b`` -> ``ScheduleInterleaved1F1B``, ``interleaved-zb`` ->
``ScheduleInterleavedZeroBubble``, ``zbv`` -> ``ScheduleZBVZeroBubble``, ``dualpipev`` ->
``ScheduleDualPipeV``. The torch class places the stages itself (the V schedules overwrite each
stage's stage-to-rank map with torch's ``style="v"`` map); the stages given must be the ones the
plan places here, and the class's map must equal the plan's (both checked), so the first and
last stage ranks, the tied-weight groups and the cost model's simulation agree with what runs.
Under the V placement pipeline rank 0 holds both the first and the last stage (it feeds the
inputs and computes the loss), and rank ``pp_degree - 1`` holds the two middle stages (torch
hands their activations and gradients over locally).
The zero-bubble schedules split each backward into backward-input and backward-weight
(torch's ``stage_backward_input`` / ``stage_backward_weight``); the combinations that split
cannot run (ZeRO-3, activation recompute: `autoplan.contract.plan.split_backward_conflict`)
are refused.
``scale_grads=True``: with a mean loss per micro-batch the accumulated gradients equal the
whole batch's. With ``pp_degree == 1`` the single stage is both first and last (plain gradient
accumulation over the micro-batches, through the same schedule code).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _PipelineSchedule,
)

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan, split_backward_conflict
from passes.mesh import ParallelMesh

__all__ = ["SCHEDULE_CLASSES", "Pipeline", "build_pipeline"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The torch classes a plan's schedule may run as; which one is `Plan.decisions.schedule_class`.
SCHEDULE_CLASSES: dict[str, type[_PipelineSchedule]] = {
    cls.__name__: cls
    for cls in (
        ScheduleGPipe,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
        ScheduleDualPipeV,
    )
}


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
    # `Plan.validate` refuses these before any collective; a plan that skipped it stops here.
    conflict = split_backward_conflict(
        plan.schedule,
        plan.zero_stage,
        (stage.recompute for stage in plan.stages),
        compiled=plan.any_compiled,
    )
    if conflict is not None:
        raise PlanError(conflict)
    expected = plan.stages_of_pipeline_rank(mesh.pp_rank)
    if tuple(stage_indices) != expected:
        raise PlanError(
            f"pipeline rank {mesh.pp_rank} holds stages {list(stage_indices)}, the plan places "
            f"{list(expected)} there (schedule {plan.schedule!r}, "
            f"{plan.schedule_spec.placement} placement)"
        )
    group = mesh.sub("pp").get_group()
    stages = tuple(
        PipelineStage(module, idx, plan.num_stages, device, group=group)
        for module, idx in zip(modules, stage_indices, strict=True)
    )
    cls = SCHEDULE_CLASSES[plan.decisions.schedule_class]
    n = plan.num_micro_batches
    schedule: _PipelineSchedule
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise PlanError(
                f"schedule {plan.schedule!r} runs one stage per pipeline rank, this rank has "
                f"{len(stages)}; use 'interleaved-1f1b' for virtual stages"
            )
        schedule = cls(stages[0], n, loss_fn=loss_fn, scale_grads=True)
    else:
        assert issubclass(cls, PipelineScheduleMulti), cls
        schedule = cls(list(stages), n, loss_fn=loss_fn, scale_grads=True)
    _check_placement(stages, plan)
    return Pipeline(
        stages=stages,
        schedule=schedule,
        is_first=mesh.pp_rank == plan.pipeline_rank_of_stage(0),
        is_last=mesh.pp_rank == plan.pipeline_rank_of_stage(plan.num_stages - 1),
    )


def _check_placement(stages: Sequence[PipelineStage], plan: Plan) -> None:
    """Torch's stage-to-rank map (the one it sends by) equals the plan's placement."""
    for stage in stages:
        torch_map = dict(stage.stage_index_to_group_rank)
        plan_map = {s: plan.pipeline_rank_of_stage(s) for s in range(plan.num_stages)}
        assert torch_map == plan_map, (
            f"stage {stage.stage_index}: torch places stages {torch_map}, the plan {plan_map}"
        )
