"""Checkpoints of a `DistributedModel` job: saved every k steps in the background, verified,
resumed from the newest intact one, under the same plan or another (DCP reshards).

A checkpoint holds the model and optimizer state (under the model's own parameter names, so it
loads under any plan), the step, each rank's random-number generator states and the data
position (any object with ``state_dict``/``load_state_dict``, the same on every rank: the job
draws the whole global batch on every rank, e.g. `autoplan.data.Batches` or torchdata's
``StatefulDataLoader``), so a resumed job replays no sample and skips none.

Layout: ``DIR/step_00000100/`` holds the files of ``torch.distributed.checkpoint`` (DCP) and
``autoplan.json``, the marker: step, model fingerprint and every model tensor's full shape,
plan digest, world size, the caller's ``run`` facts, the earliest non-finite step, the job
that wrote it, and each file's size and SHA-256, all under a checksum of its own.
``DIR/autoplan.lock`` names the job that holds the folder.

Guarantees:

- Saves run in the background (``dcp.async_save`` on a gloo group of their own, so their
  collectives never interleave with the training's) into a hidden staging folder
  ``DIR/.step_N.partial.*``. When every rank's writes are done, each rank hashes the files it
  wrote; rank 0 gathers the hashes, writes the marker (fsynced), then renames the staging folder
  to ``step_N`` and fsyncs ``DIR``. A ``step_N`` folder is therefore complete or absent; a job
  killed mid-save leaves only a hidden staging folder.
- A failed save (disk full, a file size limit, permission, a peer gone) is agreed by every rank
  and raised as `CheckpointSaveError`, one line naming the step, the reason and the newest good
  checkpoint, on every rank at the next `after_step` (which polls the save with one tiny
  all-reduce per step while a save is in flight), `wait` or `close`. Its staging folder is
  removed.
- `restore` takes the newest checkpoint whose marker is whole, whose model matches and whose
  every file has the recorded size and SHA-256 (the ranks split the files and combine their
  verdicts; so a restore reads the checkpoint twice), then loads it; a load that raises anyway
  (a damaged file that hashes right: an older checkpoint without checksums) counts as damage
  too. Each skipped checkpoint is one warning line on rank 0 naming the file and the reason.
  All ranks go through the same candidates in the same order (rank 0 lists them), so all load
  the same step. Another model's checkpoint is a `CheckpointError` naming the tensors whose
  shapes changed; a ``DIR`` that is a file is one too, on every rank.
- Pruning (``keep``) deletes only checkpoints this job wrote (their marker, written after
  every file was hashed, names the job; torchrun's restarts of a job keep its
  ``TORCHELASTIC_RUN_ID``, so they prune their own), only older than the newest checkpoint
  this job verified (saved or restored), keeps the ``keep`` newest verified ones and, once
  `note_nonfinite` reported a step, one verified checkpoint older than it (every older one if
  this job verified none); the step is carried in later markers. Other jobs' checkpoints (a
  job started anew resumes from them and keeps them: one line says so), folders without a
  whole marker and other jobs' cut-short saves are never deleted; a ``step_N`` folder not
  written by this job where it must save step N is moved aside to ``DIR/.replaced.step_N.*``.
- One job per folder: rank 0 takes ``DIR/autoplan.lock`` (`checkpoint_lock`: the job's
  identity, a heartbeat every `HEARTBEAT_S` seconds, the rules for taking over a stale lock,
  `STALE_S`). Another job gets a `CheckpointError` naming the holder, on every rank. `close`
  and the end of the process release it.

`checkpoint_files` holds the marker, the checksums and the checks of files, `checkpoint_lock`
the lock; this module holds the `Checkpointer`, which runs them on every rank and agrees on
the outcome.

Expects the default process group (`autoplan.parallelize` made it), a ``DIR`` every rank sees
(a shared file system across nodes), and every rank constructing the `Checkpointer` with the
same arguments; bad ones fail on every rank before the first step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save

from autoplan.runtime.checkpoint_files import (
    MARKER,
    SHOWN,
    CheckpointError,
    check_files,
    folder_problem,
    fsync_folder,
    hash_written,
    marker_bytes,
    model_mismatch,
    read_marker,
    reason,
    step_dirs,
    tensor_shapes,
    write_synced,
)
from autoplan.runtime.checkpoint_lock import HEARTBEAT_S, STALE_S, FolderLock, job_identity
from cost_model.degrees import is_whole
from cost_model.messages import shown
from passes.progress import default_group_timeout
from passes.runtime import DistributedModel

__all__ = [
    "HEARTBEAT_S",
    "STALE_S",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointSaveError",
    "Checkpointer",
    "Stateful",
]

logger = logging.getLogger(__name__)

_FORMAT = 2  # of the marker; 1 (no "format" key): no checksums, no run id


class CheckpointSaveError(RuntimeError):
    """A save failed (disk full, permission, a peer gone): raised on every rank; the message
    names the step, the reason and the newest good checkpoint."""


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
    run: dict[str, Any] = field(default_factory=dict)  # the saving job's ``run`` facts


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How a save ended, the same on every rank."""

    step: int
    path: Path
    error: str | None = None
    save_s: float | None = None
    pruned: tuple[int, ...] = ()


