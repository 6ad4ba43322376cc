"""`tests.live_bytes.LiveBytes` against torch's own MemTracker, and across micro-batches."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from autoplan import models
from tests.live_bytes import LiveBytes


def _trained_once(
    micro_batches: int,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    torch.manual_seed(0)
    model = models.gpt(2, 64, 4, 32, 128, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 128, (2 * micro_batches, 32))

    def step() -> None:
        for chunk in ids.chunk(micro_batches):
            F.cross_entropy(model(chunk).flatten(0, 1), chunk.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer state exists before the measured step
    return model, optimizer, step


def _registered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> LiveBytes:
    live = LiveBytes()
    for param in model.parameters():
        live.track(param)
    for state in optimizer.state.values():
        for value in state.values():
            live.track(value)
    return live


def test_the_peak_is_memtrackers_to_the_byte() -> None:
    model, optimizer, step = _trained_once(1)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    model, optimizer, step = _trained_once(1)
    live = _registered(model, optimizer)
    with live:
        step()
    assert live.peak == theirs


def test_several_micro_batches_count_states_once_and_free_activations() -> None:
    model, optimizer, step = _trained_once(3)
    live = _registered(model, optimizer)
    params = sum(p.numel() for p in model.parameters())
    before = live.current
    assert before >= 12 * params  # fp32 weights + Adam's two moments (+ step counters)
    with live:
        step()
        after_one = live.current
        step()
    # gradients (4 bytes a parameter) and three micro-batches' activations came and went
    assert live.peak > before + 4 * params
    # after zero_grad (set_to_none) only what persists across steps stays (here 1.5 KiB that
    # the first measured step allocates and keeps): a second step leaves exactly as much
    assert before <= after_one == live.current


def _fsdp_step(reshard: bool, track: Callable[[torch.nn.Module, torch.optim.Optimizer], object]):
    """One FSDP2 step of a small GPT on a 2-rank fake group, measured by ``track``'s tracker."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = models.gpt(2, 64, 4, 32, 128, device="cpu")
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 128, (2, 32))

    def step() -> None:
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    tracker = track(model, optimizer)
    with tracker:  # type: ignore[attr-defined]
        step()
    return tracker


def test_fsdp2_resharding_is_seen_as_memtracker_sees_it() -> None:
    """FSDP2 frees and re-allocates unsharded weights with ``UntypedStorage.resize_``, which no
    dispatch mode sees: LiveBytes follows it, to MemTracker's byte, and so finds that gathering
    weights again for the backward (ZeRO-3) peaks lower than keeping them (ZeRO-2)."""
    from tests.dist_utils import fake_process_group

    def theirs(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> MemTracker:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        return tracker

    def ours(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> LiveBytes:
        return _registered(model, optimizer)

    peaks = {}
    with fake_process_group(2):
        for reshard in (True, False):
            mem = _fsdp_step(reshard, theirs)
            live = _fsdp_step(reshard, ours)
            expected = mem.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
            assert live.peak == expected, (reshard, live.peak, expected)
            peaks[reshard] = live.peak
    assert peaks[True] < peaks[False]
