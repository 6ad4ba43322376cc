"""Non-finite losses and gradients (issue 37, Must show 2) and the stop request that rides on
the same all-reduce.

Two 2-process jobs, several checks each: a pipeline (the loss lives on rank 1, the last stage,
alone) whose loss is made NaN, and tensor parallelism whose rank 1 alone gets a NaN in the
local shard of one sharded gradient (rank 0's local gradients stay finite: only the combined
verdict can stop it). Each job also trains a second copy of the model with the check cut out
and compares losses, gradients and weights bit for bit: the check reads and changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from autoplan.contract.errors import PlanError
from passes.runtime import DistributedModel, NonFiniteError, _StepVerdict
from tests.dist_utils import run_distributed
from tests.numerics import batch, build_model, loss_fn, make_plan, optimizer_factory

_POISON = {"loss": False}  # set in a worker: its loss_fn returns NaN


def _poisoned_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(logits, targets)
    return loss * float("nan") if _POISON["loss"] else loss


def _local_params(model: DistributedModel) -> dict[str, torch.Tensor]:
    return {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _local_grads(model: DistributedModel) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _build(plan_args: dict[str, Any]) -> DistributedModel:
    from autoplan.runtime.parallelizer import parallelize

    plan = make_plan(**plan_args)
    return parallelize(
        build_model("gpt"), plan=plan, loss_fn=_poisoned_loss, optimizer=optimizer_factory()
    )


def _poison(model: DistributedModel, rank: int, how: str) -> Any:
    """Make the next steps non-finite: the loss (every rank's loss_fn; only the last stage
    calls it), or one sharded gradient's local shard on rank 1 (a hook; returns its handle)."""
    if how == "loss":
        _POISON["loss"] = True
        return None
    if rank != 1:
        return None
    name, param = next((n, p) for n, p in model.named_parameters() if isinstance(p, DTensor))
    assert param.placements[0].is_shard(), (name, param.placements)
    return param.register_hook(lambda grad: grad * float("nan"))


def _nonfinite_worker(rank: int, world_size: int, plan_args: dict[str, Any], how: str) -> Any:
    torch.manual_seed(0)
    model = _build(plan_args)
    plain = _build(plan_args)  # the same weights, the check cut out
    plain._agree = lambda loss_flag, grads: _StepVerdict(  # type: ignore[method-assign]
        loss_rank=None, grad_rank=None, stop=False, world_size=world_size
    )
    out: dict[str, Any] = {}
    global_batch = model.plan.global_batch_size

    # 1. bit for bit the same as without the check
    same = True
    for step in range(2):
        inputs, targets = batch(global_batch, step)
        same &= torch.equal(model.train_step(inputs, targets), plain.train_step(inputs, targets))
        same &= _same(_local_grads(model), _local_grads(plain))
        same &= _same(_local_params(model), _local_params(plain))
    out["bit_identical"] = same
    out["step_before"] = model.step

    # 2. on_nan="stop": the same NonFiniteError everywhere, no step taken, groups intact
    weights = _local_params(model)
    handle = _poison(model, rank, how)
    inputs, targets = batch(global_batch, 2)
    try:
        model.train_step(inputs, targets)
        out["stop_error"] = None
    except NonFiniteError as error:
        out["stop_error"] = str(error)
    out["step_after_stop"] = model.step
    out["unchanged_after_stop"] = _same(weights, _local_params(model))

    # 3. on_nan="skip": no optimizer step anywhere, the step counts and is recorded
    model.on_nan = "skip"
    skipped_loss = model.train_step(inputs, targets)
    out["skipped_loss_finite"] = bool(torch.isfinite(skipped_loss))
    out["skipped_steps"] = list(model.skipped_steps)
    out["step_after_skip"] = model.step
    out["unchanged_after_skip"] = _same(weights, _local_params(model))
    out["grads_after_skip"] = len(_local_grads(model))

    # 4. healthy again: it trains (the process groups survived the stop) and the stop request
    # of rank 1 alone reaches rank 0 through the same all-reduce
    _POISON["loss"] = False
    if handle is not None:
        handle.remove()
    out["stop_requested_before"] = model.stop_requested
    if rank == 1:
        model.request_stop()
    out["stop_requested_unseen"] = model.stop_requested
    loss = model.train_step(*batch(global_batch, 3))
    out["healthy_loss"] = float(loss)
    out["stop_requested_after"] = model.stop_requested
    out["changed_after_healthy"] = not _same(weights, _local_params(model))
    out["final_step"] = model.step
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plan_args", "how", "expected"),
    [
        ({"pp": 2}, "loss", "non-finite loss at step 3 (seen first on rank 1 of 2)"),
        ({"tp": 2}, "grad", "non-finite gradient at step 3 (seen first on rank 1 of 2)"),
    ],
    ids=["pp2-loss", "tp2-gradient-shard"],
)
def test_a_non_finite_step_stops_or_is_skipped_on_every_rank(
    plan_args: dict[str, Any], how: str, expected: str, tmp_path: Path
) -> None:
    results = run_distributed(
        _nonfinite_worker, plan_args, how, world_size=2, tmp_path=tmp_path, timeout_s=240
    )
    for rank, out in enumerate(results):
        assert out["bit_identical"], f"rank {rank}: the check changed a loss, gradient or weight"
        assert out["stop_error"] == results[0]["stop_error"], results
        assert out["stop_error"] is not None
        assert out["stop_error"].startswith(expected + ": no optimizer step taken; lower the "), (
            out["stop_error"]
        )
        assert "on_nan='skip'" in out["stop_error"] and "\n" not in out["stop_error"]
        assert out["step_before"] == out["step_after_stop"] == 2
        assert out["unchanged_after_stop"], f"rank {rank} stepped on a non-finite step"
        assert out["skipped_steps"] == [3] and out["step_after_skip"] == 3
        assert out["unchanged_after_skip"] and out["grads_after_skip"] == 0
        # the returned loss is the step's own: NaN when the loss was, finite when a gradient
        assert out["skipped_loss_finite"] == (how == "grad")
        assert out["stop_requested_before"] is False and out["stop_requested_unseen"] is False
        assert out["stop_requested_after"] is True, f"rank {rank} did not see rank 1's request"
        assert out["changed_after_healthy"] and out["final_step"] == 4
        assert out["healthy_loss"] == results[0]["healthy_loss"]
        assert torch.isfinite(torch.tensor(out["healthy_loss"]))


def test_on_nan_must_be_stop_or_skip() -> None:
    from autoplan.runtime.parallelizer import parallelize

    with pytest.raises(PlanError, match=r"^on_nan='never': use 'stop' \(the default\) or 'skip'$"):
        parallelize(build_model("gpt"), plan=make_plan(), loss_fn=loss_fn, on_nan="never")  # type: ignore[arg-type]


def test_the_verdict_names_the_loss_before_the_gradient() -> None:
    both = _StepVerdict(loss_rank=3, grad_rank=0, stop=False, world_size=4)
    assert (both.what, both.where) == ("non-finite loss", "(seen first on rank 3 of 4)")
    grads = _StepVerdict(loss_rank=None, grad_rank=2, stop=True, world_size=4)
    assert (grads.what, grads.where) == ("non-finite gradient", "(seen first on rank 2 of 4)")
    assert not both.finite and not grads.finite
    assert _StepVerdict(loss_rank=None, grad_rank=None, stop=True, world_size=4).finite
