"""One job per checkpoint folder, for `autoplan.runtime.checkpoint`: ``DIR/autoplan.lock``.

Rank 0 creates ``DIR/autoplan.lock`` with ``O_CREAT | O_EXCL`` (atomic on local file systems
and NFSv3 and later; ``flock`` would die with its process but is emulated with byte-range locks
over NFS, absent on some network file systems, and carries no identity to report), holding the
job's identity (``TORCHELASTIC_RUN_ID``, host, boot id, pid, process start, time), and touches
it every `HEARTBEAT_S` seconds.

Expects a folder that exists and that this process can write to (the `Checkpointer` checks it
first), and one `FolderLock` per job, on one rank. Guarantees: `FolderLock.acquire` either holds
the lock or raises `CheckpointError` naming the holder (job, pid, host, since when, the lock
file). A lock is taken over when it is this job's (the same ``TORCHELASTIC_RUN_ID``: torchrun's
restarts and elastic re-plans; or this very process), when its process is gone (same host and
boot), or, for another host, when its heartbeat is older than `STALE_S` seconds (measured on
the file system's clock); a takeover is one warning line. `FolderLock.release` and the end of
the process remove the lock file, only while it is still this lock's.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from autoplan.runtime.checkpoint_files import CheckpointError, reason
from cost_model.messages import shown

__all__ = ["HEARTBEAT_S", "STALE_S", "FolderLock", "job_identity"]

logger = logging.getLogger(__name__)

_LOCK = "autoplan.lock"
HEARTBEAT_S = 30.0  # the lock holder touches the lock file this often
STALE_S = 600.0  # a lock of another host untouched this long is stale

_PROCESS_JOB: tuple[int, str] | None = None


def job_identity() -> str:
    """This job's id: torchrun's ``TORCHELASTIC_RUN_ID`` (the same on every rank and across
    its restarts); its default ``none`` (no ``--rdzv-id``) by the agent process; outside
    torchrun, an id of this process."""
    global _PROCESS_JOB
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    host = socket.gethostname()
    if run_id == "none":
        agent = os.getppid()
        started = _process_start(agent)
        if started is not None:
            return f"torchrun-agent:{host}:{agent}:{started:.2f}"
    pid = os.getpid()
    if _PROCESS_JOB is None or _PROCESS_JOB[0] != pid:  # a forked child is another job
        _PROCESS_JOB = (pid, f"process:{host}:{pid}:{uuid.uuid4().hex[:8]}")
    return _PROCESS_JOB[1]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


class FolderLock:
    """``DIR/autoplan.lock`` for ``job`` (see the module docstring)."""

    def __init__(self, directory: Path, job: str) -> None:
        self.path = directory / _LOCK
        self.job = job
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._held = False

    def _identity(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "pid": os.getpid(),
            "process_start": _process_start(os.getpid()),
            "since": datetime.now(UTC).isoformat(timespec="seconds"),
            "token": self.token,
        }

    def acquire(self) -> None:
        """Take the lock, or raise `CheckpointError` naming its holder."""
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over_if_free()
                continue
            except OSError as error:
                raise CheckpointError(
                    f"cannot create the lock file {self.path} ({reason(error)}); pass a folder "
                    "this job can write to"
                ) from None
            try:
                with os.fdopen(fd, "w") as stream:
                    stream.write(json.dumps(self._identity()) + "\n")
                    stream.flush()
                    os.fsync(stream.fileno())
            except OSError as error:
                with contextlib.suppress(OSError):
                    self.path.unlink()
                raise CheckpointError(
                    f"cannot write the lock file {self.path} ({reason(error)}); free space or "
                    "pass another folder"
                ) from None
            self._held = True
            atexit.register(self.release)
            threading.Thread(target=self._beat, name="autoplan-ckpt-lock", daemon=True).start()
            return
        raise CheckpointError(
            f"could not take the lock {self.path}: other jobs keep taking it; start one job at "
            "a time on a checkpoint folder"
        )

    def _read(self) -> tuple[dict[str, Any] | None, float]:
        """The holder's record (None: unreadable) and the lock file's age on the file
        system's own clock (so clocks of other hosts do not matter)."""
        try:
            raw = self.path.read_text()
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            raise
        except OSError:
            return None, 0.0
        probe = self.path.with_name(f".{_LOCK}.clock-{uuid.uuid4().hex}")
        try:
            probe.write_bytes(b"")
            now = probe.stat().st_mtime
            probe.unlink()
        except OSError:
            now = time.time()
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = None
        return (holder if isinstance(holder, dict) else None), now - mtime

    def _take_over_if_free(self) -> None:
        """Remove the lock file when the rules let this job take it; raise `CheckpointError`
        naming the holder when they do not."""
        holder: dict[str, Any] | None = None
        age = 0.0
        for _ in range(20):  # a lock created a moment ago may not be written yet
            try:
                holder, age = self._read()
            except FileNotFoundError:
                return
            if holder is not None or age > 5.0:
                break
            time.sleep(0.05)
        if holder is None:
            raise CheckpointError(
                f"the lock file {self.path} is unreadable: if no job uses "
                f"{self.path.parent}, delete it and start again"
            )
        why = self._free(holder, age)
        if why is None:
            raise CheckpointError(self._held_message(holder))
        aside = self.path.with_name(f".{_LOCK}.taken-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)  # only one job can move this file
        except FileNotFoundError:
            return
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError):
            moved = None
        if not isinstance(moved, dict) or moved.get("token") != holder.get("token"):
            # another job replaced the stale lock meanwhile: put its lock back
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        else:
            logger.warning(
                "taking over the checkpoint lock %s of job %s (%s)",
                self.path,
                shown(holder.get("job"), 80),
                why,
            )
        with contextlib.suppress(OSError):
            aside.unlink()

    def _free(self, holder: Mapping[str, Any], age: float) -> str | None:
        """Why ``holder``'s lock may be taken over, or None (it is held)."""
        if holder.get("job") == self.job:
            return "an earlier start of this job"
        pid = holder.get("pid")
        if holder.get("host") == socket.gethostname() and holder.get("boot_id") == _boot_id():
            if not isinstance(pid, int):
                return "it names no process"
            started = _process_start(pid)
            recorded = holder.get("process_start")
            if started is None or (
                isinstance(recorded, (int, float)) and abs(started - recorded) > 1.0
            ):
                return f"its process {pid} is gone"
            return None
        if age > STALE_S:
            return f"no heartbeat for {age:.0f} s (more than {STALE_S:.0f} s)"
        return None

    def _held_message(self, holder: Mapping[str, Any]) -> str:
        return (
            f"checkpoint folder {self.path.parent} is in use by job "
            f"{shown(holder.get('job'), 80, quoted=False)} (pid {shown(holder.get('pid'))} on "
            f"{shown(holder.get('host'), 80, quoted=False)}, since "
            f"{shown(holder.get('since'), 40, quoted=False)}; lock file {self.path}): wait for "
            "it to end or pass another --checkpoint-dir; if that job is gone, delete the lock "
            "file"
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._mine():  # a later start of this job took it over
                logger.debug("checkpoint lock %s is no longer this lock's", self.path)
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def _mine(self) -> bool:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(holder, dict) and holder.get("token") == self.token

    def release(self) -> None:
        """Remove the lock file if it is still this lock's (idempotent)."""
        self._stop.set()
        if not self._held:
            return
        self._held = False
        atexit.unregister(self.release)
        if self._mine():
            with contextlib.suppress(OSError):
                self.path.unlink()
