"""Context parallelism (passes/context_parallel.py) against one process, on CPU/gloo.

Layout: the head-tail sharding equals torch's `_HeadTailLoadBalancer` and unshards back.
Ring attention: output and q/k/v gradients equal causal SDPA on the full sequence (cp2, cp3, cp4,
grouped-query heads). Training: the zoo's llama under cp2 and cp2 x tp2 (the repo's
tensor-parallel pass on a traced, split model) trains 3 AdamW steps with the loss (averaged
over cp) and every gradient equal to a single-process reference's (tests/numerics.py).
Bad input fails with `PlanError` before any collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

from autoplan.contract.errors import PlanError
from passes.context_parallel import (
    apply_context_parallel,
    average_gradients,
    check_context_parallel,
    load_balanced_positions,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from tests.dist_utils import fake_process_group, run_distributed
from tests.numerics import (
    HIDDEN,
    SEQ,
    STEPS,
    assert_matches,
    batch,
    build_model,
    full_grads,
    loss_fn,
    make_plan,
    optimizer_factory,
    reference,
)

GLOBAL_BATCH = 2

# Ring attention vs SDPA: both in fp32, the ring merges cp partial softmaxes with log-sum-exp
# (exp/log round-off, ~1e-7 relative) and sums dK/dV contributions in another order. Measured
# differences are below 1e-6; a wrong mask or a dropped block changes outputs by O(0.1).
ATTN_RTOL, ATTN_ATOL = 1e-5, 1e-6


@pytest.mark.parametrize(("seq_len", "cp"), [(16, 2), (24, 3), (32, 4)])
def test_layout_is_torch_head_tail(seq_len: int, cp: int) -> None:
    torch_order = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0].view(cp, -1)
    for rank in range(cp):
        assert load_balanced_positions(seq_len, cp, rank).tolist() == torch_order[rank].tolist()
    x = torch.arange(3 * seq_len).view(3, seq_len)
    shards = [shard_sequence(x, cp, r) for r in range(cp)]
    assert all(s.shape == (3, seq_len // cp) for s in shards)
    torch.testing.assert_close(unshard_sequence(shards), x)


def test_seq_not_divisible_by_two_cp_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match=r"seq_len 18 is not divisible by 2 \* cp_degree = 4"):
        check_context_parallel(18, 2)
    with pytest.raises(PlanError, match="divisible"):
        shard_sequence(torch.zeros(1, 6), 2, 0)


def test_bad_input_raises_before_any_collective() -> None:
    # The fake process group moves no data: an error here is raised by the checks alone.
    with fake_process_group(2):
        model = build_model("llama")
        with pytest.raises(PlanError, match="not divisible by 2 \\* cp_degree"):
            apply_context_parallel(model, dist.group.WORLD, seq_len=SEQ + 2)
        with pytest.raises(PlanError, match="no attention in GPT"):
            apply_context_parallel(build_model("gpt"), dist.group.WORLD, seq_len=SEQ)
        with pytest.raises(PlanError, match="fewer than the sequence length"):
            apply_context_parallel(model, dist.group.WORLD, seq_len=2 * SEQ)
        with pytest.raises(PlanError, match="needs CUDA"):
            apply_context_parallel(model, dist.group.WORLD, seq_len=SEQ, backend="torch")


def _attention_worker(rank: int, world_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, seq_len, 8, generator=generator)  # 4 query heads
    k = torch.randn(2, 2, seq_len, 8, generator=generator)  # 2 kv heads (GQA)
    v = torch.randn(2, 2, seq_len, 8, generator=generator)
    dout = torch.randn(2, 4, seq_len, 8, generator=generator)
    local = [shard_sequence(t, world_size, rank, seq_dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, dist.group.WORLD)
    out.backward(shard_sequence(dout, world_size, rank, seq_dim=2))
    return {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_attention_matches_causal_sdpa(cp: int, tmp_path: Path) -> None:
    seq_len = 8 * cp
    results = run_distributed(_attention_worker, seq_len, world_size=cp, tmp_path=tmp_path)
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, seq_len, 8, generator=generator).requires_grad_()
    k = torch.randn(2, 2, seq_len, 8, generator=generator).requires_grad_()
    v = torch.randn(2, 2, seq_len, 8, generator=generator).requires_grad_()
    dout = torch.randn(2, 4, seq_len, 8, generator=generator)
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True
    )
    out.backward(dout)
    expected = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, want in expected.items():
        got = unshard_sequence([r[name] for r in results], seq_dim=2)
        torch.testing.assert_close(got, want, rtol=ATTN_RTOL, atol=ATTN_ATOL, msg=name)


# ---------------------------------------------------------------------------------------------
# Training


def _train(
    model: torch.nn.Module,
    forward: Any,
    cp_group: dist.ProcessGroup,
    cp_rank: int,
    named: Any,
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """3 AdamW steps on this rank's tokens; per step the cp-mean loss and the full gradients."""
    cp = dist.get_world_size(cp_group)
    optimizer = optimizer_factory()(model.parameters())
    records = []
    for step in range(STEPS):
        inputs, targets = batch(GLOBAL_BATCH, step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(
            forward(shard_sequence(inputs, cp, cp_rank)), shard_sequence(targets, cp, cp_rank)
        )
        loss.backward()  # type: ignore[no-untyped-call]
        average_gradients(model, cp_group)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=cp_group)
        records.append((mean_loss.item() / cp, full_grads(named())))
        optimizer.step()
    return records


