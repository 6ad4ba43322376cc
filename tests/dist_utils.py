"""A small multi-process launcher for distributed tests on CPU (gloo).

`run_distributed(fn, world_size=N, tmp_path=...)` starts N processes, each with

- a gloo process group rendezvousing through a ``file://`` store in ``tmp_path`` (no ports, so
  parallel test runs cannot clash), with a short process-group timeout;
- ``torch.set_num_threads(1)``, a fixed seed (``torch.manual_seed(seed)`` on every rank) and the
  torchrun environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...);

runs ``fn(rank, world_size, *args)`` and returns the per-rank results in rank order (results must
be picklable; return CPU tensors). If any rank raises, the others are killed and the error is
re-raised in the test with that rank's traceback; if the job outlives ``timeout_s`` every rank is
killed and the test fails naming the ranks that never finished. Nothing can hang the test run.

Processes start from a ``forkserver`` that has imported torch once: each rank then starts in
about 0.1 s (``spawn`` costs about 2 s a rank), and, unlike a plain ``fork`` of the pytest
process, a rank never inherits thread pools or state from torch work that earlier tests ran in
the parent. ``fn`` must be a module-level function of an importable module (``tests.<name>``).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

__all__ = ["DistributedTestError", "fake_process_group", "run_distributed"]

_CONTEXT: BaseContext | None = None


class DistributedTestError(AssertionError):
    """A rank failed or the job timed out; the message carries the rank's traceback."""


