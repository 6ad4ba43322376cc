"""`autoplan.parallelize` beyond numerics: meta models materialised shard by shard, checkpoints
through torch.distributed.checkpoint, bad plans refused on every rank, a failing rank taking
the job down, and a plan searched for the running job."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import ModelRef, Plan
from passes import init_full_model_
from tests.dist_utils import DistributedTestError, run_distributed
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
    row_paths,
    train_worker,
)

SEED = 7


def _local_numel(param: torch.Tensor) -> int:
    return (param.to_local() if isinstance(param, DTensor) else param).numel()


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


# ----------------------------------------------------------------------------- meta models


def meta_worker(
    rank: int, world_size: int, plan_data: dict[str, Any], model_name: str = "gpt"
) -> dict[str, Any]:
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    model = build_model(model_name, device="meta")
    dist_model = parallelize(
        model, plan=plan, loss_fn=loss_fn, optimizer=optimizer_factory(), seed=SEED
    )
    params = dict(dist_model.named_parameters())
    local_numel = sum(_local_numel(p) for p in params.values())
    initial = {name: _full(p) for name, p in params.items()}
    records = []
    for step in range(STEPS):
        inputs, targets = batch(plan.global_batch_size, step)
        loss = dist_model.train_step(inputs, targets)
        records.append((float(loss), full_grads(dist_model.named_parameters())))
    return {"local_numel": local_numel, "initial": initial, "records": records}


# Hugging Face models built under torch.device("meta") are exported on meta: their graphs name
# the meta device (passes.retarget_devices) and their RoPE tables come from the model's own
# initialize_weights() (passes.meta_buffer_values). GPT-2's fused Conv1D q/k/v is not TP-able.
META_CASES = {
    "pp2": ("gpt", {"pp": 2}),
    "dp2-zero3": ("gpt", {"dp": 2, "zero": 3}),
    "tp2": ("gpt", {"tp": 2}),
    "dp2-ddp": ("gpt", {"dp": 2, "zero": 0}),
    "hf-gpt2-pp2": ("hf-gpt2", {"pp": 2}),
    "hf-gpt2-dp2-zero3": ("hf-gpt2", {"dp": 2, "zero": 3}),
    # Llama's TP shards and pipeline stages in one job (tp 2 and pp 2 alone cost ~10 s each)
    "hf-llama-tp2xpp2": ("hf-llama", {"tp": 2, "pp": 2}),
    # context parallelism: each cp rank materialises its own rows of the RoPE tables
    "llama-cp2": ("llama", {"cp_degree": 2, "rank_layout": ("pp", "dp", "cp", "tp")}),
    # expert parallelism: each ep rank initialises its slice of the experts (no load-balancing
    # loss, so the plain reference applies: see tests/test_parallelize_cp_ep.py)
    "moe-ep2-ddp": ("moe-noaux", {"dp": 2, "ep_degree": 2, "num_units": 5}),
    "moe-ep2-zero3": ("moe-noaux", {"dp": 2, "ep_degree": 2, "zero": 3, "num_units": 5}),
}
_SLOW_META = {"hf-gpt2-pp2", "hf-gpt2-dp2-zero3", "hf-llama-tp2xpp2"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW_META else c for c in META_CASES],
)
def test_meta_model_is_materialised_shard_by_shard(tmp_path: Path, case: str) -> None:
    model_name, plan_args = META_CASES[case]
    plan = make_plan(**plan_args)
    results = run_distributed(
        meta_worker, plan.to_data(), model_name, world_size=plan.num_devices, tmp_path=tmp_path
    )

    # The single-process model initialised by the same rule: the weights do not depend on the
    # plan, and every rank's shard is a slice of them.
    model = build_model(model_name)
    rows, num_blocks = row_paths(model)
    init_full_model_(model, seed=SEED, row_paths=rows, num_blocks=num_blocks)
    expected = dict(model.named_parameters(remove_duplicate=False))
    total = sum(p.numel() for p in model.parameters())
    for result in results:
        if plan.pp_degree > 1 or plan.tp_degree > 1 or plan.zero_stage == 3 or plan.ep_degree > 1:
            # No rank holds the whole model: each has its pipeline stage / its shard only.
            assert result["local_numel"] < total
        else:
            assert result["local_numel"] == total  # DDP replicates; the tie stays one tensor
        for name, value in result["initial"].items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=0, msg=name)
    if plan_args.get("zero") == 3:
        # FSDP: the two data-parallel ranks hold half of the parameters each (dim-0 chunks).
        assert all(r["local_numel"] <= total // 2 + 64 for r in results)
    assert_matches(
        [r["records"] for r in results], reference(model_name, plan.global_batch_size, model=model)
    )


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_worker(
    rank: int, world_size: int, plan_data: dict[str, Any], checkpoint_dir: str
) -> dict[str, list[float]]:
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    first = parallelize(
        build_model("gpt"), plan=plan, loss_fn=loss_fn, optimizer=optimizer_factory()
    )
    for step in range(2):
        first.train_step(*batch(plan.global_batch_size, step))
    dcp.save(first.state_dict(), checkpoint_id=checkpoint_dir)
    continued = [float(first.train_step(*batch(plan.global_batch_size, s))) for s in (2, 3)]

    # A fresh model with other weights and a fresh optimizer, then the checkpoint.
    other = build_model("gpt")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5).add_(0.1)
    second = parallelize(other, plan=plan, loss_fn=loss_fn, optimizer=optimizer_factory())
    state = second.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    second.load_state_dict(state)
    resumed = [float(second.train_step(*batch(plan.global_batch_size, s))) for s in (2, 3)]
    dist.barrier()
    return {"continued": continued, "resumed": resumed}


@pytest.mark.parametrize(
    "plan_args",
    [
        {"pp": 2},
        {"dp": 2, "zero": 3},
        {"tp": 2},
        {"dp": 2, "zero": 0},
        # Under the V, rank 0 holds both copies of the tied weight, saved once under one name:
        # each copy's optimizer needs its own state (shared tensors took two Adam updates a
        # step). interleaved-zb: the same split backward under the loop placement.
        {"pp": 2, "schedule": "zbv", "virtual_stages": 2, "num_micro_batches": 4},
        {"pp": 2, "schedule": "interleaved-zb", "virtual_stages": 2, "num_micro_batches": 4},
    ],
    ids=["pp2-tied", "dp2-zero3", "tp2", "dp2-ddp", "zbv-tied", "interleaved-zb"],
)
def test_checkpoint_round_trip_continues_identically(
    tmp_path: Path, plan_args: dict[str, Any]
) -> None:
    plan = make_plan(**plan_args)
    results = run_distributed(
        checkpoint_worker,
        plan.to_data(),
        str(tmp_path / "checkpoint"),
        world_size=plan.num_devices,
        tmp_path=tmp_path,
    )
    for result in results:
        # Same weights, same optimizer state (Adam moments and step): the same numbers, exactly,
        # except under DDP. Its gradients after the resumed job's first backward differ from
        # the continued job's by a few float32 ulps (observed on an AMD EPYC host, not on the
        # earlier Intel one; the weights and Adam state loaded were bit-identical): a fresh
        # DDP wrapper reduces in its initial bucket layout and rebuilds the buckets after that
        # backward. A wrong weight or moment would move the loss by orders of magnitude more.
        if plan.dp_degree > 1 and plan.zero_stage == 0:
            assert result["resumed"] == pytest.approx(result["continued"], rel=1e-6, abs=0)
        else:
            assert result["resumed"] == result["continued"]
    assert results[0]["continued"][1] < results[0]["continued"][0] + 1.0  # a real run


# ----------------------------------------------------------------------------- bad input


def bad_plan_worker(rank: int, world_size: int, model_name: str, plan_data: dict[str, Any]) -> str:
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    try:
        parallelize(build_model(model_name), plan=plan, loss_fn=loss_fn)
    except PlanError as error:
        return str(error)
    return "no error"


def _heads3(rank: int, world_size: int, plan_data: dict[str, Any]) -> str:
    from autoplan.models import gpt
    from autoplan.runtime.parallelizer import parallelize

    try:
        parallelize(
            gpt(2, 24, 3, 16, 64, device="cpu"), plan=Plan.from_data(plan_data), loss_fn=loss_fn
        )
    except PlanError as error:
        return str(error)
    return "no error"


def test_plan_for_another_world_size_fails_on_every_rank(tmp_path: Path) -> None:
    plan = make_plan(dp=4)
    messages = run_distributed(
        bad_plan_worker, "gpt", plan.to_data(), world_size=2, tmp_path=tmp_path, timeout_s=60
    )
    for message in messages:
        assert "4 processes but the job has 2" in message, message


def test_plan_for_another_model_fails_on_every_rank(tmp_path: Path) -> None:
    plan = make_plan(dp=2)
    foreign = dataclasses.replace(
        plan, model=ModelRef(name="other", num_units=4, seq_len=16, fingerprint="0123abcd")
    )
    messages = run_distributed(
        bad_plan_worker, "gpt", foreign.to_data(), world_size=2, tmp_path=tmp_path, timeout_s=60
    )
    for message in messages:
        assert "fingerprint 0123abcd" in message and "search a new plan" in message, message


def test_tp_degree_that_does_not_divide_the_heads_fails_on_every_rank(tmp_path: Path) -> None:
    plan = make_plan(tp=2)
    messages = run_distributed(
        _heads3, plan.to_data(), world_size=2, tmp_path=tmp_path, timeout_s=60
    )
    for message in messages:
        assert "tp_degree = 2 does not divide num_heads = 3" in message, message


def test_tp_plan_for_gpt2s_fused_conv1d_is_refused_before_any_collective() -> None:
    from autoplan.runtime.parallelizer import _check_tensor_parallel
    from autoplan.tracing import trace

    model = build_model("hf-gpt2")
    graph = trace(model)
    _check_tensor_parallel(make_plan(pp=2), model, graph)  # no TP: nothing to refuse
    with pytest.raises(PlanError, match=r"transformer\.h\.0\.attn\.c_attn \(Conv1D\)"):
        _check_tensor_parallel(make_plan(tp=2), model, graph)


def _hf_llama_plan(rank: int, world_size: int, plan_data: dict[str, Any]) -> str:
    from autoplan.runtime.parallelizer import parallelize

    try:
        parallelize(build_model("hf-llama"), plan=Plan.from_data(plan_data), loss_fn=loss_fn)
    except PlanError as error:
        return str(error)
    return "no error"


def test_bf16_plan_for_an_exported_model_fails_on_every_rank(tmp_path: Path) -> None:
    """The exported graph pins fp32 (export drops no-op casts): a bf16 run would mix dtypes
    mid-step, so it is refused before any collective, on every rank."""
    plan = make_plan(dp=2, dtype="bf16")
    messages = run_distributed(
        _hf_llama_plan, plan.to_data(), world_size=2, tmp_path=tmp_path, timeout_s=120
    )
    for message in messages:
        assert "dtype = 'bf16'" in message and "use dtype 'fp32'" in message, message


# ----------------------------------------------------------------------------- failures


def _failing_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if dist.get_rank() == 1 and getattr(_failing_loss, "armed", False):
        raise RuntimeError("injected failure in rank 1's loss")
    return loss_fn(logits, targets)


def failing_worker(rank: int, world_size: int, plan_data: dict[str, Any]) -> None:
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    dist_model = parallelize(build_model("gpt"), plan=plan, loss_fn=_failing_loss)
    dist_model.train_step(*batch(plan.global_batch_size, 0))
    _failing_loss.armed = True  # type: ignore[attr-defined]
    dist_model.train_step(*batch(plan.global_batch_size, 1))


def test_a_rank_failing_mid_step_takes_the_job_down(tmp_path: Path) -> None:
    plan = make_plan(pp=2)
    pg_timeout_s = 20.0
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(
            failing_worker,
            plan.to_data(),
            world_size=2,
            tmp_path=tmp_path,
            pg_timeout_s=pg_timeout_s,
            timeout_s=90,
            kill_on_error=False,  # rank 0 must fail by itself, not be killed by the launcher
        )
    elapsed = time.monotonic() - start
    message = str(info.value)
    # The root cause first, with its traceback, then rank 0's own failure (no hang).
    assert message.startswith("rank 1 failed:\nRuntimeError: injected failure"), message[:300]
    assert "rank 0 failed" in message
    assert elapsed < pg_timeout_s + 15, f"took {elapsed:.0f} s"


# ----------------------------------------------------------------------------- no plan


def search_worker(rank: int, world_size: int, plan_path: str) -> dict[str, Any]:
    import contextlib
    import io

    from autoplan.runtime.parallelizer import parallelize

    # this process configures no logging, as a user's script may not: the plan's line still
    # comes out on stderr (rank 0's)
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        dist_model = parallelize(
            build_model("gpt"), loss_fn=loss_fn, optimizer=optimizer_factory(), global_batch_size=4
        )
        losses = [float(dist_model.train_step(*batch(4, s))) for s in range(2)]
        # the plan saved, then loaded by path on every rank
        if rank == 0:
            dist_model.plan.to_yaml(plan_path)
        dist.barrier()
        loaded = parallelize(build_model("gpt"), plan=plan_path, loss_fn=loss_fn)
    said = [line for line in stderr.getvalue().splitlines() if line.startswith("autoplan: ")]
    return {
        "plan": dist_model.plan.to_data(),
        "loaded": loaded.plan.to_data(),
        "losses": losses,
        "said": said,
    }


def test_without_a_plan_every_rank_runs_the_plan_rank0_chose(tmp_path: Path) -> None:
    plan_path = str(tmp_path / "searched.yaml")
    results = run_distributed(search_worker, plan_path, world_size=2, tmp_path=tmp_path)
    plans = [r["plan"] for r in results]
    assert plans[0] == plans[1] == results[0]["loaded"] == results[1]["loaded"]
    plan = Plan.from_data(plans[0])
    assert plan.num_devices == 2 and plan.global_batch_size == 4
    # rank 0 says which plan it searched, then which it loaded, a line each: its shape and its
    # predicted step
    said, loaded = results[0]["said"]
    assert results[1]["said"] == []
    assert loaded.startswith(f"autoplan: running the plan loaded from {plan_path}: "), loaded
    assert loaded.split(": ", 2)[2].split(";")[0] == said.split("): ", 1)[1].split(";")[0]
    searched = r"autoplan: plan searched on rank 0 in \d+\.\d s "
    proof = r"\((proven the fastest|a faster one may exist by up to \d+\.\d%)\)"
    assert re.fullmatch(searched + proof + r": .+; predicted step .+", said), said
    shape = f"dp {plan.dp_degree} x tp {plan.tp_degree} x pp {plan.pp_degree}"
    assert shape in said and plan.zero_text in said and plan.schedule in said, said
    assert results[0]["losses"] == results[1]["losses"]
    ref = reference("gpt", 4, steps=2)
    torch.testing.assert_close(
        torch.tensor(results[0]["losses"]),
        torch.tensor([r[0] for r in ref.records]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_the_plan_line_shows_without_logging_configured_and_obeys_logging_when_it_is(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from passes import announce_rank0

    logger = logging.getLogger("autoplan.runtime.parallelizer")
    with monkeypatch.context() as unconfigured:
        # no handler on the logger's chain (pytest's own taken off), the root at warnings: the
        # line goes to stderr all the same, where Python would print a warning
        unconfigured.setattr(logging.root, "handlers", [])
        announce_rank0(logger, "autoplan: %s", "plan x")
        assert capsys.readouterr().err == "autoplan: plan x\n"
        for level in (logging.WARNING, logging.ERROR):  # silenced on purpose: nothing
            logger.setLevel(level)
            try:
                announce_rank0(logger, "autoplan: %s", "plan y")
            finally:
                logger.setLevel(logging.NOTSET)
            assert capsys.readouterr().err == ""
    # configured (pytest's handlers): the record at INFO, through them, not to stderr
    with caplog.at_level(logging.INFO, logger=logger.name):
        announce_rank0(logger, "autoplan: %s", "plan z")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "autoplan: plan z")
    ]
    assert capsys.readouterr().err == ""


def test_a_plan_path_that_does_not_load_fails_before_any_process_group() -> None:
    from autoplan.runtime.parallelizer import parallelize

    before = dist.is_initialized()
    with pytest.raises(PlanError, match=re.escape("plan file '/no/such/plan.yaml' does not")):
        parallelize(build_model("gpt"), plan="/no/such/plan.yaml", loss_fn=loss_fn)
    assert dist.is_initialized() == before  # (no process group created)


# ----------------------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("plan_args", [{"dp": 2, "zero": 3}, {"pp": 2}], ids=["dp2-zero3", "pp2"])
def test_bf16_plans_train_with_fp32_master_weights(
    tmp_path: Path, plan_args: dict[str, Any]
) -> None:
    plan = dataclasses.replace(make_plan(**plan_args), dtype="bf16")
    results = run_distributed(train_worker, "gpt", plan.to_data(), world_size=2, tmp_path=tmp_path)
    expected = reference("gpt", plan.global_batch_size)
    for records in results:
        # bf16 keeps 8 significant bits (eps 2^-8 = 0.4%) in the matmuls; FSDP2 reduces the
        # gradients in fp32 and updates fp32 master weights, so the loss of the first steps
        # stays within 0.1% of fp32's (measured: under 0.03%).
        torch.testing.assert_close(
            torch.tensor([loss for loss, _ in records]),
            torch.tensor([loss for loss, _ in expected.records]),
            rtol=1e-3,
            atol=0.0,
        )
        for grads in (g for _, g in records):
            assert all(g.dtype == torch.float32 for g in grads.values())


def reshard_worker(
    rank: int,
    world_size: int,
    save_plan: dict[str, Any],
    load_plan: dict[str, Any],
    checkpoint_dir: str,
) -> dict[str, list[float]]:
    from autoplan.runtime.parallelizer import parallelize

    first_plan, second_plan = Plan.from_data(save_plan), Plan.from_data(load_plan)
    first = parallelize(
        build_model("gpt"), plan=first_plan, loss_fn=loss_fn, optimizer=optimizer_factory()
    )
    for step in range(2):
        first.train_step(*batch(first_plan.global_batch_size, step))
    dcp.save(first.state_dict(), checkpoint_id=checkpoint_dir)
    continued = [float(first.train_step(*batch(first_plan.global_batch_size, s))) for s in (2, 3)]
    second = parallelize(
        build_model("gpt"), plan=second_plan, loss_fn=loss_fn, optimizer=optimizer_factory()
    )
    state = second.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    second.load_state_dict(state)
    resumed = [float(second.train_step(*batch(second_plan.global_batch_size, s))) for s in (2, 3)]
    dist.barrier()
    return {"continued": continued, "resumed": resumed}


@pytest.mark.parametrize(
    ("save_args", "load_args"),
    [
        ({"dp": 2, "zero": 3}, {"pp": 2, "num_micro_batches": 4}),
        ({"pp": 2}, {"tp": 2}),
        # saved in a V (embedding and head both on rank 0), loaded on ranks 0 and 1
        (
            {"pp": 2, "schedule": "zbv", "virtual_stages": 2, "num_micro_batches": 4},
            {"pp": 2, "schedule": "1f1b", "num_micro_batches": 4},
        ),
    ],
    ids=["dp2-zero3-to-pp2", "pp2-to-tp2", "zbv-to-1f1b"],
)
def test_a_checkpoint_loads_under_another_plan(
    tmp_path: Path, save_args: dict[str, Any], load_args: dict[str, Any]
) -> None:
    save_plan, load_plan = make_plan(**save_args), make_plan(**load_args)
    assert save_plan.global_batch_size == load_plan.global_batch_size
    results = run_distributed(
        reshard_worker,
        save_plan.to_data(),
        load_plan.to_data(),
        str(tmp_path / "checkpoint"),
        world_size=2,
        tmp_path=tmp_path,
    )
    for result in results:
        # Weights and Adam state resharded by DCP: the same losses up to summation order.
        torch.testing.assert_close(
            torch.tensor(result["resumed"]),
            torch.tensor(result["continued"]),
            rtol=1e-5,
            atol=1e-6,
        )


def _over_memory(rank: int, world_size: int, plan_data: dict[str, Any], check: bool) -> str:
    import logging

    from autoplan.runtime.parallelizer import parallelize
    from cost_model.estimate import MemoryCapacityError
    from cost_model.hardware import Cluster

    # the local preset reserves 0.5 GiB for the framework: 64 KiB more leaves no room for
    # this model's weights, gradients and Adam state (about 0.6 MiB, predicted)
    reserve = Cluster.local(num_devices=world_size).calibration.reserved_memory_bytes
    cluster = Cluster.local(num_devices=world_size).with_overrides(
        memory_bytes=int(reserve) + 2**16
    )
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("autoplan.runtime.parallelizer").addHandler(Keep(logging.WARNING))
    try:
        dist_model = parallelize(
            build_model("gpt"),
            cluster,
            plan=Plan.from_data(plan_data),
            loss_fn=loss_fn,
            check_memory=check,
        )
    except MemoryCapacityError as error:
        return f"refused: {error}"
    inputs, targets = batch(plan_data["global_batch_size"])
    loss = dist_model.train_step(inputs, targets)
    return f"trained (loss {float(loss):.3f}); warned: {' | '.join(warnings)}"


def test_a_plan_over_memory_is_refused_on_every_rank_unless_overridden(tmp_path: Path) -> None:
    plan = make_plan(dp=2)
    refused = run_distributed(
        _over_memory, plan.to_data(), True, world_size=2, tmp_path=tmp_path, timeout_s=120
    )
    for message in refused:
        assert message.startswith("refused: plan does not fit: pipeline rank 0 needs "), message
    forced = run_distributed(
        _over_memory, plan.to_data(), False, world_size=2, tmp_path=tmp_path, timeout_s=120
    )
    for message in forced:
        assert message.startswith("trained (loss "), message
    assert "check_memory=False, running anyway: plan does not fit" in forced[0]


def _given_plans(rank: int, world_size: int, plans: list[dict[str, Any] | None]) -> str:
    from autoplan.runtime.parallelizer import parallelize

    data = plans[rank]
    try:
        parallelize(
            build_model("gpt"),
            plan=None if data is None else Plan.from_data(data),
            loss_fn=loss_fn,
            global_batch_size=4,
        )
    except PlanError as error:
        return str(error)
    return "built"


@pytest.mark.parametrize("second", ["another plan", "no plan"])
def test_ranks_with_different_plans_fail_together(second: str, tmp_path: Path) -> None:
    # Without the check rank 0 would wait in DDP's parameter broadcast and rank 1 in the
    # pipeline's first receive (or in the search's broadcast) until the timeout.
    first = make_plan(dp=2)
    other = None if second == "no plan" else make_plan(pp=2).to_data()
    messages = run_distributed(
        _given_plans, [first.to_data(), other], world_size=2, tmp_path=tmp_path, timeout_s=120
    )
    assert messages[0] == messages[1], messages
    expected = f"rank 1: plan {make_plan(pp=2).digest()}" if other else "rank 1: no plan"
    assert messages[0].startswith(
        f"the ranks hold different plans (rank 0: plan {first.digest()}; {expected}); pass the "
        "same plan to parallelize on every rank"
    ), messages[0]
    # the estimate is not part of what the ranks must agree on
    assert first.with_estimate(None).digest() == first.digest() != make_plan(pp=2).digest()


@pytest.mark.slow
def test_a_plan_error_under_torchrun_is_one_line_from_rank_zero() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(Path(__file__).parent / "bad_plan_job.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("autoplan: error:")]
    assert ours == [
        "autoplan: error: the plan needs dp x tp x pp = 8 x 1 x 1 = 8 processes but the job has "
        "2; launch 8 processes or make a plan for 2 (every one of the 2 ranks stopped)"
    ], done.stderr
    # no rank printed its traceback (torchrun's own summary follows, as always)
    assert (
        "autoplan.contract.errors.PlanError" not in done.stderr
        and 'bad_plan_job.py", line' not in (done.stderr)
    ), done.stderr


@pytest.mark.slow
def test_a_stopped_rank_is_named_when_the_timeout_ends_the_job(tmp_path: Path) -> None:
    # Rank 1 SIGSTOPs itself before step 3; its peers wait in their first collective with it
    # for the 10 s process-group timeout, then name rank 1. Under dp2pp2 those collectives run
    # on sub-groups of the world (the mesh's dp and pp groups), which must have that timeout
    # too (stall_job.py's 2-process layouts use the world's own group). Once a rank has said so the test ends the job (torchrun would stop the stopped
    # process 30 s later: it cannot act on SIGTERM).
    import time

    from tests.jobs import free_port, start_agent

    agent = start_agent(
        tmp_path,
        ["dp2pp2", "10"],
        nproc=4,
        port=free_port(),
        script=Path(__file__).parent / "stall_job.py",
    )
    pattern = re.compile(
        r"StalledRankError: rank 1 stopped making progress: last seen starting step 2, while "
        r"rank \d reached step 3 and waited for it for the process-group timeout \(10 s\); the "
        r"collective failed with: "
    )
    try:
        deadline = time.monotonic() + 240
        while not pattern.search(agent.output()) and time.monotonic() < deadline:
            assert agent.process.poll() is None, agent.output()[-3000:]
            time.sleep(0.2)
    finally:
        agent.stop()
    output = agent.output()
    assert pattern.search(output), output[-3000:]
    assert "Timed out waiting 10000ms" in output
