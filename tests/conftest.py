"""Shared test fixtures: the installed console script and an isolated local-cluster cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

AUTOPLAN_SCRIPT = Path(sys.executable).parent / "autoplan"


@pytest.fixture(autouse=True)
def _no_local_calibration(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tests see the shipped `local` preset, never a calibration saved on the developer's machine."""
    missing = tmp_path_factory.getbasetemp() / "no-calibration.yaml"
    monkeypatch.setenv("AUTOPLAN_LOCAL_CLUSTER", str(missing))


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the real ``autoplan`` console script; never raises on a non-zero exit."""
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
