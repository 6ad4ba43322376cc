"""Measurement jobs in local worker processes that report progress, so that the parent can tell
a slow machine from a hung job.

Workers call `beat(path)` after each measurement; `join_workers` waits for them as long as they
make progress and gives up only when none was reported for ``stall_s`` seconds (a loaded machine
is slower, not silent). Every failure is one `CalibrationError` line with a hint.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from autoplan.contract.errors import CalibrationError

__all__ = ["DEFAULT_STALL_S", "beat", "join_workers"]

# Seconds without any reported progress after which a job counts as hung. The slowest single
# measurement (a 16 MiB collective x 21 on gloo, or one warm-up training step) takes a few
# seconds on an idle 2-core machine; 120 s leaves room for a machine loaded many times over.
DEFAULT_STALL_S = 120.0


def beat(path: str | os.PathLike[str]) -> None:
    """Report progress (touch ``path``)."""
    Path(path).touch()


def _last_beat(path: Path, since: float) -> float:
    try:
        return max(since, path.stat().st_mtime)
    except FileNotFoundError:
        return since


def join_workers(
    context: Any, heartbeat: str | os.PathLike[str], *, stall_s: float, what: str, hint: str
) -> None:
    """Wait for torch's ``start_processes`` ``context`` while its workers beat ``heartbeat``.

    Raises `CalibrationError` (one line) when a worker fails, or when none beat for ``stall_s``
    seconds; the workers are killed first."""
    if not stall_s > 0:
        raise CalibrationError(f"stall timeout {stall_s!r} s must be > 0; e.g. 120")
    path = Path(heartbeat)
    started = time.time()
    try:
        while not context.join(timeout=1.0):
            silent = time.time() - _last_beat(path, started)
            if silent > stall_s:
                raise CalibrationError(
                    f"{what} made no progress for {silent:.0f} s (stall timeout {stall_s:.0f} s)"
                    f"; {hint}"
                )
    except CalibrationError:
        _kill(context)
        raise
    except Exception as error:  # a worker raised or died: its last line is the reason
        _kill(context)
        reason = str(error).strip().splitlines()
        last = reason[-1] if reason else type(error).__name__
        raise CalibrationError(f"{what} failed: {last}; {hint}") from error


def _kill(context: Any) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()
