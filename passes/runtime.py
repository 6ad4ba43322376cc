"""`DistributedModel`: one rank's share of a model compiled from a `Plan`, ready to train.

Expects the outputs of the passes (split, tensor parallel, recompute, data parallel,
materialise, pipeline) and an optimizer factory. Guarantees:

- `DistributedModel.train_step(inputs, targets)` runs one optimizer step over the plan's
  *global* batch (every rank is given the same batch and keeps its data-parallel slice, and
  under context parallelism its load-balanced chunks of every sequence) and returns the mean
  loss over the global batch, the same value on every rank (from the last pipeline stage,
  averaged over data-parallel replicas and cp ranks);
- gradients of tied parameter copies on different stages are summed between the stages holding
  them after every backward (Megatron-LM's embedding group), so the copies stay identical;
- `state_dict()` / `load_state_dict()` carry the model and the optimizer under the model's own
  parameter names (a tied parameter under the name of its first use), as DTensors where
  sharded: ``torch.distributed.checkpoint`` saves and loads them, and a checkpoint saved under
  one plan loads under another (DCP reshards);
- every step checks the loss (last pipeline stage) and every local gradient for NaN and inf and
  agrees on the verdict with one small all-reduce (MAX) over the default group, before any
  optimizer steps: a non-finite step raises `NonFiniteError` on every rank (``on_nan="stop"``)
  or is skipped on every rank (``"skip"``). The same all-reduce carries `request_stop`;
- what must follow new weights runs after every optimizer step and every load (``after_step``:
  an fp8 plan's fp8-gathered weights get their next scales, passes/fp8.py); checkpoints hold
  the plain tensor inside torchao's fp8 all-gather weight (`checkpoint_tensor`);
- `step_times_s` holds each `train_step`'s wall time on this rank, and `predicted_step_s` /
  `predicted_step_range_s` what the cost model predicted for it (set by `autoplan.parallelize`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from passes._log import log_rank0
from passes.context_parallel import ContextParallelResult
from passes.fp8 import checkpoint_tensor
from passes.mesh import ParallelMesh
from passes.optimizer_offload import offloading_factory
from passes.pipeline import Pipeline
from passes.progress import (
    CrashedRankError,
    RankFailures,
    StepProgress,
    default_group_timeout,
)
from passes.split import SplitModel, TiedParameter, original_fqn

__all__ = [
    "DistributedModel",
    "NonFiniteError",
    "OnNaN",
    "OptimizerFactory",
    "ReplicaSync",
    "TiedGradientSync",
]

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

OnNaN = Literal["stop", "skip"]
ON_NAN_CHOICES: tuple[OnNaN, ...] = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were NaN or inf (``on_nan="stop"``). Raised on every rank with
    the same message, before any optimizer stepped; the process groups are left intact."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _StepVerdict:
    """What every rank agreed on after a step's backward (`DistributedModel._agree`)."""

    loss_rank: int | None  # the lowest rank whose loss was not finite (None: all finite)
    grad_rank: int | None  # the lowest rank holding a non-finite gradient
    stop: bool  # some rank called `request_stop`
    world_size: int

    @property
    def finite(self) -> bool:
        return self.loss_rank is None and self.grad_rank is None

    @property
    def what(self) -> str:
        """What was not finite: the loss if it was (the gradients follow from it)."""
        return "non-finite loss" if self.loss_rank is not None else "non-finite gradient"

    @property
    def where(self) -> str:
        rank = self.loss_rank if self.loss_rank is not None else self.grad_rank
        return f"(seen first on rank {rank} of {self.world_size})"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def _nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """True (a bool tensor, no host sync) if any element of ``tensors`` is NaN or inf.

    One fused pass (torch's ``_foreach_norm``, as ``clip_grad_norm_`` uses): a 2-norm is NaN or
    inf exactly when an element is, provided the sum of squares cannot overflow. Accumulated in
    float64 it cannot for fp32/bf16/fp16 elements (at most 1.2e77 a square); float64 tensors
    take the max-norm instead (exact, but about 8x slower on CPU than the 2-norm).
    """
    narrow = [t for t in tensors if t.dtype != torch.float64]
    wide = [t for t in tensors if t.dtype == torch.float64]
    norms = list(torch._foreach_norm(narrow, 2, dtype=torch.float64)) if narrow else []
    if wide:
        norms += torch._foreach_norm(wide, float("inf"))
    return ~torch.isfinite(torch.stack([n.to(torch.float64) for n in norms]).sum())


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _TiedGroup:
    tied: TiedParameter
    params: tuple[nn.Parameter, ...]  # this rank's copies
    group: dist.ProcessGroup | None  # ranks holding copies (None: all copies are local)


