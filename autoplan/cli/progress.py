"""Progress of the commands that can take seconds, on stderr, so that stdout stays the result.

On a terminal: a transient rich bar (removed when the command ends). Piped or redirected: plain
lines, each flushed, ``PREFIX: TEXT (N s)`` with the seconds since the command started its work
(``plan: tracing gpt3-175b (2 s)``, ``plan: searching, 5 of 14,899 candidates visited, best step
19.8 s (7 s)``), cut to ``COLUMNS`` when set, else `WIDTH` columns:

- none until the command has done `FIRST_LINE_S` seconds of work (a quick command prints none,
  and its error stays the only line on stderr: git's delayed progress waits 2 s the same way);
  the work is counted in CPU seconds of this process, so a loaded machine, which stretches wall
  time but not this, does not make a quick command chatty; a command whose work runs in worker
  processes (``whatif``'s searches, ``calibrate``'s measurements: ``in_workers``) counts wall
  seconds instead;
- then a line for the phase in hand, and one at once for each phase after it (``Status.update``'s
  ``phase``: tracing, enumerating, seeding, visiting, ...);
- within a phase that counts (``total`` given), a line each time it passes another
  `PERCENT_STEP` percent;
- and, while nothing else is printed, one every `STATUS_EVERY_S` seconds of wall time.

Commands turn it off under ``--json`` unless ``--progress`` (`progress_enabled`). Guarantees:
nothing goes to stdout; the status thread stops when the ``with`` block ends.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autoplan._format import WIDTH, fmt_time

__all__ = [
    "FIRST_LINE_S",
    "PERCENT_STEP",
    "STATUS_EVERY_S",
    "Status",
    "progress_enabled",
    "progress_option",
    "search_status",
    "status_reporter",
]

# CPU seconds of work before the first piped line (git's progress.c delays its meter 2 s).
FIRST_LINE_S = 2.0
# Wall seconds between two piped lines of one phase that reports nothing new.
STATUS_EVERY_S = 10.0
# A piped line each time a counted phase passes another this many percent.
PERCENT_STEP = 25
# Seconds between two looks of the status thread at a phase that has not been printed.
_POLL_S = 0.25

# --progress/--no-progress: the default (None) shows progress except under --json
progress_option = click.option(
    "--progress/--no-progress",
    "progress",
    default=None,
    help="Progress on stderr (a bar on a terminal, else a line a phase) [on, except with --json].",
)


def progress_enabled(progress: bool | None, as_json: bool) -> bool:
    """Whether a command shows progress: as ``--progress/--no-progress`` says, else unless its
    stdout is JSON (a script reading it may read stderr too)."""
    return not as_json if progress is None else progress


@dataclass
class Status:
    """What a long command is doing: ``text`` (one line) in ``phase``, and for a bar
    ``completed`` of ``total`` (None: unknown). Commands call `update`; the reporter shows it."""

    prefix: str  # e.g. "plan", shown before each piped line
    text: str = ""
    phase: str = ""
    completed: int = 0
    total: int | None = None
    started: float = field(default_factory=time.monotonic)
    # the clock of the delay before the first line: this process's CPU time, or wall time for
    # a command whose work runs in worker processes
    work_clock: Callable[[], float] = time.process_time
    started_work: float = field(default_factory=time.process_time)
    delay_s: float = FIRST_LINE_S
    piped: bool = False  # print plain lines on stderr (`status_reporter` sets it)
    _printed_phase: str | None = None
    _printed_at: float = 0.0  # time.monotonic() of the last piped line
    _printed_percent: int = 0
    _progress: Progress | None = None
    _task: object = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def update(
        self, text: str, completed: int = 0, total: int | None = None, *, phase: str | None = None
    ) -> None:
        """Show ``text`` (and the bar's ``completed`` of ``total``) from now on; ``phase``
        names the step it belongs to (default: the text itself, each text a phase)."""
        with self._lock:
            self.text, self.completed, self.total = text, completed, total
            self.phase = text if phase is None else phase
            if self.piped:
                self._print_if_due()
        if self._progress is not None:
            self._progress.update(
                self._task,  # type: ignore[arg-type]
                description=text,
                completed=completed,
                total=total,
            )

    def line(self) -> str:
        """The piped status line: the prefix, the text and the seconds so far, cut to the
        output's width (``COLUMNS``, as the tables, else `WIDTH`)."""
        suffix = f" ({time.monotonic() - self.started:.0f} s)"
        head = f"{self.prefix}: {self.text}"
        columns = os.environ.get("COLUMNS", "")
        room = (int(columns) if columns.isdigit() and int(columns) >= 20 else WIDTH) - len(suffix)
        if len(head) > room:
            head = head[: room - 3] + "..."
        return head + suffix

    def tick(self) -> None:
        """The status thread's look: the phase in hand once the delay has passed, or the
        heartbeat."""
        with self._lock:
            self._print_if_due()

    def _print_if_due(self) -> None:
        # (called with the lock held; nothing to say before the first update)
        if not self.text or (
            self._printed_phase is None and self.work_clock() - self.started_work < self.delay_s
        ):
            return
        now = time.monotonic()
        percent = (
            PERCENT_STEP * (100 * self.completed // (self.total * PERCENT_STEP))
            if self.total
            else 0
        )
        # a new phase, another PERCENT_STEP of this one, or the heartbeat
        if self.phase != self._printed_phase or percent > self._printed_percent:
            self._printed_percent = percent
        elif now - self._printed_at < STATUS_EVERY_S:
            return
        self._printed_phase, self._printed_at = self.phase, now
        click.echo(self.line(), err=True)  # (click.echo flushes)


@contextmanager
def status_reporter(
    prefix: str, *, enabled: bool = True, in_workers: bool = False
) -> Iterator[Status]:
    """A `Status` shown on stderr while the block runs (see the module docstring); with
    ``in_workers`` the delay before the first piped line counts wall seconds (the work runs in
    other processes, whose CPU time this one does not see)."""
    clock = time.monotonic if in_workers else time.process_time
    status = Status(prefix=prefix, work_clock=clock, started_work=clock(), delay_s=FIRST_LINE_S)
    if not enabled:
        yield status
        return
    if sys.stderr.isatty():
        progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        with progress:
            status._progress, status._task = progress, progress.add_task("", total=None)
            yield status
        return
    status.piped = True
    done = threading.Event()

    def tick() -> None:
        while not done.wait(_POLL_S):
            status.tick()

    ticker = threading.Thread(target=tick, name="autoplan-status", daemon=True)
    ticker.start()
    try:
        yield status
    finally:
        done.set()
        ticker.join()


def search_status(phase: str, visited: int, total: int, best_step_time_s: float | None) -> str:
    """One search's progress as a status text: ``searching, 1,234 of 13,195 candidates
    visited, best step 17.3 s``; the phases before the visit say what they do."""
    best = (
        f", best step {fmt_time(best_step_time_s)}"
        if best_step_time_s is not None
        else ", no plan found yet"
    )
    if phase == "enumerate":
        return f"searching, {visited:,} candidates enumerated"
    if phase == "seed":
        return f"searching, first guesses: {visited:,} of the candidates split evenly{best}"
    return f"searching, {visited:,} of {total:,} candidates visited{best}"
