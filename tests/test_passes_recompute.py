"""The recompute pass: which units it wraps, and what full and selective recompute re-run."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.contract.ops import op_category
from autoplan.contract.plan import Recompute
from autoplan.tracing import trace
from passes import apply_recompute, split_stages
from tests.numerics import VOCAB, build_model, loss_fn, make_plan


class _CountOps(TorchDispatchMode):
    """Counts the ATen ops that actually execute (cached ones never reach this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.by_op: Counter[Any] = Counter()  # by OpOverload

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket.__name__)] += 1
        self.by_op[func] += 1
        return func(*args, **(kwargs or {}))


def _run(mode: Recompute) -> tuple[Counter[str], dict[str, torch.Tensor], int]:
    counts, grads, wrapped, _ = _run_ops(mode)
    return counts, grads, wrapped


def _run_ops(
    mode: Recompute,
) -> tuple[Counter[str], dict[str, torch.Tensor], int, Counter[Any]]:
    model = build_model("gpt")
    split = split_stages(trace(model), make_plan(recompute=mode))
    (stage,) = split.stages
    wrapped = apply_recompute(stage, mode, make_plan().decisions.recompute)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, VOCAB, (2, 16), generator=generator)
    targets = torch.randint(0, VOCAB, (2, 16), generator=generator)
    with _CountOps() as counter:
        loss_fn(stage.module(inputs), targets).backward()
    grads = {name: p.grad.clone() for name, p in stage.module.named_parameters()}  # type: ignore[union-attr]
    return counter.counts, grads, wrapped, counter.by_op


def test_only_blocks_are_wrapped() -> None:
    split = split_stages(trace(build_model("gpt")), make_plan(pp=2, recompute="full"))
    for stage in split.stages:
        assert apply_recompute(stage, "full", make_plan().decisions.recompute) == 1
        kinds = {
            unit.profile.kind: isinstance(stage.unit_module(unit), CheckpointWrapper)
            for unit in stage.units
        }
        assert kinds["block"] is True
        assert not any(wrapped for kind, wrapped in kinds.items() if kind != "block")


def test_full_and_selective_recompute_rerun_what_they_should() -> None:
    none, grads_none, wrapped_none = _run("none")
    full, grads_full, wrapped_full = _run("full")
    selective, grads_selective, wrapped_selective = _run("selective")
    assert (wrapped_none, wrapped_full, wrapped_selective) == (0, 2, 2)
    # Full recompute re-runs each block's forward in backward, GEMMs and norms included: q, k,
    # v, o and up per block (torch stops recomputing once backward has what it needs: the last
    # GEMM, down_proj, feeds only an add, which saves nothing).
    assert full["addmm"] == none["addmm"] + 2 * 5
    assert full["native_layer_norm"] == none["native_layer_norm"] + 4
    # The trace knows that tail: the cost model prices full recompute as the GEMMs before it.
    blocks = [u for u in trace(build_model("gpt")).profile.units if u.kind == "block"]
    rerun = 0
    for block in blocks:
        kept = block.ops[: len(block.ops) - block.recompute_skip_ops]
        rerun += sum(1 for op in kept if op.kind == "matmul")
    assert rerun == full["addmm"] - none["addmm"]
    # Selective keeps GEMM and attention outputs (no extra GEMM, no extra attention) and
    # re-runs the cheap ops in between (the four block norms, the GeLUs).
    assert selective["addmm"] == none["addmm"]
    attention = next(k for k in none if "scaled_dot_product" in k and "backward" not in k)
    assert selective[attention] == none[attention]
    assert full[attention] == none[attention] + 2
    assert selective["native_layer_norm"] == none["native_layer_norm"] + 4
    assert selective["gelu"] == none["gelu"] + 2
    # Recompute never changes the gradients.
    for name, grad in grads_none.items():
        key = name.replace("unit_1.", "unit_1._checkpoint_wrapped_module.").replace(
            "unit_2.", "unit_2._checkpoint_wrapped_module."
        )
        torch.testing.assert_close(grads_full[key], grad, rtol=0, atol=0)
        torch.testing.assert_close(grads_selective[key], grad, rtol=0, atol=0)


def test_selective_reruns_what_the_cost_model_prices_as_rerun() -> None:
    # One decision (Plan.decisions.recompute): the runtime's policy keeps the op categories it
    # saves, and the cost model prices the others as run again (RecomputePolicy.recomputes).
    policy = make_plan().decisions.recompute
    none = _run_ops("none")[3]
    selective = _run_ops("selective")[3]
    rerun = {op for op in selective if selective[op] > none[op] and "backward" not in str(op)}
    assert rerun, "selective recompute re-ran nothing"
    for op in rerun:
        assert op_category(op) not in policy.saved_kinds, op
    kept = [op for op in none if op_category(op) in policy.saved_kinds]
    assert kept  # the GEMMs and the attention kernel
    for op in kept:
        assert selective[op] == none[op], op
    # what the cost model counts as re-run for a traced block: exactly its ops of those kinds
    block = next(u for u in trace(build_model("gpt")).profile.units if u.kind == "block")
    traced = {op.kind for op in block.ops if policy.recomputes(op.kind, "selective")}
    assert traced == {"elementwise", "reduction"}
    assert {op_category(op) for op in rerun} <= {*traced, "view", "other"}


@pytest.mark.parametrize("mode", ["none"])
def test_no_recompute_changes_nothing(mode: Recompute) -> None:
    split = split_stages(trace(build_model("gpt")), make_plan())
    (stage,) = split.stages
    before = [type(stage.unit_module(u)) for u in stage.units]
    assert apply_recompute(stage, mode, make_plan().decisions.recompute) == 0
    assert [type(stage.unit_module(u)) for u in stage.units] == before


class _MlpBlock(torch.nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class _MlpModel(torch.nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.blocks = torch.nn.ModuleList([_MlpBlock(32, dropout) for _ in range(2)])
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_tail_is_what_torch_skips(dropout: float) -> None:
    # Without dropout the last GEMM feeds only the residual add and torch never re-runs it;
    # dropout after it saves its mask, so the GEMM must run again. The trace says the same.
    torch.manual_seed(0)
    model = _MlpModel(dropout)
    ids = torch.randint(0, VOCAB, (2, 8))
    block_profile = next(
        u for u in trace(model, example_inputs=(ids,)).profile.units if u.kind == "block"
    )
    kept = block_profile.ops[: len(block_profile.ops) - block_profile.recompute_skip_ops]
    x = torch.randn(2, 8, 32, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(model.blocks[0], x, use_reentrant=False)
    with _CountOps() as counter:
        out.sum().backward()
    # The backward itself runs mm (not addmm) for the gradients: each addmm is a recompute.
    assert counter.counts["addmm"] == sum(1 for op in kept if op.kind == "matmul")
    assert counter.counts["addmm"] == (2 if dropout else 1)