def _cp_worker(
    rank: int, world_size: int, recompute: bool
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    model = build_model("llama")
    result = apply_context_parallel(model, dist.group.WORLD, seq_len=SEQ)
    assert result.attention_sites == ("blocks.0.attn", "blocks.1.attn")
    assert result.position_buffers == ("rope_cos", "rope_sin")
    if recompute:  # the ring's forward (and its K/V shifts) runs again inside backward
        for block in model.blocks:  # type: ignore[union-attr]
            checkpoint(block)
    return _train(model, model, dist.group.WORLD, rank, model.named_parameters)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_cp2_llama_matches_one_process(recompute: bool, tmp_path: Path) -> None:
    results = run_distributed(_cp_worker, recompute, world_size=2, tmp_path=tmp_path)
    assert_matches(results, reference("llama", GLOBAL_BATCH))


def _cp_tp_worker(rank: int, world_size: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    from autoplan.tracing import trace
    from passes import apply_tensor_parallel, original_fqn, split_stages

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = build_model("llama")
    split = split_stages(trace(model), make_plan(tp=2))
    (stage,) = split.stages
    tp = apply_tensor_parallel(
        stage, mesh["tp"], sequence_parallel=False, shared=split.shared_in_stage[0]
    )
    assert tp.num_matched == 16  # 2 blocks x 7 linears + embedding + head
    result = apply_context_parallel(stage.module, mesh["cp"], seq_len=SEQ, backend="ring")
    assert len(result.attention_sites) == 2
    assert len(result.position_buffers) == 4  # each block unit holds its own rope tables

    def named() -> Any:
        return ((original_fqn(n), p) for n, p in stage.module.named_parameters())

    return _train(
        stage.module, stage.module, mesh["cp"].get_group(), mesh.get_local_rank("cp"), named
    )


def test_cp2_tp2_llama_matches_one_process(tmp_path: Path) -> None:
    results = run_distributed(_cp_tp_worker, world_size=4, tmp_path=tmp_path)
    assert_matches(results, reference("llama", GLOBAL_BATCH))


def test_cuda_backend_wraps_sdpa_with_torchs_context_parallel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Construction only: torch's ring attention needs the CUDA SDPA kernels (module docs)."""
    from torch.distributed.tensor.experimental._attention import (
        _disable_context_parallel_dispatcher,
    )

    from passes.context_parallel import TorchContextParallelCore

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        model = build_model("llama")
        try:
            result = apply_context_parallel(model, mesh, seq_len=SEQ)
        finally:
            _disable_context_parallel_dispatcher()
        assert result.backend == "torch"
        core = model.blocks[0].attn.attention_core  # type: ignore[union-attr,index]
        assert isinstance(core, TorchContextParallelCore)
        assert core.sdpa._forward_pre_hooks and core.sdpa._forward_hooks  # DTensor in, local out
        assert model.rope_cos.shape == (SEQ // 2, HIDDEN // 4)


def test_applying_twice_is_a_plan_error_and_buffer_values_follow() -> None:
    with fake_process_group(2):
        model = build_model("llama")
        full = {name: b.clone() for name, b in model.named_buffers()}
        result = apply_context_parallel(model, dist.group.WORLD, seq_len=SEQ)
        local = result.shard_buffer_values(full)  # what materialize copies after a meta build
        for name, buffer in model.named_buffers():
            torch.testing.assert_close(local[name], buffer, rtol=0, atol=0)
        with pytest.raises(PlanError, match="already applied"):
            apply_context_parallel(model, dist.group.WORLD, seq_len=SEQ)
        assert model.rope_cos.size(0) == SEQ // 2  # sharded once


def test_a_rank_s_rope_rows_stay_out_of_its_state_dict() -> None:
    # Each rank's rows are not the model's table: a checkpoint holding one rank's rows would
    # give them to every rank. Even a model that declares its table persistent loses it.
    with fake_process_group(2):
        model = build_model("llama")
        model._non_persistent_buffers_set.clear()
        assert "rope_cos" in model.state_dict()
        apply_context_parallel(model, dist.group.WORLD, seq_len=SEQ)
        assert model.rope_cos.size(0) == SEQ // 2
        assert not any("rope" in key for key in model.state_dict())
