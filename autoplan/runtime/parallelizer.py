"""`autoplan.parallelize`: compile a model and a `Plan` into this rank's `DistributedModel`.

Call it on every rank of a torchrun job (or of any job whose default process group is set up).
Expects an ``nn.Module`` built on the meta device (the zoo's default) or on a real device with
the same weights on every rank, a ``loss_fn(logits, targets)`` with mean reduction and an
optimizer factory such as ``functools.partial(torch.optim.AdamW, lr=1e-3)``.

Guarantees:

- every rank holds the same plan: an all-gather of the plans' digests is the first collective,
  and ranks that differ fail together (`PlanError`); the process group this call creates has a
  finite timeout (`DEFAULT_TIMEOUT_S`), so a collective waiting on a lost peer fails;
- the plan is checked against the job before any other collective: a plan for another world size,
  for another model (fingerprint), with a TP degree that does not divide the heads, or with TP
  on layers DTensor cannot shard (GPT-2's fused Conv1D; sequence parallelism on a graph from
  torch.export) raises `PlanError` on every rank, so nothing hangs; a searched plan avoids them;
- without a plan, global rank 0 searches one for the running job (``Cluster.local`` with the
  torchrun world: ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes) and broadcasts it: every rank runs the
  same plan;
- the passes run in order, each checking its own result: split into stages and units ->
  tensor parallel -> context parallel (cp > 1) -> expert parallel (ep > 1, or etp > 1:
  each expert split over etp ranks of a TP group, `passes.ExpertTensorParallel`) -> activation
  recompute -> data parallel -> materialise -> pipeline; a plan with ``tp_comm_overlap`` runs
  torch's async TP (`passes.async_tp`, CUDA and NCCL only: refused elsewhere on every rank
  before anything is built); a plan with ``optimizer_offload`` steps that share of each
  optimizer on host copies (`passes.optimizer_offload`, wrapped around ``optimizer``);
- a meta model is materialised shard by shard (`passes.materialize`): no rank ever holds it
  whole; a real model's weights are used as they are.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import HashStore, PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from autoplan._format import fmt_time_range
from autoplan.contract.errors import InputError, PlanError
from autoplan.contract.graph import ModelGraph
from autoplan.contract.plan import Plan, runtime_refusal
from autoplan.planner.search import SearchResult, search_plans
from autoplan.runtime import rank_failures
from autoplan.tracing import trace
from cost_model.degrees import is_whole
from cost_model.estimate import estimate
from cost_model.frameworks import DEFAULT_FRAMEWORK
from cost_model.hardware import Cluster, as_cluster
from cost_model.headroom import check_memory_headroom
from cost_model.messages import shown
from cost_model.results import Estimate
from passes import (
    ContextParallelResult,
    DistributedModel,
    ExpertTensorParallel,
    Fp8ScalePrecompute,
    Fp8Selection,
    ParallelMesh,
    ReplicatedGradientSum,
    SplitModel,
    TensorParallelResult,
    announce_rank0,
    apply_compile,
    apply_context_parallel,
    apply_data_parallel,
    apply_expert_parallel,
    apply_recompute,
    apply_tensor_parallel,
    async_tp_refusal,
    build_mesh,
    build_pipeline,
    convert_to_fp8,
    enable_async_tp,
    find_grouped_experts,
    has_meta_tensors,
    materialize,
    meta_buffer_values,
    norm_parameter_names,
    retarget_devices,
    select_fp8_linears,
    split_stages,
    torchao_float8,
    uses_ddp,
)
from passes.offload import apply_activation_offload
from passes.progress import RankFailures
from passes.runtime import ON_NAN_CHOICES, OnNaN, OptimizerFactory
from passes.split import StageModule

__all__ = ["parallelize"]

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

DEFAULT_OPTIMIZER: OptimizerFactory = functools.partial(torch.optim.AdamW, lr=1e-3)

# The process-group timeout when parallelize creates the group: torchtitan's default for the
# first collectives (comm.init_timeout_seconds = 300); long enough for a first step that
# compiles or loads, short enough that a lost peer ends the job in minutes, not gloo's 30.
DEFAULT_TIMEOUT_S = 300.0


def parallelize(
    model: nn.Module,
    cluster: Cluster | str | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    *,
    loss_fn: LossFn,
    optimizer: OptimizerFactory = DEFAULT_OPTIMIZER,
    global_batch_size: int | None = None,
    search_constraints: Mapping[str, Any] | None = None,
    graph: ModelGraph | None = None,
    seed: int = 0,
    timeout_s: float | None = None,
    check_memory: bool = True,
    on_nan: OnNaN = "stop",
    memory_headroom: float | None = None,
) -> DistributedModel:
    """Build this rank's part of ``model`` for ``plan`` (a `Plan`, or a plan file's path that
    every rank loads; searched when None); see the module doc. Rank 0 logs the plan in one line
    (`passes.announce_rank0`: shown where the program configured no logging too).

    ``global_batch_size`` is needed only to search a plan, and ``search_constraints`` (keywords
    of ``autoplan.search``, e.g. ``{"pp": 1}``) narrow that search; on CPU it defaults to fp32
    plans. ``graph`` is ``autoplan.trace(model)``
    if you already have it. ``seed`` seeds the initialisation of a meta model. ``timeout_s``
    sets the process-group timeout when this call creates the process group (default
    `DEFAULT_TIMEOUT_S`); every rank must pass the same plan (checked: `PlanError` on all). A
    plan whose predicted peak memory exceeds the device's fails on every rank before any
    allocation (`MemoryCapacityError`, `Estimate.require_fits`); ``check_memory=False`` runs it
    anyway with a warning. ``memory_headroom``: the share of each device the plan must leave
    free beyond the upper end of its peak's range (`cost_model.headroom`; None: the plan's
    recorded one, else the default; a searched plan is searched with it). ``on_nan``: what a
    non-finite loss or gradient does in `DistributedModel.train_step` ("stop":
    `NonFiniteError` on every rank; "skip": the step is skipped on every rank).

    Once the process group exists, an exception that ends any rank of the job is reported once,
    by the lowest failing rank, before the launcher tears the job down
    (`autoplan.runtime.rank_failures`); a rank whose collective fails because another rank
    crashed raises `CrashedRankError` naming it.
    """
    failures: RankFailures | None = None
    plan_path: str | None = None
    try:
        if isinstance(plan, (str, os.PathLike)):
            plan_path = os.fspath(plan)
            plan = Plan.from_yaml(plan_path)  # a bad file: one line, alike on every rank
        _check_arguments(model, plan, loss_fn, optimizer, global_batch_size, on_nan)
        if memory_headroom is not None:
            check_memory_headroom(memory_headroom)  # on every rank, before any process group
        world_size, local_world = _job_shape()
        device = _device()
        created = _init_process_group(device, timeout_s)
        failures = _report_failures()
        return _parallelize(
            model,
            cluster,
            plan,
            loss_fn=loss_fn,
            optimizer=optimizer,
            global_batch_size=global_batch_size,
            search_constraints=search_constraints,
            graph=graph,
            seed=seed,
            timeout_s=timeout_s,
            check_memory=check_memory,
            on_nan=on_nan,
            memory_headroom=memory_headroom,
            plan_path=plan_path,
            job=_Job(
                world_size=world_size,
                local_world=local_world,
                device=device,
                created=created,
                failures=failures,
            ),
        )
    except InputError:
        if failures is None:
            rank_failures.one_line_without_store()
        raise
    except Exception as error:
        # a collective that failed because another rank had failed: name it
        if failures is None:
            raise
        crashed = failures.crashed(error)
        if crashed is None:
            raise
        failures.record(crashed, primary=False)
        raise crashed from error


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    """What `parallelize` learnt of the job before building anything."""

    world_size: int
    local_world: int  # processes per node
    device: torch.device
    created: bool  # parallelize created the default process group
    failures: RankFailures


def _report_failures() -> RankFailures:
    """This rank's failure records in the job's store; under torchrun, or in any job of more
    than one process, the excepthook that reports a failure once (`rank_failures`)."""
    failures = RankFailures(dist.get_rank(), dist.get_world_size())
    if "TORCHELASTIC_RUN_ID" in os.environ or dist.get_world_size() > 1:
        rank_failures.install(failures)
    return failures


def _parallelize(
    model: nn.Module,
    cluster: Cluster | str | None,
    plan: Plan | None,
    *,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    global_batch_size: int | None,
    search_constraints: Mapping[str, Any] | None,
    graph: ModelGraph | None,
    seed: int,
    timeout_s: float | None,
    check_memory: bool,
    on_nan: OnNaN,
    memory_headroom: float | None,
    plan_path: str | None,
    job: _Job,
) -> DistributedModel:
    device = job.device
    chosen = _choose_plan(
        model,
        cluster,
        plan,
        global_batch_size=global_batch_size,
        search_constraints=search_constraints,
        graph=graph,
        check_memory=check_memory,
        memory_headroom=memory_headroom,
        job=job,
    )
    plan, graph = chosen.plan, chosen.graph
    if plan.tp_comm_overlap and (why := async_tp_refusal(device, dist.get_backend())) is not None:
        raise PlanError(why)  # alike on every rank, before anything is built
    # one line on rank 0, shown where logging is not configured too (`passes.announce_rank0`)
    announce_rank0(logger, "autoplan: %s", _chosen_line(chosen, plan_path))

    mesh = build_mesh(plan, device.type)
    if plan.tp_comm_overlap:
        # before the blocks' first forward, when inductor compiles them (`passes.async_tp`)
        enable_async_tp(mesh.sub("tp").get_group().group_name)
    meta = has_meta_tensors([model])
    buffers = meta_buffer_values(model) if meta else {}
    norms = norm_parameter_names(model) if meta else None
    local = plan.stages_of_pipeline_rank(mesh.pp_rank)
    split = split_stages(graph, plan, stage_indices=local)
    retarget_devices(split, device)
    if not meta:
        for stage in split.stages:
            stage.module.to(device)
    context, tp_results = _shard_stages(split, plan, graph, mesh, device, chosen.fp8)
    if context is not None and meta:
        buffers = context.shard_buffer_values(buffers)  # the RoPE rows of this cp rank
    num_blocks = sum(unit.kind == "block" for unit in graph.profile.units)
    if meta and uses_ddp(plan):
        # DDP broadcasts real parameters when built; it shards none, so this costs no memory.
        materialize(split, device, seed=seed, num_blocks=num_blocks, buffers=buffers, norms=norms)
    wrapped, finish = _wrap_data_parallel(split, plan, mesh, tp_results)
    if meta and not uses_ddp(plan):
        materialize(split, device, seed=seed, num_blocks=num_blocks, buffers=buffers, norms=norms)
    pipeline = build_pipeline([wrapped[idx] for idx in local], local, plan, mesh, loss_fn, device)
    after_step = (
        (Fp8ScalePrecompute([stage.module for stage in split.stages]),)
        if chosen.fp8 is not None and chosen.fp8.all_gather
        else ()
    )
    distributed = DistributedModel(
        context=context,
        after_backward=tuple(finish),
        after_step=after_step,
        plan=plan,
        mesh=mesh,
        split=split,
        wrapped=wrapped,
        pipeline=pipeline,
        optimizer=optimizer,
        device=device,
        timeout_s=(timeout_s or DEFAULT_TIMEOUT_S) if job.created else None,
        fingerprint=graph.profile.fingerprint,
        search_time_s=chosen.search_time_s,
        on_nan=on_nan,
        failures=job.failures,
    )
    # what the cost model predicts for this plan on the job's cluster (`autoplan.runtime.
    # step_timing` compares it with the measured steps)
    distributed.predicted_step_s = chosen.predicted.step_time_s
    distributed.predicted_step_range_s = chosen.predicted.step_time_range_s
    return distributed


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _ChosenPlan:
    """The plan every rank runs, checked against the job, and what choosing it gave."""

    plan: Plan
    graph: ModelGraph  # traced at the plan's micro-batch size where the front end needs it
    predicted: Estimate  # the plan's estimate on the job's cluster
    search_time_s: float | None  # None: the plan was given
    # the search's unproven gap (`SearchStats.optimality_gap`; 0: proven; None: given)
    optimality_gap: float | None
    fp8: Fp8Selection | None  # the linears an fp8 plan converts (None: not an fp8 plan)


def _choose_plan(
    model: nn.Module,
    cluster: Cluster | str | None,
    plan: Plan | None,
    *,
    global_batch_size: int | None,
    search_constraints: Mapping[str, Any] | None,
    graph: ModelGraph | None,
    check_memory: bool,
    memory_headroom: float | None,
    job: _Job,
) -> _ChosenPlan:
    """The given plan, or the one rank 0 searches, checked alike on every rank before launch."""
    _agree_on_plan(plan, job.device)  # the first collective: nothing below can hang on a mismatch
    if memory_headroom is not None:  # the plan is checked, or searched, with it
        search_constraints = {**(search_constraints or {}), "memory_headroom": memory_headroom}
        if plan is not None:
            plan = dataclasses.replace(plan, memory_headroom=memory_headroom)
    if graph is None:
        graph = _trace(model, plan)
    if cluster is None:
        cluster = _job_cluster(job.world_size, job.local_world)
    else:
        cluster = as_cluster(cluster)
    if plan is not None:
        checked = _check_before_launch(plan, model, graph, cluster, job.world_size, check_memory)
        return _ChosenPlan(
            plan=plan,
            graph=graph,
            predicted=checked.predicted,
            search_time_s=None,
            optimality_gap=None,
            fp8=checked.fp8,
        )
    return _search_for_job(
        model, graph, cluster, global_batch_size, search_constraints, check_memory, job
    )


def _search_for_job(
    model: nn.Module,
    graph: ModelGraph,
    cluster: Cluster,
    global_batch_size: int | None,
    search_constraints: Mapping[str, Any] | None,
    check_memory: bool,
    job: _Job,
) -> _ChosenPlan:
    """A plan searched on rank 0 for this job's devices and model, checked on every rank."""
    started = time.perf_counter()
    constraints = dict(search_constraints or {})
    if job.device.type == "cpu":
        constraints.setdefault("dtype", "fp32")  # CPUs train fp32; bf16 GEMMs crawl
    if _layers_tp_cannot_shard(model, graph):
        constraints.setdefault("tp", 1)
    # an exported graph's limits (fp32, no sequence or context parallelism) and a model
    # without RoPE tables (no context parallelism): the search keeps to them itself
    # (`runtime_refusal`)
    searched = _searched_plan(graph, cluster, global_batch_size, constraints)
    plan = searched.plan
    if graph.front_end == "export" and plan.micro_batch_size != graph.batch_size:
        graph = _trace(model, plan)  # an exported graph's shapes are fixed: re-trace
    # same plan, same verdict on every rank
    checked = _check_before_launch(plan, model, graph, cluster, job.world_size, check_memory)
    return _ChosenPlan(
        plan=plan,
        graph=graph,
        predicted=checked.predicted,
        search_time_s=time.perf_counter() - started,
        optimality_gap=searched.optimality_gap,
        fp8=checked.fp8,
    )


