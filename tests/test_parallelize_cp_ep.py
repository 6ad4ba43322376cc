"""Context and expert parallelism through `autoplan.parallelize`, against one process (CPU/gloo).

Each case makes an explicit plan with ``autoplan.manual_plan(..., cp=, ep=)``, trains the tiny
model (tests/numerics.py) for 3 AdamW steps with `DistributedModel.train_step` on every rank,
and compares the loss on every rank and every gradient (DTensors gathered) with a deep copy
trained in one process (tolerances: tests/numerics.py).

- cp (llama): the reference is the plain one on the whole global batch: each cp rank's loss is
  the mean over its equal share of the tokens, so their mean is the global mean.
- ep (MoE, with its load-balancing loss): the loss is a statistic of the tokens of one forward,
  attached with weight 1 to every forward (autoplan/models/moe.py), as in Megatron-LM. The
  reference therefore runs one forward and backward per micro-batch of every data-parallel
  rank, on the same rows, and divides the summed gradients by their number: what the data-
  parallel mean and the pipeline's micro-batch mean compute. No case combines cp with the MoE
  model: the per-rank load-balancing loss over a cp rank's tokens is not one a single process
  computes (tests/test_expert_parallel.py runs cp2 x ep2 by hand with the coefficient at 0).
- MoE under tensor parallelism with sequence parallelism: each TP rank routes its own sequence
  shard (passes/moe_sequence_parallel.py). The load-balancing loss is made the one over all
  the micro-batch's tokens (counts summed over tp, each rank's loss divided by tp), so cases
  run with it ("moe" against the micro-batch reference) as well as without ("moe-noaux"
  against the plain one).

Bad plans (cp not dividing the sequence, ep not dividing the experts, ep on a dense model) fail
with `PlanError` on every rank from `parallelize`, before the mesh or any pass is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from tests.dist_utils import run_distributed
from tests.numerics import (
    STEPS,
    Reference,
    assert_matches,
    batch,
    build_model,
    loss_fn,
    make_plan,
    optimizer_factory,
    reference,
    train_worker,
)


def _plan(model: str, processes: int, **degrees: Any) -> Plan:
    graph = autoplan.trace(build_model(model))
    return autoplan.manual_plan(
        graph, autoplan.Cluster.local(num_devices=processes), dtype="fp32", **degrees
    )


def _micro_batch_reference(model_name: str, plan: Plan) -> Reference:
    """One process, one forward and backward per micro-batch of every data-parallel rank (the
    same rows, in global-batch order), gradients summed and divided by their number."""
    model: nn.Module = build_model(model_name)
    names_of: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), set()).add(name)
    optimizer = optimizer_factory()(model.parameters())
    size = plan.micro_batch_size
    count = plan.global_batch_size // size
    records = []
    for step in range(STEPS):
        inputs, targets = batch(plan.global_batch_size, step)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for idx in range(count):
            rows = slice(idx * size, (idx + 1) * size)
            loss = loss_fn(model(inputs[rows]), targets[rows])
            loss.backward()  # type: ignore[no-untyped-call]
            total += loss.item() / count
        for param in model.parameters():
            if param.grad is not None:
                param.grad.div_(count)
        grads = {
            name: p.grad.detach().clone()
            for name, p in model.named_parameters(remove_duplicate=False)
            if p.grad is not None
        }
        records.append((total, grads))
        optimizer.step()
    return Reference(records=records, aliases=list(names_of.values()))


def _train(tmp_path: Path, model: str, plan: Plan) -> list[list[tuple[float, Any]]]:
    return run_distributed(
        train_worker, model, plan.to_data(), world_size=plan.num_devices, tmp_path=tmp_path
    )


def test_cp2_llama(tmp_path: Path) -> None:
    plan = _plan("llama", 2, cp=2, global_batch=2)
    assert (plan.dp_degree, plan.cp_degree, plan.rank_layout) == (1, 2, ("pp", "dp", "cp", "tp"))
    assert_matches(_train(tmp_path, "llama", plan), reference("llama", plan.global_batch_size))


def test_ep2_moe(tmp_path: Path) -> None:
    plan = _plan("moe", 2, ep=2, global_batch=4, micro_batch=2)
    assert (plan.dp_degree, plan.ep_degree, plan.decisions.dp_wrapper) == (2, 2, "ddp")
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


@pytest.mark.slow
def test_ep2_dp2_moe_zero3(tmp_path: Path) -> None:
    # 4 ranks: ep groups {0, 1} and {2, 3}; each expert on 2 ranks (edp), sharded by FSDP2
    plan = _plan("moe", 4, ep=2, zero=3, global_batch=4)
    assert (plan.dp_degree, plan.decisions.dp_wrapper) == (4, "fsdp")
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


@pytest.mark.slow
def test_cp2_tp2_llama(tmp_path: Path) -> None:
    plan = _plan("llama", 4, cp=2, tp=2, global_batch=2)
    assert plan.decisions.dp_wrapper == "replicate"  # over the 2 cp ranks
    assert_matches(_train(tmp_path, "llama", plan), reference("llama", plan.global_batch_size))


@pytest.mark.slow
def test_pp2_ep2_moe(tmp_path: Path) -> None:
    plan = _plan("moe", 4, pp=2, ep=2, global_batch=4)
    assert (plan.dp_degree, plan.num_micro_batches) == (2, 2)
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


@pytest.mark.slow
def test_cp2_ep2_moe_without_load_balancing_loss(tmp_path: Path) -> None:
    # ep inside dp, cp beside it: experts reduce over the 2 ranks of the same ep rank (edp x cp)
    plan = _plan("moe-noaux", 4, cp=2, ep=2, zero=3, global_batch=4)
    assert (plan.dp_degree, plan.expert_data_group_ranks(0)) == (2, (0, 1))
    assert_matches(_train(tmp_path, "moe-noaux", plan), reference("moe-noaux", 4))


def test_ep2_moe_selective_recompute(tmp_path: Path) -> None:
    # Recompute keeps collective outputs: the token counts' exchange must be a functional
    # collective, or the re-run leaves its buffer unfilled (passes/expert_parallel.py).
    plan = _plan("moe", 2, ep=2, global_batch=4, recompute="selective")
    assert plan.decisions.dp_wrapper == "ddp"
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


# ----------------------------------------------------------------------------- bad plans


def _refusal(rank: int, world_size: int, model_name: str, plan_data: dict[str, Any]) -> str:
    from autoplan.runtime.parallelizer import parallelize

    try:
        parallelize(
            build_model(model_name),
            plan=Plan.from_data(plan_data),
            loss_fn=loss_fn,
            optimizer=optimizer_factory(),
        )
    except PlanError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("model", "degrees", "message"),
    [
        ("llama", {"cp_degree": 3, "dp": 1}, "2 x cp_degree = 6 must divide seq_len = 16"),
        ("moe", {"ep_degree": 3, "dp": 3}, "ep_degree = 3 does not divide num_experts = 4"),
        ("llama", {"ep_degree": 2, "dp": 2}, "is dense (no mixture-of-experts layer)"),
        ("gpt", {"cp_degree": 2, "dp": 1}, "has no RoPE tables (rope_cos/rope_sin buffers)"),
        (
            "moe",
            {"ep_degree": 2, "dp": 2, "ep_folding": True, "zero": 1},
            "zero_stage 1 with ep_degree = 2: ZeRO-1 runs as DDP + ZeroRedundancyOptimizer",
        ),
        (
            "moe",
            {"ep_degree": 2, "dp": 2, "ep_folding": True, "zero": 3, "recompute": "selective"},
            "recompute 'selective' with ep_degree = 2 under FSDP2",
        ),
    ],
    ids=[
        "cp-not-dividing-seq",
        "ep-not-dividing-experts",
        "ep-on-dense-model",
        "cp-on-gpt",
        "folded-ep-zero1",
        "folded-ep-selective-fsdp",
    ],
)
def test_bad_cp_ep_plans_fail_on_every_rank(
    model: str, degrees: dict[str, Any], message: str, tmp_path: Path
) -> None:
    # Hand-written plans (no model reference): manual_plan would refuse them before any job.
    cp = degrees.get("cp_degree", 1)
    extra = {"rank_layout": ("pp", "dp", "cp", "tp")} if cp > 1 else {}
    num_units = 5 if model == "moe" else 4  # embedding, blocks, head
    plan = make_plan(num_units=num_units, **degrees, **extra)
    refusals = run_distributed(
        _refusal, model, plan.to_data(), world_size=plan.num_devices, tmp_path=tmp_path
    )
    assert len(refusals) == plan.num_devices
    for refusal in refusals:
        assert message in refusal, refusal


def test_the_batch_is_split_by_the_plan_s_layout() -> None:
    """What train_step feeds a cp rank: its load-balanced chunks (`ContextParallelResult`)."""
    from passes import ContextParallelResult

    layout = ContextParallelResult(
        cp_degree=2, cp_rank=1, seq_len=8, backend="ring", attention_sites=(), position_buffers=()
    )
    ids = torch.arange(8).unsqueeze(0)
    assert layout.shard(ids).tolist() == [[2, 3, 4, 5]]  # chunks 1 and 2 of 4


def _search_worker(rank: int, world_size: int) -> tuple[int, int, float]:
    from autoplan.runtime.parallelizer import parallelize

    dist_model = parallelize(
        build_model("moe"),
        loss_fn=loss_fn,
        optimizer=optimizer_factory(),
        global_batch_size=4,
        search_constraints={"ep": (2,)},
    )
    plan = dist_model.plan
    loss = float(dist_model.train_step(*batch(plan.global_batch_size)))
    return plan.ep_degree, plan.dp_degree, loss


def test_a_searched_ep_plan_trains(tmp_path: Path) -> None:
    # No plan: rank 0 searches one (ep 2 asked for), leaving out what ep cannot run with
    results = run_distributed(_search_worker, world_size=2, tmp_path=tmp_path)
    assert [result[:2] for result in results] == [(2, 2), (2, 2)]
    assert results[0][2] == results[1][2] and 3.0 < results[0][2] < 5.0  # ln(64) = 4.16


# ------------------------------------------------------- MoE under sequence parallelism


def test_tp2_sp_moe_load_balancing_loss_is_exact(tmp_path: Path) -> None:
    # each TP rank routes its own half of the sequence; router, shared expert and experts are
    # replicated over tp, their gradients summed over it. The counts the loss reads are summed over tp and each rank's loss divided by tp: the tp
    # ranks' losses add up to the one over all the micro-batch's tokens
    plan = _plan("moe", 2, tp=2, global_batch=4, micro_batch=2, sequence_parallel=True)
    assert (plan.dp_degree, plan.num_micro_batches) == (1, 2)
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


@pytest.mark.slow
def test_tp2_ep2_sp_moe_with_load_balancing_loss(tmp_path: Path) -> None:
    # ep over the 2 dp ranks of each tp rank; every rank routes its own quarter of the tokens
    plan = _plan("moe", 4, tp=2, ep=2, global_batch=4, sequence_parallel=True)
    assert (plan.dp_degree, plan.ep_group_ranks(1)) == (2, (1, 3))
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


@pytest.mark.slow
def test_tp2_ep2_sp_moe_zero3(tmp_path: Path) -> None:
    # FSDP2 shards the experts over their edp group (1 rank here) and the rest over dp; the tp
    # sum runs on the reduced shards
    plan = _plan("moe", 4, tp=2, ep=2, zero=3, global_batch=4, sequence_parallel=True)
    assert plan.decisions.dp_wrapper == "fsdp"
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


# ------------------------------------------------------- folded expert parallelism


def _folded_plan(processes: int, **fields: Any) -> Plan:
    """A hand-written folded plan of the tiny MoE (5 units), with sequence parallelism unless
    told otherwise."""
    fields.setdefault("sequence_parallel", True)
    plan = make_plan(num_units=5, ep_folding=True, **fields)
    assert plan.num_devices == processes
    return plan


def test_folded_tp2_ep2_moe(tmp_path: Path) -> None:
    # ep spans the tp group: each TP rank routes its own half of the sequence (SP) to the two
    # ranks' experts; no rank shares experts with another (edp 1), no dense replica (dp 1)
    plan = _folded_plan(2, tp=2, ep_degree=2, micro_batch=2, num_micro_batches=2)
    assert (plan.dp_degree, plan.ep_group_ranks(0), plan.expert_data_group_ranks(1)) == (
        1,
        (0, 1),
        (1,),
    )
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


@pytest.mark.slow
def test_folded_ep4_over_dp2_tp2_moe(tmp_path: Path) -> None:
    # one ep group of all 4 ranks (dp x tp), each holding one expert; dense weights averaged
    # over dp, router and shared expert summed over tp first
    plan = _folded_plan(4, dp=2, tp=2, ep_degree=4)
    assert (plan.ep_group_ranks(2), plan.expert_data_group_ranks(2)) == ((0, 1, 2, 3), (2,))
    assert_matches(_train(tmp_path, "moe-noaux", plan), reference("moe-noaux", 4))


def test_folded_cp2_ep2_moe_without_load_balancing_loss(tmp_path: Path) -> None:
    # ep spans the cp ring: each cp rank routes its own chunks of the sequence to both ranks'
    # experts; the experts' gradients are averaged over dp x cp = 2 like the dense ones
    plan = _folded_plan(
        2, ep_degree=2, cp_degree=2, rank_layout=("pp", "dp", "cp", "tp"), sequence_parallel=False
    )
    assert (plan.dp_degree, plan.ep_group_ranks(0)) == (1, (0, 1))
    assert_matches(_train(tmp_path, "moe-noaux", plan), reference("moe-noaux", 2))


@pytest.mark.slow
def test_folded_ep2_over_tp_dp2_tp2_moe_zero3(tmp_path: Path) -> None:
    # ep groups are the tp pairs; FSDP2 shards each expert over the 2 ranks holding it (one
    # per dp rank) on the folded mesh, its average over them scaled by tp / ep = 1
    plan = _folded_plan(4, dp=2, tp=2, ep_degree=2, zero=3)
    assert (plan.ep_group_ranks(2), plan.expert_data_group_ranks(1)) == ((2, 3), (1, 3))
    assert plan.decisions.dp_wrapper == "fsdp"
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_tp2_sp_moe_recompute(recompute: str, tmp_path: Path) -> None:
    # the recomputed forward re-runs the counts' all-reduce over tp (a functional collective,
    # whose output selective recompute keeps)
    plan = _plan(
        "moe", 2, tp=2, global_batch=2, micro_batch=2, sequence_parallel=True, recompute=recompute
    )
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


@pytest.mark.slow
def test_folded_pp2_tp2_ep2_moe(tmp_path: Path) -> None:
    # each pipeline rank folds its own ep group over its tp pair
    plan = _folded_plan(4, pp=2, tp=2, ep_degree=2)
    assert (plan.ep_group_ranks(0), plan.ep_group_ranks(3)) == ((0, 1), (2, 3))
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


def test_tp2_moe_without_sequence_parallelism(tmp_path: Path) -> None:
    # every TP rank routes the same tokens: router and experts computed redundantly (equal
    # gradients, nothing summed), the shared expert tensor-parallel
    plan = _plan("moe", 2, tp=2, global_batch=2, micro_batch=2)
    assert not plan.sequence_parallel
    assert_matches(_train(tmp_path, "moe", plan), _micro_batch_reference("moe", plan))


@pytest.mark.slow
def test_cp2_tp2_sp_moe_without_load_balancing_loss(tmp_path: Path) -> None:
    # each rank routes a quarter of every sequence: its cp chunks' sequence-parallel shard
    plan = _plan("moe-noaux", 4, cp=2, tp=2, global_batch=2, sequence_parallel=True)
    assert (plan.dp_degree, plan.cp_degree, plan.tp_degree) == (1, 2, 2)
    assert_matches(_train(tmp_path, "moe-noaux", plan), reference("moe-noaux", 2))
