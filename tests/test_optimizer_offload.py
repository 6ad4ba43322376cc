"""autoplan's runtime runs `Plan.optimizer_offload` (issue 43 item 7): the share split
(`passes.optimizer_offload.offloaded_params`, Megatron-Core's rule), `OffloadedOptimizer`
against the user's optimizer alone, the runtime over gloo against one process (loss, every
gradient, every parameter after 3 AdamW steps) and its checkpoint resumed bit for bit, and the
stack profile that prices it as it runs ("blocking") and refuses what it does not run.

On this CPU machine the host is the device: the copies are CPU-to-CPU, but every tensor the
step touches on the host is a separate one, stepped by a separate optimizer (checked)."""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import runtime_refusal
from cost_model.estimate import CostModel
from cost_model.hardware import Cluster
from cost_model.parts.offload import offload_cost
from cost_model.parts.optimizer import optimizer_cost
from cost_model.strategy import Strategy
from passes.optimizer_offload import OffloadedOptimizer, offloaded_params
from tests.cost_profiles import gpt_profile, round_cluster
from tests.dist_utils import run_distributed
from tests.numerics import (
    GRAD_ATOL,
    GRAD_RTOL,
    LOSS_ATOL,
    LOSS_RTOL,
    batch,
    build_model,
    full_grads,
    logits,
    loss_fn,
    make_plan,
    optimizer_factory,
)

HOST_LINK = 10e9  # bytes/s each way: a figure for the plan's host-link rule on a CPU worker
HOST_MEMORY = 8e9  # bytes a node
STEPS = 3
SHARE = 0.5


def _linked(cluster: Cluster, link: float = HOST_LINK) -> Cluster:
    device = dataclasses.replace(cluster.device, host_link_bandwidth_bytes_per_s=link)
    return dataclasses.replace(cluster, device=device, host_memory_bytes=int(HOST_MEMORY))


# ------------------------------------------------------------------------------- the split


@pytest.mark.parametrize(
    ("numels", "share", "expected"),
    [
        ([10, 10, 10, 10], 0.5, (True, True, False, False)),
        ([10, 10, 10, 10], 0.0, (False, False, False, False)),
        ([10, 10, 10, 10], 1.0, (True, True, True, True)),
        # whole parameters: 10 < 20, so the 30 goes too (the host takes 40 of 40 x 0.5)
        ([10, 30], 0.5, (True, True)),
        ([30, 10, 10], 0.5, (True, False, False)),
        # an empty local shard (an uneven FSDP2 split) costs nothing and moves with its turn
        ([0, 10, 10], 0.5, (True, True, False)),
        ([10, 10, 10, 10], 0.26, (True, True, False, False)),
    ],
)
def test_the_split_takes_whole_parameters_in_order_until_the_share(
    numels: list[int], share: float, expected: tuple[bool, ...]
) -> None:
    assert offloaded_params(numels, share) == expected