def _shard_stages(
    split: SplitModel,
    plan: Plan,
    graph: ModelGraph,
    mesh: ParallelMesh,
    device: torch.device,
    fp8: Fp8Selection | None,
) -> tuple[ContextParallelResult | None, dict[int, TensorParallelResult]]:
    """This rank's stages through fp8 conversion (an fp8 plan), tensor, context and expert
    parallelism and recompute (in that order, stage by stage); the context-parallel result
    (None without cp) and each stage's tensor-parallel result."""
    context: ContextParallelResult | None = None
    tp_results: dict[int, TensorParallelResult] = {}
    for stage in split.stages:
        if fp8 is not None:
            # before TP and FSDP2, which wrap the converted modules (passes/fp8.py)
            convert_to_fp8(stage, fp8)
        tp_results[stage.stage_idx] = apply_tensor_parallel(
            stage,
            mesh.sub("tp"),
            sequence_parallel=plan.sequence_parallel,
            shared=split.shared_in_stage.get(stage.stage_idx, ()),
            float8_tensorwise=fp8 is not None and fp8.tensorwise,
        )
        if plan.cp_degree > 1 and _has_attention(stage):
            # after TP: the ring passes the local heads' K/V
            context = apply_context_parallel(
                stage.module, mesh.sub("cp"), seq_len=graph.profile.seq_len
            )
        if (plan.ep_degree > 1 or plan.etp_degree > 1) and find_grouped_experts(stage.module):
            apply_expert_parallel(
                stage.module,
                mesh.sub("ep") if plan.ep_degree > 1 else None,
                etp=_expert_tensor_parallel(plan, mesh),
                device_type=device.type,
            )
        own = plan.stages[stage.stage_idx]
        apply_recompute(stage, own.recompute, plan.decisions.recompute, own.recompute_units)
        # the first blocks recompute does not cover, their saved activations on the host (CUDA:
        # the plan's host-link rule refuses it on a CPU worker before any pass runs)
        apply_activation_offload(stage, own.activation_offload, plan.decisions.recompute, device)
        # after recompute, before data parallelism (torchtitan's order)
        apply_compile(
            stage, plan.stage_compiled(stage.stage_idx), plan.decisions.compiled_unit_kinds
        )
    if context is None and plan.cp_degree > 1:
        # a stage without attention (an embedding or head alone) still gets its tokens split
        context = ContextParallelResult(
            cp_degree=plan.cp_degree,
            cp_rank=mesh.cp_rank,
            seq_len=graph.profile.seq_len,
            backend="ring",
            attention_sites=(),
            position_buffers=(),
        )
    return context, tp_results


