"""The module-call and local-shapes passes on small exported graphs (one process, no mesh).

A tensor-parallel run is simulated by hand: each of ``tp`` shards gets its slice of the column
weights (rows) and of the row weight (columns), runs the rewritten graph on local shapes, and the
shards' outputs summed equal the unsharded output (what RowwiseParallel's all-reduce computes).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from autoplan.contract.errors import PlanError
from passes.local_shapes import localize_shapes
from passes.module_calls import restore_module_calls

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 5, 4, 2, 3
HIDDEN = HEADS * HEAD_DIM


class GroupedAttention(nn.Module):
    """Attention with hard-coded head counts, as an exported graph bakes them in."""

    def __init__(self, softmax_over_heads: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=True)
        self.k = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.softmax_over_heads = softmax_over_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2)  # (B, H, T, D)
        k = self.k(x).view(BATCH, SEQ, KV_HEADS, HEAD_DIM).transpose(1, 2)  # (B, KV, T, D)
        n_rep = HEADS // KV_HEADS
        k = k[:, :, None].expand(BATCH, KV_HEADS, n_rep, SEQ, HEAD_DIM)
        k = k.reshape(BATCH, HEADS, SEQ, HEAD_DIM)  # repeat_kv
        scores = q @ k.transpose(2, 3)  # (B, H, T, T)
        probs = scores.softmax(dim=1 if self.softmax_over_heads else -1)
        y = (probs @ q).transpose(1, 2).reshape(BATCH, SEQ, HIDDEN)
        return self.o(y)


def _exported(model: nn.Module) -> fx.GraphModule:
    x = torch.randn(BATCH, SEQ, HIDDEN)
    gm = torch.export.export(model, (x,)).module()
    assert isinstance(gm, fx.GraphModule)
    return gm


STYLES = {"q": "column", "k": "column", "o": "row"}


def test_inlined_linears_become_module_calls_with_the_same_parameters() -> None:
    torch.manual_seed(0)
    model = GroupedAttention()
    gm = _exported(model)
    result = restore_module_calls(gm)
    assert result.linears == ("q", "k", "o")
    assert isinstance(gm.get_submodule("q"), nn.Linear)
    assert gm.get_submodule("q").weight is gm.get_parameter("q.weight")
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert [c for c in calls if not str(c).startswith("_guards")] == ["q", "k", "o"]
    x = torch.randn(BATCH, SEQ, HIDDEN)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("tp", [2])
def test_baked_in_head_counts_become_local_and_shards_sum_to_the_output(tp: int) -> None:
    torch.manual_seed(0)
    model = GroupedAttention()
    gm = _exported(model)
    restore_module_calls(gm)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    expected = gm(x)
    result = localize_shapes(gm, STYLES, tp, unit_name="attn")
    assert result.checked
    # q/k views (heads), the repeat_kv expand and reshape; the final reshape's 12 becomes 6.
    sizes = {
        n.name: list(n.args[1])
        for n in gm.graph.nodes
        if n.name in result.rewritten and isinstance(n.args[1], (list, tuple))
    }
    assert [BATCH, SEQ, HEADS // tp, HEAD_DIM] in sizes.values()
    assert [BATCH, KV_HEADS // tp, HEADS // KV_HEADS, SEQ, HEAD_DIM] in sizes.values()
    assert [BATCH, SEQ, HIDDEN // tp] in sizes.values()

    total = torch.zeros_like(expected)
    for rank in range(tp):
        shard = copy.deepcopy(gm)
        with torch.no_grad():
            for name in ("q", "k"):
                linear = shard.get_submodule(name)
                rows = linear.out_features // tp
                linear.weight = nn.Parameter(linear.weight[rank * rows : (rank + 1) * rows])
                if linear.bias is not None:
                    linear.bias = nn.Parameter(linear.bias[rank * rows : (rank + 1) * rows])
            o = shard.get_submodule("o")
            cols = o.in_features // tp
            o.weight = nn.Parameter(o.weight[:, rank * cols : (rank + 1) * cols])
        total += shard(x)
    # Shards sum partial products in another order: fp32 rounding only.
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)


def test_an_op_along_the_split_heads_is_refused() -> None:
    gm = _exported(GroupedAttention(softmax_over_heads=True))
    restore_module_calls(gm)
    with pytest.raises(PlanError, match=r"works along dimension 1 of a value split"):
        localize_shapes(gm, STYLES, 2, unit_name="attn")


def test_a_split_value_reaching_an_unsharded_module_or_the_output_is_refused() -> None:
    gm = _exported(GroupedAttention())
    restore_module_calls(gm)
    with pytest.raises(PlanError, match=r"node 'linear_2' \(o\): module \(column\) reads a split"):
        localize_shapes(gm, {"q": "column", "k": "column", "o": "column"}, 2, unit_name="attn")
    gm = _exported(nn.Sequential(nn.Linear(HIDDEN, HIDDEN)))
    restore_module_calls(gm)
    with pytest.raises(PlanError, match=r"\['linear'\] leave the unit split"):
        localize_shapes(gm, {"0": "column"}, 2, unit_name="mlp")


def test_graphs_without_traced_values_are_not_checked() -> None:
    gm = fx.symbolic_trace(GroupedAttention())
    result = localize_shapes(gm, STYLES, 2, unit_name="attn")
    assert not result.checked and result.rewritten == ()
