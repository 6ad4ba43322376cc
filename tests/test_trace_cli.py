"""`autoplan trace` through the real console script: table, JSON, model specs, errors."""

from __future__ import annotations

import json
import subprocess

from tests.conftest import run_cli

SMALL = "gpt:num_layers=2,hidden_size=64,num_heads=4,seq_len=32,vocab_size=128"


def _assert_user_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("autoplan: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_trace_table() -> None:
    result = run_cli("trace", "--model", SMALL)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("embedding", "blocks.0", "blocks.1", "head", "total", "fwd GFLOP", "cut MiB"):
        assert name in out, out
    # the heading wraps at the console's words (it names the model spec)
    assert "4 pipeline units, batch 1 x seq 32" in " ".join(out.split())
    assert "head shares 8.19 K parameters with an earlier unit" in out


def test_trace_json_scales_with_the_batch() -> None:
    result = run_cli("trace", "--model", SMALL, "--batch-size", "2", "--seq-len", "16", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    s, h, v = 16, 64, 128
    assert (data["batch_size"], data["seq_len"], data["num_units"]) == (2, 16, 4)
    assert [u["kind"] for u in data["units"]] == ["embedding", "block", "block", "head"]
    block = data["units"][1]
    # causal attention: Q K^T and A V over s (s + 1) / 2 scores
    layer = 24 * s * h * h + 2 * s * (s + 1) * h
    assert block["forward_flops"] == 2 * layer
    assert block["cut_bytes"] == 2 * s * h * 4
    assert block["tp"]["num_heads"] == 4 and block["tp"]["ffn_hidden_size"] == 256
    assert data["totals"]["forward_flops"] == 2 * (2 * layer + 2 * s * h * v)
    assert data["totals"]["num_params"] == sum(
        u["num_params"] - u["num_params_shared"] for u in data["units"]
    )


def test_trace_preset_with_override() -> None:
    result = run_cli("trace", "--model", "llama3-8b:seq_len=4096,num_layers=2", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["seq_len"] == 4096 and data["num_units"] == 4
    assert (data["num_heads"], data["num_kv_heads"], data["vocab_size"]) == (32, 8, 128256)


def test_trace_bad_model_is_one_line() -> None:
    # Each message is checked in-process (test_model_spec.py, test_trace_errors.py); here the
    # CLI's contract: exit code 2, one line, no traceback.
    _assert_user_error(
        run_cli("trace", "--model", "gpt5"), "unknown model 'gpt5'", "gpt3-175b", "llama3-405b"
    )


def test_trace_collapses_identical_blocks_unless_all() -> None:
    short = run_cli("trace", "--model", SMALL)
    assert "blocks.0 .. blocks.1 (x2)" in short.stdout
    assert "cut MiB: what a pipeline stage" in " ".join(short.stdout.split())  # the legend
    every = run_cli("trace", "--model", SMALL, "--all")
    assert every.returncode == 0, every.stderr
    assert "(x2)" not in every.stdout and "blocks.1" in every.stdout
