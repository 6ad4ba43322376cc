"""Mixed-precision policies at run time (issue 43 item 3): `autoplan.parallelize` runs a plan's
master-weight, gradient-reduction and optimizer-state dtypes through FSDP2's
``MixedPrecisionPolicy`` and the parameters' own dtype (passes/data_parallel.py), checked
against one process running the same policy, and refuses what it cannot run in one line.

The reference makes the distributed run's roundings in the same places, so the comparison can
be tight: each data-parallel rank's half of the batch runs forward and backward in bf16 (the
working weights: the bf16 master itself, or a bf16 copy of the fp32 master as FSDP2's
``param_dtype`` makes), the two ranks' bf16 gradients are summed once and halved (in bf16 under
``grad_reduce_dtype: bf16``: one rounding, the same whatever the order of two terms, and exact
halving; FSDP2 reduce-scatters in the reduction dtype), cast to the master dtype, and AdamW
updates the master (elementwise, so sharding changes nothing). Single-threaded GEMMs on both
sides make the bf16 forward and backward bitwise alike.

Tolerances: losses and gradients agree to fp32 rounding of the few operations the two sides
order differently (the loss's mean over ranks, fp32's 2^-24): rtol 1e-5. A reduction run in
fp32 where the plan says bf16, or bf16 weights where it says fp32, moves gradients by up to
half a bf16 ulp, 2^-9 = 0.2% relative, 200 times beyond that (and the fp32-master test checks
that every reduced gradient is a bf16 value); a missing or doubled reduction is off by 50% or
more.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.tracing import trace
from cost_model.hardware import Cluster
from cost_model.local_rates import _one_thread
from tests.dist_utils import run_distributed
from tests.numerics import (
    STEPS,
    batch,
    build_model,
    full_grads,
    logits,
    loss_fn,
    make_plan,
    optimizer_factory,
)

# every test here starts processes (tests/conftest.py runs those one after another)
pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-7


def _plan(**fields: Any) -> Plan:
    """dp 2, one micro-batch of 2 samples on each rank, in bf16 with ``fields`` (the policy)."""
    plan = make_plan(dp=2, micro_batch=2, num_micro_batches=1, zero=fields.pop("zero", 3))
    return dataclasses.replace(plan, dtype="bf16", **fields)


def policy_worker(rank: int, world_size: int, plan_data: dict[str, Any]) -> dict[str, Any]:
    """Train under the plan; per step the loss and every full gradient, then the dtypes of
    the parameters, their gradients and AdamW's moments on this rank."""
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    model = parallelize(
        build_model("gpt"), plan=plan, loss_fn=loss_fn, optimizer=optimizer_factory()
    )
    records = []
    for step in range(STEPS):
        loss = model.train_step(*batch(plan.global_batch_size, step))
        records.append((float(loss), full_grads(model.named_parameters())))
    params = dict(model.named_parameters())
    states = {
        str(value.dtype)
        for optimizer in model.optimizers
        for state in optimizer.state.values()
        for key, value in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    }
    return {
        "records": records,
        "params": {str(p.dtype) for p in params.values()},
        "grads": {str(p.grad.dtype) for p in params.values() if p.grad is not None},
        "states": states,
    }