class TiedGradientSync:
    """Sum the gradients of a tied parameter's copies across the pipeline ranks holding them.

    Process groups are created at construction, on every rank, in the same order (a collective).
    """

    def __init__(
        self,
        split: SplitModel,
        modules: dict[int, nn.Module],
        plan: Plan,
        mesh: ParallelMesh,
    ) -> None:
        self._groups: list[_TiedGroup] = []
        pp_group_cache: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for tied in split.tied:
            pp_ranks = tuple(sorted({plan.pipeline_rank_of_stage(s) for s in tied.stage_indices}))
            if pp_ranks not in pp_group_cache:
                pp_group_cache[pp_ranks] = self._group_for(pp_ranks, plan, mesh)
            params = []
            for copy in tied.copies:
                if copy.stage_idx in modules:
                    params.append(modules[copy.stage_idx].get_parameter(copy.stage_fqn))
            if not params:
                continue
            shapes = {tuple(_local(p).shape) for p in params}
            assert len(shapes) == 1, f"local copies of {tied.name} differ in shape: {shapes}"
            self._groups.append(
                _TiedGroup(tied=tied, params=tuple(params), group=pp_group_cache[pp_ranks])
            )
        self._check_layouts(plan, mesh)

    @staticmethod
    def _group_for(
        pp_ranks: tuple[int, ...], plan: Plan, mesh: ParallelMesh
    ) -> dist.ProcessGroup | None:
        if len(pp_ranks) == 1:
            return None
        if len(pp_ranks) == plan.pp_degree:
            return mesh.sub("pp").get_group()
        # One group per (dp, tp) coordinate; dist.new_group is collective over the world.
        stride = plan.axis_stride("pp")
        timeout = default_group_timeout()
        mine: dist.ProcessGroup | None = None
        for base in range(plan.num_devices):
            if (base // stride) % plan.pp_degree != pp_ranks[0]:
                continue
            ranks = [base + (p - pp_ranks[0]) * stride for p in pp_ranks]
            group = dist.new_group(ranks, timeout=timeout)
            if mesh.rank in ranks:
                mine = group
        return mine

    def _check_layouts(self, plan: Plan, mesh: ParallelMesh) -> None:
        for entry in self._groups:
            placements = {p.placements if isinstance(p, DTensor) else None for p in entry.params}
            assert len(placements) == 1, f"copies of {entry.tied.name} are sharded differently"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(entry.tied.name for entry in self._groups)

    @torch.no_grad()
    def __call__(self) -> None:
        for entry in self._groups:
            grads = [p.grad for p in entry.params]
            template = _local(entry.params[0])
            total = torch.zeros_like(template)
            for grad in grads:
                if grad is not None:
                    total += _local(grad)
            if entry.group is not None:
                dist.all_reduce(total, group=entry.group)
            for param in entry.params:
                if param.grad is None:
                    param.grad = (
                        DTensor.from_local(
                            total.clone(),
                            param.device_mesh,
                            param.placements,
                            shape=param.shape,
                            stride=param.stride(),
                        )
                        if isinstance(param, DTensor)
                        else total.clone()
                    )
                else:
                    _local(param.grad).copy_(total)


def _checkpoint_aliases(split: SplitModel) -> tuple[tuple[str, str], ...]:
    """(name, canonical name) for every other name of a shared or tied parameter."""
    aliases: dict[str, str] = {}
    for tied in split.tied:
        for copy in tied.copies:
            aliases[original_fqn(copy.stage_fqn)] = tied.name
    for groups in split.shared_in_stage.values():
        for names in groups:
            first = original_fqn(names[0])
            canonical = aliases.get(first, first)
            for name in names:
                aliases[original_fqn(name)] = canonical
    # Longest first, so a name that is a prefix of another never shadows it.
    ordered = sorted(aliases.items(), key=lambda item: -len(item[0]))
    return tuple((alias, canonical) for alias, canonical in ordered if alias != canonical)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _LocalStage:
    stage_idx: int
    module: nn.Module  # the stage module (named like the model, after `original_fqn`)
    wrapped: nn.Module  # what runs: the module itself, or its DDP wrapper
    optimizer: torch.optim.Optimizer


class ReplicaSync(Protocol):
    """Replica groups that average their gradients step by step and may drop out and rejoin
    (torchft: `autoplan.runtime.replicas`). Each group runs the same plan on its own processes and
    trains on its own slice of the global batch."""

    index: int  # this group's slice of the global batch
    count: int  # the replica groups the global batch is split over

    def start_step(self) -> None:
        """Before the forward pass: join this step's quorum (a rejoining group heals)."""

    def average(self, grads: list[torch.Tensor]) -> None:
        """Average these gradients in place over the groups taking part in the step."""

    def commit(self) -> bool:
        """Whether every group's step succeeded: step the optimizer only then."""

    @property
    def step(self) -> int:
        """The steps committed so far (a healed group jumps to its peers')."""


class DistributedModel:
    """This rank's stages of a model, its optimizers and the pipeline schedule; see the module
    docstring. Build it with `autoplan.parallelize`."""

    def __init__(
        self,
        *,
        plan: Plan,
        mesh: ParallelMesh,
        split: SplitModel,
        wrapped: dict[int, nn.Module],
        pipeline: Pipeline,
        optimizer: OptimizerFactory,
        device: torch.device,
        timeout_s: float | None = None,
        fingerprint: str = "",
        search_time_s: float | None = None,
        replicas: ReplicaSync | None = None,
        context: ContextParallelResult | None = None,
        after_backward: tuple[Callable[[], None], ...] = (),
        after_step: tuple[Callable[[], None], ...] = (),
        on_nan: OnNaN = "stop",
        failures: RankFailures | None = None,
    ) -> None:
        self.plan = plan
        self.on_nan = on_nan  # what a non-finite loss or gradient does: "stop" or "skip"
        self.skipped_steps: list[int] = []  # steps skipped for a non-finite loss (on_nan="skip")
        self._stop_here = False  # request_stop was called on this rank
        self._stop_agreed = False  # some rank's request reached every rank
        # context parallelism: the layout that cuts each sequence into this rank's tokens
        self.context = context
        # gradient work after every backward (expert gradients DDP leaves alone)
        self._after_backward = after_backward
        # work after every optimizer step and load (fp8 all-gather: the weights' next scales)
        self._after_step = after_step
        self.replicas = replicas  # set by autoplan.runtime.replicas when groups of replicas train
        self.fingerprint = fingerprint  # of the traced model (checkpoints record it)
        # how long finding the plan took (rank 0's search and its broadcast); None: given
        self.search_time_s = search_time_s
        self.mesh = mesh
        self.device = device
        self.pipeline = pipeline
        modules: dict[int, nn.Module] = {stage.stage_idx: stage.module for stage in split.stages}
        self._stages = tuple(
            _LocalStage(
                stage_idx=stage.stage_idx,
                module=stage.module,
                wrapped=wrapped[stage.stage_idx],
                optimizer=self._make_optimizer(optimizer, wrapped[stage.stage_idx]),
            )
            for stage in split.stages
        )
        self.tied_sync = TiedGradientSync(split, modules, plan, mesh)
        self._local_batch = plan.micro_batch_size * plan.num_micro_batches
        self._aliases = _checkpoint_aliases(split)
        self.step = 0  # optimizer steps taken (restored with a checkpoint)
        # wall time of each train_step of this process on this rank, and the cost model's
        # prediction and its 80% range (None: not predicted)
        self.step_times_s: list[float] = []
        self.predicted_step_s: float | None = None
        self.predicted_step_range_s: tuple[float, float] | None = None
        self._progress = StepProgress(mesh.rank, plan.num_devices, timeout_s, failures)

    def _make_optimizer(
        self, factory: OptimizerFactory, wrapped: nn.Module
    ) -> torch.optim.Optimizer:
        params = [p for p in wrapped.parameters() if p.requires_grad]
        # the plan's share of each optimizer's step on the host (passes/optimizer_offload.py)
        factory = offloading_factory(factory, self.plan.optimizer_offload, self.device)
        if self.plan.zero_stage == 1 and isinstance(wrapped, nn.parallel.DistributedDataParallel):
            # ZeRO-1: each data-parallel rank keeps the optimizer state of its share of params.
            return ZeroRedundancyOptimizer(
                params,
                optimizer_class=lambda ps, **_: factory(ps),  # type: ignore[arg-type]
                process_group=self.mesh.dense_dp.get_group(),
            )
        return factory(params)

    # ------------------------------------------------------------------ introspection

    @property
    def stage_indices(self) -> tuple[int, ...]:
        return tuple(stage.stage_idx for stage in self._stages)

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """This rank's stage modules (parameter names: `original_fqn` maps them to the model's)."""
        return tuple(stage.module for stage in self._stages)

    @property
    def wrappers(self) -> tuple[nn.Module, ...]:
        """This rank's stage modules as data parallelism wraps them (a `DistributedDataParallel`,
        or the module FSDP2 sharded in place)."""
        return tuple(stage.wrapped for stage in self._stages)

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return tuple(stage.optimizer for stage in self._stages)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's own names (tied copies under their own)."""
        seen: set[int] = set()
        for stage in self._stages:
            for fqn, param in stage.module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield original_fqn(fqn), param

    # ------------------------------------------------------------------ training

    def _data_parallel_slice(self, batch: torch.Tensor, what: str) -> torch.Tensor:
        groups = self.replicas.count if self.replicas is not None else 1
        if batch.size(0) != self.plan.global_batch_size * groups:
            raise ValueError(
                f"train_step got {what} with {batch.size(0)} sequences; the plan's global batch "
                f"is {self.plan.global_batch_size} (micro_batch_size {self.plan.micro_batch_size}"
                f" x num_micro_batches {self.plan.num_micro_batches} x dp_degree "
                f"{self.plan.dp_degree})"
                + (f" x {groups} replica groups" if groups > 1 else "")
                + "; pass the whole global batch on every rank"
            )
        start = self.mesh.dp_rank * self._local_batch
        if self.replicas is not None:
            start += self.replicas.index * self.plan.global_batch_size
        return batch[start : start + self._local_batch].to(self.device)

    @property
    def on_nan(self) -> OnNaN:
        """What a non-finite loss or gradient does: "stop" (`NonFiniteError` on every rank) or
        "skip" (no optimizer step on any rank; the step counts, `skipped_steps` records it)."""
        return self._on_nan

    @on_nan.setter
    def on_nan(self, value: OnNaN) -> None:
        if value not in ON_NAN_CHOICES:
            raise PlanError(f"on_nan={value!r}: use 'stop' (the default) or 'skip'")
        self._on_nan = value

    def request_stop(self) -> None:
        """Ask every rank to stop: the next `train_step`'s all-reduce carries the request and
        sets `stop_requested` on every rank. Only sets a flag: safe in a signal handler."""
        self._stop_here = True

    @property
    def stop_requested(self) -> bool:
        """True on every rank once a `train_step`'s all-reduce saw any rank's `request_stop`."""
        return self._stop_agreed

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the global batch; returns its mean loss (same on all ranks).

        A non-finite loss or gradient on any rank is seen by every rank before any optimizer
        steps (one all-reduce of a flag): with ``on_nan="stop"`` every rank raises the same
        `NonFiniteError` (``step`` unchanged); with ``"skip"`` no rank steps its optimizer,
        the gradients are dropped, ``step`` advances and `skipped_steps` records it.

        If this rank fails mid-step, the process groups are torn down before the error
        propagates: the other ranks, blocked in a collective with it, fail at once ("connection
        closed by peer") instead of waiting for the process-group timeout. The job cannot
        continue anyway: the ranks no longer agree on the sequence of collectives. A rank whose
        collective fails because another rank crashed first (it recorded its error in the job's
        store) raises a `CrashedRankError` that names it; one whose collective waited for the
        process-group timeout because other ranks stopped making progress, a `StalledRankError`.
        """
        # Checked before the first collective: a bad batch raises on every rank, harmlessly.
        local_inputs = self._data_parallel_slice(inputs, "inputs")
        local_targets = self._data_parallel_slice(targets, "targets")
        if self.context is not None:
            # this cp rank's tokens of every sequence (load-balanced chunks r and 2cp-1-r)
            local_inputs = self.context.shard(local_inputs)
            local_targets = self.context.shard(local_targets)
        step = self.step + 1
        self._progress.started(step)
        started = time.perf_counter()
        try:
            loss, verdict = self._train_step(local_inputs, local_targets)
        except BaseException as error:
            reported = self._failed(error)
            if reported is None:
                raise
            raise reported from error
        self._stop_agreed = self._stop_agreed or verdict.stop
        if not verdict.finite:
            if self.on_nan == "stop":
                raise NonFiniteError(
                    f"{verdict.what} at step {step} {verdict.where}: no optimizer step taken; "
                    "lower the learning rate, or skip such steps (on_nan='skip', --on-nan "
                    "skip), and resume from the last good checkpoint"
                )
            self.skipped_steps.append(step)
            log_rank0(
                logger,
                logging.WARNING,
                "skipped step %d: %s %s; no optimizer step, gradients dropped (on_nan='skip'; "
                "%d skipped so far)",
                step,
                verdict.what,
                verdict.where,
                len(self.skipped_steps),
            )
        assert loss is not None
        self.step = self.replicas.step if self.replicas is not None else step
        self.step_times_s.append(time.perf_counter() - started)
        return loss

    def _failed(self, error: BaseException) -> Exception | None:
        """This rank failed mid-step: record it, tear the process groups down, and return the
        error naming the peer that crashed or stalled if that is what it was."""
        reported = self._progress.explain(error) if isinstance(error, Exception) else None
        if isinstance(reported, CrashedRankError):
            # the crashed rank reports its own error; this rank only follows it down
            logger.info("rank %d stops: %s", self.mesh.rank, reported)
        else:
            logger.error(
                "rank %d failed during train_step%s; tearing down the process groups so the "
                "other ranks stop too",
                self.mesh.rank,
                f" ({reported})" if reported else "",
            )
        if dist.is_initialized():
            dist.destroy_process_group()
        return reported

    def _train_step(
        self, local_inputs: torch.Tensor, local_targets: torch.Tensor
    ) -> tuple[torch.Tensor | None, _StepVerdict]:
        """Forward, backward, the verdict on the gradients, and the optimizer step unless the
        verdict says no; returns the reduced loss (None when the step stops on a non-finite
        value: every rank skips the loss's all-reduce alike) and the verdict."""
        for stage in self._stages:
            stage.optimizer.zero_grad(set_to_none=True)
        if self.replicas is not None:
            self.replicas.start_step()
        losses: list[torch.Tensor] = []
        schedule = self.pipeline.schedule
        first, last = self.pipeline.is_first, self.pipeline.is_last
        if first and last:
            schedule.step(local_inputs, target=local_targets, losses=losses, return_outputs=False)
        elif first:
            schedule.step(local_inputs, return_outputs=False)
        elif last:
            schedule.step(target=local_targets, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        for finish in self._after_backward:
            finish()
        self._align_gradients()
        self.tied_sync()
        grads = self._local_gradients()
        loss_flag = self._nonfinite_loss(losses)
        if self.replicas is not None:
            # The flag rides with the gradients: every replica group then sees every group's
            # loss verdict (and the same averaged gradients), so all groups decide alike.
            self.replicas.average([*grads, loss_flag])
        verdict = self._agree(loss_flag, grads)
        if self.replicas is not None and not self.replicas.commit():
            # a group failed mid-step: nobody steps (the verdict on this step does not count)
            return self._reduce_loss(losses), dataclasses.replace(
                verdict, loss_rank=None, grad_rank=None
            )
        if not verdict.finite:
            if self.on_nan == "stop":
                return None, verdict
            for stage in self._stages:
                stage.optimizer.zero_grad(set_to_none=True)
            return self._reduce_loss(losses), verdict
        for stage in self._stages:
            stage.optimizer.step()
        for finish in self._after_step:
            finish()
        return self._reduce_loss(losses), verdict

    def _nonfinite_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """1.0 if a loss of this rank's micro-batches is NaN or inf, else 0.0 (shape (1,))."""
        if not losses:  # not the last pipeline stage
            return torch.zeros(1, dtype=torch.float32, device=self.device)
        local = torch.stack([_local(loss).detach().float() for loss in losses])
        return (~torch.isfinite(local)).any().float().reshape(1)

    @torch.no_grad()
    def _agree(self, loss_flag: torch.Tensor, grads: list[torch.Tensor]) -> _StepVerdict:
        """Every rank's verdict on this step, from ONE all-reduce (MAX) of three integers over
        the default group: the stop request, and for a non-finite loss and a non-finite
        gradient the lowest rank that saw it (as world - rank, so the maximum is the lowest).
        The idea is Megatron-LM's ``--check-for-nan-in-loss-and-grad`` (on by default there,
        ``--no-check-for-nan-in-loss-and-grad`` turns it off), which stops the run on a NaN loss
        or gradient norm; here every rank learns the verdict, and ``on_nan="skip"`` may skip."""
        rank, world = dist.get_rank(), dist.get_world_size()
        mark = world - rank
        grad_bad = _nonfinite(grads) if grads else torch.zeros((), dtype=torch.bool)
        grad_bad = grad_bad.to(self.device)
        flags = torch.stack(
            [
                torch.tensor(int(self._stop_here), dtype=torch.int64, device=self.device),
                (loss_flag[0] > 0).to(torch.int64) * mark,
                grad_bad.to(torch.int64) * mark,
            ]
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, loss_code, grad_code = (int(value) for value in flags.tolist())
        return _StepVerdict(
            loss_rank=world - loss_code if loss_code else None,
            grad_rank=world - grad_code if grad_code else None,
            stop=bool(stop),
            world_size=world,
        )

    def _local_gradients(self) -> list[torch.Tensor]:
        """Every local gradient once (a DTensor's local shard: the same shard on the same rank
        of every replica group), in parameter order."""
        grads: list[torch.Tensor] = []
        seen: set[int] = set()
        for stage in self._stages:
            for param in stage.module.parameters():
                if param.grad is None or id(param) in seen:
                    continue
                seen.add(id(param))
                grads.append(_local(param.grad))
        return grads

    @torch.no_grad()
    def _align_gradients(self) -> None:
        """Give every DTensor gradient its parameter's layout.

        DTensor's sharding propagation may leave a gradient ``Partial`` (norm weights under
        sequence parallelism: each rank saw part of the sequence) or ``Replicate`` (a
        vocab-parallel embedding fed a sequence-split gradient); redistributing reduces the
        partial sums once, here, and lets the optimizer and the tied-copy sum work shard-wise.
        """
        for stage in self._stages:
            for param in stage.module.parameters():
                grad = param.grad
                if (
                    isinstance(param, DTensor)
                    and isinstance(grad, DTensor)
                    and grad.placements != param.placements
                ):
                    param.grad = grad.redistribute(param.device_mesh, param.placements)

    def _reduce_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean over micro-batches on the last stage, over data-parallel replicas, to all ranks."""
        value = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.pipeline.is_last:
            local = torch.stack([_local(loss).detach().float() for loss in losses]).mean()
            # Every TP rank of a replica holds the same loss, each cp rank the mean over its
            # equal share of the tokens: weight each of the dp x cp x tp last-stage ranks so
            # that the world sum is the mean over replicas and sequence chunks.
            value = local / (self.plan.dp_degree * self.plan.cp_degree * self.plan.tp_degree)
        dist.all_reduce(value)
        return value

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{"model": ..., "optimizer": ...}`` under the model's names, for DCP save/load."""
        self.check_checkpointable()
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        for stage in self._stages:
            for key, value in get_model_state_dict(stage.wrapped, options=_OPTIONS).items():
                model_sd.setdefault(self._checkpoint_key(key), checkpoint_tensor(value))
            optim = get_optimizer_state_dict(stage.wrapped, stage.optimizer, options=_OPTIONS)
            for key, entry in optim.items():
                optim_sd.setdefault(self._checkpoint_key(key), entry)
        return {"model": model_sd, "optimizer": optim_sd}

    def _checkpoint_key(self, stage_key: str) -> str:
        """The plan-independent name of a stage state-dict entry.

        The model's own name (`original_fqn`); for a parameter several units or stages share
        (a head tied to the embedding, or its copy on a later stage), the name of its first
        use, so that one plan's checkpoint loads under another (one stage or several).
        """
        key = original_fqn(stage_key)
        for alias, canonical in self._aliases:
            for prefix in ("", "state.", "param_groups."):
                name = prefix + alias
                if key == name or key.startswith(name + "."):
                    return prefix + canonical + key[len(name) :]
        return key

    def load_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        """Load what `state_dict` returned (e.g. after ``dcp.load`` filled it in place), at any
        point of a step: the gradients computed so far are kept.

        Why they are set aside while loading: an optimizer that has not stepped yet has no state
        to load into, and torch's ``set_optimizer_state_dict`` creates it with a zero-gradient
        step only when no gradient is present; with gradients present it loads no optimizer
        state at all (Adam would restart its moments). A torchft replica group healing in the
        middle of a step meets exactly that.
        """
        for part in ("model", "optimizer"):
            if part not in state_dict:
                raise ValueError(
                    f"state dict has keys {sorted(state_dict)}; expected 'model' and 'optimizer'"
                )
        params = [p for stage in self._stages for p in stage.module.parameters()]
        grads = [p.grad for p in params]
        for param in params:
            param.grad = None
        try:
            self._load_state_dict(state_dict)
        finally:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
        for finish in self._after_step:
            finish()  # what follows a step follows new weights (fp8 scales)

    def _load_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        self.check_checkpointable()
        loaded: set[str] = set()
        for stage in self._stages:
            own_model = get_model_state_dict(stage.wrapped, options=_OPTIONS)
            own_optim = get_optimizer_state_dict(stage.wrapped, stage.optimizer, options=_OPTIONS)
            set_model_state_dict(
                stage.wrapped,
                {k: state_dict["model"][self._checkpoint_key(k)] for k in own_model},
                options=_OPTIONS,
            )
            optim: dict[str, Any] = {}
            for key in own_optim:
                name = self._checkpoint_key(key)
                value = state_dict["optimizer"][name]
                # Two local stages holding copies of one tied parameter (the V placement puts
                # the embedding and the head on rank 0) get one saved entry. The optimizer
                # adopts the tensors it is given and updates them in place (Adam's moments and
                # step): each stage needs its own, or the second would update them twice.
                if name in loaded and isinstance(value, torch.Tensor):
                    value = value.clone()
                loaded.add(name)
                optim[key] = value
            set_optimizer_state_dict(stage.wrapped, stage.optimizer, optim, options=_OPTIONS)

    def check_checkpointable(self) -> None:
        """Raise `PlanError` if `state_dict` cannot save this plan's state (before training)."""
        problem = self.plan.checkpoint_problem()
        if problem is not None:
            raise PlanError(problem)
