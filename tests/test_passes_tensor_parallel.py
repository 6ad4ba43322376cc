"""The tensor-parallel pass on a 2-rank mesh (torch's fake process group: one process)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoplan.contract.errors import PlanError
from autoplan.contract.graph import ModelGraph
from autoplan.tracing import trace
from cost_model.workload import TpLinear
from passes import apply_tensor_parallel, build_mesh, split_stages
from tests.dist_utils import fake_process_group
from tests.numerics import build_model, make_plan


@pytest.fixture
def tp2() -> Iterator[None]:
    with fake_process_group(2):
        yield


def _tp(model_name: str, *, sequence_parallel: bool = False, graph: ModelGraph | None = None):  # type: ignore[no-untyped-def]
    graph = graph or trace(build_model(model_name))
    plan = make_plan(tp=2, sequence_parallel=sequence_parallel, num_units=graph.profile.num_units)
    split = split_stages(graph, plan)
    mesh = build_mesh(plan, "cpu")
    (stage,) = split.stages
    result = apply_tensor_parallel(
        stage, mesh.sub("tp"), sequence_parallel=sequence_parallel, shared=split.shared_in_stage[0]
    )
    return stage, result


def _placements(stage, path: str) -> tuple[object, ...]:  # type: ignore[no-untyped-def]
    weight = stage.module.get_parameter(path)
    assert isinstance(weight, DTensor), path
    return tuple(weight.placements)


@pytest.mark.usefixtures("tp2")
def test_every_traced_linear_gets_its_megatron_style() -> None:
    stage, result = _tp("gpt")
    expected = ["tok_emb", "lm_head"] + [
        f"blocks.{i}.{name}"
        for i in range(2)
        for name in (
            "attn.q_proj",
            "attn.k_proj",
            "attn.v_proj",
            "attn.o_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    assert sorted(result.linears) == sorted(expected)
    assert _placements(stage, "unit_1.blocks.0.attn.q_proj.weight") == (Shard(0),)  # column
    assert _placements(stage, "unit_1.blocks.0.attn.o_proj.weight") == (Shard(1),)  # row
    assert _placements(stage, "unit_2.blocks.1.mlp.down_proj.weight") == (Shard(1),)
    assert _placements(stage, "unit_0.tok_emb.weight") == (Shard(0),)  # vocab-parallel
    # The head tied to the embedding is still the same (sharded) parameter.
    assert stage.module.get_parameter("unit_3.lm_head.weight") is stage.module.get_parameter(
        "unit_0.tok_emb.weight"
    )
    # Norms and position embeddings stay plain, replicated tensors without sequence parallelism.
    assert not isinstance(stage.module.get_parameter("unit_1.blocks.0.ln_1.weight"), DTensor)
    assert result.sequence_parallel_norms == ()


@pytest.mark.usefixtures("tp2")
def test_swiglu_and_grouped_query_attention() -> None:
    stage, result = _tp("llama")
    assert "blocks.0.mlp.gate_proj" in result.linears
    assert _placements(stage, "unit_1.blocks.0.mlp.gate_proj.weight") == (Shard(0),)
    assert _placements(stage, "unit_1.blocks.0.attn.k_proj.weight") == (Shard(0),)  # 2 kv heads / 2


@pytest.mark.usefixtures("tp2")
def test_sequence_parallel_covers_every_norm() -> None:
    stage, result = _tp("llama", sequence_parallel=True)
    assert sorted(result.sequence_parallel_norms) == [
        "blocks.0.attn_norm",
        "blocks.0.mlp_norm",
        "blocks.1.attn_norm",
        "blocks.1.mlp_norm",
        "norm",
    ]
    assert _placements(stage, "unit_1.blocks.0.attn_norm.weight") == (Replicate(),)


@pytest.mark.usefixtures("tp2")
def test_sequence_parallel_moe_layers_route_their_shard() -> None:
    # the MoE layers' input norms hand over the local shard; the shared expert stays replicated
    stage, result = _tp("moe", sequence_parallel=True)
    assert [layer.path for layer in result.moe_layers] == [
        "unit_2.blocks.1.mlp",
        "unit_3.blocks.2.mlp",
    ]
    assert [layer.input_norm for layer in result.moe_layers] == [
        "unit_2.blocks.1.mlp_norm",
        "unit_3.blocks.2.mlp_norm",
    ]
    assert [layer.aux_loss_sites for layer in result.moe_layers] == [1, 1]
    assert result.moe_layers[0].replicated_parameters == (
        "unit_2.blocks.1.mlp.router.weight",
        "unit_2.blocks.1.mlp.shared_expert.gate_proj.weight",
        "unit_2.blocks.1.mlp.shared_expert.up_proj.weight",
        "unit_2.blocks.1.mlp.shared_expert.down_proj.weight",
    )
    assert len(result.replicated_linears) == 6  # 3 shared-expert linears in each MoE layer
    assert "unit_1.blocks.0.mlp.down_proj" not in result.replicated_linears  # the dense layer
    assert _placements(stage, "unit_2.blocks.1.mlp_norm.weight") == (Replicate(),)
    for name in result.moe_layers[0].replicated_parameters:
        assert not isinstance(stage.module.get_parameter(name), DTensor), name
    assert _placements(stage, "unit_1.blocks.0.mlp.down_proj.weight") == (Shard(1),)


@pytest.mark.usefixtures("tp2")
def test_without_sequence_parallelism_the_shared_expert_is_tensor_parallel() -> None:
    stage, result = _tp("moe")
    assert result.moe_layers == () and result.replicated_linears == ()
    assert _placements(stage, "unit_2.blocks.1.mlp.shared_expert.up_proj.weight") == (Shard(0),)
    assert not isinstance(stage.module.get_parameter("unit_2.blocks.1.mlp.router.weight"), DTensor)


@pytest.mark.usefixtures("tp2")
def test_a_rule_that_matches_nothing_is_an_error() -> None:
    graph = trace(build_model("gpt"))
    block = graph.profile.units[1]
    wrong = dataclasses.replace(
        block.tp, linears=(*block.tp.linears[:-1], TpLinear(path="mlp.missing_proj", style="row"))
    )
    units = list(graph.profile.units)
    units[1] = dataclasses.replace(block, tp=wrong)
    bad = dataclasses.replace(graph, profile=dataclasses.replace(graph.profile, units=tuple(units)))
    with pytest.raises(
        PlanError, match=r"'mlp.missing_proj' of unit 1 \('blocks.0'\) matches none"
    ):
        _tp("gpt", graph=bad)


@pytest.mark.usefixtures("tp2")
def test_hugging_face_llama_is_sharded_on_its_own_module_paths() -> None:
    # torch.export inlines every nn.Linear; the split pass restores them as module calls.
    stage, result = _tp("hf-llama")
    assert sorted(result.linears) == sorted(
        ["model.embed_tokens", "lm_head"]
        + [
            f"model.layers.{i}.{name}"
            for i in range(2)
            for name in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        ]
    )
    assert _placements(stage, "unit_1.model.layers.0.self_attn.k_proj.weight") == (Shard(0),)
    assert _placements(stage, "unit_1.model.layers.0.self_attn.o_proj.weight") == (Shard(1),)
    assert _placements(stage, "unit_0.model.embed_tokens.weight") == (Shard(0),)
    # repeat_kv's baked-in sizes are local: 2 kv heads -> 1, 4 heads -> 2 (the -1s stay).
    block = stage.module.get_submodule("unit_1")
    sizes = [
        list(n.args[1])
        for n in block.graph.nodes
        if str(n.target) in ("aten.expand.default", "aten.reshape.default")
    ]
    assert [1, 1, 2, 16, 8] in sizes and [1, 2, 16, 8] in sizes and [1, 4, 16, 8] not in sizes


@pytest.mark.usefixtures("tp2")
def test_a_layer_that_is_not_a_linear_is_refused() -> None:
    # Hugging Face GPT-2: q/k/v fused in one transposed Conv1D, left inlined by the export.
    with pytest.raises(PlanError, match=r"'transformer.h.0' calls no nn.Linear.*Conv1D"):
        _tp("hf-gpt2")
