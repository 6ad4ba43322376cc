"""The example's training function under Ray Train (issue 18 item 5): ``train_gpt.py --ray 2``
starts a local Ray cluster of two CPU workers on gloo; one worker is SIGKILLed mid-run, Ray's
``FailureConfig`` restarts the worker group, which resumes from autoplan's checkpoint, and every
loss equals the torchrun run's bit for bit (the same plan, the same batches)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import PipelineReference
from tests.jobs import EXAMPLE, ROOT, example_args, job_env, losses

STEPS = 24
EVERY = 4


def _ray_workers() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if cmdline.startswith("ray::RayTrainWorker"):
            found.append(process)
    return found


@pytest.mark.slow
def test_ray_train_restarts_the_workers_and_resumes_from_autoplans_checkpoint(
    tmp_path: Path, pipeline_reference: PipelineReference
) -> None:
    # `make test` installs the extra; a missing one fails here rather than skipping unseen
    if importlib.util.find_spec("ray") is None:
        pytest.fail("Ray is not installed: pip install -e '.[ray]' (make test does)")
    plan, expected = pipeline_reference.plan, pipeline_reference.losses
    assert pipeline_reference.steps == STEPS

    log = tmp_path / "loss.log"
    args = example_args(tmp_path, log, steps=STEPS, every=EVERY, extra=("--plan", str(plan)))
    job = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--ray", "2", "--max-failures", "1", *args],
        cwd=ROOT,
        env=job_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not losses(log) or losses(log)[-1][0] < 2 * EVERY + 2:
            assert job.poll() is None and time.monotonic() < deadline, job.stdout
            time.sleep(0.05)
        killed_at = losses(log)[-1][0]
        workers = _ray_workers()
        assert len(workers) == 2, [w.cmdline() for w in workers]
        workers[-1].kill()
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-4000:]
    assert f"ray: finished at step {STEPS}" in out, out[-3000:]
    assert str(tmp_path / "ckpt" / f"step_{STEPS:08d}") in out  # Ray's checkpoint points there
    records = losses(log)
    steps = [step for step, _ in records]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    resumed = steps[restart] - 1
    assert resumed % EVERY == 0 and EVERY <= resumed <= killed_at, steps
    assert steps[restart:] == list(range(resumed + 1, STEPS + 1))
    for step, loss in records:
        assert loss == expected[step], (step, loss, expected[step])
