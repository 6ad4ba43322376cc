"""`autoplan estimate` through the real console script: table, JSON and one-line errors."""

from __future__ import annotations

import json

from tests.conftest import run_cli

MODEL = "gpt:num_layers=4,hidden_size=256,num_heads=8,seq_len=128,vocab_size=1024"


def test_estimate_json() -> None:
    done = run_cli(
        "estimate",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100-80g:nodes=2",
        "--tp",
        "4",
        "--pp",
        "2",
        "--micro-batch",
        "2",
        "--global-batch",
        "64",
        "--recompute",
        "selective",
        "--zero",
        "1",
        "--sequence-parallel",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_device", "mfu"):
        assert data[key] > 0
    assert data["peak_memory_bytes"] > 0
    assert data["fits"] is True
    assert len(data["stages"]) == 2
    assert data["plan"]["dp_degree"] == 2  # 16 devices / (tp 4 x pp 2)
    assert data["plan"]["num_micro_batches"] == 16
    # 64 sequences of 128 tokens per step.
    assert abs(data["tokens_per_s"] * data["step_time_s"] - 64 * 128) < 1e-6 * 64 * 128
    assert {"compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s"} <= set(
        data["stages"][0]
    )


def test_estimate_table() -> None:
    done = run_cli(
        "estimate",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100-80g",
        "--pp",
        "2",
        "--virtual-stages",
        "2",
        "--micro-batch",
        "1",
        "--global-batch",
        "16",
    )
    assert done.returncode == 0, done.stderr
    assert "per pipeline rank" in done.stdout
    assert "interleaved-1f1b" in done.stdout
    assert "MFU" in done.stdout and "tokens/s" in done.stdout


def test_impossible_plan_is_one_line_and_exit_2() -> None:
    done = run_cli(
        "estimate",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100-80g",
        "--tp",
        "3",
        "--global-batch",
        "8",
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("autoplan: error:")
    assert "3" in lines[0] and "8 devices" in lines[0]