def _expert_tensor_parallel(plan: Plan, mesh: ParallelMesh) -> ExpertTensorParallel | None:
    """How the routed experts split over the etp ranks (the TP group at etp = tp; below tp the
    expert mesh's etp axis, `ParallelMesh.sub`), None at etp 1. Under sequence parallelism
    each TP rank routes its own tokens."""
    if plan.etp_degree == 1:
        return None
    return ExpertTensorParallel(
        mesh=mesh.sub("etp"), weights=mesh.expert_weights, own_tokens=plan.sequence_parallel
    )


def _wrap_data_parallel(
    split: SplitModel,
    plan: Plan,
    mesh: ParallelMesh,
    tp_results: Mapping[int, TensorParallelResult],
) -> tuple[dict[int, nn.Module], list[Callable[[], None]]]:
    """Each stage wrapped for data parallelism, by stage index, and what runs after every
    backward (the wrappers' finishing steps, the tp sums of MoE layers on sequence shards)."""
    wrapped: dict[int, nn.Module] = {}
    finish: list[Callable[[], None]] = []
    for stage in split.stages:
        result = apply_data_parallel(stage, mesh, plan)
        wrapped[stage.stage_idx] = result.module
        if result.finish is not None:
            finish.append(result.finish)
        summed = _tp_summed_parameters(tp_results[stage.stage_idx], plan)
        if summed:
            # MoE layers on sequence shards: each TP rank's gradient holds its own tokens' share
            finish.append(
                ReplicatedGradientSum(
                    module=stage.module, names=summed, group=mesh.sub("tp").get_group()
                )
            )
    return wrapped, finish


