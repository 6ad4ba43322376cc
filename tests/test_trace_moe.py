"""Tracing mixture-of-experts models: the experts as units of work.

Every MoE preset traces on meta with torch.fx (the experts a leaf, balanced routing assumed),
its units and parameters are the model's, and each `MoELayerProfile` holds the numbers worked
by hand here: parameters and FLOPs per expert, routed tokens, tokens per expert, all-to-all
bytes. Dense models get no MoE layers and their `autoplan trace --json` has no ``moe`` key.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from torch import nn

from autoplan.cli.trace_cmd import moe_lines, trace_data
from autoplan.contract.graph import ModelGraph, MoELayerProfile
from autoplan.models import MoEConfig, moe, preset, preset_config
from autoplan.models.moe import num_params_closed_form
from autoplan.tracing import trace
from autoplan.tracing.units import find_blocks
from passes import split_stages
from tests.numerics import make_plan

TINY: dict[str, Any] = dict(
    num_layers=3,
    hidden_size=32,
    num_heads=4,
    seq_len=16,
    vocab_size=97,
    num_experts=4,
    top_k=2,
    moe_ffn_hidden_size=24,
    num_kv_heads=2,
    ffn_hidden_size=48,
    num_shared_experts=1,
    num_dense_layers=1,
)


@functools.cache
def traced_preset(name: str) -> ModelGraph:
    return trace(preset(name))


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-moe-16b"])
def test_moe_presets_trace_on_meta_with_fx(name: str) -> None:
    config = preset_config(name)
    assert isinstance(config, MoEConfig)
    graph = traced_preset(name)
    profile = graph.profile
    assert graph.front_end == "fx"
    # embedding, every block (a dense first layer too: not merged into the embedding), head
    assert [u.kind for u in profile.units] == ["embedding"] + ["block"] * config.num_layers + [
        "head"
    ]
    assert [u.name for u in profile.units[1:-1]] == [
        f"blocks.{i}" for i in range(config.num_layers)
    ]
    assert profile.num_params == num_params_closed_form(config)
    assert len(graph.moe_layers) == config.num_moe_layers
    assert [layer.unit for layer in graph.moe_layers] == [
        1 + i for i in range(config.num_dense_layers, config.num_layers)
    ]
    assert graph.unit_moe_layers(1 + config.num_dense_layers)[0].path == (
        f"blocks.{config.num_dense_layers}.mlp"
    )
    for layer in graph.moe_layers:  # the experts call is one op of its unit
        ops = [op.name for op in profile.units[layer.unit].ops]
        assert layer.experts_node in ops


def test_mixtral_expert_facts_by_hand() -> None:
    layer = traced_preset("mixtral-8x7b").moe_layers[0]
    h, f, seq, k, e = 4096, 14336, 32768, 2, 8
    assert (layer.num_experts, layer.top_k, layer.hidden_size) == (e, k, h)
    assert layer.expert_ffn_hidden_size == f
    assert layer.num_params_per_expert == 3 * h * f == 176_160_768
    assert layer.param_bytes_per_expert == 4 * 3 * h * f  # traced in float32
    assert layer.num_router_params == h * e and layer.num_shared_expert_params == 0
    # SwiGLU: three (1, h) x (h, f)-sized GEMMs per token, 2 FLOPs per multiply-add.
    assert layer.forward_flops_per_token_per_expert == 6 * h * f == 352_321_536
    assert layer.backward_flops_per_token_per_expert == 2 * 6 * h * f  # input and weight grads
    assert layer.routed_tokens_per_sample == seq * k
    assert layer.tokens_per_expert_per_sample == seq * k / e == 8192
    assert layer.tokens_per_expert(micro_batch_size=2) == 16384
    assert layer.expert_forward_flops(1) == 8192 * 6 * h * f
    assert layer.dtype_bytes == 4
    assert layer.dispatch_bytes(1) == seq * k * h * 4 == 2**30
    assert layer.dispatch_bytes(2, dtype_bytes=2) == 2 * seq * k * h * 2


def test_deepseek_expert_facts_by_hand() -> None:
    graph = traced_preset("deepseek-moe-16b")
    layer = graph.moe_layers[0]
    h, f, seq, k, e = 2048, 1408, 4096, 6, 64
    assert (layer.unit, layer.path, layer.experts_path) == (
        2,
        "blocks.1.mlp",
        "blocks.1.mlp.experts",
    )
    assert layer.num_params_per_expert == 3 * h * f == 8_650_752
    assert layer.num_shared_expert_params == 3 * h * 2 * f == 17_301_504
    assert layer.num_router_params == h * e == 131_072
    assert layer.forward_flops_per_token_per_expert == 6 * h * f
    assert layer.tokens_per_expert_per_sample == seq * k / e == 384
    assert layer.dispatch_bytes(4, dtype_bytes=2) == 4 * seq * k * h * 2
    assert graph.unit_moe_layers(1) == ()  # the dense first layer


def block_forward_flops(t: int, c: dict[str, Any], *, moe_layer: bool) -> int:
    """Forward FLOPs of one tiny block on t tokens, by hand (2 per multiply-add; causal
    attention: QK^T and AV over the t (t + 1) / 2 scores a causal kernel computes)."""
    h, hd = c["hidden_size"], c["hidden_size"] // c["num_heads"]
    kv = c["num_kv_heads"] * hd
    attention = 2 * t * h * (2 * h + 2 * kv) + 2 * t * (t + 1) * hd * c["num_heads"]
    if not moe_layer:
        return attention + 3 * 2 * t * h * c["ffn_hidden_size"]
    router = 2 * t * h * c["num_experts"]
    experts = t * c["top_k"] * 6 * h * c["moe_ffn_hidden_size"]
    shared = 3 * 2 * t * h * c["num_shared_experts"] * c["moe_ffn_hidden_size"]
    return attention + router + experts + shared


@pytest.mark.parametrize("batch_size", [1, 2])
def test_tiny_moe_block_flops_by_hand(batch_size: int) -> None:
    graph = trace(moe(**TINY), batch_size=batch_size)
    units = graph.profile.units
    t = TINY["seq_len"]
    assert units[1].forward_flops == block_forward_flops(t, TINY, moe_layer=False)
    assert units[2].forward_flops == block_forward_flops(t, TINY, moe_layer=True) == 340_992
    layer = graph.moe_layers[0]
    assert layer.routed_tokens_per_sample == t * TINY["top_k"]  # per sample at any batch
    assert layer.forward_flops_per_token_per_expert == 6 * 32 * 24
    # TP still finds attention and the shared expert's column/row pair; the experts are not TP.
    assert units[2].tp.divisible_counts() == {
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_hidden_size": 24,
    }


def test_uneven_split_keeps_the_total() -> None:
    # 5 tokens x top-1 over 4 experts: balanced split 2, 1, 1, 1; the FLOPs are the same total.
    graph = trace(moe(**{**TINY, "top_k": 1, "seq_len": 5}))
    layer = graph.moe_layers[0]
    assert layer.routed_tokens_per_sample == 5
    assert layer.tokens_per_expert_per_sample == 1.25
    assert layer.forward_flops_per_token_per_expert == 6 * 32 * 24


def test_bf16_trace_dispatches_two_byte_tokens() -> None:
    graph = trace(moe(**TINY, dtype=torch.bfloat16))
    layer = graph.moe_layers[0]
    assert layer.dtype_bytes == 2 and layer.param_bytes_per_expert == 2 * 3 * 32 * 24
    assert layer.dispatch_bytes(3) == 3 * 16 * 2 * 32 * 2


def test_trace_json_lists_experts_and_dense_models_have_none() -> None:
    data = trace_data(trace(moe(**TINY), batch_size=2))
    assert "moe" not in data["units"][1]  # the dense first block keeps the dense keys only
    (entry,) = data["units"][2]["moe"]
    assert entry["num_experts"] == 4 and entry["top_k"] == 2
    assert entry["tokens_per_expert"] == 2 * 16 * 2 / 4
    assert entry["dispatch_bytes"] == entry["combine_bytes"] == 2 * 16 * 2 * 32 * 4
    (line,) = moe_lines(data)
    assert line.startswith("experts in blocks.1 .. blocks.2 (x2): 4 experts, top-2")
    dense = trace(preset("gpt2-small", num_layers=2))
    assert dense.moe_layers == ()
    assert all("moe" not in unit for unit in trace_data(dense)["units"])


def test_moe_layer_profile_is_frozen_plain_data() -> None:
    layer = traced_preset("deepseek-moe-16b").moe_layers[0]
    assert isinstance(layer, MoELayerProfile)
    with pytest.raises(AttributeError):
        layer.top_k = 1  # type: ignore[misc]
    # Layers of identical blocks differ only in where they are.
    last = traced_preset("deepseek-moe-16b").moe_layers[-1]
    assert dataclasses.replace(last, unit=layer.unit, path=layer.path,
                               experts_path=layer.experts_path,
                               experts_node=layer.experts_node) == layer  # fmt: skip
    assert hash(layer) == hash(dataclasses.replace(layer))


def test_find_blocks_groups_one_class_in_a_module_list() -> None:
    # A ModuleList of one block class whose first child differs (DeepSeekMoE's dense layer 0)
    # is one run; a Sequential needs identical structure, and other classes break a run.
    model = moe(**TINY)
    run = find_blocks(model)
    assert run is not None and run.paths == ("blocks.0", "blocks.1", "blocks.2")

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.steps = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8))
            self.mixed = nn.ModuleList([nn.Linear(2, 2), nn.Conv1d(2, 2, 1), nn.Linear(2, 2)])

    found = find_blocks(Holder())
    assert found is not None and found.paths == ("steps.1", "steps.2")


@pytest.mark.parametrize("pp", [2, 3])
def test_moe_graph_splits_into_stages_that_compute_the_model(pp: int) -> None:
    model = moe(**{**TINY, "num_layers": 4}, device="cpu")
    graph = trace(model, batch_size=2)
    split = split_stages(graph, make_plan(pp=pp, num_micro_batches=4, num_units=6))
    ids = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"]))
    value: object = ids
    for stage in split.stages:
        value = stage.module(*value) if isinstance(value, tuple) else stage.module(value)
    # Same ops on the same tensors in the same order (experts included): bit-identical.
    assert isinstance(value, torch.Tensor) and torch.equal(value, model(ids))


def test_the_cost_model_reads_the_traced_experts() -> None:
    """Every MoE unit of the profile carries its layer's facts (the dense layer none), and
    expert parallelism changes the price through them: on one node ep = 8 spreads the experts'
    weights, so the memory of a rank falls, and the all-to-alls add time."""
    import autoplan

    graph = traced_preset("deepseek-moe-16b")
    layers = {layer.unit: layer for layer in graph.moe_layers}
    for i, unit in enumerate(graph.profile.units):
        layer = layers.get(i)
        if layer is None:
            assert unit.moe is None
            continue
        assert unit.moe is not None
        assert unit.moe.experts_op == layer.experts_node
        assert unit.moe.num_experts == layer.num_experts == 64
        assert unit.moe.params_per_expert == layer.num_params_per_expert
        assert unit.moe.routed_tokens_per_sample == layer.routed_tokens_per_sample
    assert graph.profile.units[1].moe is None  # DeepSeekMoE's first layer is dense
    cluster = autoplan.Cluster.preset("dgx-h100-80g")
    args = dict(tp=1, pp=1, dp=8, micro_batch=1, global_batch=8, zero=1, recompute="full")
    one = autoplan.estimate(graph, cluster, autoplan.manual_plan(graph, cluster, **args))
    eight = autoplan.estimate(graph, cluster, autoplan.manual_plan(graph, cluster, ep=8, **args))
    assert eight.peak_memory_bytes < one.peak_memory_bytes
    assert eight.stages[0].ep_comm_s > 0 == one.stages[0].ep_comm_s


def test_identical_moe_blocks_share_one_unit_class() -> None:
    """The cost model prices a class of identical units once (`unit_classes`); the experts
    op's name carries its block's index and must not make each MoE block a class of its own
    (mixtral-8x7b's search spent 16 s pricing 32 copies)."""
    from cost_model.estimate import unit_classes

    profile = traced_preset("mixtral-8x7b").profile
    classes = unit_classes(profile)
    blocks = [i for i, unit in enumerate(profile.units) if unit.moe is not None]
    assert len(blocks) == 32 and {classes[i] for i in blocks} == {blocks[0]}
