"""Predicted memory of a small real model against what PyTorch actually holds on CPU.

Parameters, gradients and Adam states must match to the byte; the activations autograd saves
for one micro-batch (and the cross-entropy after the head) must match within 2%: the trace measures the same
saved-tensor hooks on meta, so the slack is only what the estimate adds or leaves out: the
loss's int64 targets (b s x 8 bytes, 0.1% here) and storages the per-unit attribution could
count on both sides of a unit boundary (none in these models, but up to one (b, s, h) hidden
state per block, ~6% of a GPT block, in general).
"""

from __future__ import annotations

import pytest
import torch

from autoplan import models
from autoplan.api import profile_of
from cost_model.estimate import unit_costs
from cost_model.strategy import Strategy
from tests.cost_profiles import round_cluster

BATCH = 2


def _saved_bytes_of_forward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The loss and the bytes autograd saved for its backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    return loss, sum(seen.values())


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_static_and_activation_bytes_match_a_real_cpu_run(family: str) -> None:
    torch.manual_seed(0)
    if family == "gpt":
        model = models.gpt(2, 64, 4, 32, 128, device="cpu")
    else:
        model = models.llama(2, 64, 4, 32, 128, num_kv_heads=2, device="cpu")
    profile = profile_of(model)
    strategy = Strategy(micro_batch_size=BATCH, dtype="fp32")
    costs = unit_costs(profile, round_cluster(), strategy, "none")

    unique = {id(p): p for p in model.parameters()}.values()
    num_params = sum(p.numel() for p in unique)
    # fp32 Adam: 4 B weights + 4 B grads + 8 B (momentum, variance) per parameter.
    assert sum(c.param_bytes for c in costs) == 4 * num_params
    ids = torch.randint(0, 128, (BATCH, 32))
    loss, saved = _saved_bytes_of_forward(model, ids)
    loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in unique if p.grad is not None)
    assert sum(c.grad_bytes for c in costs) == grads
    optimizer = torch.optim.Adam(list(unique), lr=1e-3)
    optimizer.step()
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for name, t in s.items()
        if name in ("exp_avg", "exp_avg_sq")
    )
    assert sum(c.optimizer_bytes for c in costs) == state
    predicted = sum(c.activation_bytes for c in costs)
    assert predicted == pytest.approx(saved, rel=0.02)