def _tp_summed_parameters(result: TensorParallelResult, plan: Plan) -> tuple[str, ...]:
    """The parameters of MoE layers on sequence shards whose gradients sum over tp: router
    and shared expert, and the routed experts unless a folded ep group reduces them over the
    tp ranks already (`Plan.expert_data_group_ranks` spans tp then) or they are split over etp
    ranks (at etp = tp each rank's slice saw every token of the group; below tp the expert-data
    group holds the other expert-TP groups of the TP group, `ParallelMesh.expert_dp`)."""
    apart = (plan.ep_folding and plan.ep_degree > 1) or plan.etp_degree > 1
    return tuple(
        name
        for layer in result.moe_layers
        for name in layer.replicated_parameters + (() if apart else layer.expert_parameters)
    )


def _check_arguments(
    model: object,
    plan: object,
    loss_fn: object,
    optimizer: object,
    global_batch_size: object,
    on_nan: object,
) -> None:
    """Every rank refuses the same wrong argument before any collective (`PlanError`)."""
    if not isinstance(model, nn.Module):
        raise PlanError(f"model must be an nn.Module, got {type(model).__name__}")
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(
            f"plan must be a Plan, a plan file's path or None, got {type(plan).__name__}"
        )
    if not callable(loss_fn):
        raise PlanError(
            f"loss_fn must be a callable (logits, targets) -> loss, got {type(loss_fn).__name__}"
        )
    if not callable(optimizer):
        raise PlanError(
            "optimizer must be a callable that builds an optimizer from parameters (e.g. "
            f"functools.partial(torch.optim.AdamW, lr=1e-3)), got {type(optimizer).__name__}"
        )
    if global_batch_size is not None and not is_whole(global_batch_size):
        raise PlanError(f"global_batch_size={global_batch_size!r} must be a whole number >= 1")
    if on_nan not in ON_NAN_CHOICES:
        raise PlanError(f"on_nan={shown(on_nan)}: use 'stop' (the default) or 'skip'")