def _context() -> BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        # The server imports these once; every rank forks from it with torch already loaded.
        ctx.set_forkserver_preload(
            ["torch", "torch.distributed", "autoplan.runtime.parallelizer", "tests.dist_utils"]
        )
        _CONTEXT = ctx
    return _CONTEXT


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    rdzv_file: str,
    pg_timeout_s: float,
    seed: int,
    args: tuple[Any, ...],
    results: Any,
    env: dict[str, str],
) -> None:
    status: tuple[str, int, Any]
    # A rank that crashes in native code (a signal) prints its Python stack to stderr, which
    # pytest shows with the failure; the rank itself cannot report.
    faulthandler.enable()
    try:
        os.environ.update(env)
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "GROUP_RANK": "0",
                "OMP_NUM_THREADS": "1",
            }
        )
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{rdzv_file}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
        except Exception as error:
            # Nothing under test has run yet: the harness's own rendezvous failed.
            results.put(("rendezvous", rank, f"{type(error).__name__}: {error}"))
            results.close()
            results.join_thread()
            return
        try:
            value = fn(rank, world_size, *args)
        finally:
            # No barrier here: a rank that failed must not wait for the others.
            if dist.is_initialized():
                dist.destroy_process_group()
        # Tensors as bytes: torch's queue pickler would pass them through shared-memory file
        # descriptors, which die with this process before the parent reads them.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        status = ("ok", rank, buffer.getvalue())
    except BaseException as error:
        status = ("error", rank, f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    results.put(status)
    # Let the queue's feeder thread flush before the process exits.
    results.close()
    results.join_thread()


# Errors a rank reports because a peer died, not because of its own fault.
_KNOCK_ON = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out")


def _describe_failure(
    rank: int, error: str, results: Any, world_size: int, procs: list[Any] | None = None
) -> str:
    """The root-cause error first: collect the other ranks' reports for a moment, then put
    errors that are not knock-on failures (a peer hung up, a collective timed out) first. A rank
    that crashed in native code reports nothing (its peers only see the connection drop): it is
    named with its exit code (negative: the signal)."""
    errors = {rank: error}
    deadline = time.monotonic() + 3.0
    while len(errors) < world_size and time.monotonic() < deadline:
        try:
            kind, other, value = results.get(timeout=0.2)
        except queue.Empty:
            continue
        if kind == "error":
            errors[other] = value
    ordered = sorted(errors, key=lambda r: (any(k in errors[r] for k in _KNOCK_ON), r))
    root = ordered[0]
    text = f"rank {root} failed:\n{errors[root]}"
    others = [r for r in ordered[1:]]
    if others:
        text += f"\n(ranks {others} failed too, most likely as a consequence)"
    silent = [
        f"rank {r} exited with code {proc.exitcode} without reporting"
        for r, proc in enumerate(procs or [])
        if r not in errors and proc.exitcode not in (None, 0)
    ]
    if silent:
        text += "\n(" + "; ".join(silent) + ": killed or crashed in native code)"
    return text


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    tmp_path: Path,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    seed: int = 0,
    env: dict[str, str] | None = None,
    kill_on_error: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results in rank order.

    Raises `DistributedTestError` with the failing rank's traceback (the root cause first)
    or, after ``timeout_s``, naming the ranks still running. With ``kill_on_error=False`` the
    other ranks are left to fail on their own (a test that they do not hang) and the error
    lists every rank's failure.

    A job in which a rank crashed in native code (SIGSEGV, SIGBUS, SIGABRT: a fault inside
    torch or gloo, not in Python) runs once more, with a warning that carries the first
    failure; a second crash fails the test. Seen once in about 60 CI runs of the 4-process
    DualPipeV + ZeRO-2 case (rank 2 got SIGSEGV inside the schedule; 12 local reruns passed).
    The crashed rank's Python stack is on the test's captured stderr (faulthandler).

    A job whose gloo rendezvous (the harness's own ``init_process_group``, before ``fn`` runs)
    failed also runs once more, with a warning: nothing under test ran. Seen in two of four
    fresh-clone CI runs (three pytest workers on two cores), both times in the run right after
    a rank's deliberate SIGSEGV (tests/test_dist_utils.py): a rank of that run got "Connection
    closed by peer" in gloo's ``connectFullMesh`` (cause not found; it never reproduced alone,
    even with the cores held busy).
    """
    retried: set[type[Exception]] = set()
    while True:
        try:
            return _run_once(
                fn, args, world_size, tmp_path, timeout_s, pg_timeout_s, seed, env, kill_on_error
            )
        except DistributedTestError as error:
            cause = type(error.__cause__)
            if cause not in _RETRIED or cause in retried:
                raise
            retried.add(cause)
            warnings.warn(f"{_RETRIED[cause]}; the job ran again: {error}", stacklevel=2)


class _NativeCrash(Exception):
    """Attached as the cause of a `DistributedTestError` when a rank died of a crash signal."""


class _RendezvousFailure(Exception):
    """Attached as the cause of a `DistributedTestError` when a rank's rendezvous failed."""


_RETRIED: dict[type[Exception], str] = {
    _NativeCrash: "a rank crashed in native code",
    _RendezvousFailure: "the gloo rendezvous failed",
}


_CRASH_SIGNALS = {-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT}


def _crashed(procs: list[Any], grace_s: float = 30.0) -> bool:
    """Whether a rank died of a crash signal. Its exit status reaches this process through the
    forkserver, which may deliver it after the peers have reported the errors the crash caused
    (possible on a loaded machine): wait for every rank's status, at most ``grace_s``. 5 s was
    once too short in a fresh-clone CI run with three pytest workers on two cores (the peer's
    connection error came, the SIGSEGV status did not); the wait only delays a job that fails
    anyway, and ends as soon as every rank's status is in."""
    deadline = time.monotonic() + grace_s
    while True:
        codes = [proc.exitcode for proc in procs]
        if any(code in _CRASH_SIGNALS for code in codes):
            return True
        if None not in codes or time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _run_once(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    tmp_path: Path,
    timeout_s: float,
    pg_timeout_s: float,
    seed: int,
    env: dict[str, str] | None,
    kill_on_error: bool,
) -> list[Any]:
    ctx = _context()
    rdzv = tmp_path / f"rdzv-{time.monotonic_ns()}"
    results = ctx.Queue()
    procs = [
        ctx.Process(  # type: ignore[attr-defined]
            target=_worker,
            args=(fn, rank, world_size, str(rdzv), pg_timeout_s, seed, args, results, env or {}),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise DistributedTestError(
                    f"distributed job timed out after {timeout_s:.0f} s; ranks {missing} never "
                    "finished (a hang: a collective some rank never joined?)"
                )
            try:
                kind, rank, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in values and p.exitcode is not None and p.exitcode != 0
                ]
                if dead:
                    # Give a dying rank's report a moment to arrive before blaming a crash.
                    try:
                        kind, rank, value = results.get(timeout=2.0)
                    except queue.Empty:
                        raise DistributedTestError(
                            f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                            "without reporting (killed or crashed in native code)"
                        ) from None
                else:
                    continue
            if kind == "rendezvous":
                raise DistributedTestError(
                    f"rank {rank} failed in init_process_group (the harness's gloo "
                    f"rendezvous):\n{value}"
                ) from _RendezvousFailure()
            if kind == "error":
                if kill_on_error:
                    raise DistributedTestError(
                        _describe_failure(rank, value, results, world_size, procs)
                    )
                errors[rank] = value
                values[rank] = None
                continue
            import torch

            values[rank] = torch.load(io.BytesIO(value), weights_only=False)
        if errors:
            ordered = sorted(errors, key=lambda r: (any(k in errors[r] for k in _KNOCK_ON), r))
            raise DistributedTestError("\n".join(f"rank {r} failed:\n{errors[r]}" for r in ordered))
    except DistributedTestError as error:
        # A crash comes first: its peers' rendezvous may fail because of it.
        if _crashed(procs):
            raise error from _NativeCrash()
        raise
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        # Until every rank is gone (SIGKILL: the kernel ends it; a short timeout could return
        # first on a loaded machine): a rank still dialling a crashed peer's freed port must not
        # reach the listener that a retry's rank may bind to the same port.
        for proc in procs:
            proc.join(timeout=60)
        results.close()
    return [values[rank] for rank in range(world_size)]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default process group of ``world_size`` ranks in this one process, as rank ``rank``,
    on torch's ``fake`` backend: meshes, DTensor layouts and wrappers can be built and checked
    without other processes (collectives return at once and move no data)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group is already set up in this process"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
