"""The materialise pass: seeded, plan-independent initialisation of a meta model's shards."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from autoplan.models import gpt, llama
from autoplan.tracing import trace
from passes import (
    apply_data_parallel,
    apply_tensor_parallel,
    build_mesh,
    has_meta_tensors,
    init_full_model_,
    materialize,
    meta_buffer_values,
    split_stages,
)
from passes.split import original_fqn
from tests.dist_utils import fake_process_group
from tests.numerics import build_model, make_plan, row_paths


def test_the_rule_is_gpt2s() -> None:
    model = gpt(4, 128, 4, 16, 512, device="cpu")
    rows, num_blocks = row_paths(model)
    init_full_model_(model, seed=3, row_paths=rows, num_blocks=num_blocks)
    block = model.blocks[0]
    assert torch.equal(block.ln_1.weight, torch.ones(128))
    assert torch.equal(block.ln_1.bias, torch.zeros(128))
    assert torch.equal(block.attn.q_proj.bias, torch.zeros(128))
    # Statistical checks on 16k-512k samples: 5% relative error is > 10 standard errors away.
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * 4)  # GPT-2: scaled by 1/sqrt(2 * num_layers)
    assert block.attn.o_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert block.mlp.down_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    # Different parameters, different draws; the same seed, the same values.
    assert not torch.equal(block.attn.q_proj.weight, block.attn.k_proj.weight)
    again = gpt(4, 128, 4, 16, 512, device="cpu")
    init_full_model_(again, seed=3, row_paths=rows, num_blocks=num_blocks)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )


def test_buffers_of_a_meta_model_are_computed_without_its_parameters() -> None:
    values = meta_buffer_values(llama(2, 32, 4, 16, 64, device="meta"))
    real = llama(2, 32, 4, 16, 64, device="cpu")
    assert set(values) == {"rope_cos", "rope_sin"}
    torch.testing.assert_close(values["rope_cos"], real.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(values["rope_sin"], real.rope_sin, rtol=0, atol=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_keeps_its_slice_of_the_same_weights(rank: int) -> None:
    """dp2 x tp2 with ZeRO-3 (2-D FSDP + TP layouts), checked from ranks 0 and 1."""
    full = build_model("gpt")
    rows, num_blocks = row_paths(full)
    init_full_model_(full, seed=11, row_paths=rows, num_blocks=num_blocks)
    expected = dict(full.named_parameters(remove_duplicate=False))

    plan = make_plan(dp=2, tp=2, zero=3)
    with fake_process_group(4, rank=rank):
        mesh = build_mesh(plan, "cpu")
        model = build_model("gpt", device="meta")
        split = split_stages(trace(model), plan)
        (stage,) = split.stages
        apply_tensor_parallel(
            stage, mesh.sub("tp"), sequence_parallel=False, shared=split.shared_in_stage[0]
        )
        apply_data_parallel(stage, mesh, plan)
        assert has_meta_tensors([stage.module])
        materialize(split, torch.device("cpu"), seed=11, num_blocks=num_blocks, buffers={})
        assert not has_meta_tensors([stage.module])
        checked = 0
        for name, param in stage.module.named_parameters():
            assert isinstance(param, DTensor)
            # The slice of the full tensor this rank's layout selects, cut without communication.
            want = torch.distributed.tensor.distribute_tensor(
                expected[original_fqn(name)].detach(),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            ).to_local()
            torch.testing.assert_close(param.to_local(), want, rtol=0, atol=0)
            checked += 1
        assert checked == len(list(full.parameters()))
