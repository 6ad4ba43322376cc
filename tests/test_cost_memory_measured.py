"""Predicted memory of a small real model against what PyTorch actually holds on CPU.

Parameters, gradients and Adam states must match to the byte; the activations autograd saves
for one micro-batch (and the cross-entropy after the head) must match within 2%: the trace measures the same
saved-tensor hooks on meta, so the slack is only what the estimate adds or leaves out: the
loss's int64 targets (b s x 8 bytes, 0.1% here) and storages the per-unit attribution could
count on both sides of a unit boundary (none in these models, but up to one (b, s, h) hidden
state per block, ~6% of a GPT block, in general).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


# ------------------------------------------------------------------ per-rank peaks, measured

MODEL = (4, 128, 4, 128, 512)  # layers, hidden, heads, seq, vocab: bench/memory.py's GPT
GLOBAL_BATCH = 16


def _gpt(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.gpt(*MODEL, device=device, tie_embeddings=True)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, MODEL[4], (GLOBAL_BATCH, MODEL[3] + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _measured_peak(rank: int, world_size: int, plan_data: dict[str, Any]) -> tuple[int, int]:
    """This rank's pipeline rank and its peak live tensor bytes over one training step, after
    a first step has made the optimizer state (bench/memory.py measures the same way)."""
    from autoplan.contract.plan import Plan
    from autoplan.runtime.parallelizer import parallelize
    from tests.live_bytes import LiveBytes

    trainer = parallelize(_gpt("meta"), plan=Plan.from_data(plan_data), loss_fn=_loss)
    trainer.train_step(*_batch(0))
    live = LiveBytes.after_warm_step(trainer)
    with live:
        trainer.train_step(*_batch(1))
    return trainer.mesh.pp_rank, live.peak


@pytest.mark.slow
@pytest.mark.parametrize(
    "option",
    [
        {"zero": 3, "recompute": "selective"},  # FSDP2 gathers and frees weights per block
        {"tp": 2, "sequence_parallel": True},
        # a split backward, and sends kept until the step ends
        {"pp": 2, "schedule": "interleaved-zb", "virtual_stages": 2, "micro_batch": 1},
    ],
    ids=["zero3-selective", "tp2-sp", "interleaved-zb"],
)
def test_predicted_peak_is_within_a_quarter_of_the_measured_one(
    option: dict[str, Any], tmp_path: Path
) -> None:
    """The issue's bound (max |error| 25%; bench/memory.py reports every plan) on three plans
    of 2 processes: FSDP2's buffers, TP with SP, a split-backward pipeline."""
    from autoplan.api import manual_plan
    from cost_model.estimate import estimate
    from cost_model.hardware import Cluster
    from tests.dist_utils import run_distributed

    cluster = Cluster.local(num_devices=2)
    profile = profile_of(_gpt("meta"))
    plan = manual_plan(profile, cluster, global_batch=GLOBAL_BATCH, dtype="fp32", **option)
    predicted = estimate(profile, cluster, plan)
    for pp_rank, measured in run_distributed(
        _measured_peak, plan.to_data(), world_size=2, tmp_path=tmp_path, timeout_s=600
    ):
        guess = predicted.ranks[pp_rank].memory.predicted_bytes
        assert abs(guess - measured) <= 0.25 * measured, (pp_rank, guess, measured)
