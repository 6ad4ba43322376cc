"""Checkpoints of a `DistributedModel` job: saved every k steps in the background, resumed from
the latest complete one, under the same plan or another (DCP reshards).

A checkpoint holds the model and optimizer state (under the model's own parameter names, so it
loads under any plan), the step, each rank's random-number generator states and the data
position (any object with ``state_dict``/``load_state_dict``, the same on every rank: the job
draws the whole global batch on every rank, e.g. `autoplan.data.Batches` or torchdata's
``StatefulDataLoader``), so a resumed job replays no sample and skips none.

Layout: ``DIR/step_00000100/`` holds the files of ``torch.distributed.checkpoint`` and, written
by rank 0 once every rank's files and DCP's ``.metadata`` are on disk, ``autoplan.json`` (step,
model fingerprint, plan digest, world size). A folder without it was cut short (the job died
mid-save): `restore` skips it, with a warning, for the previous complete one. The writes run in
a background thread (``dcp.async_save``) on a process group of their own (gloo), so training
goes on while they finish and their collectives never interleave with the job's.

Expects the default process group (`autoplan.parallelize` made it). Every rank constructs the
`Checkpointer` with the same arguments; bad ones fail on every rank before the first step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save

from autoplan.contract.errors import InputError
from passes.progress import default_group_timeout
from passes.runtime import DistributedModel

__all__ = ["CheckpointError", "CheckpointInfo", "Checkpointer", "Stateful"]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_MARKER = "autoplan.json"


class CheckpointError(InputError):
    """A checkpoint folder that cannot be used (another model, unwritable, bad interval)."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    """A complete checkpoint, as its marker describes it."""

    path: Path
    step: int
    world_size: int  # of the job that saved it
    plan_digest: str  # `Plan.digest` of the plan it was saved under
    model_fingerprint: str


class Checkpointer:
    """Save ``model`` (and ``data``) to ``directory`` every ``every`` steps; `restore` resumes.

    ``keep``: how many complete checkpoints to keep (older ones are deleted once a newer one is
    complete; None keeps all).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        model: DistributedModel,
        *,
        every: int,
        data: Stateful | None = None,
        keep: int | None = 2,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CheckpointError(
                f"checkpoint interval every={every!r}: must be a whole number of steps >= 1 "
                "(e.g. 100)"
            )
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise CheckpointError(f"keep={keep!r}: keep at least 1 checkpoint, or None for all")
        model.check_checkpointable()
        self.directory = Path(directory)
        self.model = model
        self.every = every
        self.data = data
        self.keep = keep
        self.rank = dist.get_rank()
        _check_writable(self.directory, self.rank)
        # DCP's async writes gather their results in a thread: on a group of their own, so they
        # never run concurrently with the training's collectives on the default group; with
        # its timeout, so a save waiting on a stopped peer fails as a training step would.
        self._group = dist.new_group(backend="gloo", timeout=default_group_timeout())
        self._pending: Future[Any] | None = None
        self._marked: threading.Event | None = None
        self._last_saved: int | None = None
        self.restored: CheckpointInfo | None = None  # what `restore` loaded, if anything

    # ------------------------------------------------------------------ saving

    def after_step(self) -> bool:
        """Call after each ``train_step``: starts a save when the step is a multiple of
        ``every`` (returns whether it did)."""
        if self.model.step % self.every:
            return False
        self.save()
        return True

    def save(self) -> Path:
        """Start saving the current step in the background (after the previous save finished);
        returns its folder. It counts as complete as soon as its writes are done: rank 0 marks
        it then, from the writer thread. `wait` or `close` blocks until it is."""
        self.wait()
        step = self.model.step
        target = self.directory / f"step_{step:08d}"
        if self.rank == 0 and target.exists():
            shutil.rmtree(target)  # a folder cut short by an earlier job at this step
        dist.barrier(group=self._group)
        state = self._state()
        future = async_save(state, checkpoint_id=str(target), process_group=self._group)
        assert isinstance(future, Future)
        if self.rank == 0:
            # Rank 0 is DCP's coordinator: its save completes after every rank's files and the
            # metadata are written, so its completion is the checkpoint's.
            marker, marked = self._marker_data(), threading.Event()
            future.add_done_callback(lambda done: self._completed(done, target, marker, marked))
            self._marked = marked
        self._pending = future
        self._last_saved = step
        return target

    def _completed(
        self, done: Future[Any], target: Path, marker: dict[str, Any], marked: threading.Event
    ) -> None:
        try:
            if done.exception() is not None:
                logger.error("checkpoint %s failed: %s", target, done.exception())
                return
            _write_marker(target, marker)
            self._prune()
        finally:
            marked.set()

    def wait(self) -> None:
        """Block until the save in progress (if any) is complete."""
        if self._pending is None:
            return
        future, self._pending = self._pending, None
        future.result()
        if self._marked is not None:
            self._marked.wait()  # callbacks run after result() returns elsewhere
            self._marked = None
        dist.barrier(group=self._group)  # rank 0's marker is written before anyone goes on

    def close(self, *, save: bool = True) -> None:
        """Call before the job ends: saves the last step too (unless ``save=False`` or it is
        saved already) and waits until every save is complete."""
        if save and self.model.step and self._last_saved != self.model.step:
            self.save()
        self.wait()

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = dict(self.model.state_dict())
        state["progress"] = {"step": self.model.step}
        state[f"rng/rank{self.rank}"] = _rng_state()
        if self.data is not None:
            state["data"] = self.data.state_dict()
        return state

    def _marker_data(self) -> dict[str, Any]:
        return {
            "step": self.model.step,
            "model_fingerprint": self.model.fingerprint,
            "plan_digest": self.model.plan.digest(),
            "world_size": dist.get_world_size(),
            "data": self.data is not None,
        }

    def _prune(self) -> None:
        if self.keep is None:
            return
        complete = [path for path in _step_dirs(self.directory) if (path / _MARKER).is_file()]
        for path in complete[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ resuming

    def latest(self) -> Path | None:
        """The newest complete checkpoint folder (None if there is none); warns about newer
        folders that were cut short."""
        for path in reversed(_step_dirs(self.directory)):
            if (path / _MARKER).is_file():
                return path
            if self.rank == 0:
                logger.warning(
                    "skipping checkpoint %s: it is incomplete (no %s; the job stopped while "
                    "saving it); using the previous complete one",
                    path,
                    _MARKER,
                )
        return None

    def restore(self) -> int:
        """Load the latest complete checkpoint into the model (and data); returns its step (0:
        none yet, nothing loaded). Under another plan or world size the model and optimizer
        state are resharded; each rank's RNG state comes back when that rank existed."""
        path = self.latest()
        if path is None:
            return 0
        marker = json.loads((path / _MARKER).read_text())
        saved, mine = marker.get("model_fingerprint", ""), self.model.fingerprint
        if saved and mine and saved != mine:
            raise CheckpointError(
                f"checkpoint {path} is of another model (fingerprint {saved}); this job's model "
                f"has fingerprint {mine}: point --checkpoint-dir at this model's checkpoints or "
                "at an empty folder"
            )
        if marker.get("data") and self.data is None:
            logger.warning("checkpoint %s holds a data position, but no data was given", path)
        available = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        state = self._state()
        rng_key = f"rng/rank{self.rank}"
        if not _holds(available, rng_key):
            state.pop(rng_key)
            logger.warning(
                "checkpoint %s has no RNG state for rank %d (saved by %d ranks): keeping this "
                "rank's",
                path,
                self.rank,
                marker.get("world_size", "?"),
            )
        if "data" in state and not _holds(available, "data"):
            raise CheckpointError(
                f"checkpoint {path} holds no data position; resume it without data=..."
            )
        dcp_load(
            state,
            checkpoint_id=str(path),
            process_group=self._group,
            planner=DefaultLoadPlanner(allow_partial_load=False),
        )
        self.model.load_state_dict({"model": state["model"], "optimizer": state["optimizer"]})
        self.model.step = int(state["progress"]["step"])
        self._last_saved = self.model.step
        if rng_key in state:
            _set_rng_state(state[rng_key])
        if self.data is not None:
            self.data.load_state_dict(state["data"])
        self.restored = CheckpointInfo(
            path=path,
            step=self.model.step,
            world_size=int(marker.get("world_size", 0)),
            plan_digest=str(marker.get("plan_digest", "")),
            model_fingerprint=saved,
        )
        return self.model.step


def _holds(saved: Any, key: str) -> bool:
    """Whether a checkpoint's (flattened) keys hold ``key`` or entries under it."""
    return any(name == key or name.startswith(key + ".") for name in saved)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _step_dirs(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def _write_marker(target: Path, data: dict[str, Any]) -> None:
    partial = target / f".{_MARKER}.{uuid.uuid4().hex}"
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(target / _MARKER)  # atomic: a marker is whole or absent


def _check_writable(directory: Path, rank: int) -> None:
    """Every rank writes its own files there: each checks, before the first step."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".autoplan-write-test-{rank}-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise CheckpointError(
            f"checkpoint folder {str(directory)!r} is not writable ({error.strerror or error}); "
            "pass a folder this job can write to"
        ) from None
