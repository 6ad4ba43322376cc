"""The split pass: stages and per-unit submodules cut at the plan's boundaries (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from autoplan.contract.errors import PlanError
from autoplan.tracing import trace
from passes import split_stages
from tests.numerics import SEQ, VOCAB, build_model, make_plan

_COMPUTE = ("call_module", "call_function", "call_method")


def _chain(split_model: object, inputs: torch.Tensor) -> torch.Tensor:
    value: object = inputs
    for stage in split_model.stages:  # type: ignore[attr-defined]
        value = stage.module(*value) if isinstance(value, tuple) else stage.module(value)
    assert isinstance(value, torch.Tensor)
    return value


@pytest.mark.parametrize("model_name", ["gpt", "llama", "hf-gpt2"])
@pytest.mark.parametrize(
    "plan_args",
    [{"pp": 2}, {"pp": 4}, {"pp": 2, "virtual_stages": 2, "schedule": "interleaved-1f1b"}],
    ids=["2-stages", "4-stages", "2x2-virtual"],
)
def test_stages_run_in_order_compute_the_model(
    model_name: str, plan_args: dict[str, object]
) -> None:
    model = build_model(model_name)
    graph = trace(model, batch_size=2)
    split = split_stages(graph, make_plan(num_micro_batches=4, **plan_args))  # type: ignore[arg-type]
    inputs = torch.randint(0, VOCAB, (2, SEQ))
    out = model(inputs)
    expected = out.logits if hasattr(out, "logits") else out
    # Same ops on the same tensors in the same order: bit-identical.
    assert torch.equal(_chain(split, inputs), expected)


def test_units_keep_the_models_module_paths_and_objects() -> None:
    model = build_model("gpt")
    split = split_stages(trace(model), make_plan(pp=2))
    stage0, stage1 = split.stages
    assert [u.profile.name for u in stage0.units] == ["embedding", "blocks.0"]
    q_proj = stage0.module.get_submodule("unit_1.blocks.0.attn.q_proj")
    assert q_proj is model.blocks[0].attn.q_proj  # the same object: wrappers reach the model
    # No split_module-style renaming anywhere.
    names = [name for name, _ in stage1.module.named_modules()]
    assert "unit_2.blocks.1.mlp.down_proj" in names
    assert not any("blocks_1" in name for name in names)
    # Each unit is a real submodule, called from the stage graph (hooks and wrappers fire).
    calls = [n.target for n in stage0.module.graph.nodes if n.op == "call_module"]
    assert calls == ["unit_0", "unit_1"]
    assert stage0.input_names == ("input_ids",)
    assert stage1.input_names == stage0.output_names


def test_units_keep_the_models_non_persistent_buffers_out_of_state_dicts() -> None:
    # fx copies every buffer as a persistent one: the RoPE tables (non-persistent in the model,
    # cut to each rank's rows by context parallelism) would land in every checkpoint
    model = build_model("llama")
    assert not any("rope" in key for key in model.state_dict())
    graph = trace(model)
    assert "rope_cos" in dict(graph.graph_module.named_buffers())
    assert not any("rope" in key for key in graph.graph_module.state_dict())
    for stage in split_stages(graph, make_plan(pp=2)).stages:
        buffers = [name for name, _ in stage.module.named_buffers()]
        assert any(name.endswith("rope_cos") for name in buffers), buffers
        assert not any("rope" in key for key in stage.module.state_dict())


def test_every_node_runs_in_exactly_one_unit() -> None:
    graph = trace(build_model("llama"))
    split = split_stages(graph, make_plan(pp=2))
    placed: list[str] = []
    for stage in split.stages:
        for unit in stage.units:
            module = stage.unit_module(unit)
            assert isinstance(module, fx.GraphModule)
            for node in module.graph.nodes:
                if node.op in _COMPUTE:
                    placed.append(node.name)
                    assert graph.unit_of(node.name) == unit.unit_idx
    traced = [n.name for n in graph.graph_module.graph.nodes if n.op in _COMPUTE]
    assert sorted(placed) == sorted(traced)


def test_a_head_tied_to_the_embedding_gets_its_own_copy_on_a_later_stage() -> None:
    model = build_model("gpt")
    assert model.lm_head.weight is model.tok_emb.weight
    split = split_stages(trace(model), make_plan(pp=2))
    (tied,) = split.tied
    assert tied.name == "tok_emb.weight"
    assert [(c.stage_idx, c.stage_fqn) for c in tied.copies] == [
        (0, "unit_0.tok_emb.weight"),
        (1, "unit_3.lm_head.weight"),
    ]
    embedding = split.stages[0].module.get_parameter("unit_0.tok_emb.weight")
    head = split.stages[1].module.get_parameter("unit_3.lm_head.weight")
    assert head is not embedding
    assert torch.equal(head, embedding)


def test_a_tie_inside_one_stage_stays_shared() -> None:
    split = split_stages(trace(build_model("gpt")), make_plan())
    assert split.tied == ()
    assert split.shared_in_stage[0] == (("unit_0.tok_emb.weight", "unit_3.lm_head.weight"),)
    module = split.stages[0].module
    assert module.get_parameter("unit_0.tok_emb.weight") is module.get_parameter(
        "unit_3.lm_head.weight"
    )


class _SkipModel(nn.Module):
    """The head reads the embedding output: a value that must pass through middle stages."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"seq_len": SEQ, "vocab_size": VOCAB})()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(input_ids)
        h = e
        for block in self.blocks:
            h = torch.relu(block(h))
        out: torch.Tensor = self.head(h + e)
        return out


def test_a_value_needed_two_stages_later_is_passed_through() -> None:
    torch.manual_seed(0)
    model = _SkipModel()
    split = split_stages(trace(model), make_plan(pp=4, num_micro_batches=4))
    embedding_output = split.stages[0].output_names
    # Stages 1 and 2 receive the embedding output and send it on to the head's stage.
    for stage in split.stages[1:3]:
        assert set(embedding_output) <= set(stage.input_names)
        assert set(embedding_output) <= set(stage.output_names)
    inputs = torch.randint(0, VOCAB, (2, SEQ))
    assert torch.equal(_chain(split, inputs), model(inputs))


def test_a_plan_for_another_unit_count_is_refused() -> None:
    graph = trace(build_model("gpt"))
    with pytest.raises(PlanError, match="cover 5 units but the traced model has 4"):
        split_stages(graph, make_plan(pp=1, num_units=5))


class _IntCrossModel(nn.Module):
    """Every block scales by the sequence length, read once from the input: an int the
    pipeline would have to send between stages."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"seq_len": SEQ, "vocab_size": VOCAB})()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.size(1)
        h = self.emb(input_ids)
        for block in self.blocks:
            h = block(h) / length
        out: torch.Tensor = self.head(h)
        return out


def test_a_non_tensor_crossing_a_cut_is_an_error() -> None:
    graph = trace(_IntCrossModel())
    with pytest.raises(PlanError, match=r"crosses the cut before stage 1 but is not a tensor"):
        split_stages(graph, make_plan(pp=2))