# --------------------------------------------------------------------- one process, by hand


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, device: str = "cpu"
) -> list[float]:
    losses = []
    for step in steps:
        inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(step)).to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = model(inputs).square().mean()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_offloaded_optimizer_steps_as_the_user_s_alone() -> None:
    """Half of a tiny MLP's elements (its first weight) stepped on separate host copies by a
    second AdamW: the same parameters bit for bit after 3 steps, a scheduler's learning rate
    reaches the host's optimizer, and its state dict loads into a fresh one that steps on
    identically."""
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-6, weight_decay=0.1)
    model, alone = _tiny(), _tiny()
    offloaded = OffloadedOptimizer(
        model.parameters(), factory=factory, share=SHARE, device=torch.device("cpu")
    )
    reference = factory(alone.parameters())
    first = model[0].weight
    assert [tuple(p.shape) for p in offloaded.offloaded] == [tuple(first.shape)]
    host = offloaded.host_optimizer
    assert host is not None and offloaded.device_optimizer is not None
    master = host.param_groups[0]["params"][0]
    assert master.data_ptr() != first.data_ptr()  # a host copy, not the parameter
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (offloaded, reference)]
    for step in range(STEPS):
        assert _train(model, offloaded, range(step, step + 1)) == _train(
            alone, reference, range(step, step + 1)
        )
        for scheduler in schedulers:
            scheduler.step()
    # (the host's group takes the scheduled rate at its next step; equal parameters after
    # steps at 1e-2, 5e-3 and 2.5e-3 say it did)
    assert offloaded.param_groups[-1]["lr"] == reference.param_groups[0]["lr"] == 1.25e-3
    assert host.param_groups[0]["lr"] == 2.5e-3
    for got, expected in zip(model.parameters(), alone.parameters(), strict=True):
        assert torch.equal(got, expected)
    # resume: a fresh model and optimizer from the state dicts step on identically
    saved = copy.deepcopy(offloaded.state_dict())
    resumed_model = _tiny()
    resumed_model.load_state_dict(model.state_dict())
    resumed = OffloadedOptimizer(
        resumed_model.parameters(), factory=factory, share=SHARE, device=torch.device("cpu")
    )
    resumed.load_state_dict(saved)
    assert _train(resumed_model, resumed, range(7, 9)) == _train(model, offloaded, range(7, 9))
    for got, expected in zip(resumed_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host copies are CUDA's")
def test_on_cuda_the_host_copies_are_pinned_host_memory_and_step_alike() -> None:
    """On a GPU the offloaded master copies and gradient buffers are pinned host tensors and
    the device parameters end where the user's AdamW on the GPU alone ends (CPU and CUDA
    AdamW kernels round differently: close, not equal)."""
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-6)
    model, alone = _tiny().cuda(), _tiny().cuda()
    offloaded = OffloadedOptimizer(
        model.parameters(), factory=factory, share=SHARE, device=torch.device("cuda")
    )
    host = offloaded.host_optimizer
    assert host is not None
    for master in (m for g in host.param_groups for m in g["params"]):
        assert master.device.type == "cpu" and master.is_pinned()
    reference = factory(alone.parameters())
    _train(model, offloaded, range(STEPS), "cuda")
    _train(alone, reference, range(STEPS), "cuda")
    for got, expected in zip(model.parameters(), alone.parameters(), strict=True):
        assert got.is_cuda
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- the runtime


def _linked_local(world_size: int) -> Cluster:
    return _linked(Cluster.local(num_devices=world_size))


def _record(job: Any) -> dict[str, Any]:
    """This rank's gradients, whole (collective), and the parameters after the step."""
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in job.named_parameters()
    }
    return {"grads": full_grads(job.named_parameters()), "params": params}