class Checkpointer:
    """Save ``model`` (and ``data``) to ``directory`` every ``every`` steps; `restore` resumes.

    ``keep``: how many verified checkpoints of this job to keep (older ones it wrote are deleted
    once a newer one is complete; None keeps all). ``run``: JSON-able facts about the run,
    written into every marker and given back by `restore` as ``restored.run`` (compared by the
    caller). The folder's lock is taken here and released by `close` (or when the process
    ends)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        model: DistributedModel,
        *,
        every: int,
        data: Stateful | None = None,
        keep: int | None = 2,
        run: Mapping[str, Any] | None = None,
    ) -> None:
        if not is_whole(every):
            raise CheckpointError(
                f"checkpoint interval every={shown(every)}: must be a whole number of steps "
                ">= 1 (e.g. 100)"
            )
        if keep is not None and not is_whole(keep):
            raise CheckpointError(
                f"keep={shown(keep)}: keep at least 1 checkpoint, or None for all"
            )
        try:  # as it reads back: JSON types only, string keys
            self.run: dict[str, Any] = json.loads(json.dumps(dict(run or {}), allow_nan=False))
        except (TypeError, ValueError) as error:
            raise TypeError(f"Checkpointer(run=...) must be JSON-able: {error}") from None
        model.check_checkpointable()
        self.directory = Path(directory)
        self.model = model
        self.every = every
        self.data = data
        self.keep = keep
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # DCP's async writes gather their results in a thread: on a group of their own, so they
        # never run concurrently with the training's collectives on the default group; with
        # its timeout, so a save waiting on a stopped peer fails as a training step would.
        self._group = dist.new_group(backend="gloo", timeout=default_group_timeout())
        # after_step's poll of a save in flight (the save's thread uses _group meanwhile)
        self._poll_group = dist.new_group(backend="gloo", timeout=default_group_timeout())
        self._agree_or_raise(folder_problem(self.directory, self.rank))
        self._lock: FolderLock | None = None
        refusal: str | None = None
        job = job_identity()
        if self.rank == 0:
            self._lock = FolderLock(self.directory, job)
            try:
                self._lock.acquire()
            except CheckpointError as error:
                refusal, self._lock = str(error), None
            except Exception as error:  # never leave the other ranks waiting for rank 0
                refusal, self._lock = f"cannot lock {self.directory}: {reason(error)}", None
        refusal, job = self._broadcast((refusal, job))
        if refusal is not None:
            raise CheckpointError(refusal)
        self._job = job
        self._told_others = False  # the line about other jobs' checkpoints, once
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoplan-ckpt")
        self._pending: Future[_Outcome] | None = None
        self._last_saved: int | None = None
        self._good: dict[int, Path] = {}  # checkpoints this job verified: saved or restored
        self._nonfinite: int | None = None
        self.last_complete_step: int | None = None  # newest verified checkpoint's step
        self.last_save_s: float | None = None  # wall time of the last complete save
        self.restored: CheckpointInfo | None = None  # what `restore` loaded, if anything

    # ------------------------------------------------------------------ collectives

    def _broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (over the checkpoint group)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self._group)
        return values

    def _agree_or_raise(self, problem: str | None) -> None:
        """Raise `CheckpointError` on every rank if any rank has a problem (the lowest's)."""
        found = [p for p in self._gather(problem) if p is not None]
        if found:
            raise CheckpointError(found[0])

    # ------------------------------------------------------------------ saving

    def note_nonfinite(self, step: int) -> None:
        """Training met a non-finite loss or gradient at ``step``: pruning keeps a checkpoint
        older than the earliest such step (this job's later markers carry it)."""
        if self._nonfinite is None or step < self._nonfinite:
            self._nonfinite = int(step)

    def after_step(self) -> bool:
        """Call after each ``train_step``, on every rank: raises `CheckpointSaveError` if the
        save in flight failed, and starts a save when the step is a multiple of ``every``
        (returns whether it did)."""
        if self._pending is not None:
            done = torch.tensor([int(self._pending.done())], dtype=torch.int32)
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
            if done.item():
                self._collect()
        if self.model.step % self.every:
            return False
        self.save()
        return True

    def save(self) -> Path:
        """Start saving the current step in the background (after the previous save finished;
        raises `CheckpointSaveError` if that one failed); returns the folder it will have.
        `wait` or `close` blocks until it is complete."""
        self.wait()
        step = self.model.step
        final = self.directory / f"step_{step:08d}"
        staging = self.directory / (f".step_{step:08d}.partial.{_tag(self._job)}")
        started = time.perf_counter()
        problem = None
        if self.rank == 0:
            try:
                if staging.exists():  # this job's own save of this step that failed
                    shutil.rmtree(staging)
                staging.mkdir()
            except OSError as error:
                problem = reason(error)
        problem = self._broadcast(problem)
        if problem is not None:
            raise CheckpointSaveError(self._failure(step, problem))
        state = self._state()
        marker = self._marker_data(step)
        shapes = tensor_shapes(state["model"])
        try:
            dcp_future = async_save(state, checkpoint_id=str(staging), process_group=self._group)
        except (Exception, CheckpointException) as error:
            raise CheckpointSaveError(self._failure(step, reason(error))) from None
        assert isinstance(dcp_future, Future)
        self._pending = self._executor.submit(
            self._finish,
            dcp_future,
            step=step,
            staging=staging,
            final=final,
            marker=marker,
            shapes=shapes,
            started=started,
            good=sorted(self._good),
        )
        self._last_saved = step
        return final

    def _finish(
        self,
        dcp_future: Future[Any],
        *,
        step: int,
        staging: Path,
        final: Path,
        marker: dict[str, Any],
        shapes: dict[str, list[int]],
        started: float,
        good: list[int],
    ) -> _Outcome:
        """The save's thread, on every rank: wait for DCP's writes, hash this rank's files,
        agree on the outcome; rank 0 publishes the checkpoint (marker, rename) and prunes."""
        mine: dict[str, Any] = {"error": None, "files": {}, "shapes": shapes}
        try:
            metadata = dcp_future.result()
            mine["files"] = hash_written(staging, metadata, self.rank, self.world_size)
        except (Exception, CheckpointException) as error:
            mine["error"] = reason(error)
        try:
            everyone = self._gather(mine)
        except Exception as error:  # the group broke: a peer is gone
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            return _Outcome(step, final, error=f"the ranks lost each other ({reason(error)})")
        verdict: dict[str, Any] = {}
        if self.rank == 0:
            try:
                verdict = self._publish(everyone, step, staging, final, marker, started, good)
            except Exception as error:  # never leave the other ranks waiting for rank 0
                shutil.rmtree(staging, ignore_errors=True)
                verdict = {"error": reason(error)}
        try:
            verdict = self._broadcast(verdict)
        except Exception as error:
            return _Outcome(step, final, error=f"the ranks lost each other ({reason(error)})")
        return _Outcome(
            step,
            final,
            error=verdict.get("error"),
            save_s=verdict.get("save_s"),
            pruned=tuple(verdict.get("pruned", ())),
        )

    def _publish(
        self,
        everyone: list[dict[str, Any]],
        step: int,
        staging: Path,
        final: Path,
        marker: dict[str, Any],
        started: float,
        good: list[int],
    ) -> dict[str, Any]:
        """Rank 0: the marker and the rename that make the checkpoint complete, then pruning;
        returns the verdict every rank gets."""
        failed = [entry["error"] for entry in everyone if entry["error"] is not None]
        if failed:
            shutil.rmtree(staging, ignore_errors=True)
            return {"error": failed[0]}
        files: dict[str, Any] = {}
        model_state: dict[str, list[int]] = {}
        for entry in everyone:
            files.update(entry["files"])
            for name, shape in entry["shapes"].items():
                model_state.setdefault(name, shape)
        marker = {**marker, "files": files, "model_state": model_state}
        try:
            write_synced(staging / MARKER, marker_bytes(marker))
            fsync_folder(staging)
            if final.exists():
                self._clear_way(final)
            os.rename(staging, final)
            fsync_folder(self.directory)
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)
            return {"error": reason(error)}
        save_s = time.perf_counter() - started
        try:
            pruned = self._prune([*good, step])
        except OSError as error:
            logger.warning("could not prune checkpoints in %s: %s", self.directory, reason(error))
            pruned = []
        return {"error": None, "save_s": save_s, "pruned": pruned}

    def _clear_way(self, final: Path) -> None:
        """A ``step_N`` folder where this save goes: this job's is replaced, any other moved
        aside (never deleted: this job cannot tell it wrote it)."""
        marker, _ = read_marker(final)
        if marker is not None and marker.get("job") == self._job:
            logger.warning("replacing checkpoint %s of this job with the new save", final)
            shutil.rmtree(final)
            return
        aside = final.with_name(f".replaced.{final.name}.{uuid.uuid4().hex[:8]}")
        os.rename(final, aside)
        logger.warning(
            "moved %s (%s) aside to %s to save this step; delete it when it is not needed",
            final,
            "another job's" if marker is not None else "incomplete",
            aside.name,
        )

    def _prune(self, good: Iterable[int]) -> list[int]:
        """Rank 0: delete this job's checkpoints the rules let go; returns their steps."""
        ours: dict[int, Path] = {}
        others: list[str] = []
        for path in step_dirs(self.directory):
            marker, _ = read_marker(path)
            if marker is not None and marker.get("job") == self._job:
                ours[int(path.name[5:])] = path
            elif marker is not None:
                others.append(path.name)
        doomed = _doomed(ours, good, self.keep, self._nonfinite)
        for step in doomed:
            shutil.rmtree(ours[step], ignore_errors=True)
        for partial in self.directory.glob(f".step_*.partial.{_tag(self._job)}"):
            shutil.rmtree(partial, ignore_errors=True)  # this job's saves that were cut short
        if doomed and others and not self._told_others:
            self._told_others = True
            logger.info(
                "keeping %d checkpoints of earlier jobs in %s (%s): a job deletes only its own; "
                "delete them when they are no longer needed",
                len(others),
                self.directory,
                shown(", ".join(others), 80, quoted=False),
            )
        return doomed

    def _collect(self) -> None:
        """Take the outcome of the save in flight (done on every rank); raise if it failed."""
        assert self._pending is not None
        future, self._pending = self._pending, None
        outcome = future.result()
        if outcome.error is not None:
            raise CheckpointSaveError(self._failure(outcome.step, outcome.error))
        for step in outcome.pruned:
            self._good.pop(step, None)
        self._good[outcome.step] = outcome.path
        self.last_complete_step = max(self._good)
        self.last_save_s = outcome.save_s

    def _failure(self, step: int, why: str) -> str:
        if self._good:
            newest = f"the newest good checkpoint is {self._good[max(self._good)]}"
        else:
            newest = "there is no good checkpoint of this job yet"
        return f"checkpoint of step {step} failed: {shown(why, SHOWN, quoted=False)}; {newest}"

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raises `CheckpointSaveError`
        on every rank if it failed."""
        if self._pending is not None:
            self._collect()

    def close(self, *, save: bool = True) -> None:
        """Call before the job ends: saves the last step too (unless ``save=False`` or it is
        saved already), waits until every save is complete and releases the folder's lock."""
        try:
            if save and self.model.step and self._last_saved != self.model.step:
                self.save()
            self.wait()
        finally:
            if self._pending is None:
                self._executor.shutdown(wait=False)
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = dict(self.model.state_dict())
        state["progress"] = {"step": self.model.step}
        state[f"rng/rank{self.rank}"] = _rng_state()
        if self.data is not None:
            state["data"] = self.data.state_dict()
        return state

    def _marker_data(self, step: int) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "step": step,
            "model_fingerprint": self.model.fingerprint,
            "plan_digest": self.model.plan.digest(),
            "world_size": self.world_size,
            "data": self.data is not None,
            "run": self.run,
            "nonfinite_step": self._nonfinite,
            "job": self._job,
            "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }

    # ------------------------------------------------------------------ resuming

    def latest(self) -> Path | None:
        """The newest checkpoint folder with a whole marker (None if there is none), on this
        rank; `restore` also checks its files."""
        for path in reversed(step_dirs(self.directory)):
            if read_marker(path)[0] is not None:
                return path
        return None

    def restore(self, *, before_load: Callable[[CheckpointInfo], None] | None = None) -> int:
        """Load the newest intact checkpoint into the model (and data); returns its step (0:
        none, nothing loaded). Damaged and incomplete ones are skipped, one warning line each.
        Under another plan or world size the model and optimizer state are resharded; each
        rank's RNG state comes back when that rank existed. Raises `CheckpointError` for
        another model's checkpoint, or when a checkpoint failed to load and none older did.

        ``before_load`` is called on every rank with the checkpoint about to be loaded (after
        its checks, before anything changes), e.g. to refuse its ``run``; it must decide the
        same on every rank (the same marker is given to each)."""
        self.wait()
        candidates: list[tuple[str, dict[str, Any] | None, str | None]] = []
        problem: str | None = None
        if self.rank == 0:
            try:
                for path in reversed(step_dirs(self.directory)):
                    marker, why = read_marker(path)
                    candidates.append((str(path), marker, why))
            except OSError as error:
                problem = f"cannot list checkpoints in {self.directory}: {reason(error)}"
        candidates, problem = self._broadcast((candidates, problem))
        if problem is not None:
            raise CheckpointError(problem)
        shapes: dict[str, list[int]] | None = None
        failed_load: str | None = None
        for name, marker, problem in candidates:
            path = Path(name)
            if marker is None:
                self._skip(path, problem or "no marker")
                continue
            if shapes is None:
                shapes = self._gather_shapes()
            mismatch = model_mismatch(path, marker, shapes, self.model.fingerprint)
            if mismatch is not None:
                raise CheckpointError(mismatch)
            problem = self._verify(path, marker)
            if problem is not None:
                self._skip(path, problem)
                continue
            if before_load is not None:
                before_load(_info(path, marker))
            problem = self._load(path, marker)
            if problem is not None:
                failed_load = f"{path.name} ({problem})"
                self._skip(path, f"it does not load: {problem}")
                continue
            return self._restored(path, marker)
        if failed_load is not None:
            # the model holds part of a checkpoint now: starting it from step 0 would not be
            # the fresh model the job began with
            raise CheckpointError(
                f"no checkpoint in {shown(str(self.directory), SHOWN, quoted=False)} loads "
                f"(the newest that passed its checks, {failed_load}, failed while loading): "
                "move the folder away to start from step 0, or point --checkpoint-dir at "
                "another folder"
            )
        if candidates and self.rank == 0:
            logger.warning(
                "no intact checkpoint in %s (%d skipped): starting from step 0",
                self.directory,
                len(candidates),
            )
        return 0

    def _skip(self, path: Path, why: str) -> None:
        if self.rank == 0:
            logger.warning(
                "skipping checkpoint %s: %s; trying the previous one",
                path,
                shown(why, SHOWN, quoted=False),
            )

    def _gather_shapes(self) -> dict[str, list[int]]:
        """This job's model tensors by name, their full shapes (every rank's stages)."""
        union: dict[str, list[int]] = {}
        for part in self._gather(tensor_shapes(self.model.state_dict()["model"])):
            for name, shape in part.items():
                union.setdefault(name, shape)
        return union

    def _verify(self, path: Path, marker: dict[str, Any]) -> str | None:
        """Every file's size and SHA-256 against the marker, the files split over the ranks;
        the first problem (the same on every rank), or None."""
        files: dict[str, Any] | None = marker.get("files")
        if files is None:  # a marker of format 1: nothing to check against
            if self.rank == 0:
                logger.warning(
                    "checkpoint %s was saved without checksums (an older autoplan): loading it "
                    "unverified",
                    path,
                )
            return None
        names = sorted(files)
        problems: list[tuple[str, str]] = []
        for part in self._gather(check_files(path, files, names[self.rank :: self.world_size])):
            problems.extend(part)
        if not problems:
            return None
        problems.sort(key=lambda item: names.index(item[0]))
        first = f"{problems[0][0]} {problems[0][1]}"
        return first + (f" (and {len(problems) - 1} more files)" if len(problems) > 1 else "")

    def _load(self, path: Path, marker: dict[str, Any]) -> str | None:
        """Load ``path`` into the model, the data and this rank's RNG; the reason it failed on
        the lowest rank where it did (the same on every rank), or None."""
        rng_key = f"rng/rank{self.rank}"
        error: str | None = None
        state: dict[str, Any] = {}
        try:
            available = FileSystemReader(str(path)).read_metadata().state_dict_metadata
            state = self._state()
            if not _holds(available, rng_key):
                state.pop(rng_key)
                logger.warning(
                    "checkpoint %s has no RNG state for rank %d (saved by %s ranks): keeping "
                    "this rank's",
                    path,
                    self.rank,
                    marker.get("world_size", "?"),
                )
            no_data = "data" in state and not _holds(available, "data")
        except (Exception, CheckpointException) as failure:
            error, no_data = reason(failure), False
        verdicts = self._gather((error, no_data))
        if any(lacks for _, lacks in verdicts):
            raise CheckpointError(
                f"checkpoint {path} holds no data position; resume it without data=..."
            )
        errors: list[str] = [e for e, _ in verdicts if e is not None]
        if errors:
            return errors[0]
        try:
            dcp_load(
                state,
                checkpoint_id=str(path),
                process_group=self._group,
                planner=DefaultLoadPlanner(allow_partial_load=False),
            )
            self.model.load_state_dict({"model": state["model"], "optimizer": state["optimizer"]})
        except (Exception, CheckpointException) as failure:
            error = reason(failure)
        errors = [e for e in self._gather(error) if e is not None]
        if errors:
            return errors[0]
        self.model.step = int(state["progress"]["step"])
        if rng_key in state:
            _set_rng_state(state[rng_key])
        if self.data is not None:
            self.data.load_state_dict(state["data"])
        return None

    def _restored(self, path: Path, marker: dict[str, Any]) -> int:
        step = self.model.step
        self._last_saved = step
        self._good = {step: path}
        self.last_complete_step = step
        saved_nonfinite = marker.get("nonfinite_step")
        if isinstance(saved_nonfinite, int):
            self.note_nonfinite(saved_nonfinite)
        if marker.get("data") and self.data is None and self.rank == 0:
            logger.warning("checkpoint %s holds a data position, but no data was given", path)
        self.restored = _info(path, marker)
        return step


