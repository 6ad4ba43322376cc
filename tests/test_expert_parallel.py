"""Expert parallelism (passes/expert_parallel.py) against one process, on CPU/gloo.

A tiny MoE language model (4 experts, top-2, one dense block, one MoE block with a shared
expert, one without) trains 3 AdamW steps under ep2 (2 ranks, each with its own tokens) and
ep2 x dp2 (4 ranks: the experts sharded over ep, each expert replicated over the 2-rank
expert-data-parallel group). Each rank's loss (the mean over the data-parallel world) and
every gradient (expert weights gathered from their DTensor shards) must equal a single-process
reference that accumulates the same per-rank mean losses / dp_world over the same shards of
the global batch (tolerances: tests/numerics.py; the all-to-alls only move rows, so the
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
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from autoplan.contract.errors import PlanError
from passes.expert_parallel import (
    ExpertParallelExperts,
    apply_expert_parallel,
    check_expert_parallel,
    reduce_gradients,
)
from tests.dist_utils import fake_process_group, run_distributed
from tests.moe_double import NUM_EXPERTS, GroupedExperts, tiny_moe
from tests.numerics import (
    STEPS,
    Reference,
    assert_matches,
    batch,
    build_model,
    full_grads,
    loss_fn,
    optimizer_factory,
)

MICRO_BATCH = 2  # sequences per data-parallel rank

Records = list[tuple[float, dict[str, torch.Tensor]]]


def _shard(tensor: torch.Tensor, dp_rank: int) -> torch.Tensor:
    return tensor[dp_rank * MICRO_BATCH : (dp_rank + 1) * MICRO_BATCH]


def _reference(build: Callable[[], nn.Module], dp_world: int) -> Reference:
    """One process, the same per-rank losses: sum over the dp shards of loss / dp_world."""
    model = build()
    names_of: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), set()).add(name)
    optimizer = optimizer_factory()(model.parameters())
    records = []
    for step in range(STEPS):
        inputs, targets = batch(MICRO_BATCH * dp_world, step)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for dp_rank in range(dp_world):
            loss = loss_fn(model(_shard(inputs, dp_rank)), _shard(targets, dp_rank)) / dp_world
            loss.backward()  # type: ignore[no-untyped-call]
            total += loss.item()
        grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        records.append((total, grads))
        optimizer.step()
    return Reference(records=records, aliases=list(names_of.values()))


class _ExpertsLeafTracer(fx.Tracer):
    """As the zoo's tracer: GroupedExperts (host-side split sizes) stays one call_module."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, GroupedExperts) or super().is_leaf_module(m, module_qualified_name)


def _ep_worker(rank: int, world_size: int, ep_degree: int, traced: bool) -> Records:
    edp = world_size // ep_degree
    mesh = init_device_mesh("cpu", (edp, ep_degree), mesh_dim_names=("edp", "ep"))
    model: nn.Module = tiny_moe()
    if traced:  # the runtime's path: passes run on fx units, not on the eager model
        model = fx.GraphModule(model, _ExpertsLeafTracer().trace(model))
    result = apply_expert_parallel(model, mesh["ep"])
    assert result.expert_modules == ("blocks.1.mlp.experts", "blocks.2.mlp.experts")
    experts = model.get_submodule("blocks.1.mlp.experts")
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
        records.append((mean_loss.item() / world_size, full_grads(model.named_parameters())))
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
    assert_matches(results, _reference(tiny_moe, world_size))


def test_ep_not_dividing_experts_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="ep_degree 3 does not divide num_experts 4"):
        check_expert_parallel(4, 3)
    # The fake process group moves no data: the errors come from the checks alone.
    with (
        fake_process_group(3),
        pytest.raises(PlanError, match="ep_degree 3 does not divide num_experts 4"),
    ):
        apply_expert_parallel(tiny_moe(), dist.group.WORLD)


def test_expert_parallel_on_a_dense_model_is_a_plan_error() -> None:
    with fake_process_group(2), pytest.raises(PlanError, match="a MoE plan for a dense model"):
        apply_expert_parallel(build_model("llama"), dist.group.WORLD)
