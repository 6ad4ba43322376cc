"""Expert parallelism (passes/expert_parallel.py) against one process, on CPU/gloo.

The zoo's MoE model (tests/numerics.py "moe": a dense layer, then 2 MoE layers of 4 experts,
top-2, a shared expert, the load-balancing loss) trains 3 AdamW steps under ep2 (2 ranks, each
with its own tokens; on the eager model and on the traced, split units the runtime uses),
ep2 x dp2 (4 ranks: the experts sharded over ep, each expert replicated over the 2-rank
expert-data-parallel group), cp2 x ep2 (the experts sharded over the cp ranks, which hold
different tokens of the same sequences) and pp2 x ep2 (the repo's split, pipeline pass and 1F1B
schedule; each stage's 2 ranks split its experts, ep on the plan's dp axis). Each rank's loss (the mean over the data-parallel
world) and every gradient (expert weights gathered from their DTensor shards) must equal a
single-process reference that accumulates the same per-rank mean losses / dp_world over the
same shards of the global batch: the load-balancing loss is a statistic of each rank's tokens,
as in Megatron-LM (tolerances: tests/numerics.py; the all-to-alls only move rows, so the
differences are reduction order only; a gradient summed over the wrong group or scaled by edp
instead of dp_world is off by a factor of 2). Bad input fails with `PlanError` before any
collective.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from autoplan.contract.errors import PlanError
from autoplan.tracing import trace
from passes import build_mesh, build_pipeline, original_fqn, split_stages
from passes.context_parallel import apply_context_parallel, shard_sequence
from passes.expert_parallel import (
    ExpertParallelExperts,
    apply_expert_parallel,
    check_expert_parallel,
    reduce_gradients,
)
from tests.dist_utils import fake_process_group, run_distributed
from tests.numerics import (
    NUM_BLOCKS,
    SEQ,
    STEPS,
    Reference,
    assert_matches,
    batch,
    build_model,
    full_grads,
    loss_fn,
    make_plan,
    optimizer_factory,
    reference,
)

MICRO_BATCH = 2  # sequences per data-parallel rank
NUM_EXPERTS = 4
NUM_UNITS = NUM_BLOCKS + 1 + 2  # embedding, 3 blocks, head

Records = list[tuple[float, dict[str, torch.Tensor]]]


def _shard(tensor: torch.Tensor, dp_rank: int, size: int = MICRO_BATCH) -> torch.Tensor:
    return tensor[dp_rank * size : (dp_rank + 1) * size]


def _reference(
    build: Callable[[], nn.Module], dp_world: int, shard_size: int = MICRO_BATCH
) -> Reference:
    """One process, the same per-rank losses: the gradient of each dp shard's loss, summed,
    divided by dp_world (the MoE layers attach their load-balancing loss with weight 1 whatever
    scales the logits' loss, so the division comes after backward, as in the data-parallel
    average)."""
    model = build()
    names_of: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), set()).add(name)
    optimizer = optimizer_factory()(model.parameters())
    records = []
    for step in range(STEPS):
        inputs, targets = batch(shard_size * dp_world, step)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for dp_rank in range(dp_world):
            x, y = _shard(inputs, dp_rank, shard_size), _shard(targets, dp_rank, shard_size)
            loss = loss_fn(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            total += loss.item() / dp_world
        for param in model.parameters():
            if param.grad is not None:
                param.grad.div_(dp_world)
        grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        records.append((total, grads))
        optimizer.step()
    return Reference(records=records, aliases=list(names_of.values()))


def _ep_worker(rank: int, world_size: int, ep_degree: int, traced: bool) -> Records:
    edp = world_size // ep_degree
    mesh = init_device_mesh("cpu", (edp, ep_degree), mesh_dim_names=("edp", "ep"))
    model = build_model("moe")
    if traced:  # the runtime's path: passes run on the split units, GroupedExperts a leaf
        (stage,) = split_stages(trace(model), make_plan(num_units=NUM_UNITS)).stages
        model = stage.module
    result = apply_expert_parallel(model, mesh["ep"])
    assert [p.rpartition("blocks.")[2] for p in result.expert_modules] == [
        "1.mlp.experts",
        "2.mlp.experts",
    ]
    experts = model.get_submodule(result.expert_modules[0])
    assert isinstance(experts, ExpertParallelExperts)
    assert isinstance(experts.w_gate, DTensor) and experts.w_gate.placements == (Shard(0),)
    assert experts.w_gate.to_local().size(0) == NUM_EXPERTS // ep_degree
    optimizer = optimizer_factory()(model.parameters())
    records = []
    for step in range(STEPS):
        inputs, targets = batch(MICRO_BATCH * world_size, step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(_shard(inputs, rank)), _shard(targets, rank))
        loss.backward()  # type: ignore[no-untyped-call]
        reduce_gradients(
            model,
            dp_group=dist.group.WORLD,
            expert_dp_group=mesh["edp"].get_group() if edp > 1 else None,
            dp_world_size=world_size,
        )
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        named = ((original_fqn(n), p) for n, p in model.named_parameters())
        records.append((mean_loss.item() / world_size, full_grads(named)))
        optimizer.step()
    return records


@pytest.mark.parametrize(
    ("world_size", "ep_degree", "traced"),
    [(2, 2, False), (2, 2, True), (4, 2, False)],
    ids=["ep2", "ep2-traced", "ep2xdp2"],
)
def test_expert_parallel_matches_one_process(
    world_size: int, ep_degree: int, traced: bool, tmp_path: Path
) -> None:
    results = run_distributed(
        _ep_worker, ep_degree, traced, world_size=world_size, tmp_path=tmp_path
    )
    assert_matches(results, _reference(lambda: build_model("moe"), world_size))


def _cp_ep_worker(rank: int, world_size: int) -> Records:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = build_model("moe-noaux")
    apply_context_parallel(model, mesh, seq_len=SEQ)
    apply_expert_parallel(model, mesh)  # ep over the cp ranks (torchtitan lets ep span cp)
    optimizer = optimizer_factory()(model.parameters())
    records = []
    for step in range(STEPS):
        inputs, targets = batch(MICRO_BATCH, step)
        optimizer.zero_grad(set_to_none=True)
        local_inputs, local_targets = (
            shard_sequence(t, world_size, rank) for t in (inputs, targets)
        )
        loss = loss_fn(model(local_inputs), local_targets)
        loss.backward()  # type: ignore[no-untyped-call]
        # cp ranks are data-parallel for weight gradients (passes/context_parallel.py).
        reduce_gradients(model, dp_group=dist.group.WORLD, expert_dp_group=None, dp_world_size=2)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        records.append((mean_loss.item() / world_size, full_grads(model.named_parameters())))
        optimizer.step()
    return records


def test_cp2_ep2_moe_matches_one_process(tmp_path: Path) -> None:
    results = run_distributed(_cp_ep_worker, world_size=2, tmp_path=tmp_path)
    assert_matches(results, reference("moe-noaux", MICRO_BATCH))


def test_ep_not_dividing_experts_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="ep_degree 3 does not divide num_experts 4"):
        check_expert_parallel(4, 3)
    # The fake process group moves no data: the errors come from the checks alone.
    with (
        fake_process_group(3),
        pytest.raises(PlanError, match="ep_degree 3 does not divide num_experts 4"),
    ):
        apply_expert_parallel(build_model("moe"), dist.group.WORLD)


def test_expert_parallel_on_a_dense_model_is_a_plan_error() -> None:
    with fake_process_group(2), pytest.raises(PlanError, match="a MoE plan for a dense model"):
        apply_expert_parallel(build_model("llama"), dist.group.WORLD)


def _pp_ep_worker(rank: int, world_size: int) -> Records:
    """pp2 x ep2: each pipeline stage's 2 ranks split its experts (ep borrows the dp axis)."""
    plan = make_plan(pp=2, dp=2, num_micro_batches=2, num_units=NUM_UNITS, schedule="1f1b")
    mesh = build_mesh(plan, "cpu")
    model = build_model("moe")
    (stage,) = split_stages(trace(model), plan, stage_indices=[mesh.pp_rank]).stages
    result = apply_expert_parallel(stage.module, mesh.sub("dp"))
    assert len(result.expert_modules) == 1  # blocks 1 and 2 are in different stages
    pipeline = build_pipeline(
        [stage.module], [mesh.pp_rank], plan, mesh, loss_fn, torch.device("cpu")
    )
    dp_group = mesh.sub("dp").get_group()
    optimizer = optimizer_factory()(stage.module.parameters())
    records = []
    for step in range(STEPS):
        inputs, targets = batch(plan.global_batch_size, step)
        local = plan.global_batch_size // plan.dp_degree
        x, y = _shard(inputs, mesh.dp_rank, local), _shard(targets, mesh.dp_rank, local)
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if pipeline.is_first:
            pipeline.schedule.step(x, return_outputs=False)
        else:
            pipeline.schedule.step(target=y, losses=losses, return_outputs=False)
        # scale_grads: each rank's gradients are its micro-batches' mean; then the dp mean.
        reduce_gradients(
            stage.module, dp_group=dp_group, expert_dp_group=None, dp_world_size=plan.dp_degree
        )
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.all_reduce(loss)  # the last stage's 2 ranks hold the losses
        named = ((original_fqn(n), p) for n, p in stage.module.named_parameters())
        records.append((loss.item() / plan.dp_degree, full_grads(named)))
        optimizer.step()
    return records