def reference(plan: Plan) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """The plan's training in one process (module doc): per step the mean loss and the
    reduced gradient of every parameter, in the master dtype."""
    policy = plan.precision
    master_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[policy.master]
    reduce_bf16 = policy.grad_reduce == "bf16"
    records = []
    with _one_thread():
        master = build_model("gpt").to(master_dtype)
        optimizer = optimizer_factory()(master.parameters())
        for step in range(STEPS):
            inputs, targets = batch(plan.global_batch_size, step)
            work = master if master_dtype == torch.bfloat16 else copy.deepcopy(master).bfloat16()
            grads: list[dict[str, torch.Tensor]] = []
            losses = []
            for x, y in zip(inputs.chunk(2), targets.chunk(2), strict=True):  # the dp ranks
                work.zero_grad(set_to_none=True)
                loss = loss_fn(logits(work, x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                losses.append(loss.item())
                grads.append({n: p.grad.clone() for n, p in _named(work) if p.grad is not None})
            reduced = {}
            for name in grads[0]:
                total = grads[0][name].float() + grads[1][name].float()  # exact for two bf16
                if reduce_bf16:
                    total = total.bfloat16()
                reduced[name] = (total / 2).to(master_dtype)
            for name, param in _named(master):
                param.grad = reduced[name].clone()
            optimizer.step()
            records.append((sum(losses) / 2, reduced))
    return records


def _named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters())


def _assert_matches(results: list[dict[str, Any]], plan: Plan) -> None:
    expected = reference(plan)
    for rank, result in enumerate(results):
        for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(
            zip(result["records"], expected, strict=True)
        ):
            where = f"rank {rank}, step {step}"
            torch.testing.assert_close(
                torch.tensor(loss), torch.tensor(ref_loss), rtol=RTOL, atol=ATOL, msg=where
            )
            assert set(grads) == set(ref_grads), where
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad.float(),
                    ref_grads[name].float(),
                    rtol=RTOL,
                    atol=ATOL,
                    msg=f"{name}, {where}",
                )


def test_bf16_master_states_and_reduction_match_one_process(tmp_path: Any) -> None:
    """bf16 everywhere (no fp32 copy) under ZeRO-3: bf16 parameter shards, gradients and AdamW
    moments, gradients reduce-scattered in bf16."""
    plan = _plan(master_dtype="bf16", grad_reduce_dtype="bf16", optimizer_state_dtype="bf16")
    results = run_distributed(policy_worker, plan.to_data(), world_size=2, tmp_path=tmp_path)
    for result in results:
        assert result["params"] == result["grads"] == result["states"] == {"torch.bfloat16"}
    _assert_matches(results, plan)


def test_fp32_master_with_bf16_reduction_matches_one_process(tmp_path: Any) -> None:
    """fp32 master weights and moments under ZeRO-2, gradients reduced in bf16: every reduced
    gradient (fp32, the shards' dtype) is a bf16 value."""
    plan = _plan(grad_reduce_dtype="bf16", zero=2)
    results = run_distributed(policy_worker, plan.to_data(), world_size=2, tmp_path=tmp_path)
    for result in results:
        assert result["params"] == result["grads"] == result["states"] == {"torch.float32"}
        for _, grads in result["records"]:
            for name, grad in grads.items():
                assert torch.equal(grad, grad.bfloat16().float()), name
    _assert_matches(results, plan)


def refused_worker(rank: int, world_size: int, plan_data: dict[str, Any]) -> str:
    from autoplan.runtime.parallelizer import parallelize

    try:
        parallelize(
            build_model("gpt"),
            plan=Plan.from_data(plan_data),
            loss_fn=loss_fn,
            optimizer=optimizer_factory(),
        )
    except PlanError as error:
        return str(error)
    return "ran"


def test_a_policy_the_runtime_cannot_run_fails_on_every_rank(tmp_path: Any) -> None:
    """fp32 master weights with bf16 moments (torch's AdamW keeps them in the parameters'
    dtype): refused in one line on both ranks, before any collective could hang. The plan is
    priced for Megatron-LM, which runs it (--use-precision-aware-optimizer)."""
    plan = dataclasses.replace(_plan(optimizer_state_dtype="bf16"), framework="megatron-lm")
    messages = run_distributed(refused_worker, plan.to_data(), world_size=2, tmp_path=tmp_path)
    assert messages[0] == messages[1]
    assert "torch's AdamW keeps its moments in the parameters' dtype" in messages[0]
    assert "\n" not in messages[0]
    # and at plan time, for a plan priced for autoplan's runtime
    graph = trace(build_model("gpt"))
    cluster = Cluster.preset("dgx-a100-80g", devices_per_node=2)
    with pytest.raises(PlanError, match="set optimizer_state_dtype equal to master_dtype"):
        dataclasses.replace(plan, framework="autoplan").validate(graph, cluster)
