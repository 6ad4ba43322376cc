"""`autoplan.parallelize` against a single-process reference, on CPU/gloo.

Each case trains a tiny model for 3 AdamW steps under a hand-written plan and checks the loss on
every rank and every gradient (DTensors gathered with ``full_tensor()``, pipeline stages
reported by their own ranks) against a deep copy of the same weights trained in one process on
the same global batch (tolerances and their justification: tests/numerics.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.dist_utils import run_distributed
from tests.numerics import assert_matches, make_plan, reference, train_worker

# name: (model, plan arguments). Two processes unless the degrees say otherwise.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dp2": ("gpt", {"dp": 2}),
    "tp2": ("gpt", {"tp": 2}),
    "pp2-gpipe": ("gpt", {"pp": 2, "schedule": "gpipe"}),
    "pp2-1f1b": ("gpt", {"pp": 2, "schedule": "1f1b", "num_micro_batches": 4}),
    "pp2-interleaved": (
        "gpt",
        {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2, "num_micro_batches": 4},
    ),
    "dp2-zero1": ("gpt", {"dp": 2, "zero": 1}),
    "dp2-zero2": ("gpt", {"dp": 2, "zero": 2}),
    "dp2-zero3": ("gpt", {"dp": 2, "zero": 3}),
    "pp2-recompute-full": ("gpt", {"pp": 2, "recompute": "full"}),
    "tp2-recompute-selective": ("gpt", {"tp": 2, "recompute": "selective"}),
    "tp2-sequence-parallel": ("gpt", {"tp": 2, "sequence_parallel": True}),
    "llama-tp2-sp": ("llama", {"tp": 2, "sequence_parallel": True}),
    "llama-pp2-zero3": ("llama", {"pp": 2, "zero": 3, "num_micro_batches": 2}),
}

# Hugging Face models: traced with torch.export on every rank (several seconds each), so slow.
# Tensor parallelism runs on the exported graph's restored nn.Linear calls, with the baked-in
# head counts made local (grouped-query attention: 4 heads, 2 key/value heads); GPT-2's fused
# Conv1D q/k/v is refused (test_passes_tensor_parallel.py).
CASES_HF = {
    "hf-gpt2-pp2": ("hf-gpt2", {"pp": 2}),
    "hf-gpt2-dp2-zero3-recompute": ("hf-gpt2", {"dp": 2, "zero": 3, "recompute": "full"}),
    "hf-llama-pp2-selective": ("hf-llama", {"pp": 2, "recompute": "selective"}),
    "hf-llama-dp2": ("hf-llama", {"dp": 2}),
    "hf-llama-tp2": ("hf-llama", {"tp": 2}),
}

# Four processes: the compositions.
CASES_4 = {
    "dp2xtp2-zero3": ("gpt", {"dp": 2, "tp": 2, "zero": 3}),
    "pp2xdp2": ("gpt", {"pp": 2, "dp": 2}),
    "dp2xpp2-layout-interleaved-zero2": (
        "gpt",
        {
            "pp": 2,
            "dp": 2,
            "zero": 2,
            "schedule": "interleaved-1f1b",
            "virtual_stages": 2,
            "rank_layout": ("dp", "pp", "tp"),  # pipeline neighbours adjacent, replicas apart
        },
    ),
    "pp2xtp2": ("gpt", {"pp": 2, "tp": 2}),
    "hf-llama-dp2xtp2": ("hf-llama", {"dp": 2, "tp": 2}),
    "pp2xtp2-interleaved-sp": (
        "gpt",
        {
            "pp": 2,
            "tp": 2,
            "schedule": "interleaved-1f1b",
            "virtual_stages": 2,
            "num_micro_batches": 2,
            "sequence_parallel": True,
        },
    ),
}


def _check(tmp_path: Path, model: str, plan_args: dict[str, Any]) -> None:
    plan = make_plan(**plan_args)
    results = run_distributed(
        train_worker, model, plan.to_data(), world_size=plan.num_devices, tmp_path=tmp_path
    )
    assert_matches(results, reference(model, plan.global_batch_size))


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes(case: str, tmp_path: Path) -> None:
    model, plan_args = CASES[case]
    _check(tmp_path, model, plan_args)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES_HF))
def test_hugging_face_models(case: str, tmp_path: Path) -> None:
    model, plan_args = CASES_HF[case]
    _check(tmp_path, model, plan_args)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES_4))
def test_four_processes(case: str, tmp_path: Path) -> None:
    model, plan_args = CASES_4[case]
    _check(tmp_path, model, plan_args)


@pytest.mark.slow
def test_pp2_dp2_tp2_eight_processes(tmp_path: Path) -> None:
    _check(tmp_path, "gpt", {"pp": 2, "dp": 2, "tp": 2, "zero": 3, "num_micro_batches": 2})
