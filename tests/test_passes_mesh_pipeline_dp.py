"""Mesh, data-parallel and pipeline passes: layouts, wrappers and schedules (fake process
groups: one process, no data moves)."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import cost_model.strategy as strategy_module
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import MeshAxis
from autoplan.tracing import trace
from cost_model.estimate import estimate
from cost_model.hardware import Cluster
from cost_model.strategy import Decisions, Strategy
from passes import (
    apply_data_parallel,
    apply_tensor_parallel,
    build_mesh,
    build_pipeline,
    split_stages,
)
from tests.dist_utils import fake_process_group
from tests.numerics import batch, build_model, loss_fn, make_plan


@pytest.mark.parametrize(
    "layout", [("pp", "dp", "tp"), ("dp", "pp", "tp"), ("tp", "dp", "pp")], ids="/".join
)
@pytest.mark.parametrize("rank", [0, 5])
def test_mesh_follows_the_plans_rank_layout(layout: tuple[MeshAxis, ...], rank: int) -> None:
    plan = make_plan(dp=2, tp=2, pp=2, rank_layout=layout)
    with fake_process_group(8, rank=rank):
        mesh = build_mesh(plan, "cpu")  # checks every group against plan.group_ranks
        assert mesh.mesh.mesh_dim_names == layout
        for axis in ("pp", "dp", "tp"):
            group = tuple(mesh.sub(axis).mesh.flatten().tolist())  # type: ignore[arg-type]
            assert group == plan.group_ranks(axis, rank)  # type: ignore[arg-type]
            assert group[getattr(mesh, f"{axis}_rank")] == rank


def test_mesh_for_another_world_size_is_refused() -> None:
    with fake_process_group(4), pytest.raises(PlanError, match="8 processes but the job has 4"):
        build_mesh(make_plan(dp=2, tp=2, pp=2), "cpu")


def _stage(plan_args: dict[str, object], world: int):  # type: ignore[no-untyped-def]
    plan = make_plan(**plan_args)  # type: ignore[arg-type]
    mesh = build_mesh(plan, "cpu")
    split = split_stages(
        trace(build_model("gpt")), plan, stage_indices=plan.stages_of_pipeline_rank(mesh.pp_rank)
    )
    for stage in split.stages:
        apply_tensor_parallel(
            stage,
            mesh.sub("tp"),
            sequence_parallel=False,
            shared=split.shared_in_stage[stage.stage_idx],
        )
    return plan, mesh, split


@pytest.mark.parametrize(("zero", "tp"), [(0, 2), (2, 1), (3, 1), (3, 2)])
def test_fsdp2_and_replicate_manage_every_parameter(zero: int, tp: int) -> None:
    with fake_process_group(2 * tp):
        plan, mesh, split = _stage({"dp": 2, "tp": tp, "zero": zero}, 2 * tp)
        (stage,) = split.stages
        result = apply_data_parallel(stage, mesh, plan)
        assert result.module is stage.module
        assert isinstance(stage.module, ReplicateModule if zero == 0 else FSDPModule)
        # Blocks are their own groups; the tied embedding and head share the stage's group.
        assert result.num_groups == 3
        kinds = {u.profile.kind: isinstance(stage.unit_module(u), FSDPModule) for u in stage.units}
        assert kinds == {"embedding": False, "block": True, "head": False}
        assert all(isinstance(p, DTensor) for p in stage.module.parameters())
        state = stage.module.unit_1._get_fsdp_state()  # type: ignore[operator]
        if zero == 3:  # parameters resharded after forward, gathered again for backward
            assert state._fsdp_param_group.post_forward_mesh_info is not None
        if zero == 2:  # kept until backward
            assert state._fsdp_param_group.post_forward_mesh_info is None


def test_wrapped_stages_return_no_views() -> None:
    # The head's replicated logits come from DTensor's to_local, a view; FSDP2 warns that an
    # in-place op on a view would drop its pre-backward hook. The pass hands out a copy.
    with fake_process_group(4):
        plan, mesh, split = _stage({"dp": 2, "tp": 2, "zero": 3}, 4)
        (stage,) = split.stages
        apply_data_parallel(stage, mesh, plan)
        inputs, _ = batch(plan.micro_batch_size)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*returned a view tensor")
            logits = stage.module(inputs)
        assert logits._base is None


def test_zero0_without_tp_is_ddp() -> None:
    with fake_process_group(2):
        plan, mesh, split = _stage({"dp": 2, "zero": 0}, 2)
        result = apply_data_parallel(split.stages[0], mesh, plan)
        assert isinstance(result.module, DistributedDataParallel)
        assert (result.kind, result.zero_stage) == ("ddp", 0)


def test_zero1_is_ddp_without_tp_and_fsdp_with_tp(caplog: pytest.LogCaptureFixture) -> None:
    with fake_process_group(2):
        plan, mesh, split = _stage({"dp": 2, "zero": 1}, 2)
        result = apply_data_parallel(split.stages[0], mesh, plan)
        assert isinstance(result.module, DistributedDataParallel)
        assert result.zero_stage == 1
    with fake_process_group(4), caplog.at_level(logging.INFO, logger="passes.data_parallel"):
        plan, mesh, split = _stage({"dp": 2, "tp": 2, "zero": 1}, 4)
        result = apply_data_parallel(split.stages[0], mesh, plan)
        assert result.kind == "fsdp" and result.zero_stage == 2
        assert "running FSDP2 without resharding after forward (ZeRO-2)" in caplog.text


@pytest.mark.parametrize(
    ("plan_args", "world"),
    [
        ({"dp": 2, "zero": 0}, 2),
        ({"dp": 2, "zero": 1}, 2),
        ({"dp": 2, "zero": 2}, 2),
        ({"dp": 2, "zero": 3}, 2),
        ({"dp": 2, "tp": 2, "zero": 0}, 4),
        ({"dp": 2, "tp": 2, "zero": 1}, 4),
        ({"dp": 2, "pp": 2, "zero": 0}, 4),
        ({"tp": 2}, 2),
    ],
)
def test_the_pass_and_the_cost_model_read_one_decision(
    plan_args: dict[str, int], world: int
) -> None:
    # The wrapper and the ZeRO stage the pass builds are what Plan.decisions says, and the cost
    # model prices the same decision (its memory model charges the wrapper it names).
    with fake_process_group(world):
        plan, mesh, split = _stage(plan_args, world)
        result = apply_data_parallel(split.stages[0], mesh, plan)
    decisions = plan.decisions
    assert result.kind == decisions.dp_wrapper
    if result.kind != "none":
        assert result.zero_stage == decisions.zero_stage
    strategy = Strategy.of(plan)
    assert (strategy.dp_wrapper, strategy.runtime_zero_stage) == (
        decisions.dp_wrapper,
        decisions.zero_stage,
    )
    assert isinstance(result.module, DistributedDataParallel) == (decisions.dp_wrapper == "ddp")


def test_changing_the_decision_changes_both_the_runtime_and_the_price(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both read `decide`: a different decision for a dp2 ZeRO-0 plan (DDP) -- FSDP2 ZeRO-3 --
    # makes the pass shard the parameters and the cost model price sharded state.
    plan = make_plan(dp=2, zero=0)
    graph = trace(build_model("gpt"))
    cluster = Cluster.local(num_devices=2)
    before = estimate(graph.profile, cluster, plan).peak_memory_bytes
    real = strategy_module.decide

    def sharded(strategy: Strategy) -> Decisions:
        return dataclasses.replace(real(strategy), dp_wrapper="fsdp", zero_stage=3)

    monkeypatch.setattr(strategy_module, "decide", sharded)
    assert plan.decisions.dp_wrapper == "fsdp"
    assert estimate(graph.profile, cluster, plan).peak_memory_bytes < before
    with fake_process_group(2):
        plan, mesh, split = _stage({"dp": 2, "zero": 0}, 2)
        result = apply_data_parallel(split.stages[0], mesh, plan)
    assert (result.kind, result.zero_stage) == ("fsdp", 3)
    assert isinstance(split.stages[0].module, FSDPModule)


def test_nothing_to_do_for_one_replica_in_fp32() -> None:
    with fake_process_group(2):
        plan, mesh, split = _stage({"tp": 2}, 2)
        result = apply_data_parallel(split.stages[0], mesh, plan)
        assert result.kind == "none" and not isinstance(split.stages[0].module, FSDPModule)


@pytest.mark.parametrize(
    ("plan_args", "schedule_type", "num_local"),
    [
        ({"pp": 2, "schedule": "gpipe"}, ScheduleGPipe, 1),
        ({"pp": 2, "schedule": "1f1b"}, Schedule1F1B, 1),
        (
            {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2, "num_micro_batches": 4},
            ScheduleInterleaved1F1B,
            2,
        ),
    ],
    ids=["gpipe", "1f1b", "interleaved-1f1b"],
)
def test_each_schedule_maps_to_torchs(
    plan_args: dict[str, object], schedule_type: type, num_local: int
) -> None:
    with fake_process_group(2, rank=1):
        plan, mesh, split = _stage(plan_args, 2)
        local = [s.stage_idx for s in split.stages]
        assert local == list(range(1, plan.num_stages, 2))  # stage i on pipeline rank i % pp
        pipeline = build_pipeline(
            [s.module for s in split.stages], local, plan, mesh, loss_fn, torch.device("cpu")
        )
        assert isinstance(pipeline.schedule, schedule_type)
        assert len(pipeline.stages) == num_local
        assert (pipeline.is_first, pipeline.is_last) == (False, True)


def test_stages_on_the_wrong_pipeline_rank_are_refused() -> None:
    with fake_process_group(2, rank=0):
        plan, mesh, split = _stage({"pp": 2}, 2)
        with pytest.raises(PlanError, match="holds stages \\[1\\], the plan places \\[0\\]"):
            build_pipeline([split.stages[0].module], [1], plan, mesh, loss_fn, torch.device("cpu"))
