"""Checkpoints of context- and expert-parallel plans (`autoplan.Checkpointer`, CPU/gloo).

As tests/test_checkpoint.py for dense plans: a job trains, saves every 3 steps, stops at step
7 and resumes from step 6 into a freshly `parallelize`d model whose weights were perturbed; it
must then train on exactly as the uninterrupted job (every loss, RNG draw and parameter equal,
bit for bit, under the same plan), and under another plan as the uninterrupted job up to
summation order.

- ep: the experts are DTensors ``Shard(0)`` over the ep mesh (also under DDP), sharded again by
  FSDP2 over the expert-data group under ZeRO-3, or on the second (pp, edp, ep) mesh of folded
  expert parallelism; DCP saves each expert once and reshards them, so an ep2 checkpoint loads
  into a plan without expert parallelism and back.
- cp: each rank holds its own rows of the RoPE tables. They are derived from the model's
  configuration (non-persistent buffers of the zoo's models), so they are not checkpointed: a
  rank restoring another's rows would attend at the wrong positions.
- tp2 with sequence parallelism on the MoE model: router and shared expert replicated over tp,
  their gradients summed by `ReplicatedGradientSum`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from autoplan.contract.plan import Plan
from tests.dist_utils import run_distributed
from tests.numerics import make_plan
from tests.test_checkpoint import assert_equal_parameters, resume_worker

MOE_UNITS = 5  # embedding, 3 blocks, head (tests/numerics.py)
CP_LAYOUT = ("pp", "dp", "cp", "tp")


def _ep2() -> Plan:
    return make_plan(num_units=MOE_UNITS, dp=2, ep_degree=2, micro_batch=2, num_micro_batches=1)


def _dp2_moe() -> Plan:
    return make_plan(num_units=MOE_UNITS, dp=2, micro_batch=2, num_micro_batches=1)


def _cp2() -> Plan:
    # DDP over the cp pair (its weights' data-parallel group), 2 micro-batches
    return make_plan(cp_degree=2, rank_layout=CP_LAYOUT, micro_batch=1, num_micro_batches=2)


def _dp2_llama() -> Plan:
    return make_plan(dp=2, micro_batch=1, num_micro_batches=1)


def _folded_tp2_ep2() -> Plan:
    # ep spans the tp pair; each TP rank routes its own half of the sequence
    return make_plan(
        num_units=MOE_UNITS,
        tp=2,
        ep_degree=2,
        ep_folding=True,
        sequence_parallel=True,
        micro_batch=2,
        num_micro_batches=2,
    )


def _tp2_sp_moe() -> Plan:
    return make_plan(
        num_units=MOE_UNITS, tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=2
    )


def _ep2_dp2_zero3() -> Plan:
    # ep groups {0, 1} and {2, 3}; FSDP2 shards each expert over its 2 holders (edp)
    return make_plan(
        num_units=MOE_UNITS, dp=4, ep_degree=2, zero=3, micro_batch=1, num_micro_batches=1
    )


def _resume(tmp_path: Path, model: str, first: Plan, second: Plan) -> list[dict[str, Any]]:
    assert first.global_batch_size == second.global_batch_size
    assert first.num_devices == second.num_devices
    results: list[dict[str, Any]] = run_distributed(
        resume_worker,
        first.to_data(),
        second.to_data(),
        str(tmp_path / "ckpt"),
        model,
        world_size=first.num_devices,
        tmp_path=tmp_path,
        timeout_s=300,
    )
    for result in results:
        assert result["resumed_at"] == 6  # the incomplete step 9 was skipped
        assert result["kept"] == ["step_00000006", "step_00000009"]
        assert result["complete"] == [True, True]
    return results


def _accumulates_in_ddp(plan: Plan) -> bool:
    """DDP summing several micro-batches' gradients (pipelining's ``no_sync`` for all but the
    last): a freshly built DDP's first step sums them one rounding away from a DDP that has
    stepped before (measured: a 5e-7 loss difference two steps later, also for a dense dp2
    GPT; with one micro-batch the resumed DDP job is exact)."""
    return plan.decisions.dp_wrapper == "ddp" and plan.num_micro_batches > 1


def _assert_same_run(results: list[dict[str, Any]], plan: Plan) -> None:
    if _accumulates_in_ddp(plan):
        _assert_resharded_run(results)
        return
    for result in results:
        # same plan: the same numbers exactly (weights, Adam state, RNG, data position)
        assert result["resumed"] == result["uninterrupted"]
        assert_equal_parameters(result)


def _assert_resharded_run(results: list[dict[str, Any]]) -> None:
    for result in results:
        # another plan (or DDP's first step, above) sums in another order: equal up to fp32 rounding carried through 3
        # AdamW steps (tests/numerics.py's tolerances); a lost expert shard, Adam moment or
        # RoPE row changes the loss by 1e-3 or more at once
        torch.testing.assert_close(
            torch.tensor(result["resumed"]),
            torch.tensor(result["uninterrupted"]),
            rtol=1e-5,
            atol=1e-6,
        )
        assert_equal_parameters(result, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("model", "plan"),
    [
        ("moe", _ep2),
        ("moe", _folded_tp2_ep2),
        ("llama", _cp2),
        ("moe", _tp2_sp_moe),
    ],
    ids=["ep2", "folded-tp2-ep2", "cp2", "tp2-sp-moe"],
)
def test_a_cp_or_ep_job_resumes_as_if_it_never_stopped(
    model: str, plan: Any, tmp_path: Path
) -> None:
    _assert_same_run(_resume(tmp_path, model, plan(), plan()), plan())


@pytest.mark.slow
def test_an_ep2_dp2_zero3_job_resumes_as_if_it_never_stopped(tmp_path: Path) -> None:
    plan = _ep2_dp2_zero3()
    assert plan.decisions.dp_wrapper == "fsdp"
    _assert_same_run(_resume(tmp_path, "moe", plan, plan), plan)


@pytest.mark.parametrize(
    ("model", "first", "second"),
    [
        ("moe", _ep2, _dp2_moe),
        ("llama", _cp2, _dp2_llama),
        ("moe", _folded_tp2_ep2, _tp2_sp_moe),
    ],
    ids=["ep2-to-ep1", "cp2-to-dp2", "folded-ep2-to-tp2-sp"],
)
def test_a_cp_or_ep_checkpoint_reshards_into_another_plan(
    model: str, first: Any, second: Any, tmp_path: Path
) -> None:
    _assert_resharded_run(_resume(tmp_path, model, first(), second()))
