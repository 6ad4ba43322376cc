"""examples/train_gpt.py under torchrun: it searches a plan, prints it and the loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_gpt_example_learns(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        AUTOPLAN_LOCAL_CLUSTER=str(tmp_path / "no-calibration.yaml"),
        COLUMNS="200",
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "train_gpt.py"),
            "--steps",
            "60",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "plan for 2 processes: dp " in out
    match = re.search(
        r"mean of first 10: ([0-9.]+)\), end [0-9.]+ \(mean of last 10: ([0-9.]+)\)", out
    )
    assert match, out[-2000:]
    first, last = float(match.group(1)), float(match.group(2))
    # Uniform guessing over the 97 characters costs ln 97 = 4.57; 60 steps reach about 3.
    assert last < first - 0.5, (first, last)