# ---------------------------------------------------------------------- helpers


def _info(path: Path, marker: Mapping[str, Any]) -> CheckpointInfo:
    run = marker.get("run")
    world_size = marker.get("world_size")
    return CheckpointInfo(
        path=path,
        step=int(marker["step"]),
        world_size=world_size if isinstance(world_size, int) else 0,
        plan_digest=str(marker.get("plan_digest", "")),
        model_fingerprint=str(marker.get("model_fingerprint", "")),
        run=dict(run) if isinstance(run, dict) else {},
    )


def _doomed(
    ours: Iterable[int], good: Iterable[int], keep: int | None, nonfinite: int | None
) -> list[int]:
    """The steps of this job's checkpoints (``ours``) that pruning deletes: never one at or
    after the newest verified (``good``) step, never the ``keep`` newest verified ones, and,
    with a non-finite step, never the newest verified one before it (nor any before it when
    none of those was verified)."""
    verified = sorted(set(good))
    if keep is None or not verified:
        return []
    kept = set(verified[-keep:])
    floor = -1  # steps below it are all kept
    if nonfinite is not None:
        older = [step for step in verified if step < nonfinite]
        if older:
            kept.add(older[-1])
        else:
            floor = nonfinite
    newest = verified[-1]
    return sorted(step for step in ours if step not in kept and floor <= step < newest)


def _holds(saved: Any, key: str) -> bool:
    """Whether a checkpoint's (flattened) keys hold ``key`` or entries under it."""
    return any(name == key or name.startswith(key + ".") for name in saved)


def _tag(identity: str) -> str:
    """A short file-name-safe tag of a job or run id."""
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


# ---------------------------------------------------------------------- RNG


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