# ----------------------------------------------------------------------------- job


def _job_shape() -> tuple[int, int]:
    """World size and processes per node, before any collective."""
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _init_process_group(device: torch.device, timeout_s: float | None) -> bool:
    """The default process group, unless the caller made one (then False), with a finite
    timeout: a collective that waits longer than it for a peer fails (gloo and NCCL alike)
    instead of hanging for torch's default (30 minutes on gloo)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    if "MASTER_ADDR" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # A single process outside torchrun: a private in-memory store.
        dist.init_process_group(
            backend,
            store=HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
        )
        return True
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return True


def _attempt_store(timeout: datetime.timedelta) -> Store | None:
    """Under torchrun with the agent's store (torch's default), a store whose keys belong to this
    start of the job alone; None otherwise (``env://`` as usual).

    Why: the first node's agent hosts one TCPStore for the whole job (the c10d rendezvous's
    shared store) and the workers build their process group on it with no per-start prefix, so
    after a restart the group's keys still hold the dead workers' addresses: gloo connects to
    them ("connectFullMesh ... Connection refused") or waits; NCCL reads a stale unique id
    (pytorch#135712). ``TORCHELASTIC_RESTART_COUNT`` cannot name the start: each agent counts
    its own restarts. So the workers agree on a fresh name through the store itself
    (`_agree_on_attempt`). The agent's store is kept rather than torch's opt-out
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, a store hosted by worker rank 0): a stopped rank 0
    would freeze that store and every rank waiting on it.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout
    )
    attempt = _agree_on_attempt(client, rank, world, timeout)
    return PrefixStore(f"autoplan/attempt/{attempt}/", client)


