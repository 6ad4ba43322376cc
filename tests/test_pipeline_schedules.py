"""Every pipeline schedule the runtime builds, against a single-process reference, on CPU/gloo.

Each numerics case trains a tiny GPT (tied embedding and head, one pipeline unit per stage) for
3 AdamW steps with `autoplan.parallelize` under a hand-written plan and checks the loss on every
rank and every gradient against the same weights trained in one process (tolerances:
tests/numerics.py). The zero-bubble schedules split each backward into backward-input and
backward-weight; ``zbv`` and ``dualpipev`` also place the stages in a V, so pipeline rank 0
holds the first *and* the last stage: it feeds the inputs, computes the loss and holds both
copies of the tied weight (their gradients are summed locally, with no process group).

``gpipe``, ``1f1b`` and ``interleaved-1f1b`` on two processes are covered by
tests/test_parallelize_numerics.py; here they also run on four pipeline ranks. The combinations
the runtime refuses under a split backward (ZeRO-3, activation recompute) are checked to be
refused, before any collective.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan, split_backward_conflict
from autoplan.tracing import trace
from cost_model.hardware import Cluster
from cost_model.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    TORCH_SCHEDULE_CLASSES,
    ScheduleSpec,
    pipeline_order,
)
from passes import build_mesh, build_pipeline, split_stages
from passes.pipeline import SCHEDULE_CLASSES
from tests.dist_utils import fake_process_group, run_distributed
from tests.numerics import (
    STEPS,
    assert_matches,
    batch,
    build_model,
    full_grads,
    loss_fn,
    make_plan,
    optimizer_factory,
    reference,
    train_worker,
)
from tests.test_parallelize_runtime import bad_plan_worker

# Two stages per rank, and 4 micro-batches: torch's interleaved rule (m % max(1, m // pp) == 0)
# holds for pp 2 and 4, and dualpipev's (m >= 2 pp) for pp 2.
_V2 = {"virtual_stages": 2, "num_micro_batches": 4}


def _num_blocks(plan_args: dict[str, Any]) -> int:
    """One unit per stage: embedding, blocks, head."""
    return max(plan_args.get("pp", 1) * plan_args.get("virtual_stages", 1) - 2, 1)


def _plan(plan_args: dict[str, Any]) -> Plan:
    return make_plan(num_units=_num_blocks(plan_args) + 2, **plan_args)


def _run(tmp_path: Path, plan: Plan) -> list[list[tuple[float, dict[str, torch.Tensor]]]]:
    num_blocks = plan.num_units - 2
    results: list[list[tuple[float, dict[str, torch.Tensor]]]] = run_distributed(
        train_worker,
        "gpt",
        plan.to_data(),
        STEPS,
        num_blocks,
        world_size=plan.num_devices,
        tmp_path=tmp_path,
    )
    return results


# ----------------------------------------------------------------------------- numerics

# name: plan arguments (fp32; processes = pp x dp x tp).
CASES: dict[str, dict[str, Any]] = {
    "pp2-interleaved-zb": {"pp": 2, "schedule": "interleaved-zb", **_V2},
    "pp2-zbv": {"pp": 2, "schedule": "zbv", **_V2},
    "pp2-dualpipev": {"pp": 2, "schedule": "dualpipev", **_V2},
    "pp4-interleaved-zb": {"pp": 4, "schedule": "interleaved-zb", **_V2},
    "pp4-zbv": {"pp": 4, "schedule": "zbv", **_V2},
    "pp4-dualpipev": {
        "pp": 4,
        "schedule": "dualpipev",
        "virtual_stages": 2,
        "num_micro_batches": 8,
    },
    "pp4-gpipe": {"pp": 4, "schedule": "gpipe", "num_micro_batches": 2},
    "pp4-1f1b": {"pp": 4, "schedule": "1f1b", "num_micro_batches": 4},
    "pp4-interleaved-1f1b": {"pp": 4, "schedule": "interleaved-1f1b", **_V2},
    # Data parallel under a split backward: FSDP2's replicate (ZeRO-0) and fully_shard without
    # resharding after forward (ZeRO-2); each replica's pipeline on its own pp group.
    "pp2xdp2-interleaved-zb": {"pp": 2, "dp": 2, "schedule": "interleaved-zb", **_V2},
    "pp2xdp2-zbv": {"pp": 2, "dp": 2, "schedule": "zbv", **_V2},
    "pp2xdp2-dualpipev-zero2": {"pp": 2, "dp": 2, "schedule": "dualpipev", "zero": 2, **_V2},
    # Pipeline neighbours adjacent, replicas apart: the V's rank 0 is global ranks 0 and 2.
    "dp2xpp2-layout-zbv-zero2": {
        "pp": 2,
        "dp": 2,
        "schedule": "zbv",
        "zero": 2,
        "rank_layout": ("dp", "pp", "tp"),
        **_V2,
    },
    "pp2xtp2-zbv-sp": {"pp": 2, "tp": 2, "schedule": "zbv", "sequence_parallel": True, **_V2},
    # One pipeline rank, fp32, ZeRO-0: DDP's reducer refuses GPipe's forwards before backwards
    # (an internal assert), so the runtime uses FSDP2's replicate there (bench/runtime.py
    # found it).
    "dp2-gpipe-m2": {"dp": 2, "schedule": "gpipe", "num_micro_batches": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_schedule_matches_one_process(case: str, tmp_path: Path) -> None:
    plan = _plan(CASES[case])
    expected = reference(
        "", plan.global_batch_size, model=build_model("gpt", num_blocks=plan.num_units - 2)
    )
    assert_matches(_run(tmp_path, plan), expected)


@pytest.mark.slow
def test_split_backward_in_bf16_matches_interleaved_1f1b(tmp_path: Path) -> None:
    """bf16 (FSDP2's mixed-precision policy around every stage, gradients reduced in fp32):
    ``zbv``'s gradients against ``interleaved-1f1b``'s on the same stages and micro-batches.

    Both run the same bf16 forward and backward kernels per micro-batch; they differ in the
    order the micro-batch gradients are summed and in backward-weight's separate
    ``autograd.grad`` call, so a gradient may differ by a few bf16 roundings (eps 2^-8 = 0.4%):
    measured at most 0.3% of a tensor's norm. Wrong weight gradients (the ZeRO-3 failure) are
    off by tens of percent.
    """
    base = _plan({"pp": 2, "schedule": "interleaved-1f1b", **_V2})
    base = dataclasses.replace(base, dtype="bf16")
    grads = {}
    for schedule in ("interleaved-1f1b", "zbv"):
        results = _run(tmp_path, dataclasses.replace(base, schedule=schedule))
        grads[schedule] = {name: g for records in results for name, g in records[0][1].items()}
    assert grads["zbv"].keys() == grads["interleaved-1f1b"].keys()
    for name, grad in grads["zbv"].items():
        expected = grads["interleaved-1f1b"][name]
        assert grad.dtype == torch.float32
        error = ((grad - expected).norm() / expected.norm()).item()
        assert error < 1e-2, f"{name}: relative difference {error:.2e}"


# ----------------------------------------------------------------------------- runtime paths


def meta_worker(
    rank: int, world_size: int, plan_data: dict[str, Any]
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    model = build_model("gpt", num_blocks=plan.num_units - 2, device="meta")
    dist_model = parallelize(model, plan=plan, loss_fn=loss_fn, optimizer=optimizer_factory())
    records = []
    for step in range(STEPS):
        loss = dist_model.train_step(*batch(plan.global_batch_size, step))
        records.append((float(loss), full_grads(dist_model.named_parameters())))
    return records


@pytest.mark.slow
def test_meta_model_in_a_v_initialises_both_tied_copies_alike(tmp_path: Path) -> None:
    """The zoo builds on meta: rank 0 materialises stage 0 (the embedding) and stage 3 (the
    head tied to it) on its own; the copies must start equal and stay equal (checked through
    the gradients: an untied head would give other losses and head gradients)."""
    from passes import init_full_model_
    from tests.numerics import row_paths

    plan = _plan({"pp": 2, "schedule": "zbv", **_V2})
    results = run_distributed(meta_worker, plan.to_data(), world_size=2, tmp_path=tmp_path)
    model = build_model("gpt", num_blocks=plan.num_units - 2)
    rows, num_blocks = row_paths(model)
    init_full_model_(model, seed=0, row_paths=rows, num_blocks=num_blocks)
    assert_matches(results, reference("", plan.global_batch_size, model=model))


# ----------------------------------------------------------------------------- placement


@pytest.mark.parametrize(
    ("schedule", "rank", "local", "first_last"),
    [
        ("zbv", 0, (0, 3), (True, True)),
        ("zbv", 1, (1, 2), (False, False)),
        ("dualpipev", 0, (0, 3), (True, True)),
        ("interleaved-zb", 0, (0, 2), (True, False)),
        ("interleaved-zb", 1, (1, 3), (False, True)),
    ],
)
def test_stages_are_placed_where_torchs_schedule_sends(
    schedule: str, rank: int, local: tuple[int, ...], first_last: tuple[bool, bool]
) -> None:
    plan = make_plan(pp=2, schedule=schedule, **_V2)  # type: ignore[arg-type]
    with fake_process_group(2, rank=rank):
        mesh = build_mesh(plan, "cpu")
        stage_indices = plan.stages_of_pipeline_rank(mesh.pp_rank)
        assert stage_indices == local
        split = split_stages(
            trace(build_model("gpt", num_blocks=2)), plan, stage_indices=stage_indices
        )
        pipeline = build_pipeline(
            [s.module for s in split.stages], local, plan, mesh, loss_fn, torch.device("cpu")
        )
        # the class the plan's decisions name, the one the cost model simulates
        assert type(pipeline.schedule).__name__ == plan.decisions.schedule_class
        assert plan.decisions.schedule_class == TORCH_SCHEDULE_CLASSES[plan.schedule]
        assert (pipeline.is_first, pipeline.is_last) == first_last
        for stage in pipeline.stages:  # the map torch sends by is the plan's
            assert stage.stage_index_to_group_rank == {
                s: plan.pipeline_rank_of_stage(s) for s in range(plan.num_stages)
            }


def test_runtime_classes_are_the_cost_models() -> None:
    """The runtime can build the class whose order the cost model simulates, for every schedule."""
    assert set(SCHEDULE_CLASSES) == set(TORCH_SCHEDULE_CLASSES.values())
    assert set(TORCH_SCHEDULE_CLASSES) == set(SCHEDULES)


# ----------------------------------------------------------------------------- refused


@pytest.mark.parametrize("schedule", sorted(SPLIT_BACKWARD))
def test_split_backward_refuses_zero3_and_recompute(schedule: str) -> None:
    cluster = Cluster.local(num_devices=4)
    args = {"pp": 2, "dp": 2, "schedule": schedule, **_V2}
    make_plan(**args).validate(None, cluster)  # ZeRO-0, no recompute: runs
    make_plan(zero=2, **args).validate(None, cluster)
    with pytest.raises(PlanError, match=r"zero_stage = 3 .* use zero_stage 2"):
        make_plan(zero=3, **args).validate(None, cluster)
    for mode in ("selective", "full"):
        with pytest.raises(PlanError, match=rf"recompute = '{mode}' .* set recompute 'none'"):
            make_plan(recompute=mode, **args).validate(None, cluster)  # type: ignore[arg-type]


def test_schedules_without_split_backward_keep_zero3_and_recompute() -> None:
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert split_backward_conflict(schedule, 3, ["selective", "full"]) is None  # type: ignore[arg-type]


@pytest.mark.slow
def test_refused_plan_fails_on_every_rank(tmp_path: Path) -> None:
    plan = make_plan(pp=2, schedule="zbv", zero=3, **_V2)
    messages = run_distributed(
        bad_plan_worker, "gpt", plan.to_data(), world_size=2, tmp_path=tmp_path, timeout_s=60
    )
    for message in messages:
        assert "zero_stage = 3 with schedule 'zbv'" in message, message


# ----------------------------------------------------------------------------- orders


def order_worker(
    rank: int, world_size: int, num_blocks: int, plan_data: dict[str, Any]
) -> tuple[int, list[tuple[int, str, int]]]:
    """One training step under autoplan's runtime, recording every compute action torch's
    schedule runs on this rank, in order: (stage, F / B / I / W, micro-batch)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from autoplan.runtime.parallelizer import parallelize

    ran: list[tuple[int, str, int]] = []
    forward = _PipelineStageBase.forward_one_chunk
    backward = _PipelineStageBase.backward_one_chunk
    weight = _PipelineStageBase.backward_weight_one_chunk

    def record_forward(self: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
        ran.append((self.stage_index, "F", chunk))
        return forward(self, chunk, *args, **kwargs)

    def record_backward(self: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        ran.append((self.stage_index, "B" if full else "I", chunk))
        return backward(self, chunk, *args, **kwargs)

    def record_weight(self: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
        ran.append((self.stage_index, "W", chunk))
        return weight(self, chunk, *args, **kwargs)

    _PipelineStageBase.forward_one_chunk = record_forward  # type: ignore[method-assign]
    _PipelineStageBase.backward_one_chunk = record_backward  # type: ignore[method-assign]
    _PipelineStageBase.backward_weight_one_chunk = record_weight  # type: ignore[method-assign]
    plan = Plan.from_data(plan_data)
    model = parallelize(
        build_model("gpt", num_blocks=num_blocks),
        plan=plan,
        loss_fn=loss_fn,
        optimizer=optimizer_factory(),
    )
    model.train_step(*batch(plan.global_batch_size, 0))
    return model.mesh.pp_rank, ran


ORDER_CASES: dict[str, dict[str, Any]] = {
    "pp2-gpipe": {"pp": 2, "schedule": "gpipe", "num_micro_batches": 3},
    "pp4-1f1b": {"pp": 4, "schedule": "1f1b", "num_micro_batches": 6},
    "pp2-interleaved-1f1b-v3": {
        "pp": 2,
        "schedule": "interleaved-1f1b",
        "virtual_stages": 3,
        "num_micro_batches": 4,
    },
    "pp4-interleaved-zb": {"pp": 4, "schedule": "interleaved-zb", **_V2},
    "pp2-zbv": {"pp": 2, "schedule": "zbv", "virtual_stages": 2, "num_micro_batches": 6},
    "pp4-dualpipev": {
        "pp": 4,
        "schedule": "dualpipev",
        "virtual_stages": 2,
        "num_micro_batches": 8,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ORDER_CASES))
def test_the_simulated_orders_are_the_ones_torch_runs(case: str, tmp_path: Path) -> None:
    """What the cost model simulates (`cost_model.schedules.pipeline_order`) is, action for
    action, what torch's schedule executes on each rank at run time."""
    plan = _plan(ORDER_CASES[case])
    results = run_distributed(
        order_worker,
        plan.num_units - 2,
        plan.to_data(),
        world_size=plan.num_devices,
        tmp_path=tmp_path,
    )
    spec = ScheduleSpec(
        schedule=plan.schedule,
        pp_degree=plan.pp_degree,
        virtual_stages=plan.virtual_stages,
        num_micro_batches=plan.num_micro_batches,
    )
    simulated = pipeline_order(spec)
    for pp_rank, ran in results:
        assert ran == [(a.stage_idx, a.kind, a.microbatch_idx) for a in simulated[pp_rank]]
