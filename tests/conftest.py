"""Shared test fixtures: the command line (in-process, or the installed console script) and an
isolated local-cluster cache."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from filelock import FileLock

T = TypeVar("T")
AUTOPLAN_SCRIPT = Path(sys.executable).parent / "autoplan"


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest-xdist worker computes on one thread, as the jobs the tests start do
    (`tests.jobs`, `tests.dist_utils`): the workers outnumber the machine's cores already, so
    torch's default of a thread per core only adds threads contending for them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _no_local_calibration(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tests see the shipped `local` preset, never a calibration saved on the developer's machine."""
    missing = tmp_path_factory.getbasetemp() / "no-calibration.yaml"
    monkeypatch.setenv("AUTOPLAN_LOCAL_CLUSTER", str(missing))


@pytest.fixture(autouse=True)
def _piped_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests read the CLI's output as piped, 100 columns wide (`autoplan._format.WIDTH`),
    whatever the shell that runs them exports (``COLUMNS``, rich's ``TTY_COMPATIBLE``); a test
    of other widths sets them itself."""
    for name in ("COLUMNS", "TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)


@dataclass(frozen=True)
class PipelineReference:
    """The example run without a fault under a fixed 2-process pipeline plan."""

    plan: Path
    steps: int
    every: int
    losses: dict[int, float]  # step -> loss, exact


@pytest.fixture(scope="session")
def pipeline_reference(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> PipelineReference:
    """Shared by the restart, Ray, example and resume tests, which compare their runs with it
    bit for bit: one run (~20 s) for every pytest-xdist worker."""
    from tests.jobs import fixed_plan, run_uninterrupted

    def run(folder: Path) -> PipelineReference:
        plan = fixed_plan(folder, 2)
        steps, every = 24, 4
        losses = run_uninterrupted(folder, 2, steps=steps, every=every, extra=("--plan", str(plan)))
        return PipelineReference(plan=plan, steps=steps, every=every, losses=losses)

    return shared_by_workers(tmp_path_factory, worker_id, "pipeline-reference", run)


def shared_by_workers(
    tmp_path_factory: pytest.TempPathFactory,
    worker_id: str,
    name: str,
    compute: Callable[[Path], T],
) -> T:
    """``compute(folder)`` once for every pytest-xdist worker of this run (the first to ask
    computes it under a file lock, the others unpickle it): a module fixture that costs
    seconds, which each worker running one of its tests would otherwise compute again.
    ``folder`` is the run's own, shared by the workers; nothing in it may be written later."""
    if worker_id == "master":  # not under xdist
        return compute(tmp_path_factory.mktemp(name))
    folder = tmp_path_factory.getbasetemp().parent / name
    record = folder.with_suffix(".pickle")
    with FileLock(str(folder) + ".lock"):
        if not record.exists():
            folder.mkdir()
            record.write_bytes(pickle.dumps(compute(folder)))
    value: T = pickle.loads(record.read_bytes())
    return value


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 120, real: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the ``autoplan`` command line; never raises on a non-zero exit.

    By default in this process, through `autoplan.cli.main` (the console script's entry point):
    each call then costs milliseconds instead of a Python start with torch's import (about
    1.5 s here). An exception escaping `main` is what the console script would print as a
    traceback: it is returned the same way, exit code 1 and the traceback on stderr.
    ``real=True`` runs the installed console script in a subprocess (tests of the script
    itself); ``timeout`` applies to it only.
    """
    if real:
        assert AUTOPLAN_SCRIPT.exists(), (
            f"console script missing at {AUTOPLAN_SCRIPT}; pip install -e ."
        )
        env = dict(os.environ, COLUMNS="120", NO_COLOR="1")
        return subprocess.run(
            [str(AUTOPLAN_SCRIPT), *args],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=env,
            timeout=timeout,
            check=False,
        )
    from autoplan.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    previous = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            except BaseException:
                code = 1
                err.write(traceback.format_exc())
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess(["autoplan", *args], code, out.getvalue(), err.getvalue())
