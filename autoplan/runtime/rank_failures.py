"""How a job reports an error that ends some of its ranks: once, by the lowest failing rank, before
the launcher tears the job down.

`autoplan.parallelize` installs `FailureReport` as the process's ``sys.excepthook`` once the job's
process group exists (under torchrun, or any job of more than one process). When an exception is
about to end a rank, the hook:

1. records it in the job's store (`passes.progress.RankFailures`) as *primary* (the rank's own
   failure) or *secondary* (a collective that failed because a peer had recorded a failure first:
   a `CrashedRankError`, or an error in gloo's words while such a record exists);
2. destroys the rank's process groups;
3. a primary rank waits up to `GRACE_S` for the other ranks' records, then the lowest primary
   rank prints the job's error: one line for an `InputError` (``autoplan: error: <message>
   (rank 1; 2 ranks stopped)``), its traceback and that line for any other exception; the store
   elects one printer (``compare_set``), so the line appears once whatever the timing;
4. every other rank waits (up to `REPORT_WAIT_S`) until the line is printed before it exits:
   torchrun's agent stops every worker as soon as the first one exits, and must not stop the
   printer first. The printer, in turn, holds back a SIGTERM that arrives while it decides and
   prints (at most `GRACE_S` plus a store round trip) and acts on it right after; no signal is
   swallowed;
5. the process then ends within `EXIT_S`: its exit closes its sockets, and that is what makes
   the peers' collectives with it fail at once ("Connection closed by peer"), so they find the
   record and raise `CrashedRankError` instead of waiting for the process-group timeout.

Why 5: on gloo (torch 2.13) neither ``destroy_process_group`` nor ``ProcessGroup.abort`` or
``shutdown`` closes a group's connections while a peer waits on them (checked: a peer's send
still waits for the timeout), and Python's exit joins every non-daemon thread first: a
checkpoint writer blocked in a collective with a peer that waits for this process holds the
exit until the timeout. So after `EXIT_S` a daemon thread runs the exit handlers
(``atexit``: a checkpoint folder's lock is released) and ends the process with ``os._exit(1)``.

Without a store (an error before the process group exists) every rank raised the same error
(the checks before the group are identical on every rank): rank 0 prints it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import torch.distributed as dist

from autoplan.contract.errors import InputError
from cost_model.messages import shown
from passes.progress import (
    PEER_WAIT_S,
    CrashedRankError,
    RankFailure,
    RankFailures,
    StalledRankError,
)

__all__ = ["EXIT_S", "GRACE_S", "REPORT_WAIT_S", "FailureReport", "install", "summary_line"]

# How long the first failing rank waits for lower ranks' records before it decides it is the
# lowest: a peer whose collective failed because of it records within milliseconds.
GRACE_S = 1.0
# How long a rank that does not print waits for the one that does (then it prints its own).
REPORT_WAIT_S = 10.0
# How long the normal exit may take after the hook before the process ends regardless.
EXIT_S = 3.0

_Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


class FailureReport:
    """The excepthook; see the module doc. ``failures`` is the current job's (parallelize
    replaces it when it builds another)."""

    def __init__(self, failures: RankFailures, previous: _Hook) -> None:
        self.failures = failures
        self.previous = previous

    def __call__(
        self, kind: type[BaseException], error: BaseException, trace: TracebackType | None
    ) -> None:
        if not isinstance(error, Exception) or hasattr(sys, "ps1"):
            # KeyboardInterrupt and the like, or an interactive session: as usual
            self.previous(kind, error, trace)
            return
        try:
            self._report(kind, error, trace)
        finally:
            _exit_within(EXIT_S)

    def _report(
        self, kind: type[BaseException], error: Exception, trace: TracebackType | None
    ) -> None:
        with _SigtermHeld():
            mine = self._record(error)
            if dist.is_initialized():
                # no abort at exit; on gloo the peers fail when this process ends (EXIT_S)
                dist.destroy_process_group()
            if mine.primary and self._lowest_primary() and self.failures.claim_report():
                self._print(kind, error, trace, mine)
                return
            if self.failures.wait_reported(REPORT_WAIT_S):
                return
            # nobody printed (the failing rank died before it could): say what this rank saw
            if self.failures.claim_report():
                self._print(kind, error, trace, mine)

    def _record(self, error: Exception) -> RankFailure:
        failures = self.failures
        if failures.mine is not None:  # train_step recorded it already
            return failures.mine
        if isinstance(error, CrashedRankError):
            return failures.record(error, primary=False)
        if isinstance(error, InputError | StalledRankError):
            return failures.record(error, primary=True)
        return failures.record(error, primary=failures.crashed(error, PEER_WAIT_S) is None)

    def _lowest_primary(self) -> bool:
        """Wait up to `GRACE_S` for every rank's record (the lower ranks' decide who prints, the
        others' complete the summary); whether no lower rank failed on its own."""
        me, world = self.failures.rank, self.failures.world_size
        found = self.failures.wait(lambda found: len(found) >= world, GRACE_S)
        return not any(f.primary and rank < me for rank, f in found.items())

    def _print(
        self,
        kind: type[BaseException],
        error: BaseException,
        trace: TracebackType | None,
        mine: RankFailure,
    ) -> None:
        if not mine.input_error:
            self.previous(kind, error, trace)  # the traceback, on this rank only
        line = summary_line(mine, self.failures.read(), self.failures.world_size)
        print(line, file=sys.stderr, flush=True)
        self.failures.reported()