def test_pp2_ep2_moe_matches_one_process(tmp_path: Path) -> None:
    results = run_distributed(_pp_ep_worker, world_size=4, tmp_path=tmp_path)
    # 4 sequences: 2 dp ranks x 2 micro-batches of 1, each a shard of the reference
    reference_ = _reference(lambda: build_model("moe"), dp_world=4, shard_size=1)
    # Loss: only the last stage's ranks see it; the first stage's report their gradients only.
    last = [records for rank, records in enumerate(results) if rank >= 2]
    first = [
        [(reference_.records[step][0], grads) for step, (_, grads) in enumerate(records)]
        for records in results[:2]
    ]
    assert_matches(last + first, reference_)


def _ep_fsdp_worker(rank: int, world_size: int) -> Records:
    """ep2 x dp2 with FSDP2 (ZeRO-3) as torchtitan composes them: the experts fully sharded
    over the edp mesh, every block and the root over the 4-rank dp mesh (edp x ep flattened).
    FSDP averages the experts' gradients over edp; they need / dp_world (module docs), so a
    further / ep. torchtitan sets ``set_gradient_divide_factor(dp_world)`` on the experts
    instead, which reduces with PREMUL_SUM: not in gloo, so here the shards are divided."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    dp_mesh = mesh["edp", "ep"]._flatten("dp")
    model = build_model("moe")
    result = apply_expert_parallel(model, mesh["ep"])
    expert_params = []
    for path in result.expert_modules:
        experts = fully_shard(model.get_submodule(path), mesh=mesh["edp"])
        expert_params.extend(experts.parameters())
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = optimizer_factory()(model.parameters())
    records = []
    for step in range(STEPS):
        inputs, targets = batch(MICRO_BATCH * world_size, step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(_shard(inputs, rank)), _shard(targets, rank))
        loss.backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for param in expert_params:
                param.grad.to_local().div_(result.ep_degree)  # type: ignore[union-attr]
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        records.append((mean_loss.item() / world_size, full_grads(model.named_parameters())))
        optimizer.step()
    return records


def test_ep2_dp2_fsdp_matches_one_process(tmp_path: Path) -> None:
    results = run_distributed(_ep_fsdp_worker, world_size=4, tmp_path=tmp_path)
    assert_matches(results, _reference(lambda: build_model("moe"), 4))


def test_applying_twice_is_a_plan_error() -> None:
    with fake_process_group(2):
        model = build_model("moe")
        apply_expert_parallel(model, dist.group.WORLD)
        with pytest.raises(PlanError, match="already applied"):
            apply_expert_parallel(model, dist.group.WORLD)


def test_meta_model_stays_meta_with_local_shapes() -> None:
    """The runtime applies passes to a meta model and materialises shards afterwards."""
    with fake_process_group(2):
        model = build_model("moe", device="meta")
        cp = apply_context_parallel(model, dist.group.WORLD, seq_len=SEQ)
        ep = apply_expert_parallel(model, dist.group.WORLD)
        w_gate = model.get_submodule(ep.expert_modules[0]).w_gate
        assert isinstance(w_gate, DTensor) and w_gate.to_local().is_meta
        assert w_gate.shape[0] == NUM_EXPERTS and w_gate.to_local().shape[0] == NUM_EXPERTS // 2
        assert model.rope_cos.is_meta and model.rope_cos.size(0) == SEQ // 2
        assert cp.position_buffers == ("rope_cos", "rope_sin")
