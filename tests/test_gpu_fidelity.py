"""bench/gpu_fidelity.py on a machine without CUDA: it says so and exits 0; and the plans it
would run on GPUs (checked against the A100 preset) cover what the issue asks and all fit."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autoplan

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_fidelity.py")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "skipped: bench/gpu_fidelity.py needs CUDA GPUs; this machine has none"
    ]


def test_the_gpu_plans_span_the_issue_dimensions_and_fit() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_fidelity
    finally:
        sys.path.remove(str(BENCH))
    a100 = autoplan.Cluster.preset("dgx-a100-40g")
    skipped: list[str] = []
    single = list(
        gpu_fidelity.single_device_cases(dataclasses.replace(a100, devices_per_node=1), skipped)
    )
    plans = [case.plan for case in single]
    assert {p.micro_batch_size for p in plans} == {1, 2, 4}
    assert {p.dtype for p in plans} == {"bf16", "fp32"}
    assert {s.recompute for p in plans for s in p.stages} == {"none", "selective", "full"}
    assert {case.model_spec for case in single} == {
        f"{name}:seq_len={seq}" for name in ("gpt2-small", "gpt3-1.3b") for seq in (512, 1024, 2048)
    }
    assert len(single) + len(skipped) == 2 * 3 * 3 * 3 * 2
    parallel = list(gpu_fidelity.parallel_cases(dataclasses.replace(a100, devices_per_node=4), []))
    degrees = {(c.plan.dp_degree, c.plan.tp_degree, c.plan.pp_degree) for c in parallel}
    assert {(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2)} <= degrees
    assert {c.plan.zero_stage for c in parallel} == {0, 2, 3}
    # What does not fit one 40 GiB GPU: only the medium model's largest micro-batches.
    assert skipped and all("gpt3-1.3b:seq_len=2048" in s and " mb4x4 " in s for s in skipped)
