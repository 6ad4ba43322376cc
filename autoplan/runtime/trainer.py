"""`autoplan.Trainer`: a training loop that survives lost workers.

The same function runs under torchrun (``--max-restarts``, elastic ``--nnodes MIN:MAX``) and Ray
Train. Every (re)start of the job:

1. builds this rank's part of the model with `autoplan.parallelize` for the world it finds: with
   no plan given, rank 0 searches one for that world and every rank agrees on it (a job that
   comes back on fewer or more workers re-plans);
2. resumes from the latest complete checkpoint in ``checkpoint_dir`` (model, optimizer, step,
   RNG, data position), resharded by DCP when the plan changed;
3. trains, saving every ``checkpoint_every`` steps in the background.

`Trainer.setup` records what the start cost (`Setup`: search, build and restore times, and
whether the plan changed from the checkpoint's), and rank 0 logs it, so a re-planned restart
says what it re-planned and how long resharding took.

Expects the model on the meta device (or the same weights on every rank), a ``data`` iterator
that yields the whole global batch ``(inputs, targets)`` on every rank and has
``state_dict``/``load_state_dict`` (e.g. `autoplan.data.Batches`), and the same arguments on
every rank.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.runtime.checkpoint import Checkpointer, CheckpointInfo
from autoplan.runtime.parallelizer import DEFAULT_OPTIMIZER, LossFn, parallelize
from autoplan.runtime.replicas import TorchFTReplicas
from cost_model.hardware import Cluster
from passes import log_rank0
from passes.runtime import DistributedModel, OptimizerFactory

__all__ = ["Setup", "StatefulBatches", "Trainer"]

logger = logging.getLogger(__name__)


class StatefulBatches(Protocol):
    """Global batches with a position a checkpoint can save."""

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """What this start of the job did before its first step."""

    world_size: int
    plan_digest: str
    search_time_s: float | None  # rank 0's plan search and its broadcast (None: plan given)
    build_time_s: float  # parallelize as a whole (the search included)
    restore_time_s: float  # finding and loading the checkpoint (0 when there is none)
    resumed: CheckpointInfo | None  # the checkpoint it resumed from

    @property
    def replanned(self) -> bool:
        """Resumed under another plan than the checkpoint's (another world size, or a new
        search's answer): the state was resharded."""
        return self.resumed is not None and self.resumed.plan_digest != self.plan_digest

    def describe(self) -> str:
        """One line for the job's log."""
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
    ) -> None:
        if plan is None and global_batch_size is None:
            raise PlanError(
                "Trainer got no plan and no global_batch_size to search one for; pass plan=... "
                "or global_batch_size=... (an elastic job passes global_batch_size: every "
                "world it restarts on plans for the same global batch)"
            )
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
        )
        self.replicas = None if replicas is None else replicas.connect(self.model)
        if self.replicas is not None:
            self.replicas.register("data", data.load_state_dict, data.state_dict)
        build_time_s = time.perf_counter() - started
        self.data = data
        self.checkpointer: Checkpointer | None = None
        restore_time_s = 0.0
        if checkpoint_dir is not None:
            # Constructed on every rank with the same arguments: bad ones fail everywhere.
            self.checkpointer = Checkpointer(
                checkpoint_dir, self.model, every=checkpoint_every, data=data, keep=keep
            )
            started = time.perf_counter()
            self.checkpointer.restore()
            restore_time_s = time.perf_counter() - started
        self.setup = Setup(
            world_size=self.model.plan.num_devices,
            plan_digest=self.model.plan.digest(),
            search_time_s=self.model.search_time_s,
            build_time_s=build_time_s,
            restore_time_s=restore_time_s,
            resumed=self.checkpointer.restored if self.checkpointer else None,
        )
        log_rank0(logger, logging.INFO, "%s", self.setup.describe())

    @property
    def plan(self) -> Plan:
        return self.model.plan

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored from the checkpoint on a restart)."""
        return self.model.step

    def steps(self, total: int) -> Iterator[float]:
        """Train until ``total`` optimizer steps are done (counting those before a restart),
        yielding each step's loss; saves every ``checkpoint_every`` steps and, when the loop
        finishes, the last step, waiting for the writes."""
        while self.model.step < total:
            loss = float(self.model.train_step(*next(self.data)))
            if self.checkpointer is not None:
                self.checkpointer.after_step()
            yield loss
        self.close()

    def close(self) -> None:
        """Save the last step (if not saved yet) and wait for every write to finish."""
        if self.checkpointer is not None:
            self.checkpointer.close()


def _per_group(global_batch_size: int, groups: int) -> int:
    if global_batch_size % groups:
        raise PlanError(
            f"global_batch_size = {global_batch_size} does not split over {groups} replica "
            f"groups; use a multiple of {groups}"
        )
    return global_batch_size // groups
