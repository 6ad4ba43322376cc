"""`autoplan.Trainer`: a training loop that survives lost workers, divergence and preemption.

The same function runs under torchrun (``--max-restarts``, elastic ``--nnodes MIN:MAX``) and Ray
Train. Every (re)start of the job:

1. builds this rank's part of the model with `autoplan.parallelize` for the world it finds: with
   no plan given, rank 0 searches one for that world and every rank agrees on it (a job that
   comes back on fewer or more workers re-plans);
2. resumes from the latest complete checkpoint in ``checkpoint_dir`` (model, optimizer, step,
   RNG, data position), resharded by DCP when the plan changed, and says what differs from the
   run that saved it (`Setup.changes`): this run's optimizer hyperparameters and global batch
   are applied, another optimizer class or other data settings are refused;
3. trains, saving every ``checkpoint_every`` steps in the background. A non-finite loss or
   gradient stops the run (``on_nan="stop"``: `NonFiniteError`, nothing saved from the bad
   step, every good checkpoint left) or skips the step (``"skip"``: the checkpointer keeps a
   checkpoint older than it). A SIGTERM or SIGINT (``save_on_signal``) stops the job after the
   step every rank agrees on, saves that step if the save fits the grace period, and raises
   `TrainingStopped`.

`Trainer.setup` records what the start cost (`Setup`: search, build and restore times, and
whether the plan changed from the checkpoint's), and rank 0 logs it, so a re-planned restart
says what it re-planned and how long resharding took. When `steps` finishes, rank 0 logs the
predicted against the measured step time (`Trainer.step_timing`, `autoplan.runtime.step_timing`).

Expects the model on the meta device (or the same weights on every rank), a ``data`` iterator
that yields the whole global batch ``(inputs, targets)`` on every rank and has
``state_dict``/``load_state_dict`` (e.g. `autoplan.data.Batches`; a ``config()`` mapping, if it
has one, is compared on resume), and the same arguments on every rank.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from autoplan.contract.errors import InputError, PlanError
from autoplan.contract.plan import Plan
from autoplan.runtime.checkpoint import Checkpointer, CheckpointError, CheckpointInfo
from autoplan.runtime.parallelizer import DEFAULT_OPTIMIZER, LossFn, parallelize
from autoplan.runtime.replicas import TorchFTReplicas
from autoplan.runtime.step_timing import StepTiming, log_step_timing, step_timing
from cost_model.hardware import Cluster
from cost_model.messages import shown
from passes import log_rank0
from passes.runtime import DistributedModel, NonFiniteError, OptimizerFactory

__all__ = ["Setup", "StatefulBatches", "Trainer", "TrainingStopped", "default_signal_grace_s"]

logger = logging.getLogger(__name__)

OnNaN = Literal["stop", "skip"]

# Seconds between the SIGTERM that ends a job and the SIGKILL that follows: torchrun's agent
# sends SIGTERM to its workers and SIGKILLs them `shutdown_timeout` later (torch 2.13:
# torch/distributed/launcher/api.py, LaunchConfig.shutdown_timeout from --shutdown-timeout or
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30; elastic/multiprocessing/api.py, `_close`). Slurm's
# KillWait (slurm.conf, default 30 s) and Kubernetes' terminationGracePeriodSeconds (default
# 30 s) give the same.
DEFAULT_SIGNAL_GRACE_S = 30.0
# A save may take longer than the last one did (a busier file system): it is tried only when
# this many times the last save's time fits in what is left of the grace period.
_SAVE_MARGIN = 1.5
# A second signal this soon after the first is the same request relayed, not a second one:
# Slurm signals every process of a job step, and torchrun's agent then forwards the SIGTERM it
# got to its workers again.
_RELAYED_S = 2.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def default_signal_grace_s() -> float:
    """The grace period of the launcher this process runs under: torchrun's shutdown timeout
    when it is set in the environment (``--shutdown-timeout`` given as ``PET_SHUTDOWN_TIMEOUT``
    or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), else `DEFAULT_SIGNAL_GRACE_S`."""
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        try:
            value = float(os.environ[name])
        except (KeyError, ValueError):
            continue
        if math.isfinite(value) and value >= 0:
            return value
    return DEFAULT_SIGNAL_GRACE_S


class StatefulBatches(Protocol):
    """Global batches with a position a checkpoint can save."""

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class TrainingStopped(Exception):  # not an error: the job was asked to stop
    """Raised by `Trainer.steps` on every rank when a signal (or `DistributedModel.request_stop`)
    stopped the job before its last step; the message is the one-line report.

    ``signal``: the signal's number (None: stopped by a request in code); ``step``: the last
    step trained; ``saved_step``: the newest complete checkpoint (None: there is none);
    ``steps_lost``: steps a resumed job trains again. A script exits with `exit_code` (128 +
    the signal's number, the shell's convention for a process ended by a signal; 1 otherwise):
    non-zero, so a scheduler does not take a preempted job for a finished one.
    """

    def __init__(
        self,
        message: str,
        *,
        signal: int | None,
        step: int,
        saved_step: int | None,
        steps_lost: int,
    ) -> None:
        super().__init__(message)
        self.signal = signal
        self.step = step
        self.saved_step = saved_step
        self.steps_lost = steps_lost

    @property
    def exit_code(self) -> int:
        return 128 + self.signal if self.signal else 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """What this start of the job did before its first step."""

    world_size: int
    plan_digest: str
    search_time_s: float | None  # rank 0's plan search and its broadcast (None: plan given)
    build_time_s: float  # parallelize as a whole (the search included)
    restore_time_s: float  # finding and loading the checkpoint (0 when there is none)
    resumed: CheckpointInfo | None  # the checkpoint it resumed from
    # one line per setting this run changed from the checkpoint's run (each applied)
    changes: tuple[str, ...] = ()

    @property
    def replanned(self) -> bool:
        """Resumed under another plan than the checkpoint's (another world size, or a new
        search's answer): the state was resharded."""
        return self.resumed is not None and self.resumed.plan_digest != self.plan_digest

    def describe(self) -> str:
        """One line for the job's log (the changes are lines of their own)."""
        how = (
            f"searched a plan in {self.search_time_s:.2f} s"
            if self.search_time_s is not None
            else "plan given"
        )
        line = f"{self.world_size} processes: {how}, built in {self.build_time_s:.2f} s"
        if self.resumed is None:
            return line + ", no checkpoint to resume"
        where = f"resumed step {self.resumed.step} from {self.resumed.path}"
        if self.replanned:
            return (
                f"{line}; re-planned: {where}, saved by {self.resumed.world_size} processes "
                f"under plan {self.resumed.plan_digest}, resharded to plan {self.plan_digest} "
                f"in {self.restore_time_s:.2f} s"
            )
        return f"{line}; {where} in {self.restore_time_s:.2f} s (same plan)"


