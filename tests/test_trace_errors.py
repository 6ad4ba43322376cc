"""`autoplan.trace` on awkward models and bad input: models fx cannot trace, models nothing can
trace, models without repeated blocks, user-chosen units and leaves, missing inputs."""

from __future__ import annotations

import logging

import networkx as nx
import pytest
import torch
from torch import nn

from autoplan.contract.errors import InputError, TraceError
from autoplan.contract.plan import even_stages
from autoplan.models import gpt
from autoplan.tracing import trace


class DataDependentBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # branch on a tensor value: neither fx nor export can trace it
            return self.linear(x)
        return x


class ShapeDependentBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 8:  # branch on a shape: fx cannot trace it, export and meta can
            x = self.linear(x)
        return x


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], num_blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Flat(nn.Module):
    """Embedding, an MLP, a norm and a head: no repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.out(self.norm(x + self.mlp(x)))


X = torch.zeros(2, 16)


def test_untraceable_model_names_module_and_line() -> None:
    with pytest.raises(TraceError) as caught:
        trace(Stack(DataDependentBlock), (X,))
    message = str(caught.value)
    assert isinstance(caught.value, InputError)
    assert "module 'blocks.0' (DataDependentBlock)" in message
    assert "test_trace_errors.py:" in message and "if x.sum() > 0:" in message
    assert "torch.export failed" in message
    assert "leaf_modules" in message and "example_inputs" in message
    assert "\n" not in message  # one line for the CLI


def test_fx_failure_falls_back_to_export() -> None:
    graph = trace(Stack(ShapeDependentBlock), (X,))
    assert graph.front_end == "export"
    assert [u.name for u in graph.profile.units] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(u.forward_flops == 2 * 16 * 16 for u in graph.profile.units)  # per sample
    assert graph.exported_program is not None


def test_leaf_modules_keep_fx_and_are_measured_whole() -> None:
    graph = trace(Stack(ShapeDependentBlock), (X,), leaf_modules=[ShapeDependentBlock])
    assert graph.front_end == "fx"
    calls = [n.target for n in graph.graph_module.graph.nodes if n.op == "call_module"]
    assert calls == ["blocks.0", "blocks.1", "blocks.2"]
    assert [u.forward_flops for u in graph.profile.units] == [2 * 16 * 16] * 3
    # Backward is measured: the first block's input needs no gradient (only dW), the others
    # need dX too.
    assert [u.backward_flops for u in graph.profile.units] == [512, 1024, 1024]


def test_model_without_repeated_blocks(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="autoplan.tracing"):
        graph = trace(Flat(), (torch.zeros(2, 8, dtype=torch.long),))
    assert "no repeated blocks" in caplog.text
    profile = graph.profile
    assert [u.name for u in profile.units] == ["emb", "mlp", "norm", "out"]
    assert {u.kind for u in profile.units} == {"other"}
    assert profile.num_params == sum(p.numel() for p in Flat().parameters())
    # Still plannable: units in order, every cut valid, an even split exists.
    assert nx.is_directed_acyclic_graph(graph.unit_graph())
    assert len(even_stages(profile.num_units, 2)) == 2
    assert profile.units[1].tp.ffn_hidden_size == 64  # Linear -> GeLU -> Linear is a TP pair
    assert profile.units[0].tp.vocab_size == profile.units[-1].tp.vocab_size == 100


def test_units_and_block_path_arguments() -> None:
    model = gpt(num_layers=4, hidden_size=32, num_heads=2, seq_len=8, vocab_size=64)
    chosen = trace(model, units=["blocks.1", "blocks.3"])
    assert [u.name for u in chosen.profile.units] == ["embedding", "blocks.1", "blocks.3", "head"]
    # blocks.0 runs before the first chosen unit, blocks.2 inside blocks.1's range.
    assert chosen.unit_of("blocks_0_attn_q_proj") == 0
    assert chosen.unit_of("blocks_2_attn_q_proj") == 1
    by_path = trace(model, block_path="blocks")
    assert by_path.profile.num_units == 6
    with pytest.raises(TraceError, match=r"no module 'blocks\.9'"):
        trace(model, units=["blocks.9"])
    with pytest.raises(TraceError, match="not both"):
        trace(model, units=["blocks.1"], block_path="blocks")


def test_missing_or_inconsistent_inputs() -> None:
    with pytest.raises(TraceError, match="example_inputs") as caught:
        trace(nn.Linear(4, 4))
    assert "config.seq_len" in str(caught.value)
    model = gpt(num_layers=1, hidden_size=32, num_heads=2, seq_len=8, vocab_size=64)
    with pytest.raises(TraceError, match=r"exceeds GPT's config\.seq_len = 8"):
        trace(model, seq_len=16)
    with pytest.raises(TraceError, match="seq_len = 4 but example_inputs have"):
        trace(model, (torch.zeros(1, 8, dtype=torch.long),), seq_len=4)
    with pytest.raises(TraceError, match="batch_size = 0"):
        trace(model, batch_size=0)
    with pytest.raises(TraceError, match="do not match"):
        trace(model, (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1)))


class LowRankBlock(nn.Module):
    """fc1 -> fc2 with nothing between: data flow finds no Megatron pair, names do."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.fc1(self.norm(x)))


def test_tp_structure_falls_back_to_module_names(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="autoplan.tracing"):
        graph = trace(Stack(LowRankBlock, num_blocks=2), (X,))
    assert "from module names" in caplog.text
    block = graph.profile.units[0]
    assert [(t.path, t.style) for t in block.tp.linears] == [("fc1", "column"), ("fc2", "row")]
    assert block.num_params_tp_sharded == 16 * 8 + 8 + 8 * 16
