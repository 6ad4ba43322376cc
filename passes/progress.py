"""Which rank stopped: each rank records the training step it is on in the job's key-value store.

A rank that stops making progress (a SIGSTOPped or wedged process, a dead host whose
connections stay open) leaves its peers waiting in a collective until the process-group
timeout, and gloo's timeout error names no peer. When a collective fails, `StepProgress`
reads every rank's last recorded step from the store: the ranks behind the others are the ones
that stopped, and the error says so. It works on every backend (NCCL's watchdog and flight
recorder dump more; this is what gloo has) and costs one store write per step.

Expects the default process group to be initialised; without a store it records nothing.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]

__all__ = ["StalledRankError", "StepProgress", "default_group_timeout"]

logger = logging.getLogger(__name__)

_PREFIX = "autoplan/step/"


class StalledRankError(RuntimeError):
    """A collective timed out because other ranks stopped making progress (named)."""


class StepProgress:
    """This rank's step in the store, and the verdict on who stalled when a collective fails."""

    def __init__(self, rank: int, world_size: int, timeout_s: float | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s  # the process group's, when known (for the message)
        self._store = _default_store()

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
            + f"; the collective failed with: {_first_message(error)}"
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


def _first_message(error: BaseException) -> str:
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