_ATTEMPT = "autoplan/attempt"


def _agree_on_attempt(store: Store, rank: int, world: int, timeout: datetime.timedelta) -> str:
    """A name that every worker of this start of the job gets and no earlier start used.

    Rank 0 draws it at random. Every other rank asks for it under a nonce of its own (key
    ``ask/<rank>``, which an earlier start may have left with an old nonce) and waits for the
    answer under ``reply/<nonce>``, a key only this start can have written; rank 0 answers every
    nonce it sees, stale ones included (harmless), until all ``world - 1`` ranks have counted
    themselves in under the fresh name. The workers of a start begin only after the agents have
    stopped every worker of the previous one, so no stale rank asks again.
    """
    if world == 1:
        return uuid.uuid4().hex
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{_ATTEMPT}/ask/{rank}", nonce)
        attempt = bytes(store.get(f"{_ATTEMPT}/reply/{nonce}")).decode()  # waits for rank 0
        store.add(f"{_ATTEMPT}/{attempt}/joined", 1)
        return attempt
    attempt = uuid.uuid4().hex
    joined = f"{_ATTEMPT}/{attempt}/joined"
    answered: dict[int, str] = {}
    deadline = time.monotonic() + timeout.total_seconds()
    while int(store.add(joined, 0)) < world - 1:
        for other in range(1, world):
            key = f"{_ATTEMPT}/ask/{other}"
            if store.check([key]):
                nonce = bytes(store.get(key)).decode()
                if answered.get(other) != nonce:
                    store.set(f"{_ATTEMPT}/reply/{nonce}", attempt)
                    answered[other] = nonce
        if time.monotonic() > deadline:
            missing = world - 1 - int(store.add(joined, 0))
            raise TimeoutError(
                f"rank 0 waited {timeout.total_seconds():.0f} s for {missing} of the job's "
                f"{world} processes to join the process group's store; is every process running?"
            )
        time.sleep(0.01)
    return attempt


def _agree_on_plan(plan: Plan | None, device: torch.device) -> None:
    """Every rank holds the same plan (or every rank None, to search one): an all-gather of the
    plan digests, before any other collective, so ranks given different plans fail together
    with a `PlanError` instead of waiting in different collectives until the timeout."""
    world = dist.get_world_size()
    if world == 1:
        return
    mine = int(plan.digest(), 16) if plan is not None else 0
    local = torch.tensor([mine], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    digests = [int(value.item()) for value in gathered]
    if len(set(digests)) == 1:
        return
    holders: dict[int, list[int]] = {}
    for rank, digest in enumerate(digests):
        holders.setdefault(digest, []).append(rank)
    described = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: "
        + (f"plan {digest:015x}" if digest else "no plan")
        for digest, ranks in holders.items()
    )
    raise PlanError(
        f"the ranks hold different plans ({described}); pass the same plan to parallelize on "
        "every rank (e.g. Plan.from_yaml of one file), or plan=None on every rank for rank 0 "
        "to search one"
    )


def _job_cluster(world_size: int, local_world: int) -> Cluster:
    """The running job as a cluster: this machine's devices, one node per torchrun agent."""
    if world_size % local_world != 0:
        raise PlanError(
            f"WORLD_SIZE = {world_size} is not a multiple of LOCAL_WORLD_SIZE = {local_world}; "
            "autoplan needs the same number of processes on every node"
        )
    cluster = Cluster.local(num_devices=local_world)
    nodes = world_size // local_world
    return dataclasses.replace(cluster, num_nodes=nodes) if nodes > 1 else cluster


