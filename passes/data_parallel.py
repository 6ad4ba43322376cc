"""Data-parallel pass: replicate or shard a stage over the ``dp`` mesh axis, per the ZeRO stage.

Expects a `StageModule` after the tensor-parallel and recompute passes, the job's mesh, and the
plan's ``zero_stage``, ``dp_degree``, ``tp_degree`` and ``dtype``.

Guarantees (Rajbhandari et al. 2020 for the ZeRO stages), always with PyTorch's own wrappers:

- ZeRO-3: FSDP2 ``fully_shard(reshard_after_forward=True)`` on every unit, then on the stage:
  parameters, gradients and optimizer state sharded; parameters re-gathered for backward;
- ZeRO-2: ``fully_shard(reshard_after_forward=False)``: the same sharding at rest, but gathered
  parameters stay until backward (no second all-gather);
- HSDP (``dp_shard_degree``): ZeRO-1 (as ZeRO-2), 2 or 3 as above, on the 2-D (dp_replicate,
  dp_shard) mesh (`ParallelMesh.fsdp_mesh`): FSDP2 shards over the shard groups, gathers and
  reduce-scatters there, and all-reduces each gradient shard over the replicas;
- ZeRO-1: ``DistributedDataParallel`` plus ``ZeroRedundancyOptimizer`` (optimizer state sharded,
  gradients all-reduced) when `uses_ddp` (fp32, no TP, no PP); otherwise its nearest FSDP2
  equivalent, ZeRO-2, said so in the log;
- ZeRO-0: ``DistributedDataParallel`` (bucketed all-reduce overlapping backward: 15-20% faster
  than FSDP2's ``replicate`` on CPU/gloo, bench/runtime.py) when `uses_ddp`; otherwise
  ``replicate`` (FSDP2's replicated data parallelism: composes with DTensor and the pipeline
  schedules, and has a mixed-precision policy);
- nothing when ``dp_degree == 1`` and the plan trains in fp32; for bf16/fp16 plans FSDP2's
  ``MixedPrecisionPolicy`` carries out the plan's precision policy (`Plan.precision`,
  `cost_model.precision`), on a 1-rank mesh if need be: ``param_dtype`` the compute dtype (an
  fp8 recipe's is bf16, `compute_dtype`), ``reduce_dtype`` the gradient reduction dtype (fp32
  by default; FSDP2 also accumulates micro-batches' unsharded gradients in it), and the
  parameters themselves, which FSDP2 shards and the optimizer updates, in the master dtype:
  cast to bf16 here under ``master_dtype: bf16`` (so torch's AdamW keeps its moments in bf16:
  ``optimizer_state_dtype`` must equal ``master_dtype``, which `Plan.validate` checks). DDP and
  the unwrapped path run fp32 plans only (`cost_model.strategy.decide`), whose policy is fp32
  throughout. With ``fp8_all_gather`` torchao's weight wrapper (passes/fp8.py) makes FSDP2
  gather the converted weights in fp8.
Each block unit is its own FSDP/replicate group; the embedding, the head and any unit holding a
parameter shared with another unit (a tied embedding and head) belong to the stage-level group,
since FSDP2 manages a shared parameter in exactly one group. After the pass
every parameter of the stage is managed (checked).

Context and expert parallelism (torchtitan's composition, torchtitan/models/llama4/infra/
parallelize.py ``apply_fsdp``): the dense weights are replicated or sharded over the flattened
dp x cp mesh (`ParallelMesh.dense_dp`: each cp rank's loss is the mean over its own tokens, so
cp ranks average like replicas; DDP then reduces over that group too). The routed experts
(`ExpertParallelExperts`, already sharded over ep) are wrapped first, on their own, over the
edp x cp mesh (`ParallelMesh.expert_dp`: the ranks holding the same experts). Their gradient
already sums every ep rank's tokens through the all-to-all backward, so it must be divided by
dp x cp, not by the edp x cp that FSDP averages over (Megatron-LM's
``expert_gradient_scaling_factor``; passes/expert_parallel.py): an all-reduce hook
(``set_all_reduce_hook``, run on the reduced shard on every backend) divides it by ep. Folded
expert parallelism (``ep_folding``) is the same with its own groups: the experts' data-parallel
mesh is the dp x cp x tp / ep ranks at one ep position, so the hook divides by ep / tp, and
with no dense replicas (dp x cp = 1, no wrapper) `ExpertGradientReduce` sums the experts over
those ranks if there are several. Expert tensor parallelism below tp (1 < etp < tp) is the same
again on the expert mesh (`ParallelMesh.experts_apart`): the expert-data group is the
dp x cp x tp / (ep x etp) ranks at one ep and etp place, the hook divides by ep x etp / tp.
torchtitan uses ``set_gradient_divide_factor`` instead, whose ``PREMUL_SUM`` gloo lacks, and
whose sum-only fallback divides twice on a one-rank mesh (torch 2.13). DDP reduces every
parameter over one group: under expert parallelism it is told to ignore the expert weights
(``_set_params_and_buffers_to_ignore_for_model``; under context parallelism the buffers too,
which DDP would otherwise overwrite with rank 0's RoPE rows), and `ExpertGradientReduce` (the
result's ``finish``, called by the runtime after every backward) all-reduces them over
edp x cp and divides by dp x cp, as passes/expert_parallel.py's ``reduce_gradients``. Either way the
wrapper is the plan's decision (`cost_model.strategy.decide`), which the cost model prices.

A wrapped module never returns a view that requires grad: FSDP2 hooks its outputs for the
backward all-gather, and an in-place op on a view would drop that hook (FSDP2 warns). Views
come from DTensor's ``to_local`` (the vocab head's replicated logits under tensor parallelism);
such an output is cloned by a forward hook that runs before FSDP2's own (one copy of the
logits; every other output passes through untouched).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map_only

from autoplan.contract.plan import Plan
from cost_model.strategy import DataParallelWrapper
from passes._log import log_rank0
from passes.expert_parallel import ExpertParallelExperts, all_reduce_gradients
from passes.mesh import ParallelMesh
from passes.split import StageModule

__all__ = [
    "DataParallelKind",
    "DataParallelResult",
    "ExpertGradientReduce",
    "apply_data_parallel",
    "torch_dtype",
    "uses_ddp",
]

logger = logging.getLogger(__name__)

DataParallelKind = DataParallelWrapper

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class DataParallelResult:
    """The stage's data-parallel wrapper: what the pipeline stage and optimizer must use."""

    stage_idx: int
    kind: DataParallelKind
    module: nn.Module  # the stage module, or its DDP wrapper
    zero_stage: int  # the ZeRO stage actually run (ZeRO-1 with TP runs as 2)
    num_groups: int  # FSDP/replicate parameter groups (units wrapped + the stage)
    # what must run after every backward (DDP under expert parallelism: the expert gradients)
    finish: ExpertGradientReduce | None = None


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ExpertGradientReduce:
    """The expert gradients DDP leaves alone: all-reduce over the ranks holding the same
    experts (``group``; None: no other rank does), divide by the dense data-parallel size."""

    params: tuple[nn.Parameter, ...]
    group: dist.ProcessGroup | None
    divisor: int

    def __call__(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        all_reduce_gradients(grads, self.group, divisor=self.divisor)


def apply_data_parallel(stage: StageModule, mesh: ParallelMesh, plan: Plan) -> DataParallelResult:
    """Wrap ``stage`` for data parallelism in place (DDP returns a new wrapper module)."""
    decisions = plan.decisions  # what the cost model prices
    wrapper = decisions.dp_wrapper
    if wrapper == "none":
        # no dense replicas (dp x cp = 1); a folded ep group over tp ranks may still leave
        # several ranks holding the same experts, each with its own tokens' share
        expert_dp = mesh.expert_dp
        experts = _expert_modules(stage.module) if mesh.experts_apart else []
        return DataParallelResult(
            stage_idx=stage.stage_idx,
            kind="none",
            module=stage.module,
            zero_stage=0,
            num_groups=0,
            finish=ExpertGradientReduce(
                params=tuple(p for _, sub in experts for p in sub.parameters()),
                group=expert_dp.get_group(),
                divisor=mesh.dense_dp.size(),
            )
            if experts and expert_dp.size() > 1
            else None,
        )
    zero = decisions.zero_stage
    if zero != plan.zero_stage:
        log_rank0(
            logger,
            logging.INFO,
            "zero_stage 1 runs as DDP + ZeroRedundancyOptimizer only in fp32 without tensor or "
            "pipeline parallelism (here dtype %s, tp_degree %d, pp_degree %d): running FSDP2 "
            "without resharding after forward (ZeRO-2), its nearest equivalent",
            plan.dtype,
            plan.tp_degree,
            plan.pp_degree,
        )
    if wrapper == "ddp":
        finish = None
        ignored: list[str] = []
        if mesh.cp_degree > 1:
            # DDP broadcasts rank 0's buffers when built: each cp rank's RoPE rows are its own
            ignored += [name for name, _ in stage.module.named_buffers()]
        if mesh.experts_apart:
            experts = _expert_modules(stage.module)
            ignored += [
                f"{path}.{name}" for path, sub in experts for name, _ in sub.named_parameters()
            ]
            expert_dp = mesh.expert_dp
            finish = ExpertGradientReduce(
                params=tuple(p for _, sub in experts for p in sub.parameters()),
                group=expert_dp.get_group() if expert_dp.size() > 1 else None,
                divisor=mesh.dense_dp.size(),
            )
        if ignored:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # type: ignore[no-untyped-call]
                stage.module, ignored
            )
        ddp = DistributedDataParallel(
            stage.module,
            process_group=mesh.dense_dp.get_group(),
            forward_sync_buffers=False,  # buffers are equal on every rank (seeded init)
        )
        return DataParallelResult(
            stage_idx=stage.stage_idx,
            kind="ddp",
            module=ddp,
            zero_stage=zero,
            num_groups=1,
            finish=finish,
        )

    # dense_dp, or under HSDP the 2-D (replicate, shard) mesh: FSDP2 then shards within the
    # shard groups and all-reduces each gradient shard over the replicas
    dp_mesh = mesh.fsdp_mesh
    mp = _mixed_precision(plan)
    _to_master_dtype(stage.module, torch_dtype(plan.precision.master))
    shared_ids = _shared_param_ids(stage.module)
    groups = 0
    if mesh.experts_apart:
        # FSDP2 averages over the expert_dp ranks; the experts' gradient wants the sum over
        # them divided by dp x cp (module doc): divide the average by dp x cp / expert_dp (ep,
        # or ep x etp / tp when the expert-data group spans tp ranks: folded, or etp < tp)
        divisor = mesh.dense_dp.size() / mesh.expert_dp.size()
        for _, expert_module in _expert_modules(stage.module):
            _wrap(expert_module, mesh.expert_dp, zero, mp)
            assert isinstance(expert_module, FSDPModule)
            expert_module.set_all_reduce_hook(functools.partial(_divide, divisor=divisor))
            groups += 1
    for unit in stage.units:
        module = stage.unit_module(unit)
        # One group per block (torchtitan's grouping): its parameters are gathered just before
        # it runs and freed after. The embedding and head join the stage-level group, as do
        # parameters shared between units (FSDP2 manages a shared parameter in one group).
        if unit.profile.kind != "block" or not any(True for _ in module.parameters()):
            continue
        if any(id(p) in shared_ids for p in module.parameters()):
            continue
        _wrap(module, dp_mesh, zero, mp)
        groups += 1
    _wrap(stage.module, dp_mesh, zero, mp)
    groups += 1
    _check(stage)
    return DataParallelResult(
        stage_idx=stage.stage_idx,
        kind=wrapper,
        module=stage.module,
        zero_stage=zero,
        num_groups=groups,
    )


