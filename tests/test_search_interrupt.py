"""Ctrl-C during `autoplan plan`: the best plan found so far is printed with its gap, the exit
code is 130, and no traceback is shown."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ctrl_c_prints_the_best_plan_so_far_and_exits_130() -> None:
    # --budget 0: until proven, far longer than the test waits; the piped status line says when
    # a plan is held (every second here: the console script's entry point, its interval
    # shortened from 10 s)
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; import autoplan.cli.progress as progress; progress.STATUS_EVERY_S = 1.0;"
            " from autoplan.cli import main; main(sys.argv[1:])",
            "plan",
            "--model",
            "llama3-8b",
            "--cluster",
            "dgx-h100-80g:nodes=8",
            "--global-batch",
            "512",
            "--budget",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        seen.append(line)
        if "best step" in line:
            process.send_signal(signal.SIGINT)
            break
    out, err = process.communicate(timeout=300)
    err = "".join(seen) + err
    assert process.returncode == 130, err
    assert "Traceback" not in err
    assert "best plans (rank 1 is chosen)" in out
    assert "interrupted: the plans above are the best found so far" in err
    assert "a faster one may exist by up to" in err


def test_a_search_without_a_budget_says_what_is_left_and_the_ways_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    from tests.conftest import run_cli

    plan_module = importlib.import_module("autoplan.cli.plan_cmd")
    monkeypatch.setattr(plan_module, "UNBOUNDED_HINT_S", 0.0)  # (60 s by default)
    done = run_cli(
        "plan",
        "--model",
        "gpt2-small",
        "--cluster",
        "dgx-a100-80g:nodes=1",
        "--global-batch",
        "16",
        "--budget",
        "0",
        "--max-pp",
        "2",
    )
    assert done.returncode == 0, done.stderr
    hint = [line for line in done.stderr.splitlines() if "--budget 0 proves" in line]
    assert len(hint) == 1  # once
    assert "remain after" in hint[0] and "Ctrl-C" in hint[0] and "--tp 8" in hint[0]