def _trace(model: nn.Module, plan: Plan | None) -> ModelGraph:
    # The micro-batch size: a graph from torch.export (Hugging Face models) has its shapes fixed.
    batch = plan.micro_batch_size if plan is not None else 1
    return trace(model, batch_size=batch)


def _check_plan(plan: Plan, graph: ModelGraph, cluster: Cluster, world_size: int) -> None:
    """Every check that needs no communication: raised identically on every rank."""
    if plan.num_devices != world_size:
        names, values = "dp x tp x pp", [plan.dp_degree, plan.tp_degree, plan.pp_degree]
        if plan.cp_degree > 1:
            names, values = names + " x cp", [*values, plan.cp_degree]
        raise PlanError(
            f"the plan needs {names} = {' x '.join(map(str, values))} = {plan.num_devices} "
            f"processes but the job has {world_size}; launch {plan.num_devices} processes or "
            f"make a plan for {world_size}"
        )
    plan.validate(graph, cluster)
    # what this runtime cannot run with this model, whatever stack the plan was priced for
    refusal = runtime_refusal(plan, graph.profile)
    if refusal is not None:
        raise PlanError(refusal)


def _has_attention(stage: StageModule) -> bool:
    return any(op.kind == "attention" for unit in stage.units for op in unit.profile.ops)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Checked:
    """What checking a plan against the job gave."""

    predicted: Estimate  # the plan's estimate on the job's cluster
    fp8: Fp8Selection | None  # the linears an fp8 plan converts


def _check_before_launch(
    plan: Plan,
    model: nn.Module,
    graph: ModelGraph,
    cluster: Cluster,
    world_size: int,
    check_memory: bool,
) -> _Checked:
    """Every check of ``plan`` that needs no communication, raised alike on every rank;
    returns the plan's estimate on ``cluster`` (as autoplan's runtime runs it) and, for an
    fp8 plan, the linears it converts (their shapes checked, torchao importable)."""
    _check_plan(plan, graph, cluster, world_size)
    _check_tensor_parallel(plan, model, graph)
    fp8 = select_fp8_linears(model, graph, plan)
    if fp8 is not None:
        torchao_float8()  # torchao missing: one line naming the extra, on every rank
    return _Checked(predicted=_check_memory(plan, graph, cluster, check_memory), fp8=fp8)


def _check_memory(plan: Plan, graph: ModelGraph, cluster: Cluster, check: bool) -> Estimate:
    """The memory check of `autoplan validate` and the search (`Estimate.require_fits`), from
    the plan alone: the same verdict on every rank, before anything is allocated. A plan
    priced for another training stack is checked as this runtime runs it."""
    if plan.framework != DEFAULT_FRAMEWORK:
        logger.warning(
            "the plan is priced for %s; autoplan's runtime runs it (and checks its memory) as "
            "its own (`autoplan export` launches it on %s)",
            plan.framework,
            plan.framework,
        )
        plan = dataclasses.replace(plan, framework=DEFAULT_FRAMEWORK, estimate=None)
    result = estimate(graph.profile, cluster, plan)
    if result.fits:
        return result
    if check:
        result.require_fits()
    logger.warning("check_memory=False, running anyway: %s", result.memory_problem())
    return result


def _layers_tp_cannot_shard(model: nn.Module, graph: ModelGraph) -> list[str]:
    """Layers of the traced TP structure that DTensor's styles cannot shard, with their types.

    ``ColwiseParallel``/``RowwiseParallel`` shard ``nn.Linear`` and ``nn.Embedding`` only; a
    Hugging Face GPT-2 fuses q/k/v in one transposed ``Conv1D`` (``c_attn``).
    """
    bad = []
    for unit in graph.profile.units:
        for linear in unit.tp.linears:
            for path in (f"{unit.name}.{linear.path}", linear.path):
                try:
                    layer = model.get_submodule(path)
                except AttributeError:
                    continue
                if not isinstance(layer, nn.Linear | nn.Embedding):
                    bad.append(f"{path} ({type(layer).__name__})")
                break
    return bad