def _mixed_precision(plan: Plan) -> MixedPrecisionPolicy:
    """FSDP2's policy for the plan's precision policy (module doc): the compute dtype of the
    gathered weights (an fp8 recipe computes in bf16: only its converted GEMMs take fp8
    inputs, passes/fp8.py) and the gradient reduction dtype; none for fp32 training."""
    policy = plan.precision
    if policy.compute == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(policy.compute), reduce_dtype=torch_dtype(policy.grad_reduce)
    )


def _to_master_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """``module``'s floating-point parameters in ``dtype`` (the master weights': FSDP2 shards
    them, the optimizer updates them), before FSDP2 wraps them; buffers (RoPE tables) keep
    theirs, and a parameter held twice stays one parameter."""
    cast: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(
                    param.detach().to(dtype), requires_grad=param.requires_grad
                )
            sub._parameters[name] = cast[id(param)]


def uses_ddp(plan: Plan) -> bool:
    """Whether the plan's data parallelism is DDP (`Plan.decisions`: the cost model
    prices the same rule). DDP needs real parameters (it broadcasts them when it is
    built): a meta model is materialised before this pass, at no cost in memory, since DDP
    shards no parameters."""
    return plan.decisions.dp_wrapper == "ddp"


def _wrap(module: nn.Module, dp_mesh: DeviceMesh, zero: int, mp: MixedPrecisionPolicy) -> None:
    # Registered first, so it runs before the wrapper's post-forward hook sees the outputs.
    module.register_forward_hook(_own_outputs)
    if zero >= 2:
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=mp)
    else:
        replicate(module, mesh=dp_mesh, mp_policy=mp)


def _expert_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (path, sub)
        for path, sub in module.named_modules()
        if isinstance(sub, ExpertParallelExperts)
    ]


def _divide(reduced: torch.Tensor, *, divisor: float) -> None:
    """FSDP2's all-reduce hook on the experts: their average over the expert-data ranks,
    divided by dp x cp / their number, is their sum over dp x cp (module doc)."""
    if divisor != 1:
        reduced.div_(divisor)


def _own_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """``output`` with every view that requires grad replaced by a copy (see the module doc)."""

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t._base is not None and t.requires_grad else t

    return tree_map_only(torch.Tensor, own, output)


def _shared_param_ids(module: nn.Module) -> set[int]:
    counts: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    return {key for key, count in counts.items() if count > 1}


def _check(stage: StageModule) -> None:
    assert isinstance(stage.module, FSDPModule), "the stage module was not wrapped"
    unmanaged = [name for name, p in stage.module.named_parameters() if not isinstance(p, DTensor)]
    assert not unmanaged, f"parameters outside any data-parallel group: {unmanaged[:5]}"
