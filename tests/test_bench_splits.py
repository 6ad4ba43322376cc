"""The bench's pipeline splits against hand-worked examples of the stacks' own rules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import validate_published
from validate_published import ModelDims

# A small llama whose nanotron costs are whole numbers of decoder layers L:
# decoder 4 a (h // a) h + 3 f h = 4 * 64 * 64 + 3 * 128 * 64 = 40960 = L,
# lm_head V h = 1280 * 64 = 81920 = 2 L; total 6 L + 2 L = 8 L.
# Units: 0 embedding, 1-6 blocks, 7 head (final norm, lm_head; nanotron's fp32 cast and loss).
_DIMS = ModelDims(
    family="llama",
    num_layers=6,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=4,
    ffn_hidden_size=128,
    seq_len=16,
    vocab_size=1280,
)


def _ranges(num_stages: int) -> list[tuple[int, int]]:
    profile = validate_published.profile_for(_DIMS)
    stages = validate_published.nanotron_compute_balanced_stages(profile, _DIMS, num_stages, "none")
    assert all(s.recompute == "none" for s in stages)
    return [(s.first_unit, s.last_unit) for s in stages]


def test_nanotron_split_moves_on_only_past_the_share() -> None:
    """pp 2, shares 4 L and 8 L. Running cost after each decoder layer: 1..6 L; after the 4th it
    equals the first share, which nanotron's strict ``>`` does not pass, so the 5th layer still
    goes to rank 0 and the rank moves on after it: rank 0 holds the embedding and 5 layers, rank
    1 the 6th layer and the head (Megatron's even split: 3 and 3)."""
    assert _ranges(2) == [(0, 5), (6, 7)]


def test_nanotron_split_can_leave_the_head_alone() -> None:
    """pp 3, shares 8/3, 16/3, 8 L: rank 0 moves on after the 3rd layer (3 > 2.67), rank 1
    after the 6th (6 > 5.33); the head (2 L) is left alone on rank 2, as nanotron places the
    1.3B model's lm_head on 4 stages."""
    assert _ranges(3) == [(0, 3), (4, 6), (7, 7)]


def test_nanotron_split_refuses_to_cut_the_head() -> None:
    """pp 4, shares 2, 4, 6, 8 L: layers 1-3 on rank 0 (3 > 2), 4-5 on rank 1 (5 > 4), the 6th
    (6, not > 6) and the final norm on rank 2, whose lm_head (8 > 6) moves the fp32 cast and the
    loss to rank 3: inside autoplan's head unit."""
    with pytest.raises(ValueError, match="different ranks"):
        _ranges(4)