def _check_tensor_parallel(plan: Plan, model: nn.Module, graph: ModelGraph) -> None:
    """Refuse, before any collective, a TP plan the passes would refuse half-way."""
    if plan.tp_degree == 1:
        return
    bad = _layers_tp_cannot_shard(model, graph)
    if bad:
        raise PlanError(
            f"tp_degree = {plan.tp_degree}, but tensor parallelism shards nn.Linear and "
            f"nn.Embedding layers only, and {', '.join(bad[:3])}"
            f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''} are not (Hugging Face "
            "GPT-2 fuses q/k/v in one transposed Conv1D, which needs an interleaved column "
            "split); use tp_degree 1 for this model"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _SearchedPlan:
    """The plan rank 0 searched, as every rank received it, and the search's unproven gap."""

    plan: Plan
    optimality_gap: float  # `SearchStats.optimality_gap` (0: proven the fastest)


def _searched_plan(
    graph: ModelGraph,
    cluster: Cluster,
    global_batch_size: int | None,
    constraints: Mapping[str, Any],
) -> _SearchedPlan:
    """Rank 0 searches; every rank gets its plan and gap (or its error) by broadcast."""
    if global_batch_size is None:
        raise PlanError(
            "parallelize() got no plan and no global_batch_size to search one for; pass "
            "plan=... or global_batch_size=..."
        )
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            found = _search(graph, cluster, global_batch_size, constraints)
            payload[0] = ("plan", found.plans[0].to_data(), found.stats.optimality_gap)
        except Exception as error:
            payload[0] = ("error", f"{type(error).__name__}: {error}", None)
    dist.broadcast_object_list(payload, src=0)
    kind, body, gap = payload[0]
    if kind == "error":
        raise PlanError(f"plan search on rank 0 failed: {body}")
    return _SearchedPlan(
        plan=Plan.from_data(body, source="searched plan"), optimality_gap=float(gap)
    )


def _search(
    graph: ModelGraph,
    cluster: Cluster,
    global_batch_size: int,
    constraints: Mapping[str, Any],
) -> SearchResult:
    return search_plans(graph.profile, cluster, global_batch=global_batch_size, **constraints)


def _chosen_line(chosen: _ChosenPlan, plan_path: str | None) -> str:
    """The plan this job runs, in one line: searched (in how long, proven or with its gap),
    loaded from ``plan_path`` or given, its shape and its predicted step on the job's cluster."""
    if plan_path is not None:
        # whole up to Linux's PATH_MAX: a log names the file the user can open
        how = f"running the plan loaded from {shown(plan_path, 4096, quoted=False)}"
    elif chosen.search_time_s is None or chosen.optimality_gap is None:
        how = "running the plan given"
    else:
        gap = chosen.optimality_gap
        proof = "proven the fastest" if gap == 0 else f"a faster one may exist by up to {gap:.1%}"
        how = f"plan searched on rank 0 in {chosen.search_time_s:.1f} s ({proof})"
    predicted = chosen.predicted
    return (
        f"{how}: {_describe(chosen.plan)}; predicted step "
        f"{fmt_time_range(predicted.step_time_s, predicted.step_time_range_s)}"
    )


def _ep_where(plan: Plan) -> str:
    return "folded over dp x cp x tp" if plan.ep_folding else "within dp"


def _describe(plan: Plan) -> str:
    stages = ", ".join(
        f"[{s.first_unit}..{s.last_unit}{'' if s.recompute == 'none' else ' ' + s.recompute}]"
        for s in plan.stages
    )
    if len(plan.stages) > 8:  # (the line stays readable: the plan file lists them all)
        sizes = [s.num_units for s in plan.stages]
        modes = "+".join(sorted({s.recompute for s in plan.stages}))
        stages = f"{len(sizes)} of {min(sizes)}-{max(sizes)} units, recompute {modes}"
    return (
        f"dp {plan.dp_degree} x tp {plan.tp_degree} x pp {plan.pp_degree}"
        + (f" x cp {plan.cp_degree}" if plan.cp_degree > 1 else "")
        + (f", ep {plan.ep_degree} {_ep_where(plan)}" if plan.ep_degree > 1 else "")
        + (f", experts split over etp {plan.etp_degree}" if plan.etp_degree > 1 else "")
        + f" (layout {'/'.join(plan.rank_layout)}), schedule {plan.schedule}, "
        f"{plan.num_micro_batches} micro-batch{'es' if plan.num_micro_batches > 1 else ''} of "
        f"{plan.micro_batch_size}, "
        f"{plan.zero_text}"
        + (f", optimizer offload {plan.optimizer_offload:g}" if plan.optimizer_offload else "")
        + f", SP {'on' if plan.sequence_parallel else 'off'}, "
        f"{plan.dtype}, stages {stages}"
    )
