"""examples/train_gpt.py under torchrun: it searches a plan, prints it and the loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PipelineReference
from tests.jobs import losses

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_gpt_example_learns(tmp_path: Path) -> None:
    result = _run_example(tmp_path, "--steps", "60")
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
    # the end-of-run line: the prediction for the plan against the median measured step
    timing = re.search(
        r"predicted ([0-9.]+) ms a step \(range [0-9.]+-[0-9.]+ ms\), measured ([0-9.]+) ms "
        r"\(([+-][0-9]+)%; median of 57 steps\)",
        out,
    )
    assert timing, out[-2000:]
    predicted, measured = float(timing.group(1)), float(timing.group(2))
    assert int(timing.group(3)) == pytest.approx(100 * (predicted / measured - 1), abs=2)


def _run_example(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        AUTOPLAN_LOCAL_CLUSTER=str(tmp_path / "no-calibration.yaml"),
        COLUMNS="200",
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "train_gpt.py"),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_train_gpt_example_resumes_from_its_checkpoint(
    tmp_path: Path, pipeline_reference: PipelineReference
) -> None:
    log = tmp_path / "parts.log"
    plan = ["--plan", str(pipeline_reference.plan)]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4"]
    # The first job stops at step 6 (it saves 4, and its last step at the end) ...
    first = _run_example(tmp_path, "--steps", "6", *plan, *ckpt, "--loss-log", str(log))
    assert first.returncode == 0, first.stderr[-3000:]
    # ... the second resumes at 6: the same batches and losses as the job that never stopped.
    second = _run_example(tmp_path, "--steps", "10", *plan, *ckpt, "--loss-log", str(log))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed step 6 from {tmp_path / 'ckpt' / 'step_00000006'} in " in second.stdout
    assert "(same plan)" in second.stdout
    records = losses(log)
    assert [step for step, _ in records] == list(range(1, 11))
    for step, loss in records:  # printed with repr: bit for bit
        assert loss == pipeline_reference.losses[step], step
    # a bad interval stops the script before it starts any process group
    bad = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--checkpoint-every", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode != 0 and "0 must be >= 1 (steps between checkpoints)" in bad.stderr
