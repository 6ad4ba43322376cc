"""Which rank stopped or crashed: each rank records in the job's key-value store the training
step it is on and, when it fails, its error.

A rank that stops making progress (a SIGSTOPped or wedged process, a dead host whose
connections stay open) leaves its peers waiting in a collective until the process-group
timeout, and gloo's timeout error names no peer. When a collective fails, `StepProgress`
reads every rank's last recorded step from the store: the ranks behind the others are the ones
that stopped, and the error says so. It works on every backend (NCCL's watchdog and flight
recorder dump more; this is what gloo has) and costs one store write per step.

A rank that fails records its error (`RankFailures.record`) before it tears its process groups
down: a *primary* failure is its own, a *secondary* one a collective that failed because a peer
had failed first. A peer whose collective then fails finds the record and raises a
`CrashedRankError` naming the rank and its error, at once, instead of a `StalledRankError` after
the timeout; and the failing ranks agree through the store which one prints the job's error
(`autoplan.runtime.rank_failures`).

Expects the default process group to be initialised (or a store given); without a store it
records nothing.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]

from autoplan.contract.errors import InputError

__all__ = [
    "PEER_WAIT_S",
    "CrashedRankError",
    "RankFailure",
    "RankFailures",
    "StalledRankError",
    "StepProgress",
    "default_group_timeout",
    "first_message",
    "looks_like_peer_failure",
]

logger = logging.getLogger(__name__)

_PREFIX = "autoplan/step/"
_FAILED = "autoplan/failed/"  # + rank: that rank's `RankFailure`, as JSON
_FAILED_COUNT = "autoplan/failed_count"  # how many ranks recorded a failure
_FAILED_RANKS = "autoplan/failed_rank/"  # + n (1, 2, ...): the n-th rank that recorded one
_REPORTER = "autoplan/failure_reporter"  # the rank that prints the job's error (compare_set)
_REPORTED = "autoplan/failure_reported"  # set once that rank has printed it
_MESSAGE_CHARS = 500  # of an error's first line kept in the store

# How long a rank whose collective failed waits for a peer's record of a crash. A peer records
# its error when it reaches the except path or the excepthook; the `finally` blocks on its way
# there (a launcher script's destroy_process_group, say) may close its connections first. On
# gloo only the process's end closes them, after the record, so the wait covers store latency
# and backends that close earlier; a peer killed outright (SIGKILL) never records, and every
# survivor pays this wait before it fails (before: 5 s, which made a SIGKILLed rank's restart
# take 15 s instead of 10 in bench/faults.py).
PEER_WAIT_S = 1.0
# gloo's and NCCL's words for a collective that failed because of a peer (gloo: "Connection
# closed by peer ... typically caused by a remote worker crashing"); torch.distributed.DistError
# covers the errors torch classifies itself.
_PEER_WORDS = re.compile(
    r"connection|closed by peer|reset by peer|broken pipe|timed out|timeout|remote worker|"
    r"gloo|nccl|socket",
    re.IGNORECASE,
)


class StalledRankError(RuntimeError):
    """A collective timed out because other ranks stopped making progress (named)."""


class CrashedRankError(RuntimeError):
    """A collective failed because other ranks had failed first: it names them and their
    errors (recorded in the job's store)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFailure:
    """One rank's failure as recorded in the store."""

    rank: int
    primary: bool  # its own failure (False: a collective failed because a peer had failed)
    error_type: str  # the exception's class name
    message: str  # the first line of its message (at most _MESSAGE_CHARS characters)
    input_error: bool  # an `InputError` (a user's mistake: one line, no traceback)

    @property
    def summary(self) -> str:
        """``Type: message`` (just the message for an InputError, which says it all)."""
        return self.message if self.input_error else f"{self.error_type}: {self.message}"

    def to_json(self) -> str:
        return json.dumps(
            {
                "rank": self.rank,
                "primary": self.primary,
                "error_type": self.error_type,
                "message": self.message,
                "input_error": self.input_error,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RankFailure:
        data = json.loads(text)
        return cls(
            rank=int(data["rank"]),
            primary=bool(data["primary"]),
            error_type=str(data["error_type"]),
            message=str(data["message"]),
            input_error=bool(data["input_error"]),
        )


class RankFailures:
    """This rank's failure in the job's store, the other ranks' failures, and the choice of the
    one rank that reports them. Every method survives a store that is gone (it then knows
    nothing, and says so in the log)."""

    def __init__(self, rank: int, world_size: int, store: Store | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = store if store is not None else _default_store()
        self.mine: RankFailure | None = None  # what this rank recorded (the first record wins)
        self._store_failed = False  # a store operation failed: said once, not asked again

    def _lost(self, what: str, failure: Exception) -> None:
        if not self._store_failed:
            logger.warning("could not %s in the job's store: %s", what, failure)
        self._store_failed = True

    def record(self, error: BaseException, *, primary: bool) -> RankFailure:
        """Record this rank's failure (once: a later call returns the first record)."""
        if self.mine is not None:
            return self.mine
        self.mine = RankFailure(
            rank=self.rank,
            primary=primary,
            error_type=type(error).__name__,
            message=first_message(error)[:_MESSAGE_CHARS],
            input_error=isinstance(error, InputError),
        )
        if self.store is not None:
            try:
                self.store.set(f"{_FAILED}{self.rank}", self.mine.to_json())
                slot = self.store.add(_FAILED_COUNT, 1)
                self.store.set(f"{_FAILED_RANKS}{slot}", str(self.rank))
            except Exception as failure:
                self._lost(f"record rank {self.rank}'s failure", failure)
        return self.mine

    def read(self) -> dict[int, RankFailure]:
        """Every rank's recorded failure, by rank."""
        if self.store is None or self._store_failed:
            return {}
        found: dict[int, RankFailure] = {}
        try:
            count = int(self.store.add(_FAILED_COUNT, 0))
            for slot in range(1, count + 1):
                key = f"{_FAILED_RANKS}{slot}"
                if not self.store.check([key]):  # being written: get() would wait
                    continue
                rank = int(bytes(self.store.get(key)).decode())
                text = bytes(self.store.get(f"{_FAILED}{rank}")).decode()
                found[rank] = RankFailure.from_json(text)
        except Exception as failure:  # the store itself may be gone with the job
            self._lost("read the ranks' failures", failure)
        return found

    def wait(
        self, done: Callable[[dict[int, RankFailure]], bool], timeout_s: float
    ) -> dict[int, RankFailure]:
        """`read`, again every 20 ms until ``done`` holds or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.read()
            if done(found) or time.monotonic() >= deadline:
                return found
            if self.store is None or self._store_failed:
                return found
            time.sleep(0.02)

    def crashed(self, error: BaseException, wait_s: float = PEER_WAIT_S) -> CrashedRankError | None:
        """If ``error`` is a collective that failed because other ranks had failed first (they
        recorded primary failures), the error naming them. Waits up to ``wait_s`` for such a
        record when the error reads like a peer's failure (``looks_like_peer_failure``)."""
        if not looks_like_peer_failure(error):
            return None
        found = self.wait(lambda found: bool(self._crashed_peers(found)), wait_s)
        peers = self._crashed_peers(found)
        if not peers:
            return None
        named = "; ".join(f"rank {peer.rank} crashed: {peer.summary}" for peer in peers[:3])
        more = f" (and {len(peers) - 3} more ranks)" if len(peers) > 3 else ""
        them = "it" if len(peers) == 1 else "them"
        return CrashedRankError(
            f"{named}{more}; rank {self.rank}'s collective with {them} failed: "
            f"{first_message(error)[:200]}"
        )

    def _crashed_peers(self, found: dict[int, RankFailure]) -> list[RankFailure]:
        """Other ranks' own failures; not a peer's report of a stall (that peer was waiting,
        like this rank, for one that stopped)."""
        return [
            f
            for rank, f in sorted(found.items())
            if f.primary and rank != self.rank and f.error_type != StalledRankError.__name__
        ]

    def claim_report(self) -> bool:
        """Whether this rank is the one that prints the job's error (the first to ask is)."""
        if self.store is None:
            return True
        try:
            mine = str(self.rank)
            return bytes(self.store.compare_set(_REPORTER, "", mine)).decode() == mine
        except Exception as failure:
            self._lost("agree on who reports the failure", failure)
            return True

    def reported(self) -> None:
        """The job's error is printed (the others may exit now)."""
        if self.store is not None:
            try:
                self.store.set(_REPORTED, "1")
            except Exception as failure:
                self._lost("record that the failure was reported", failure)

    def wait_reported(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until some rank printed the job's error; whether one did."""
        if self.store is None:
            return False
        deadline = time.monotonic() + timeout_s
        try:
            while not self.store.check([_REPORTED]):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)
        except Exception:
            return False
        return True


def looks_like_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an error down its chain of causes) reads like a collective that
    failed because of another rank: a `torch.distributed.DistError` or a RuntimeError in gloo's
    or NCCL's words."""
    seen: BaseException | None = error
    for _ in range(16):  # a chain of causes is short; a cycle is not followed forever
        if seen is None:
            return False
        if isinstance(seen, dist.DistError | CrashedRankError | StalledRankError):
            return True
        if isinstance(seen, RuntimeError) and _PEER_WORDS.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class StepProgress:
    """This rank's step in the store, and the verdict on who crashed or stalled when a
    collective fails."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float | None = None,
        failures: RankFailures | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s  # the process group's, when known (for the message)
        self._store = _default_store()
        # the job's (parallelize makes it: the excepthook shares it), or this rank's own
        self.failures = failures or RankFailures(rank, world_size, self._store)

    def explain(self, error: BaseException) -> CrashedRankError | StalledRankError | None:
        """This rank failed mid-step with ``error``: record it in the store, and return the
        error naming the ranks at fault (a `CrashedRankError` if they recorded a crash, a
        `StalledRankError` if they are behind), or None if it is this rank's own failure."""
        crashed = self.failures.crashed(error)
        if crashed is not None:
            self.failures.record(crashed, primary=False)
            return crashed
        stalled = self.stalled(error)
        self.failures.record(stalled or error, primary=True)
        return stalled

    def started(self, step: int) -> None:
        """Record that this rank started ``step`` (1-based)."""
        if self._store is not None:
            self._store.set(f"{_PREFIX}{self.rank}", str(step))

    def stalled(self, error: BaseException) -> StalledRankError | None:
        """The error naming the ranks behind this one, or None when none is behind (the failure
        was something else, e.g. a rank that raised and tore the groups down)."""
        steps = self._steps()
        if not steps:
            return None
        mine = steps.get(self.rank, 0)
        behind = sorted(rank for rank, step in steps.items() if step < mine)
        if not behind:
            return None
        last = sorted({steps[rank] for rank in behind})
        when = f"step {last[0]}" if len(last) == 1 else "steps " + ", ".join(map(str, last))
        timeout = self.timeout_s
        return StalledRankError(
            f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} stopped making "
            f"progress: last seen starting {when}"
            + (" (0: never started)" if 0 in last else "")
            + f", while rank {self.rank} "
            f"reached step {mine} and waited for {'them' if len(behind) > 1 else 'it'}"
            + (f" for the process-group timeout ({timeout:.0f} s)" if timeout else "")
            + f"; the collective failed with: {first_message(error)}"
        )

    def _steps(self) -> dict[int, int]:
        if self._store is None:
            return {}
        keys = [f"{_PREFIX}{rank}" for rank in range(self.world_size)]
        steps: dict[int, int] = {}
        try:
            for rank, key in enumerate(keys):
                # a rank that never recorded a step has no key: check first, get() would wait
                steps[rank] = int(self._store.get(key)) if self._store.check([key]) else 0
        except Exception as error:  # the store itself may be gone with the job
            logger.warning("could not read the ranks' progress from the store: %s", error)
            return {}
        return steps


def first_message(error: BaseException) -> str:
    """The first line of the first non-empty message down the chain of causes (DDP re-raises
    gloo's timeout as an empty RuntimeError)."""
    seen: BaseException | None = error
    while seen is not None:
        text = str(seen).strip()
        if text:
            return text.splitlines()[0]
        seen = seen.__cause__ or seen.__context__
    return type(error).__name__


def _default_store() -> Store | None:
    """The default group's store (torch has no public accessor; None if this torch lacks it)."""
    if not dist.is_initialized():
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        store: Store = getter()
    except Exception:
        return None
    return store


def default_group_timeout() -> datetime.timedelta | None:
    """The default process group's timeout, for the groups made after it.

    ``dist.new_group`` gives a new group torch's backend default (30 minutes on gloo), not the
    default group's: a group made for checkpoints or tied gradients would then wait half an hour
    on a stopped peer, and a thread blocked in it keeps its process from exiting. None when
    this torch does not expose it (the backend default applies then).
    """
    if not dist.is_initialized():
        return None
    try:
        group = dist.group.WORLD
        assert group is not None
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        timeout = group._get_backend(device).options._timeout
    except Exception:
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None