def _optimizer_state(job: Any) -> dict[str, torch.Tensor]:
    """This rank's optimizer state, local shards, by the checkpoint's flattened names."""
    state = job.state_dict()["optimizer"]
    return {
        key: (value.to_local() if isinstance(value, DTensor) else value).clone()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def offload_worker(
    rank: int, world_size: int, plan_data: dict[str, Any], zero1_data: dict[str, Any], folder: str
) -> dict[str, Any]:
    """Train ``plan_data`` 3 steps under `autoplan.parallelize`, checkpointing after step 2;
    then a fresh job (perturbed weights) resumes from it and takes step 3 again. Then
    ``zero1_data`` (DDP + ZeroRedundancyOptimizer, the offloaded optimizer inside) 3 steps."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from autoplan import Checkpointer
    from autoplan.contract.plan import Plan
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    cluster = _linked_local(world_size)

    def build(perturb: bool = False, plan: Plan = plan) -> Any:
        model = build_model("gpt")
        if perturb:  # the restored weights must replace these
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5).add_(0.1)
        return parallelize(model, cluster, plan, loss_fn=loss_fn, optimizer=optimizer_factory())

    job = build()
    (optimizer,) = job.optimizers
    assert isinstance(optimizer, OffloadedOptimizer)
    host = optimizer.host_optimizer
    assert host is not None and optimizer.device_optimizer is not None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = {id(p): (p.to_local() if isinstance(p, DTensor) else p).numel() for p in params}
    moved = sum(local[id(p)] for p in optimizer.offloaded)
    assert moved >= SHARE * sum(local.values())  # (whole parameters: at least the share)
    masters = [m for g in host.param_groups for m in g["params"]]
    device_ptrs = {(p.to_local() if isinstance(p, DTensor) else p).data_ptr() for p in params}
    assert not {m.to_local().data_ptr() for m in masters} & device_ptrs
    checkpointer = Checkpointer(folder, job, every=2)
    records = []
    for step in range(STEPS):
        loss = job.train_step(*batch(plan.global_batch_size, step))
        records.append({"loss": float(loss), **_record(job)})
        checkpointer.after_step()
    checkpointer.close(save=False)
    state = _optimizer_state(job)

    resumed = build(perturb=True)
    checkpointer = Checkpointer(folder, resumed, every=100)
    resumed_at = checkpointer.restore()
    loss = resumed.train_step(*batch(plan.global_batch_size, resumed_at))
    again = {"loss": float(loss), **_record(resumed)}
    checkpointer.close(save=False)
    state_again = _optimizer_state(resumed)
    # the same checkpoint under another plan: ZeRO-2, nothing offloaded (DCP reshards)
    plain = build(plan=dataclasses.replace(plan, zero_stage=2, optimizer_offload=0.0))
    checkpointer = Checkpointer(folder, plain, every=100)
    assert checkpointer.restore() == resumed_at
    loss = plain.train_step(*batch(plan.global_batch_size, resumed_at))
    resharded = {"loss": float(loss), **_record(plain)}
    checkpointer.close(save=False)

    zero1 = build(plan=Plan.from_data(zero1_data))
    (sharded,) = zero1.optimizers
    assert isinstance(sharded, ZeroRedundancyOptimizer)
    assert isinstance(sharded.optim, OffloadedOptimizer) and sharded.optim.offloaded
    zero1_records = []
    for step in range(STEPS):
        loss = zero1.train_step(*batch(plan.global_batch_size, step))
        zero1_records.append({"loss": float(loss), **_record(zero1)})
    return {
        "records": records,
        "resumed_at": resumed_at,
        "again": again,
        "state_equal": state.keys() == state_again.keys()
        and all(torch.equal(value, state_again[key]) for key, value in state.items()),
        "host_states": sum(len(s) for s in host.state.values()),
        "zero1": zero1_records,
        "resharded": resharded,
    }


def _reference(global_batch: int) -> list[dict[str, Any]]:
    """One process, the user's AdamW over the whole model: per step loss, gradients and the
    parameters after the step."""
    model = build_model("gpt")
    optimizer = optimizer_factory()(model.parameters())
    records = []
    for step in range(STEPS):
        inputs, targets = batch(global_batch, step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(logits(model, inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        records.append({"loss": loss.item(), "grads": grads, "params": params})
    return records


@pytest.mark.slow
def test_dp2_offloaded_half_matches_one_process_and_resumes_bit_for_bit(
    tmp_path: Path,
) -> None:
    """2 gloo ranks, FSDP2 ZeRO-3, half of each rank's local shards stepped on the host: the
    loss, every gradient and every parameter after each of 3 AdamW steps match one process
    running AdamW over the whole model (tolerances of tests/numerics.py: reduction order; the
    parameters move by lr x Adam's normalised step, so the same tolerances hold). The job saved
    after step 2 (DCP) and a fresh job, its weights perturbed, restored from it: step 3 again
    gives the same loss, gradients, parameters and optimizer state bit for bit, and so does a
    job under ZeRO-2 without offload restored from it (DCP reshards). The same ranks
    then run ZeRO-1 on DDP (fp32), the offloaded optimizer inside ZeroRedundancyOptimizer's
    partition: the same match."""
    plan = make_plan(dp=2, zero=3, optimizer_offload=SHARE)
    zero1 = make_plan(dp=2, zero=1, optimizer_offload=SHARE)  # fp32: DDP + ZeRO's partition
    results = run_distributed(
        offload_worker,
        plan.to_data(),
        zero1.to_data(),
        str(tmp_path / "ckpt"),
        world_size=2,
        tmp_path=tmp_path,
        timeout_s=300,
    )
    expected = _reference(plan.global_batch_size)
    worst: dict[str, float] = {}  # the largest difference by run and part, reported
    for rank, result in enumerate(results):
        assert result["host_states"] > 0  # the host optimizer stepped and holds state
        runs = [("zero3", r, w) for r, w in zip(result["records"], expected, strict=True)]
        runs += [("zero1", r, w) for r, w in zip(result["zero1"], expected, strict=True)]
        for step, (run, got, want) in enumerate(runs):
            where = f"{run}, rank {rank}, step {step % STEPS}"
            torch.testing.assert_close(
                torch.tensor(got["loss"]), torch.tensor(want["loss"]),
                rtol=LOSS_RTOL, atol=LOSS_ATOL, msg=where,
            )  # fmt: skip
            for part in ("grads", "params"):
                assert set(got[part]) == set(want[part]), where
                for name, value in got[part].items():
                    torch.testing.assert_close(
                        value, want[part][name], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                        msg=f"{part} {name}, {where}",
                    )  # fmt: skip
                    key = f"{run} {part}"
                    gap = float((value - want[part][name]).abs().max())
                    worst[key] = max(worst.get(key, 0.0), gap)
        assert result["resumed_at"] == 2
        last = result["records"][-1]
        assert result["again"]["loss"] == last["loss"]
        for part in ("grads", "params"):
            for name, value in result["again"][part].items():
                assert torch.equal(value, last[part][name]), f"resumed {part} {name}"
        assert result["state_equal"]
        # resumed under ZeRO-2 without offload: the same step (FSDP2 reduces alike at ZeRO-2
        # and 3 over the same ranks; the tolerances allow another order all the same)
        assert result["resharded"]["loss"] == pytest.approx(last["loss"], rel=LOSS_RTOL)
        for part in ("grads", "params"):
            for name, value in result["resharded"][part].items():
                torch.testing.assert_close(
                    value, last[part][name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name
                )
    print(f"max abs difference from one process over {STEPS} steps: {worst}")


# --------------------------------------------------------------- the stack, as it runs


def test_the_runtime_s_step_is_priced_as_it_runs() -> None:
    """autoplan's runtime copies the gradients out and waits, steps the host beside the device,
    then copies the weights back ("blocking"): out + max(device, host) + back; Megatron-Core
    pipelines the three with the device's step: the longest of the four."""
    cluster = _linked(round_cluster(), link=1e9)
    strategy = Strategy(dtype="bf16", optimizer_offload=0.5)
    part = offload_cost(1e9, strategy, cluster)
    device_s = 1e9 * 0.5 * 30 / (1e12 * 0.5) + cluster.calibration.kernel_overhead_s
    blocking = optimizer_cost(1e9, strategy, cluster, "blocking").step_s
    assert blocking == pytest.approx(
        part.device_to_host_s + max(device_s, part.host_step_s) + part.host_to_device_s
    )
    pipelined = optimizer_cost(1e9, strategy, cluster).step_s
    assert pipelined == pytest.approx(max(device_s, part.critical_s)) and blocking > pipelined
    # the stacks' profiles say which: the same plan's unit costs differ by exactly that
    profile = gpt_profile()
    plan_strategy = Strategy(dtype="bf16", dp_degree=8, zero_stage=1, optimizer_offload=0.5)
    ours = CostModel(profile, cluster, "autoplan").unit_costs(plan_strategy, "none")
    theirs = CostModel(profile, cluster, "megatron-lm").unit_costs(plan_strategy, "none")
    assert all(a.optimizer_s >= b.optimizer_s for a, b in zip(ours, theirs, strict=True))
    assert sum(a.optimizer_s for a in ours) > sum(b.optimizer_s for b in theirs)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_runtime_takes_it_at_every_zero_stage(zero: int) -> None:
    plan = autoplan.manual_plan(
        gpt_profile(), _linked(round_cluster()), dp=8, global_batch=8, zero=zero, dtype="bf16",
        optimizer_offload=0.5,
    )  # fmt: skip
    plan.validate(gpt_profile(), _linked(round_cluster()))


def test_the_runtime_refuses_it_beside_fp8_all_gather_in_one_line() -> None:
    plan = autoplan.manual_plan(
        gpt_profile(), "dgx-h100-80g", dp=8, global_batch=8, zero=3, dtype="fp8",
        optimizer_offload=0.5,
    )  # fmt: skip
    gathered = dataclasses.replace(plan, fp8_all_gather=True)
    with pytest.raises(PlanError) as info:
        gathered.validate(gpt_profile(), "dgx-h100-80g")
    # what parallelize asks, whatever stack the plan is priced for
    assert runtime_refusal(gathered, gpt_profile()) == str(info.value).removesuffix(".")
    message = str(info.value)
    assert "optimizer_offload 0.5 at zero 3 with fp8_all_gather" in message, message
    assert "set fp8_all_gather: false" in message and "\n" not in message


def test_the_search_offloads_it_for_the_runtime_where_memory_binds() -> None:
    """tests/test_offload.py's tight case for autoplan's runtime: 8 devices of 13 MiB hold no
    plan with the optimizer on the device, and the search finds one with it on the host; with
    room to spare it keeps the optimizer on the device."""

    def search(memory_mib: int, **constraints: Any) -> Any:
        cluster = _linked(round_cluster(memory_bytes=memory_mib * 2**20))
        return autoplan.search(
            gpt_profile(s=16), cluster, global_batch=8, tp=1, pp=1, dtype="bf16",
            memory_headroom=0.0, **constraints,
        )  # fmt: skip

    assert search(13).optimizer_offload == 1.0
    with pytest.raises(autoplan.NoFeasiblePlanError):
        search(13, optimizer_offload=False)
    assert search(40).optimizer_offload == 0.0
