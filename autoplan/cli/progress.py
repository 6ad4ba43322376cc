"""Progress of the long commands (`plan`, `whatif`) on stderr, so that stdout stays the result.

On a terminal: a transient rich bar (removed when the command ends). Piped or redirected: a
one-line status every `STATUS_EVERY_S` seconds once the command has run that long (a command
that ends sooner prints none), e.g. ``plan: searching, 1,234 of 13,195 candidates visited,
best step 17.3 s (20 s)``. Off with ``--json`` (as the bar always was). Guarantees: nothing
goes to stdout; the status thread stops when the ``with`` block ends.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autoplan._format import fmt_time

__all__ = ["STATUS_EVERY_S", "Status", "search_status", "status_reporter"]

# Seconds between two status lines when stderr is not a terminal (and before the first).
STATUS_EVERY_S = 10.0


@dataclass
class Status:
    """What a long command is doing: ``text`` (one line), and for a bar ``completed`` of
    ``total`` (None: unknown). Commands call `update`; the reporter shows it."""

    prefix: str  # e.g. "plan", shown before each piped line
    text: str = ""
    completed: int = 0
    total: int | None = None
    started: float = field(default_factory=time.monotonic)
    _progress: Progress | None = None
    _task: object = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def update(self, text: str, completed: int = 0, total: int | None = None) -> None:
        """Show ``text`` (and the bar's ``completed`` of ``total``) from now on."""
        with self._lock:
            self.text, self.completed, self.total = text, completed, total
        if self._progress is not None:
            self._progress.update(
                self._task,  # type: ignore[arg-type]
                description=text,
                completed=completed,
                total=total,
            )

    def line(self) -> str:
        """The piped status line: the prefix, the text and the seconds so far."""
        with self._lock:
            text = self.text
        return f"{self.prefix}: {text} ({time.monotonic() - self.started:.0f} s)"


@contextmanager
def status_reporter(prefix: str, *, enabled: bool = True) -> Iterator[Status]:
    """A `Status` shown on stderr while the block runs (see the module docstring)."""
    status = Status(prefix=prefix)
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
    done = threading.Event()

    def tick() -> None:
        while not done.wait(STATUS_EVERY_S):
            click.echo(status.line(), err=True)

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