def summary_line(mine: RankFailure, found: dict[int, RankFailure], world_size: int) -> str:
    """The job's one line: ``autoplan: error: <what> (rank 1; 2 ranks stopped)``, or
    ``(every one of the 2 ranks stopped)`` when every rank failed alike; other ranks' different
    errors are named, shortened."""
    primaries = {rank: f for rank, f in found.items() if f.primary}
    primaries[mine.rank] = mine
    alike = sorted(rank for rank, f in primaries.items() if f.summary == mine.summary)
    if world_size > 1 and len(alike) == world_size:
        where = f"every one of the {world_size} ranks stopped"
    else:
        where = f"rank{'s' if len(alike) > 1 else ''} {', '.join(map(str, alike))}"
        others = [f for rank, f in sorted(primaries.items()) if f.summary != mine.summary]
        for other in others[:2]:
            where += f"; rank {other.rank}: {shown(other.summary, quoted=False)}"
        if len(others) > 2:
            where += f"; {len(others) - 2} more ranks failed"
        where += f"; {world_size} rank{'s' if world_size != 1 else ''} stopped"
    return f"autoplan: error: {mine.summary} ({where})"


class _SigtermHeld:
    """Hold back a SIGTERM while the hook runs (bounded: `REPORT_WAIT_S` at most); afterwards
    SIGTERM has its default action again, and one that arrived meanwhile ends the process."""

    def __init__(self) -> None:
        self.received = False
        self.installed = False

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def __enter__(self) -> _SigtermHeld:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._hold)
            self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.installed:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.received:
            sys.stdout.flush()
            sys.stderr.flush()
            signal.raise_signal(signal.SIGTERM)


def _exit_within(seconds: float) -> None:
    """End the process ``seconds`` from now if its normal exit has not (see the module doc)."""

    def end() -> None:
        time.sleep(seconds)
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(1)

    threading.Thread(target=end, name="autoplan-exit", daemon=True).start()


def install(failures: RankFailures) -> None:
    """Make `FailureReport` the process's excepthook for this job (once per process; a later
    job's ``failures`` replace the earlier one's)."""
    hook = sys.excepthook
    if isinstance(hook, FailureReport):
        hook.failures = failures
        return
    sys.excepthook = FailureReport(failures, hook)


def one_line_without_store() -> None:
    """An `InputError` raised before the job's store exists: every rank raised it (the checks
    before the process group are the same on every rank), so rank 0 prints it as one line and
    the others stay quiet. Under torchrun only; elsewhere the usual traceback."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or isinstance(
        sys.excepthook, FailureReport | _RankZeroLine
    ):
        return
    sys.excepthook = _RankZeroLine(sys.excepthook)


class _RankZeroLine:
    def __init__(self, previous: _Hook) -> None:
        self.previous = previous

    def __call__(
        self, kind: type[BaseException], error: BaseException, trace: TracebackType | None
    ) -> None:
        if not isinstance(error, InputError):
            self.previous(kind, error, trace)
            return
        if int(os.environ.get("RANK", "0")) == 0:
            world = os.environ.get("WORLD_SIZE", "?")
            print(
                f"autoplan: error: {error} (every one of the {world} ranks stopped)",
                file=sys.stderr,
                flush=True,
            )