class Trainer:
    """Parallelize ``model``, resume it, and train; see the module doc.

    ``plan``: run this plan (it must fit the world the job starts with); None searches one for
    whatever world the job has, which is what an elastic job wants. ``global_batch_size`` and
    ``search_constraints`` are for that search. ``checkpoint_dir`` None: no checkpoints.
    ``timeout_s``: the process-group timeout when parallelize creates the group.
    ``replicas``: this job is one of several replica groups that average gradients through
    torchft and survive each other's failures (`autoplan.runtime.replicas`);
    ``global_batch_size`` is then the batch over all groups, the plan (given or searched) each
    group's, and checkpoints go to ``checkpoint_dir/replica_<group>``.
    ``on_nan``: what a non-finite loss or gradient does (`parallelize`'s ``on_nan``).
    ``save_on_signal``: while `steps` runs, SIGTERM and SIGINT stop the job and save its step
    (None: on under torchrun); ``signal_grace_s``: the time between the signal and the SIGKILL
    that follows it (None: `default_signal_grace_s`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn,
        data: StatefulBatches,
        optimizer: OptimizerFactory = DEFAULT_OPTIMIZER,
        plan: Plan | None = None,
        cluster: Cluster | str | None = None,
        global_batch_size: int | None = None,
        search_constraints: Mapping[str, Any] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 100,
        keep: int | None = 2,
        timeout_s: float | None = None,
        seed: int = 0,
        replicas: TorchFTReplicas | None = None,
        on_nan: OnNaN = "stop",
        save_on_signal: bool | None = None,
        signal_grace_s: float | None = None,
    ) -> None:
        _check_options(plan, global_batch_size, on_nan, save_on_signal, signal_grace_s)
        if checkpoint_dir is not None:
            # Refused before anything runs; a search avoids it (ZeRO-2 shards the same state).
            problem = plan.checkpoint_problem() if plan is not None else None
            if problem is not None:
                raise PlanError(f"checkpoint_dir is set, but {problem}")
            if plan is None and "zero" not in (search_constraints or {}):
                search_constraints = {**(search_constraints or {}), "zero": (0, 2, 3)}
        if replicas is not None:
            # Each replica group runs the plan on its own slice of the global batch.
            if plan is not None:
                replicas.check(plan)
            if global_batch_size is not None:
                global_batch_size = _per_group(global_batch_size, replicas.num_replica_groups)
            search_constraints = {**(search_constraints or {}), "dp": 1, "tp": 1}
            if checkpoint_dir is not None:
                checkpoint_dir = os.path.join(checkpoint_dir, f"replica_{replicas.replica_group}")
        self.save_on_signal = (
            "TORCHELASTIC_RUN_ID" in os.environ if save_on_signal is None else save_on_signal
        )
        self.signal_grace_s = (
            default_signal_grace_s() if signal_grace_s is None else float(signal_grace_s)
        )
        self.stopped_by: str | None = None  # the signal that stopped `steps` (its name)
        self._diverged = False  # a NonFiniteError ended `steps`: nothing more is saved
        self._skips_told = 0  # model.skipped_steps told to the checkpointer
        started = time.perf_counter()
        self.model: DistributedModel = parallelize(
            model,
            cluster,
            plan,
            loss_fn=loss_fn,
            optimizer=optimizer,
            global_batch_size=global_batch_size,
            search_constraints=search_constraints,
            seed=seed,
            timeout_s=timeout_s,
            on_nan=on_nan,
        )
        self.replicas = None if replicas is None else replicas.connect(self.model)
        if self.replicas is not None:
            self.replicas.register("data", data.load_state_dict, data.state_dict)
        build_time_s = time.perf_counter() - started
        self.data = data
        self.checkpointer: Checkpointer | None = None
        restore_time_s = 0.0
        changes: tuple[str, ...] = ()
        if checkpoint_dir is not None:
            run = run_facts(self.model.optimizers, self.model.plan.global_batch_size, data)
            # Constructed on every rank with the same arguments: bad ones fail everywhere.
            self.checkpointer = Checkpointer(
                checkpoint_dir,
                self.model,
                every=checkpoint_every,
                data=data,
                keep=keep,
                run=run,
            )
            started = time.perf_counter()
            changes = self._restore(run)
            restore_time_s = time.perf_counter() - started
        self.setup = Setup(
            world_size=self.model.plan.num_devices,
            plan_digest=self.model.plan.digest(),
            search_time_s=self.model.search_time_s,
            build_time_s=build_time_s,
            restore_time_s=restore_time_s,
            resumed=self.checkpointer.restored if self.checkpointer else None,
            changes=changes,
        )
        log_rank0(logger, logging.INFO, "%s", self.setup.describe())
        for line in changes:
            log_rank0(logger, logging.WARNING, "%s", line)

    def _restore(self, run: Mapping[str, Any]) -> tuple[str, ...]:
        """Resume from the newest complete checkpoint and compare its run with this one (on
        every rank, so a refusal fails everywhere); returns the lines naming what changed."""
        assert self.checkpointer is not None

        def refuse(info: CheckpointInfo) -> None:
            # Before loading: another optimizer's state fails to load, or loads wrongly.
            refusal = run_refusal(info.run, run, step=info.step, path=info.path)
            if refusal is not None:
                raise CheckpointError(refusal)

        wanted = [_hyperparameters(optimizer) for optimizer in self.model.optimizers]
        self.checkpointer.restore(before_load=refuse)
        info = self.checkpointer.restored
        if info is None:
            return ()
        # The optimizer state brought the checkpoint's hyperparameters back with it: this
        # run's values (its optimizer factory's) are the ones it was given.
        loaded = [_hyperparameters(optimizer) for optimizer in self.model.optimizers]
        for optimizer, groups in zip(self.model.optimizers, wanted, strict=True):
            for group, values in zip(optimizer.param_groups, groups, strict=True):
                group.update(values)
        return run_changes(
            info.run,
            run,
            step=info.step,
            saved_groups=loaded[0] if loaded else [],
            groups=wanted[0] if wanted else [],
        )

    @property
    def plan(self) -> Plan:
        return self.model.plan

    def step_timing(self) -> StepTiming | None:
        """This run's predicted step time and its measured median on this rank (None before
        any step after the warm-up); `steps` logs it when it finishes."""
        return step_timing(self.model)

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored from the checkpoint on a restart)."""
        return self.model.step

    def steps(self, total: int) -> Iterator[float]:
        """Train until ``total`` optimizer steps are done (counting those before a restart),
        yielding each step's loss; saves every ``checkpoint_every`` steps and, when the loop
        finishes, the last step, waiting for the writes.

        A `NonFiniteError` (``on_nan="stop"``) propagates after the saves in progress finish,
        with the newest good checkpoint named; nothing of the bad step is saved. A stop agreed
        on every rank (a signal, with ``save_on_signal``) saves the step if the save fits the
        grace period and raises `TrainingStopped`. Signal handlers are those of the caller
        again when this returns or raises."""
        handler = _StopOnSignal(self.model) if self.save_on_signal else None
        if handler is not None and not handler.install():
            log_rank0(
                logger,
                logging.WARNING,
                "save_on_signal: not installing SIGTERM/SIGINT handlers outside the main thread "
                "(%s); a signal ends the job without a save",
                threading.current_thread().name,
            )
            handler = None
        try:
            while self.model.step < total:
                try:
                    loss = float(self.model.train_step(*next(self.data)))
                except NonFiniteError as error:
                    raise self._diverged_error(error) from None
                if self.checkpointer is not None:
                    self._tell_skipped_steps()
                    self.checkpointer.after_step()
                yield loss
                if self.model.stop_requested and self.model.step < total:
                    raise self._stop(handler)
            log_step_timing(self.model)
            self.close()
        finally:
            if handler is not None:
                handler.uninstall()

    def close(self) -> None:
        """Save the last step (if not saved yet; never after a non-finite stop) and wait for
        every write to finish."""
        if self.checkpointer is not None:
            self.checkpointer.close(save=not self._diverged)

    # ------------------------------------------------------------------ ending early

    def _tell_skipped_steps(self) -> None:
        """Steps skipped for a non-finite loss (``on_nan="skip"``) go to the checkpointer, which
        then keeps a checkpoint older than the first of them."""
        assert self.checkpointer is not None
        skipped = self.model.skipped_steps
        for step in skipped[self._skips_told :]:
            self.checkpointer.note_nonfinite(step)
        self._skips_told = len(skipped)

    def _diverged_error(self, error: NonFiniteError) -> NonFiniteError:
        """The run stops at a non-finite step: the saves of earlier (good) steps in flight
        finish, nothing else is saved, and the message names the checkpoint to resume from."""
        self._diverged = True
        if self.checkpointer is None:
            return NonFiniteError(f"{error}; this run saves no checkpoints (no checkpoint_dir)")
        self.checkpointer.close(save=False)
        newest = self.checkpointer.last_complete_step
        where = (
            f"the newest good checkpoint is step {newest} ({self._step_path(newest)})"
            if newest is not None
            else "there is no checkpoint yet"
        )
        # B's message names the step, the rank and the fix; this adds where to resume from
        return NonFiniteError(f"{error}; {where}, nothing saved after it")

    def _stop(self, handler: _StopOnSignal | None) -> TrainingStopped:
        """Every rank agreed to stop after this step: save it if the save fits what is left of
        the grace period (one verdict for all ranks), wait for the writes, report."""
        step = self.model.step
        # each rank's view: the signal it got (0: none) and whether the save would not fit
        signum = handler.signum if handler is not None and handler.signum else 0
        late = 0
        if self.checkpointer is not None:
            self.checkpointer.wait()  # the save in flight finishes in any case
            last_save_s = self.checkpointer.last_save_s
            if handler is not None and handler.at is not None and last_save_s is not None:
                left_s = self.signal_grace_s - (time.monotonic() - handler.at)
                late = int(last_save_s * _SAVE_MARGIN > left_s)
        verdict = torch.tensor([signum, late], dtype=torch.int64, device=self.model.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        signum, late = int(verdict[0]), int(verdict[1])
        name = signal.Signals(signum).name if signum else "a stop request"
        self.stopped_by = signal.Signals(signum).name if signum else None
        if self.checkpointer is None:
            message = (
                f"stopped by {name} after step {step}: no checkpoint_dir, nothing saved; "
                f"{step} steps lost"
            )
            return TrainingStopped(
                message, signal=signum or None, step=step, saved_step=None, steps_lost=step
            )
        started = time.perf_counter()
        self.checkpointer.close(save=not late)
        saved = self.checkpointer.last_complete_step
        lost = step - (saved or 0)
        if saved == step:
            what = (
                f"saved step {step} to {self._step_path(step)} in "
                f"{time.perf_counter() - started:.1f} s; 0 steps lost"
            )
        else:
            why = (
                f"not saved (the last save took {self.checkpointer.last_save_s:.1f} s, more than "
                f"the {self.signal_grace_s:.0f} s grace period allows)"
                if late
                else "not saved"
            )
            newest = (
                f"the newest checkpoint is step {saved} ({self._step_path(saved)})"
                if saved is not None
                else "there is no checkpoint"
            )
            what = f"{why}; {newest}: {lost} steps lost"
        return TrainingStopped(
            f"stopped by {name} after step {step}: {what}",
            signal=signum or None,
            step=step,
            saved_step=saved,
            steps_lost=lost,
        )

    def _step_path(self, step: int) -> Path:
        assert self.checkpointer is not None
        return self.checkpointer.directory / f"step_{step:08d}"


class _StopOnSignal:
    """SIGTERM and SIGINT handlers that ask the model to stop (B's `request_stop` only sets a
    flag: safe in a handler); the stop itself happens after the step every rank agrees on. A
    second signal (not the first relayed, see `_RELAYED_S`) goes to the handlers that were
    there before, at once: the default ones end the process, with no save."""

    def __init__(self, model: DistributedModel) -> None:
        self.model = model
        self.signum: int | None = None  # the first signal received
        self.at: float | None = None  # when (time.monotonic)
        self._previous: dict[int, Any] = {}

    def install(self) -> bool:
        """Install the handlers (not over a signal ignored by the caller); False outside the
        main thread, where Python cannot install them (e.g. Ray Train's worker thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in _SIGNALS:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:
                continue  # nohup or a background job: that signal is not meant to stop it
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
            self.model.request_stop()
            return
        assert self.at is not None
        if time.monotonic() - self.at < _RELAYED_S:
            return
        previous = self._previous.get(signum)
        self.uninstall()
        if callable(previous):
            previous(signum, frame)  # Python's SIGINT handler: KeyboardInterrupt
        else:
            signal.raise_signal(signum)  # the default action: the process ends


# ---------------------------------------------------------------------- what a checkpoint's run was


def run_facts(
    optimizers: Sequence[torch.optim.Optimizer], global_batch: int, data: object
) -> dict[str, Any]:
    """The facts about this run a checkpoint records (JSON-able): the optimizer's class and
    hyperparameters (of the first local optimizer; every stage's comes from the same factory),
    the global batch and the data's settings (its ``config()``, if it has one)."""
    facts: dict[str, Any] = {"global_batch": int(global_batch)}
    if optimizers:
        facts["optimizer"] = _class_path(type(optimizers[0]))
        facts["param_groups"] = [
            {key: _jsonable(value) for key, value in group.items()}
            for group in _hyperparameters(optimizers[0])
        ]
    config = getattr(data, "config", None)
    facts["data"] = {
        "class": _class_path(type(data)),
        **({key: _jsonable(value) for key, value in config().items()} if callable(config) else {}),
    }
    return facts


def run_refusal(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, step: int, path: Path
) -> str | None:
    """Why this run cannot resume the saved one (one line), or None. Refused: another
    optimizer class (its state cannot be loaded into this optimizer) and other data settings
    (the saved data position belongs to the saved data: under other settings it would resume
    neither run's stream). A checkpoint that records no run (an older version's) is compared
    with nothing."""
    old, new = saved.get("optimizer"), current.get("optimizer")
    if old and new and old != new:
        return (
            f"cannot resume step {step} from {path}: it holds the state of optimizer "
            f"{_short(old)}, and this run builds {_short(new)}, whose state it cannot load; "
            f"resume with {_short(old)}, or start the {_short(new)} run in an empty checkpoint "
            "folder"
        )
    old_data, new_data = saved.get("data"), current.get("data")
    if isinstance(old_data, Mapping) and isinstance(new_data, Mapping):
        differ = _differences(
            {k: v for k, v in old_data.items() if k not in _DATA_BATCH_KEYS},
            {k: v for k, v in new_data.items() if k not in _DATA_BATCH_KEYS},
        )
        if differ:
            return (
                f"cannot resume step {step} from {path}: the data changed ({differ}), and the "
                "data position it saved belongs to the old data; resume with the checkpoint's "
                "data settings, or start the changed run in an empty checkpoint folder"
            )
    return None


# A data config's batch size follows the global batch, which is compared (and applied) apart.
_DATA_BATCH_KEYS = frozenset({"batch_size", "global_batch_size"})


def run_changes(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    step: int,
    saved_groups: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
) -> tuple[str, ...]:
    """One line per setting this run changed and applies: the optimizer's hyperparameters
    (``saved_groups``: what the checkpoint's optimizer state held; ``groups``: this run's) and
    the global batch."""
    lines = []
    if len(saved_groups) != len(groups):
        lines.append(
            f"resumed step {step}: {len(saved_groups)} -> {len(groups)} optimizer parameter "
            "groups (applied: this run's optimizer settings)"
        )
    else:
        several = len(groups) > 1
        differ = "; ".join(
            (f"group {index}: " if several else "") + found
            for index, (old, new) in enumerate(zip(saved_groups, groups, strict=True))
            if (found := _differences(old, new))
        )
        if differ:
            lines.append(
                f"resumed step {step}: {differ} (applied: this run's values, not the checkpoint's)"
            )
    old_batch, new_batch = saved.get("global_batch"), current.get("global_batch")
    if old_batch is not None and new_batch is not None and old_batch != new_batch:
        # the plan was made for this run's batch; the data position is re-based: it counts
        # on from the checkpoint's, in batches of the new size
        lines.append(
            f"resumed step {step}: global batch {shown(old_batch)} -> {shown(new_batch)} "
            f"(applied; the data goes on from its position in batches of {shown(new_batch)})"
        )
    return tuple(lines)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (everything but its parameters)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """``lr 0.003 -> 1e+10, seed 0 -> 1``: the keys whose values differ (a key only one side
    has too)."""
    parts = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key), new.get(key)
        if not _same(a, b):
            parts.append(f"{key} {_value(a)} -> {_value(b)}")
    return ", ".join(parts)


def _same(a: object, b: object) -> bool:
    return bool(_jsonable(a) == _jsonable(b))


def _jsonable(value: object) -> Any:
    """A hyperparameter or setting as JSON would hold it (tuples as lists, a one-element tensor
    as its number); anything else by its short repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _jsonable(value.item())
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return shown(value)


def _value(value: object) -> str:
    """A value for a message: floats short but exact (``1e+10``, ``0.003``)."""
    if isinstance(value, float) and float(f"{value:g}") == value:
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_value(item) for item in value) + ")"
    return "(none)" if value is None else shown(value, quoted=False)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _short(path: object) -> str:
    return shown(str(path).rsplit(".", 1)[-1], quoted=False)


def _check_options(
    plan: Plan | None,
    global_batch_size: int | None,
    on_nan: object,
    save_on_signal: object,
    signal_grace_s: object,
) -> None:
    if plan is None and global_batch_size is None:
        raise PlanError(
            "Trainer got no plan and no global_batch_size to search one for; pass plan=... "
            "or global_batch_size=... (an elastic job passes global_batch_size: every "
            "world it restarts on plans for the same global batch)"
        )
    if on_nan not in ("stop", "skip"):
        raise InputError(f"on_nan={shown(on_nan)}: use 'stop' (the default) or 'skip'")
    if save_on_signal is not None and not isinstance(save_on_signal, bool):
        raise InputError(
            f"save_on_signal={shown(save_on_signal)}: use True, False or None (on under torchrun)"
        )
    if signal_grace_s is not None and (
        isinstance(signal_grace_s, bool)
        or not isinstance(signal_grace_s, (int, float))
        or not math.isfinite(signal_grace_s)
        or signal_grace_s < 0
    ):
        raise InputError(
            f"signal_grace_s={shown(signal_grace_s)}: give the seconds between the scheduler's "
            "SIGTERM and its SIGKILL (a number >= 0), or None for the launcher's (30 s)"
        )


def _per_group(global_batch_size: int, groups: int) -> int:
    if global_batch_size % groups:
        raise PlanError(
            f"global_batch_size = {global_batch_size} does not split over {groups} replica "
            f"groups; use a multiple of {groups}"
        )
    return global_batch_size // groups
