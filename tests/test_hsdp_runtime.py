"""HSDP at run time (`Plan.dp_shard_degree`, CPU/gloo, 4 processes): FSDP2 on a 2-D
(dp_replicate, dp_shard) mesh, shard 2 x replicate 2. Its loss and every gradient match one
process over 3 AdamW steps; a checkpoint saved under HSDP resumes under plain FSDP over all 4
ranks and the reverse (DCP reshards the 2-D DTensors); `parallelize` refuses what its runtime
does not run (HSDP with context parallelism) in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from autoplan.contract.plan import Plan
from tests.dist_utils import fake_process_group, run_distributed
from tests.numerics import assert_matches, make_plan, reference, train_worker
from tests.test_checkpoint import assert_equal_parameters, resume_worker
from tests.test_parallelize_runtime import bad_plan_worker

HSDP_RANKS = 4


def _hsdp(zero: int = 3) -> Plan:
    # shard groups {0, 1} and {2, 3}; their replicas {0, 2} and {1, 3}; 2 micro-batches, so
    # the gradients accumulate before FSDP2 reduce-scatters and all-reduces them
    return make_plan(dp=HSDP_RANKS, zero=zero, dp_shard_degree=2, num_micro_batches=2)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [3, 1], ids=["zero3", "zero1-as-zero2"])
def test_hsdp_matches_one_process(zero: int, tmp_path: Path) -> None:
    plan = _hsdp(zero)
    assert plan.decisions.dp_wrapper == "fsdp"
    results = run_distributed(
        train_worker, "gpt", plan.to_data(), world_size=HSDP_RANKS, tmp_path=tmp_path
    )
    # tolerances: tests/numerics.py (fp32; the reduction's order differs from one process's)
    assert_matches(results, reference("gpt", plan.global_batch_size))


def test_the_mesh_is_two_dimensional_over_the_plan_groups() -> None:
    """The mesh splits dp into dp_replicate (outer) x dp_shard (inner), checked against the
    plan's groups on every rank (`build_mesh`), and FSDP2 wraps over (replicate, shard)."""
    from passes.mesh import build_mesh, mesh_dims

    plan = make_plan(dp=8, tp=2, zero=3, dp_shard_degree=4, num_micro_batches=1)
    assert mesh_dims(plan) == (("pp", "dp_replicate", "dp_shard", "tp"), (1, 2, 4, 2))
    for rank in (0, 5, 14):
        with fake_process_group(16, rank=rank):
            mesh = build_mesh(plan, "cpu")
            fsdp = mesh.fsdp_mesh
            assert fsdp.mesh_dim_names == ("dp_replicate", "dp_shard")
            assert tuple(fsdp["dp_shard"].mesh.tolist()) == plan.shard_group_ranks(rank)
            assert tuple(fsdp["dp_replicate"].mesh.tolist()) == plan.replicate_group_ranks(rank)
            assert tuple(mesh.sub("dp").mesh.tolist()) == plan.group_ranks("dp", rank)


def _resume(tmp_path: Path, first: Plan, second: Plan) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = run_distributed(
        resume_worker,
        first.to_data(),
        second.to_data(),
        str(tmp_path / "ckpt"),
        world_size=HSDP_RANKS,
        tmp_path=tmp_path,
        timeout_s=300,
    )
    for result in results:
        assert result["resumed_at"] == 6  # the incomplete step 9 was skipped
        # another layout sums in another order: equal up to fp32 rounding carried through the
        # AdamW steps (tests/test_checkpoint.py's tolerances); a lost or misplaced shard (a
        # replica loading another shard group's rows) changes the loss by 1e-3 or more at once
        torch.testing.assert_close(
            torch.tensor(result["resumed"]),
            torch.tensor(result["uninterrupted"]),
            rtol=1e-5,
            atol=1e-6,
        )
        assert_equal_parameters(result, rtol=1e-4, atol=1e-5)
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "second"),
    [
        (_hsdp(3), make_plan(dp=HSDP_RANKS, zero=3, num_micro_batches=2)),
        (make_plan(dp=HSDP_RANKS, zero=2, num_micro_batches=2), _hsdp(2)),
    ],
    ids=["hsdp-to-fsdp4", "fsdp4-to-hsdp"],
)
def test_an_hsdp_checkpoint_reshards_to_and_from_plain_fsdp(
    first: Plan, second: Plan, tmp_path: Path
) -> None:
    _resume(tmp_path, first, second)


@pytest.mark.slow
def test_parallelize_refuses_hsdp_with_context_parallelism_on_every_rank(tmp_path: Path) -> None:
    """Priced and exported, but autoplan's runtime builds HSDP's mesh from dp ranks only: every
    rank of the job raises the same one-line `PlanError` before building anything."""
    plan = make_plan(
        dp=2,
        cp_degree=2,
        zero=3,
        dp_shard_degree=1,  # shards over the cp pair: HSDP with context parallelism
        num_micro_batches=1,
        rank_layout=("pp", "dp", "cp", "tp"),
    )
    messages = run_distributed(
        bad_plan_worker, "llama", plan.to_data(), world_size=4, tmp_path=tmp_path, timeout_s=60
    )
    assert (
        messages
        == [
            "dp_shard 1 with cp 2: autoplan runs HSDP on a 2-D (replicate, shard) mesh of dp "
            "ranks, without context parallelism; leave dp_shard_degree out (the weights sharded "
            "over dp x cp), or set --cp 1"
        ]
        * 4
    )
