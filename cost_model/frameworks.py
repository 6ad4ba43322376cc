"""Framework profiles: what a training stack does that changes step time or memory.

A plan runs on one stack: autoplan's own runtime (the default), or a plan exported to Megatron-LM,
DeepSpeed or torchtitan (`autoplan export`). The stacks differ in behaviour the hardware does not
decide: the attention kernel, how far full recompute re-runs the forward, which op outputs
selective recompute keeps, whether data-parallel gradient sync overlaps the backward, whether
the pipeline keeps the activations it sent, the bytes the loss keeps, how ZeRO-3 gathers
weights (FSDP2 per block, DeepSpeed per module in prefetch buckets), the least time its host
work lets a tensor-parallel block take on a GPU (nanotron's), and a pipeline engine that
re-times the whole step (DeepSpeed's, with BF16_Optimizer or its fp16 optimizers). A
`FrameworkProfile` names each behaviour with its source; `FrameworkProfile.cluster_for` writes
the calibration ones into the cluster's `Calibration`, whose fields the cost model's parts read,
and `cost_model.estimate.CostModel` reads the ZeRO-3 gathers and the engine. A field left
``None`` keeps the cluster's own value, so the ``autoplan`` profile is the identity: a
cluster's calibration (presets, `autoplan calibrate`) describes autoplan's runtime.

Applying a profile twice equals applying it once (every field is a replacement, and the
overlap a minimum), so a cluster that already carries a profile may be passed again.

Described alike for every stack, with the reason:
- the optimizer: each profiled stack but Megatron-LM 2019 (FP16_Optimizer over a per-tensor
  FusedAdam, `optimizer_bytes_per_param`) runs a fused or multi-tensor Adam (Megatron-Core:
  Transformer Engine's or apex's FusedAdam, megatron/core/optimizer/__init__.py; DeepSpeed: its
  FusedAdam, deepspeed/runtime/engine.py; torchtitan: ``implementation = "fused"``, its default,
  torchtitan/components/optimizer/optimizer.py; autoplan: torch's AdamW, foreach on CUDA), which
  `cost_model.parts.optimizer` prices as one memory-bound pass. Megatron-LM's distributed
  optimizer is the plan's ZeRO-1 (`autoplan export` writes ``--use-distributed-optimizer``).
- a fixed time per step (data loading, logging, timers): no source separates it for any stack,
  so it is `Calibration.step_overhead_s`, zero in the presets; the `megatron-lm-2019` profile
  carries the one fitted to Shoeybi et al.'s rows (bench/data/validation_assumptions.yaml).
Not described: fp8 training.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from cost_model.errors import InputError
from cost_model.hardware import Cluster
from cost_model.memory import RECOMPUTE_MODULES, RecomputeModule, SelectiveScope, StackActivations
from cost_model.messages import shown
from cost_model.schedules import V_SCHEDULES, ScheduleName, runs_in_gpipe_order
from cost_model.stage_splits import PipelineSplit, StageSplitError, own_stage_starts
from cost_model.strategy import Axis, PlanLike, RecomputeMode, Strategy, is_subsequence
from cost_model.workload import ModelProfile

AttentionKernel = Literal["fused", "unfused"]
# A training engine that re-times the whole step (`cost_model.parts.deepspeed_pipeline`).
Engine = Literal["deepspeed-pipe"]
# How ZeRO-3 gathers weights: one collective per unit (FSDP2's fully_shard per block) or one
# per prefetch bucket of modules (DeepSpeed, `cost_model.parts.data_parallel`).
Zero3Gathers = Literal["per-unit", "per-module"]
# Where a stack places an expert-parallel group (`FrameworkProfile.expert_layout`).
ExpertLayout = Literal["dp", "folded"]

DEFAULT_FRAMEWORK = "autoplan"


# a profile field an option sets: a number, a name, or names (e.g. the schedules)
OptionValue = float | str | tuple[str, ...]


class FrameworkError(InputError):
    """An unknown framework name or option, or a plan priced for a stack that cannot run it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    """Why a stack cannot run a plan: the plan's value, the stack's rule, and the nearest
    change the stack runs. Prints as one line, ``value: rule; fix``."""

    # what the plan does, with its numbers: "schedule gpipe", "zero 1 with pp 2"
    value: str
    # the stack's limit, the same for every plan it refuses so (the search counts by it)
    rule: str
    # the nearest plan the stack runs: "set --schedule 1f1b"
    fix: str

    def __str__(self) -> str:
        return f"{self.value}: {self.rule}; {self.fix}"


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameworkProfile:
    """A training stack's behaviour; ``None``: as the cluster's calibration says."""

    name: str
    # The releases whose behaviour this describes (behaviour changed at the stated versions).
    version: str
    summary: str
    # fused: one flash/memory-efficient kernel (the trace's SDPA op, at the calibration's
    # attention efficiency); unfused: Q K^T, softmax, dropout and x V with the s x s scores in
    # memory (`unfused_attention_efficiency`).
    attention: AttentionKernel | None = None
    # The dropout probability the stack's runs use (hidden and attention alike; 0: none, as the
    # traced models): with it a block keeps 1-byte masks (`cost_model.memory.StackActivations`).
    dropout: float = 0.0
    # What its selective recompute drops from memory (`cost_model.memory.SelectiveScope`;
    # ``None``: the traced cheap ops' outputs, as autoplan's runtime).
    selective_recompute: SelectiveScope | None = None
    # With selective_recompute "modules": the submodules it checkpoints (Megatron-Core's
    # --recompute-modules, `cost_model.memory.RECOMPUTE_MODULES`). Memory only: the re-run's
    # time stays the stack's selective price (the traced cheap ops,
    # `cost_model.parts.compute.recompute_s`), short of a whole MoE layer's forward for "moe".
    recompute_modules: tuple[RecomputeModule, ...] = ("core_attn",)
    # An unfused core's bytes per score element, forward and backward (``None``: 13 and 19,
    # `unfused_attention_efficiency`).
    unfused_score_bytes: tuple[float, float] | None = None
    # The fused attention kernel's rate where the stack's kernel is known to differ from the
    # FlashAttention-1/2-era rate the presets hold: `Calibration.attention_efficiency` by device
    # name prefix (e.g. "H100"), in the trace's causal-counted FLOPs.
    attention_efficiency_by_device: Mapping[str, float] = field(default_factory=dict)
    # `Calibration.full_recompute_early_stop`: 1 when full recompute stops once every saved
    # tensor is back (torch's non-reentrant checkpoint since 2.1), 0 when it re-runs the
    # whole forward (reentrant checkpointing).
    full_recompute_early_stop: float | None = None
    # `Calibration.selective_gemm_recompute_fraction`: the share of forward GEMM work that
    # selective recompute re-runs.
    selective_gemm_recompute_fraction: float | None = None
    # Whether gradient sync overlaps the backward (1) or follows it (0); the cluster's
    # `dp_overlap_fraction` still bounds it (a CPU worker's one core cannot overlap).
    dp_overlap: float | None = None
    # The ZeRO stages at which the stack can overlap the sync at all (``None``: every one), and
    # whether it can with pipeline parallelism; elsewhere the sync follows the backward
    # (`overlaps_dp_sync`).
    dp_overlap_zero_stages: tuple[int, ...] | None = None
    pipeline_dp_overlap: bool = True
    # `Calibration.pipeline_boundary_retention`: 1 keeps every sent activation until its
    # backward (torch.distributed.pipelining), 0 frees it once sent.
    pipeline_boundary_retention: float | None = None
    # `Calibration.tp_block_host_floor_s`: the least time a tensor-parallel block takes per
    # micro-batch on a GPU, set by the stack's host work for it (written on GPU clusters only:
    # a CPU worker's host time adds to its compute, `autoplan calibrate` measures it there).
    tp_block_host_floor_s: float | None = None
    # `Calibration.step_overhead_s`: the stack's own fixed time per step, where one is known.
    step_overhead_s: float | None = None
    # `Calibration.block_sync_copy_bytes` and `checkpoint_sync_copy_bytes`.
    block_sync_copy_bytes: float | None = None
    checkpoint_sync_copy_bytes: float | None = None
    # `Calibration.separate_bias_add`, `separate_output_dropout` and `optimizer_bytes_per_param`.
    separate_bias_add: float | None = None
    separate_output_dropout: float | None = None
    optimizer_bytes_per_param: float | None = None
    # `Calibration.loss_saved_bytes_per_logit`.
    loss_saved_bytes_per_logit: float | None = None
    # `Calibration.loss_forward_bytes_per_logit` and `loss_backward_bytes_per_logit`.
    loss_forward_bytes_per_logit: float | None = None
    loss_backward_bytes_per_logit: float | None = None
    # An engine whose accumulation, gradient sync and optimizer step differ from autoplan's
    # runtime as a whole (``None``: priced part by part as above). DeepSpeed's pipeline engine
    # wraps Adam in the optimizer its engine picks (deepspeed/runtime/engine.py,
    # _configure_optimizer): BF16_Optimizer for bf16 below ZeRO-3, DeepSpeedZeroOptimizer for
    # fp16 at ZeRO-1, FP16_Optimizer for fp16 without ZeRO; other plans are priced part by part
    # (`cost_model.parts.deepspeed_pipeline.deepspeed_pipe_optimizer`).
    engine: Engine | None = None
    zero3_gathers: Zero3Gathers | None = None
    # Where the stack puts an expert-parallel group: "folded" over consecutive ranks of the
    # dp x cp x tp block with the experts not tensor-parallel (`Plan.ep_folding`), or "dp"
    # inside data parallelism; ``None``: the plan says (autoplan's runtime runs both).
    expert_layout: ExpertLayout | None = None
    # A MoE layer's shared expert under sequence parallelism: "whole" on each TP rank's own
    # tokens, or "tensor-parallel" like the dense MLPs; ``None``: autoplan's runtime ("whole").
    moe_shared_expert: Literal["whole", "tensor-parallel"] | None = None
    # How the stack cuts the model into pipeline stages when no cut is stated
    # (`cost_model.stage_splits`): `autoplan.manual_plan` builds that cut for this framework;
    # ``None``: autoplan's even split of the units.
    pipeline_split: PipelineSplit | None = None
    # "own": the stack cuts the stages itself (`pipeline_split`, else evenly over the units)
    # and takes no stated cut, so the search prices that cut only; ``None``: a plan may state
    # any cut (autoplan's runtime, Megatron-LM's --pipeline-model-parallel-layout, torchtitan's
    # split points).
    stage_cuts: Literal["own"] | None = None
    # The pipeline schedules the stack runs (the search keeps to them); ``None``: every one
    # autoplan's runtime builds (torch.distributed.pipelining's).
    schedules: tuple[ScheduleName, ...] | None = None
    # False: the stack has no Megatron-style sequence parallelism (the search leaves it out).
    sequence_parallel: bool | None = None
    # The recompute modes the stack has (the search keeps to them); ``None``: all three.
    recompute_modes: tuple[RecomputeMode, ...] | None = None
    # "global": one recompute setting for the whole model, so every stage alike (the search
    # prices each mode alone); ``None``: a setting per stage (autoplan's runtime).
    recompute_scope: Literal["global"] | None = None
    # False: the stack has no pipeline parallelism, or no Megatron-style tensor parallelism.
    pipeline_parallel: bool = True
    tensor_parallel: bool = True
    # The ZeRO stages the stack runs, in autoplan's terms (FSDP's SHARD_GRAD_OP is 2,
    # FULL_SHARD 3); ``None``: 0-3. The search offers these only.
    zero_stages: tuple[int, ...] | None = None
    # With pipeline parallelism: the largest ZeRO stage the stack's pipeline engine runs
    # (``None``: any), and whether tensor parallelism combines with it (`refusal`).
    pipeline_max_zero: int | None = None
    pipeline_tensor_parallel: bool = True
    # The orders of its process groups the stack builds, outermost first, as the search's
    # ``rank_layouts`` (the search keeps to them; cp sits just outside tp); ``None``: both
    # of autoplan's ([pp, dp, tp] and [dp, pp, tp]).
    rank_layouts: tuple[tuple[Axis, ...], ...] | None = None
    # False: the stack has no context parallelism of autoplan's kind (ring attention over
    # sequence chunks), or no expert parallelism, as a plan degree (`refusal`).
    context_parallel: bool = True
    expert_parallel: bool = True
    # The training dtypes the stack runs (``None``: fp32, bf16 and fp16).
    dtypes: tuple[str, ...] | None = None
    # The least ZeRO stage with context parallelism (a stack that shards the weights over
    # dp x cp whenever cp > 1); ``None``: any.
    cp_min_zero: int | None = None
    # A mixture-of-experts model with tensor parallelism needs sequence parallelism.
    moe_tp_needs_sequence_parallel: bool = False
    # What its interleaved schedule needs of the micro-batches: at least pp (Megatron-Core's
    # groups of pp or more), or a multiple of pp on more than 2 ranks (Megatron-LM 2021).
    interleaved_microbatches: Literal["pp-or-more", "multiple-of-pp"] | None = None
    sources: tuple[str, ...] = ()
    # The stack's own flags that change its behaviour, given as ``NAME:option=value``:
    # option -> value -> the profile fields it sets (e.g. Megatron-LM 2021's --DDP-impl).
    options: Mapping[str, Mapping[str, Mapping[str, OptionValue]]] = field(default_factory=dict)

    def refusal(self, strategy: Strategy, *, moe: bool = False) -> Refusal | None:
        """Why the stack cannot run ``strategy``'s outer choices on a model (``moe``: with
        experts); None when it can."""
        name, z = self.name, strategy.zero_stage
        tp, pp, cp = strategy.tp_degree, strategy.pp_degree, strategy.cp_degree
        if not self.context_parallel and cp > 1:
            return Refusal(
                value=f"cp {cp}",
                rule=f"{name} has no ring-attention context parallelism",
                fix="set --cp 1",
            )
        if not self.expert_parallel and strategy.ep_degree > 1:
            return Refusal(
                value=f"ep {strategy.ep_degree}",
                rule=f"{name} has no expert parallelism as a plan degree",
                fix="set --ep 1",
            )
        if not self.pipeline_parallel and pp > 1:
            return Refusal(
                value=f"pp {pp}", rule=f"{name} has no pipeline parallelism", fix="set --pp 1"
            )
        if not self.tensor_parallel and tp > 1:
            return Refusal(
                value=f"tp {tp}",
                rule=f"{name} has no Megatron-style tensor parallelism",
                fix="set --tp 1",
            )
        if self.zero_stages is not None and z not in self.zero_stages:
            # the next stage up (the same traffic, less memory), else the largest below
            nearest = min((s for s in self.zero_stages if s > z), default=max(self.zero_stages))
            return Refusal(
                value=f"zero {z}",
                rule=f"{name} runs only ZeRO {', '.join(map(str, self.zero_stages))}",
                fix=f"set --zero {nearest}",
            )
        if self.cp_min_zero is not None and cp > 1 and z < self.cp_min_zero:
            return Refusal(
                value=f"zero {z} with cp {cp}",
                rule=f"{name} shards the weights over dp x cp with context parallelism",
                fix=f"set --zero {self.cp_min_zero} or more, or --cp 1",
            )
        if (
            self.moe_tp_needs_sequence_parallel
            and moe
            and tp > 1
            and not strategy.sequence_parallel
        ):
            return Refusal(
                value=f"tp {tp} without sequence parallelism on a mixture-of-experts model",
                rule=f"{name} needs sequence parallelism for experts with tp > 1",
                fix="set --sequence-parallel, or --tp 1",
            )
        if pp == 1:
            return None
        m = strategy.num_micro_batches
        if strategy.schedule == "interleaved-1f1b":
            value = f"interleaved-1f1b with m = {m} micro-batch{'es' if m > 1 else ''} on pp = {pp}"
            if self.interleaved_microbatches == "pp-or-more" and m < pp:
                return Refusal(
                    value=value,
                    rule=f"{name}'s interleaved schedule needs m >= pp",
                    fix=f"use at least {pp} micro-batches, or --schedule 1f1b",
                )
            if self.interleaved_microbatches == "multiple-of-pp" and (m % pp or pp <= 2):
                fix = (
                    f"use a multiple of {pp} micro-batches ({-(-m // pp) * pp})"
                    if pp > 2
                    else "use pp > 2"
                )
                return Refusal(
                    value=value,
                    rule=(
                        f"{name}'s interleaved schedule needs pp > 2 and a multiple of pp "
                        "micro-batches"
                    ),
                    fix=f"{fix}, or --schedule 1f1b",
                )
        if not self.pipeline_tensor_parallel and tp > 1:
            return Refusal(
                value=f"tp {tp} with pp {pp}",
                rule=f"{name}'s pipeline engine has no tensor parallelism",
                fix="set --tp 1, or --pp 1",
            )
        if self.pipeline_max_zero is not None and z > self.pipeline_max_zero:
            return Refusal(
                value=f"zero {z} with pp {pp}",
                rule=f"{name}'s pipeline engine runs ZeRO {self.pipeline_max_zero} at most",
                fix=f"set --zero {self.pipeline_max_zero}, or --pp 1",
            )
        return None

    def plan_refusal(self, plan: PlanLike, profile: ModelProfile) -> Refusal | None:
        """Why the stack cannot run ``plan`` on ``profile``'s model: `refusal` of its outer
        choices, its schedule, sequence parallelism, dtype, its stages' recompute, its rank
        order and, for a stack that cuts its stages itself, its stage cut; None when it can."""
        strategy = Strategy.of(plan)
        name = self.name
        if (why := self.refusal(strategy, moe=bool(profile.moe_layers))) is not None:
            return why
        pipelined = strategy.pp_degree > 1
        gpipe_order = runs_in_gpipe_order(
            strategy.schedule, strategy.num_micro_batches, strategy.pp_degree
        )
        if (
            self.schedules is not None
            and pipelined
            and strategy.schedule not in self.schedules
            and not (gpipe_order and "1f1b" in self.schedules)
        ):
            return Refusal(
                value=f"schedule {strategy.schedule}",
                rule=f"{name} runs only {', '.join(self.schedules)}",
                fix=_nearest_schedule(self.schedules, strategy.virtual_stages),
            )
        if self.sequence_parallel is False and strategy.sequence_parallel:
            return Refusal(
                value="sequence parallelism",
                rule=f"{name} has no Megatron-style sequence parallelism",
                fix="leave out --sequence-parallel",
            )
        if self.dtypes is not None and strategy.dtype not in self.dtypes:
            return Refusal(
                value=f"dtype {strategy.dtype}",
                rule=f"{name} trains in {' or '.join(self.dtypes)}",
                fix=f"set --dtype {self.dtypes[0]}",
            )
        modes = sorted({stage.recompute for stage in plan.stages}, key=_RECOMPUTE_ORDER.index)
        allowed = self.recompute_modes
        if allowed is not None and not set(modes) <= set(allowed):
            refused = next(mode for mode in modes if mode not in allowed)
            # the next mode up that the stack has (keeps less), else the heaviest it has
            heavier = _RECOMPUTE_ORDER[_RECOMPUTE_ORDER.index(refused) :]
            nearest = next((mode for mode in heavier if mode in allowed), allowed[-1])
            return Refusal(
                value=f"recompute {refused}",
                rule=f"{name} has only {' and '.join(allowed)} recompute",
                fix=f"set --recompute {nearest}",
            )
        if self.recompute_scope == "global" and len(modes) > 1:
            return Refusal(
                value=f"recompute {' and '.join(modes)} by stage",
                rule=f"{name} has one recompute setting for all stages",
                fix=f"set --recompute {modes[-1]} for all",
            )
        if self.rank_layouts is not None:
            # as the stack sees it: the axes of degree > 1, cp just outside tp
            used = [axis for axis in strategy.rank_layout if strategy.degree(axis) > 1]
            orders: list[list[str]] = [
                [*layout[:-1], "cp", layout[-1]] for layout in self.rank_layouts
            ]
            if not any(is_subsequence(used, order) for order in orders):
                shown = " or ".join(str(list(layout)) for layout in self.rank_layouts)
                return Refusal(
                    value=f"rank_layout {list(strategy.rank_layout)}",
                    rule=f"{name} orders its process groups {shown}",
                    fix=f"set rank_layout {list(self.rank_layouts[0])}",
                )
        if self.stage_cuts == "own" and len(plan.stages) > 1:
            cuts = [(stage.first_unit, stage.last_unit) for stage in plan.stages]
            try:
                starts = self.stage_starts(profile, len(plan.stages))
            except StageSplitError as err:
                return Refusal(
                    value=f"{len(plan.stages)} stages",
                    rule=f"{name} cuts the stages itself: {err}",
                    fix="price another pipeline degree",
                )
            ends = [*starts[1:], profile.num_units]
            own = [(first, end - 1) for first, end in zip(starts, ends, strict=True)]
            if cuts != own:
                return Refusal(
                    value=f"stages {_cuts_text(cuts)}",
                    rule=f"{name} cuts the stages itself",
                    fix=f"use its cut {_cuts_text(own)} (leave the stages to it)",
                )
        return None

    @property
    def saved_activations(self) -> StackActivations:
        """What the stack saves for backward beyond the traced model (`cost_model.memory`)."""
        return StackActivations(
            unfused_attention=self.attention == "unfused",
            dropout=self.dropout > 0,
            selective=self.selective_recompute or "traced-ops",
            recompute_modules=self.recompute_modules,
        )

    def overlaps_dp_sync(self, strategy: Strategy) -> bool:
        """Whether the stack runs ``strategy``'s data-parallel gradient sync during the
        backward (the cluster's `dp_overlap_fraction` still bounds how much), not after it."""
        if self.dp_overlap is not None and self.dp_overlap <= 0:
            return False
        if (
            self.dp_overlap_zero_stages is not None
            and strategy.zero_stage not in self.dp_overlap_zero_stages
        ):
            return False
        return self.pipeline_dp_overlap or strategy.pp_degree == 1

    def stage_starts(self, profile: ModelProfile, num_stages: int) -> tuple[int, ...]:
        """The first unit of each stage as this stack cuts ``num_stages`` stages when no cut
        is stated (`cost_model.stage_splits.own_stage_starts`): what `autoplan.manual_plan`
        and the search build for it; `StageSplitError` where its rule cuts inside a unit."""
        return own_stage_starts(profile, num_stages, self.pipeline_split)

    def cluster_for(self, profile: ModelProfile, cluster: Cluster) -> Cluster:
        """``cluster`` with this stack's behaviour in its calibration."""
        cal = cluster.calibration
        changes: dict[str, float] = {}
        if self.attention == "unfused" and profile.num_heads:
            # an unfused core computes every score; the trace counts a causal kernel's half
            head_dim, fraction = round(profile.head_dim), profile.score_fraction
            forward, backward = self.unfused_score_bytes or (None, None)
            changes["attention_efficiency"] = (
                unfused_attention_efficiency(cluster, head_dim, "forward", forward) * fraction
            )
            changes["attention_backward_efficiency"] = (
                unfused_attention_efficiency(cluster, head_dim, "backward", backward) * fraction
            )
        if self.attention == "fused":
            for prefix, value in self.attention_efficiency_by_device.items():
                if cluster.device.name.startswith(prefix):
                    changes["attention_efficiency"] = value
        for name in (
            "full_recompute_early_stop",
            "selective_gemm_recompute_fraction",
            "pipeline_boundary_retention",
            "loss_saved_bytes_per_logit",
            "loss_forward_bytes_per_logit",
            "loss_backward_bytes_per_logit",
            "separate_bias_add",
            "separate_output_dropout",
            "optimizer_bytes_per_param",
            "block_sync_copy_bytes",
            "checkpoint_sync_copy_bytes",
            "step_overhead_s",
        ):
            value = getattr(self, name)
            if value is not None:
                changes[name] = value
        if self.tp_block_host_floor_s is not None and cluster.device.kind == "gpu":
            changes["tp_block_host_floor_s"] = self.tp_block_host_floor_s
        if self.dp_overlap is not None:
            changes["dp_overlap_fraction"] = min(cal.dp_overlap_fraction, self.dp_overlap)
        if not changes:
            return cluster
        return dataclasses.replace(cluster, calibration=dataclasses.replace(cal, **changes))


def unfused_attention_efficiency(
    cluster: Cluster,
    head_dim: int,
    direction: Literal["forward", "backward"] = "forward",
    score_bytes: float | None = None,
) -> float:
    """Effective efficiency of an unfused attention core (Q K^T, softmax, dropout, x V: Megatron-LM
    2019-2022's CoreAttention with FusedScaleMaskSoftmax), in the terms of the fused attention op
    the trace records, for its forward or its backward.

    Per score element of one head and sample, in 16-bit elements and a 1-byte dropout mask:

    - forward, 4 d GEMM FLOPs: Q K^T writes the score (2 bytes), the fused scale-mask-softmax
      reads and writes it (4), dropout reads it and writes its output and mask (5), x V reads
      that output (2): 13 bytes;
    - backward, 8 d GEMM FLOPs: dO V^T writes the probability gradient (2), dropout's backward
      reads it and the mask and writes (5), the softmax's backward reads it and the saved
      probabilities and writes (6), the Q and K gradients each read it (4), V's gradient
      reads the saved dropout output (2): 19 bytes.

    ``score_bytes`` replaces the direction's 13 or 19 for a core with other passes (Megatron-LM
    2019's separate scale and mask: `FrameworkProfile.unfused_score_bytes`).

    GEMM FLOPs at the GEMM efficiency, bytes at the memory efficiency:
    ``eff = 1 / (1 / e_gemm + bytes * peak / (flops * bandwidth))``: datasheet and calibration
    only.
    """
    cal = cluster.calibration
    peak = cluster.device.peak_flops_for("bf16")
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    default_bytes, score_flops = (
        (13.0, 4.0 * head_dim) if direction == "forward" else (19.0, 8.0 * head_dim)
    )
    score_bytes = default_bytes if score_bytes is None else score_bytes
    return min(
        1.0, 1.0 / (1.0 / cal.gemm_efficiency + score_bytes * peak / (score_flops * bandwidth))
    )


# recompute modes from the least kept to the most
_RECOMPUTE_ORDER: tuple[RecomputeMode, ...] = ("none", "selective", "full")


def _nearest_schedule(allowed: tuple[ScheduleName, ...], virtual_stages: int) -> str:
    """The change to an ``allowed`` schedule nearest a plan with ``virtual_stages`` stages a
    rank: one with as many stages a rank where there is one, 1F1B for one stage a rank."""
    several = [s for s in allowed if s not in ("gpipe", "1f1b")]
    if virtual_stages > 1 and several:
        pick = several[0]
        v_fix = " --virtual-stages 2" if pick in V_SCHEDULES and virtual_stages != 2 else ""
        return f"set --schedule {pick}{v_fix}"
    one = [s for s in ("1f1b", "gpipe") if s in allowed]
    if one:
        return f"set --schedule {one[0]}" + (" --virtual-stages 1" if virtual_stages > 1 else "")
    return f"set --schedule {allowed[0]} --virtual-stages 2"


def _cuts_text(cuts: list[tuple[int, int]]) -> str:
    """Stages as unit ranges, ``[0-4, 5-9]``."""
    return "[" + ", ".join(f"{first}-{last}" for first, last in cuts) + "]"


_LLM_FOUNDRY = FrameworkProfile(
    name="llm-foundry",
    version="MosaicML llm-foundry with Composer, torch 2.0 (its 2023 throughput tables)",
    summary=(
        "llm-foundry's MPT on Composer/FSDP: flash attention, torch 2.0's "
        "checkpointing (no early stop), flash-attn's fused cross-entropy, overlapped FSDP"
    ),
    attention="fused",
    # Its benchmark sweep pins mosaicml/pytorch:2.0.1 (scripts/train/benchmarking/
    # sweep.sh): torch's non-reentrant checkpoint re-ran the whole forward before 2.1
    # (the early stop is pytorch PR #96866).
    full_recompute_early_stop=0.0,
    # MPT's loss_fn defaults to flash-attn's CrossEntropyLoss, which saves the bf16
    # logits (and a log-sum-exp per row) for its backward
    # (llmfoundry/models/mpt/modeling_mpt.py; flash_attn/ops/triton/cross_entropy.py).
    loss_saved_bytes_per_logit=2.0,
    # Composer's FSDP overlaps gradient reduce-scatter with the backward.
    dp_overlap=1.0,
    # activation_checkpointing: one setting for every MPT block
    recompute_scope="global",
    # Composer's FSDP (fsdp_config is train.py's only parallelism setting: no pipeline,
    # tensor or context parallelism; scripts/train/train.py, 00b4bae4, 2023) maps
    # sharding_strategy NO_SHARD, SHARD_GRAD_OP, FULL_SHARD: ZeRO 0, 2, 3 (HYBRID_SHARD
    # only from torch 2.1; composer/trainer/mosaic_fsdp_utils.py, SHARDING_MAP)
    pipeline_parallel=False,
    tensor_parallel=False,
    context_parallel=False,
    zero_stages=(0, 2, 3),
    sources=(
        "mosaicml/llm-foundry scripts/train/benchmarking/sweep.sh (torch 2.0.1 image)",
        "mosaicml/llm-foundry scripts/train/train.py (fsdp_config, 2023)",
        "mosaicml/composer composer/trainer/mosaic_fsdp_utils.py (SHARDING_MAP)",
        "mosaicml/llm-foundry llmfoundry/models/mpt/modeling_mpt.py (loss_fn)",
        "Dao-AILab/flash-attention flash_attn/ops/triton/cross_entropy.py",
    ),
)


def _recompute_module_options() -> dict[str, dict[str, OptionValue]]:
    """Option values for every non-empty set of `RECOMPUTE_MODULES`, in their order."""
    sets = (
        names
        for size in range(1, len(RECOMPUTE_MODULES) + 1)
        for names in itertools.combinations(RECOMPUTE_MODULES, size)
    )
    return {"+".join(names): {"recompute_modules": names} for names in sets}


FRAMEWORKS: dict[str, FrameworkProfile] = {
    profile.name: profile
    for profile in (
        FrameworkProfile(
            name="autoplan",
            version="this project (torch >= 2.13)",
            summary=(
                "autoplan's runtime: SDPA attention, torch's non-reentrant checkpoint, "
                "torch.distributed.pipelining, DDP/FSDP2 overlapped gradient sync"
            ),
            sources=("autoplan passes/ and cost_model/calibration.py (the defaults)",),
        ),
        FrameworkProfile(
            name="megatron-lm",
            version="Megatron-Core 0.5 and later (2024-), as `autoplan export` launches it",
            summary=(
                "Megatron-LM with Transformer Engine's fused attention, reentrant full "
                "recompute, outputs freed once sent, --overlap-grad-reduce"
            ),
            attention="fused",
            # --hidden-dropout and --attention-dropout default to 0.1 (megatron/training/
            # arguments.py); the hidden one keeps a 1-byte mask in bias_dropout_add
            # (megatron/core/fusions/fused_bias_dropout.py), the attention one none inside the
            # fused kernel. Recipes that set both to 0 (most Llama ones): option dropout=0.
            dropout=0.1,
            # --recompute-granularity selective checkpoints core attention only
            # (--recompute-modules defaults to core_attn, megatron/core/transformer/
            # transformer_config.py): every other saved tensor stays. Option
            # recompute_modules=layernorm+moe etc. for runs that name other modules.
            selective_recompute="modules",
            # Transformer Engine's DotProductAttention runs cuDNN's fused attention on Hopper.
            # cuDNN on H100 SXM5, head dim 128, sequences 2k-16k, no causal mask: 595-617
            # TFLOP/s forward and 465-518 backward (Shah et al. 2024, FlashAttention-3, Fig. 5),
            # 1.6x FlashAttention-2's 362-370 and 291-322 there. Forward and backward weighted
            # by their FLOPs (1 : 2.5): 3.5 / (989 / 607 + 2.5 x 989 / 516) = 0.54 of the peak.
            attention_efficiency_by_device={"H100": 0.54},
            # CheckpointFunction is a reentrant torch.autograd.Function: the backward re-runs
            # the block's whole forward (megatron/core/tensor_parallel/random.py).
            full_recompute_early_stop=0.0,
            # --recompute-granularity selective re-runs the attention core only (softmax,
            # dropout, the two bmm), keeping every projection GEMM's output
            # (megatron/core/transformer/attention.py, checkpoint_core_attention).
            selective_gemm_recompute_fraction=0.0,
            # schedules.py deallocate_output_tensor frees a stage output once sent, and the
            # p2p layer waits for each batch of sends (p2p_communication.py, wait_on_reqs).
            pipeline_boundary_retention=0.0,
            # --overlap-grad-reduce (set by the export): bucketed all-reduce/reduce-scatter
            # during the backward (megatron/core/distributed/distributed_data_parallel.py);
            # without it (Megatron's default) the reduction follows the backward.
            dp_overlap=1.0,
            # Megatron-Core's expert rank generator orders tp-cp-ep-dp-pp for the dense layers
            # and etp-ep-edp-pp for the experts over the same ranks: with
            # --expert-tensor-parallel-size 1 an ep group is ep consecutive ranks of the
            # tp x cp x dp block (megatron/core/parallel_state.py, initialize_model_parallel;
            # Liu et al. 2025, "MoE Parallel Folding", arXiv:2504.14960).
            expert_layout="folded",
            # SharedExpertMLP is built with the dense layers' TP config (column- and row-parallel
            # linears, megatron/core/transformer/moe/shared_experts.py)
            moe_shared_expert="tensor-parallel",
            # get_num_layers_to_build: the layers evenly over the stages unless a layout, uneven
            # first and last stages or --account-for-embedding/loss-in-pipeline-split say else
            pipeline_split="layers",
            # get_forward_backward_func: 1F1B, or interleaved 1F1B with virtual stages
            # (megatron/core/pipeline_parallel/schedules.py)
            schedules=("1f1b", "interleaved-1f1b"),
            # --recompute-granularity/--recompute-method/--recompute-num-layers apply to every
            # stage alike (megatron/core/transformer/transformer_block.py)
            recompute_scope="global",
            # validate_args: "When using MoE and tensor parallelism, sequence parallelism must be
            # used" (megatron/training/arguments.py)
            moe_tp_needs_sequence_parallel=True,
            # forward_backward_pipelining_with_interleaving: groups of >= pp micro-batches
            interleaved_microbatches="pp-or-more",
            options={
                "overlap-grad-reduce": {"on": {"dp_overlap": 1.0}, "off": {"dp_overlap": 0.0}},
                "dropout": {"0.1": {"dropout": 0.1}, "0": {"dropout": 0.0}},
                # --recompute-modules (with --recompute-granularity selective): the modules
                # joined by "+" in Megatron's order (core_attn+moe_act+layernorm+moe), what
                # `cost_model.memory.recomputed_module_bytes` prices
                "recompute_modules": _recompute_module_options(),
                "split": {
                    "layers": {"pipeline_split": "layers"},
                    "layers-with-edges": {"pipeline_split": "layers-with-edges"},
                },
            },
            sources=(
                "NVIDIA/Megatron-LM megatron/core/tensor_parallel/random.py (CheckpointFunction)",
                "NVIDIA/Megatron-LM megatron/core/parallel_state.py (expert rank generator)",
                "Shah et al. 2024, FlashAttention-3 (arXiv:2407.08608), Fig. 5 (cuDNN on H100)",
                "NVIDIA/Megatron-LM megatron/core/pipeline_parallel/schedules.py",
                "NVIDIA/Megatron-LM megatron/training/arguments.py (--overlap-grad-reduce)",
            ),
        ),
        FrameworkProfile(
            name="nanotron",
            version="Hugging Face nanotron (2024-25), as the Ultra-Scale Playbook's runs used it",
            summary=(
                "nanotron: Megatron-style column/row-parallel linears with sequence parallelism, "
                "flash-attn 2 kernels, torch DDP overlapping the gradient all-reduce with the "
                "backward"
            ),
            # flash-attn 2 (the flash_attn package), not Transformer Engine: the presets' rate
            attention="fused",
            # torch DDP's bucketed all-reduce during the backward (nanotron trainer.py)
            dp_overlap=1.0,
            # Recompute and what its 1F1B engine keeps of a sent activation are not described
            # (autoplan's defaults): the scored Ultra-Scale Playbook runs use neither.
            # build_model cuts the stages by its blocks' compute cost (no flag states a cut).
            pipeline_split="nanotron",
            stage_cuts="own",
            # its PipelineEngines: all-forward-all-backward and 1F1B
            # (src/nanotron/parallel/pipeline_parallel/engine.py)
            schedules=("gpipe", "1f1b"),
            # recompute_layer: one setting for every decoder layer (its config's ModelArgs)
            recompute_scope="global",
            # Its loss: the logits cast to fp32 (the cast_to_fp32 pipeline block), then
            # _ShardedCrossEntropy (src/nanotron/parallel/tensor_parallel/functional.py) in
            # separate passes: max (read 4), subtract (read 4, write 4), exp in place (8), sum
            # (4), divide in place (8): 32 bytes per fp32 logit forward; its backward scales
            # the saved softmax in place (8). F.cross_entropy moves 8 and 16.
            loss_forward_bytes_per_logit=32.0,
            loss_backward_bytes_per_logit=8.0,
            # Fitted (bench/data/validation_assumptions.yaml, fitted_constants) to the
            # Ultra-Scale Playbook's tensor-parallel runs at micro-batch 1, whose time per
            # micro-batch and decoder layer is the same 4.4 ms for hidden sizes 2048, 3072 and
            # 4096 at TP 2, 4 and 8 (16, 28 and 32 layers: 70, 122 and 141 ms a micro-batch)
            # wherever the device needs less: a floor that grows with the layers alone, as the
            # host's per-layer work does (its Triton RMSNorm and rotary kernels, flash-attn's
            # Python wrapper, its tensor-parallel autograd functions and their collectives).
            # The source does not say which; rows without TP need more than the floor, so it
            # is not known whether one applies there.
            tp_block_host_floor_s=4.4e-3,
            # OptimizerArgs.zero_stage > 0 builds ZeroDistributedOptimizer, "partitioning of
            # optimizer's states across DP ranks ... ZeRO Stage 1" (src/nanotron/helpers.py,
            # src/nanotron/optim/zero.py; README: "ZeRO-3 optimizer (a.k.a FSDP)" unchecked), at
            # 2411b022 (2026-04)
            zero_stages=(0, 1),
            # LlamaForTraining takes no cp group (src/nanotron/models/llama.py at 2411b022): its
            # context parallelism is the Qwen model's own attention (src/nanotron/models/qwen.py,
            # from b641237d, 2025-03), not a plan degree of any model
            context_parallel=False,
            sources=(
                "huggingface/nanotron src/nanotron/models/base.py (build_model's stage split)",
                "huggingface/nanotron src/nanotron/models/llama.py (flash_attn kernels)",
                "huggingface/nanotron src/nanotron/trainer.py (DDP)",
                "huggingface/nanotron src/nanotron/parallel/tensor_parallel/functional.py (loss)",
            ),
        ),
        FrameworkProfile(
            name="megatron-lm-2021",
            version="Megatron-LM 2.x-3.0 (2020-2022: before flash attention and Megatron-Core)",
            summary=(
                "Megatron-LM as in Narayanan et al. 2021 and Korthikanti et al. 2022: unfused "
                "attention core, reentrant full recompute, outputs freed once sent, local DDP "
                "(gradient all-reduce after the backward)"
            ),
            attention="unfused",
            # --hidden-dropout and --attention-dropout default to 0.1 (megatron/arguments.py):
            # Korthikanti et al. 2022's activation count assumes both (section 4.1)
            dropout=0.1,
            # --recompute-activations / --recompute-granularity selective: CoreAttention only
            # (megatron/model/transformer.py, _checkpointed_attention_forward)
            selective_recompute="modules",
            full_recompute_early_stop=0.0,
            selective_gemm_recompute_fraction=0.0,
            pipeline_boundary_retention=0.0,
            # --DDP-impl defaulted to 'local': one all-reduce of the contiguous gradient buffer
            # after the backward (megatron/arguments.py, megatron/model/distributed.py);
            # 'torch' is torch's DDP, whose buckets overlap the backward.
            dp_overlap=0.0,
            options={
                "ddp": {"local": {"dp_overlap": 0.0}, "torch": {"dp_overlap": 1.0}},
                "dropout": {"0.1": {"dropout": 0.1}, "0": {"dropout": 0.0}},
                # sail-sg/zero-bubble-pipeline-parallelism: Megatron-LM with the zero-bubble
                # schedules of Qi et al. 2024 (ZB-V is torch's ScheduleZBVZeroBubble)
                "fork": {
                    "zero-bubble": {
                        "schedules": ("1f1b", "interleaved-1f1b", "zbv", "interleaved-zb")
                    }
                },
            },
            # the layers evenly over the stages (megatron/model/transformer.py, ParallelTransformer
            # asserts that the stages divide them), the embedding first and the head last
            pipeline_split="layers",
            stage_cuts="own",
            # megatron/schedules.py: 1F1B, interleaved 1F1B with --virtual-pipeline-model-
            # parallel-size (Narayanan et al. 2021)
            schedules=("1f1b", "interleaved-1f1b"),
            # --checkpoint-activations: every layer of every stage (megatron/model/transformer.py)
            recompute_scope="global",
            # the interleaved schedule: megatron/schedules.py asserts num_microbatches % pp == 0,
            # megatron/arguments.py pp > 2 (v2.5, 3d718bfc)
            interleaved_microbatches="multiple-of-pp",
            # --use-distributed-optimizer (ZeRO-1) from d07d29df (2022-06-08, absent at v2.5
            # and v2.6); no FSDP, ZeRO-2 or -3 in megatron/arguments.py before Megatron-Core
            zero_stages=(0, 1),
            # --context-parallel-size came with Megatron-Core (292543d3, 2023-10)
            context_parallel=False,
            sources=(
                "NVIDIA/Megatron-LM v2.5 megatron/model/transformer.py (CoreAttention)",
                "NVIDIA/Megatron-LM v2.5 megatron/arguments.py (--DDP-impl local)",
            ),
        ),
        FrameworkProfile(
            name="megatron-lm-2019",
            version="Megatron-LM of Shoeybi et al. 2019 (NVIDIA/Megatron-LM 93ab4bea, torch 1.1)",
            summary=(
                "Megatron-LM's first release: tensor parallelism only, an unfused attention core "
                "with separate scale and mask passes, bias adds and hidden dropout as kernels of "
                "their own, reentrant full recompute, local DDP after the backward, apex's "
                "FP16_Optimizer over a per-tensor FusedAdam"
            ),
            attention="unfused",
            # mpu/transformer.py, GPT2ParallelSelfAttention: matmul(Q, K^T) writes the scores,
            # then `/ sqrt(d)`, `* mask` and `- 10000 * (1 - mask)` each read and write them before
            # the softmax (+12 bytes over the 2021 core's 13); backward, the division's and the
            # product's gradients read and write the score gradient (+8 over 19).
            unfused_score_bytes=(25.0, 27.0),
            # torch 1.1's F.linear (the NGC 19.05 image, docker/Dockerfile) runs a 3-D input as
            # matmul, then `output += bias`; the row-parallel linears add theirs after the
            # all-reduce (mpu/layers.py). Hidden dropout (0.1) follows the attention's and the
            # MLP's output projections as torch.nn.Dropout, not fused with the residual add.
            separate_bias_add=1.0,
            separate_output_dropout=1.0,
            # hidden and attention dropout 0.1 (arguments.py defaults)
            dropout=0.1,
            full_recompute_early_stop=0.0,
            selective_gemm_recompute_fraction=0.0,
            # model/distributed.py: flatten the gradients, all-reduce, unflatten and copy back
            # after the backward (USE_TORCH_DDP = False in pretrain_gpt2.py)
            dp_overlap=0.0,
            # fp16/fp16.py, FP16_Optimizer per parameter and step, bytes per parameter: zero the
            # fp16 and fp32 gradients (6); the overflow check's x.float().sum() (10); copy the
            # fp16 gradient to the fp32 master (6); unscale it (8); the clip's norm (4); apex's
            # FusedAdam, one tensor at a time (read weight, gradient, two moments; write weight
            # and moments: 28); copy the master to the fp16 weight (6); and the local DDP's
            # flatten and unflatten copies of the fp16 gradients (8): 76 bytes, where a fused
            # Adam moves 30. Not priced: the overflow check's and the clip's host sync per
            # tensor (two per parameter tensor a step).
            optimizer_bytes_per_param=76.0,
            # mpu/cross_entropy.py, _VocabParallelCrossEntropy on the fp32 logits: clone (8), max
            # (4), subtract in place (8), exp (8), sum (4), divide in place (8): 40 bytes per
            # logit forward; backward, the in-place scale of the saved softmax (8).
            loss_forward_bytes_per_logit=40.0,
            loss_backward_bytes_per_logit=8.0,
            # torch 1.1's torch.cuda.get_rng_state and set_rng_state copy the CUDA generator's
            # 200 MTGP32 states of 4120 bytes (824,000 bytes) with a synchronous cudaMemcpy
            # (aten/src/THC/THCTensorRandom.cu, THCRandom_getRNGState/setRNGState; Philox-only
            # from torch 1.3). mpu/random.py runs the attention's dropout inside
            # get_cuda_rng_tracker().fork(): get, set, get, set, on every run of a layer's
            # forward (4 copies); its CheckpointFunction gets the state in the forward and, in
            # the backward, gets it and sets it twice (4 more). "Cloning caused major performance
            # issues for +4 GPU cases" (its _set_cuda_rng_state).
            block_sync_copy_bytes=4 * 824_000.0,
            checkpoint_sync_copy_bytes=4 * 824_000.0,
            # What remains of Shoeybi et al.'s step times once the above is priced, and tensor
            # parallelism does not shrink: fitted with the V100 GEMM rate to their 1.2B on one
            # GPU and on 8 (bench/data/validation_assumptions.yaml, fitted_constants). Part of
            # it is the overflow check's and the clip's host sync per parameter tensor.
            step_overhead_s=0.197,
            pipeline_parallel=False,
            # no distributed optimizer, no sequence parallelism, whole-layer checkpointing only
            zero_stages=(0,),
            sequence_parallel=False,
            recompute_modes=("none", "full"),
            recompute_scope="global",
            context_parallel=False,
            expert_parallel=False,
            dtypes=("fp16", "fp32"),
            sources=(
                "NVIDIA/Megatron-LM 93ab4bea mpu/transformer.py, mpu/layers.py, "
                "mpu/cross_entropy.py",
                "NVIDIA/Megatron-LM 93ab4bea fp16/fp16.py, model/distributed.py, pretrain_gpt2.py",
                "NVIDIA/Megatron-LM 93ab4bea docker/Dockerfile (nvcr.io/nvidia/pytorch:19.05)",
                "NVIDIA/Megatron-LM 93ab4bea mpu/random.py (RNG tracker fork, CheckpointFunction)",
                "pytorch/pytorch aten/src/THC/THCTensorRandom.cu before 1.3 (RNG state copies)",
            ),
        ),
        FrameworkProfile(
            name="megatron-deepspeed",
            version=(
                "Megatron-DeepSpeed with DeepSpeed's pipeline engine, BF16_Optimizer or its fp16 "
                "optimizers (2022)"
            ),
            summary=(
                "Megatron-DeepSpeed as BigScience trained BLOOM: Megatron's unfused attention "
                "core, reentrant full recompute, DeepSpeed's PipelineEngine (gradient all-reduce "
                "after the flush, 1/t-sliced stage transfers) with BF16_Optimizer (fp32 gradient "
                "accumulation and all-reduce, ZeRO-1 weight all-gather) or, in fp16, "
                "DeepSpeedZeroOptimizer (fp16 accumulation and all-reduce, loss-scale checks, "
                "ZeRO-1 weight all-gather)"
            ),
            attention="unfused",
            # tr11-176B-ml.slurm passes no dropout flag: megatron/arguments.py's 0.1 for both
            dropout=0.1,
            full_recompute_early_stop=0.0,
            selective_gemm_recompute_fraction=0.0,
            pipeline_boundary_retention=0.0,
            # ZeRO's reduce buckets and ZeRO-3's prefetch overlap the backward; the pipeline
            # engine's after-flush all-reduce is its own (the engine re-times it).
            dp_overlap=1.0,
            engine="deepspeed-pipe",
            zero3_gathers="per-module",
            # GPTModelPipe's PipelineModule(partition_method="type:transformer"): the decoder
            # layers balanced over the stages (evenly where they divide; where they do not,
            # autoplan's even split of the units stands in for DeepSpeed's balanced one)
            pipeline_split="layers",
            stage_cuts="own",
            # the pipeline engine's TrainSchedule, 1F1B (deepspeed/runtime/pipe/schedule.py)
            schedules=("1f1b",),
            recompute_scope="global",
            # bigscience-workshop/Megatron-DeepSpeed megatron/arguments.py (007719ad): only
            # --checkpoint-activations (whole layers) and no --sequence-parallel
            recompute_modes=("none", "full"),
            sequence_parallel=False,
            # PipelineEngine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline
            # parallelism" (deepspeed/runtime/pipe/engine.py); Megatron's TP runs inside it
            pipeline_max_zero=1,
            sources=(
                "bigscience-workshop/Megatron-DeepSpeed megatron/model/gpt_model.py (GPTModelPipe)",
                "bigscience-workshop/Megatron-DeepSpeed megatron/model/transformer.py",
                "deepspeedai/DeepSpeed deepspeed/runtime/bf16_optimizer.py (2022)",
                "deepspeedai/DeepSpeed deepspeed/runtime/pipe/engine.py (2022)",
                "deepspeedai/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py (2022)",
                "deepspeedai/DeepSpeed deepspeed/runtime/fp16/fused_optimizer.py (2022)",
                "bigscience-workshop/bigscience train/tr11-176B-ml/README.md",
                "bigscience-workshop/bigscience train/tr11-176B-ml/chronicles-prequel.md",
            ),
        ),
        FrameworkProfile(
            name="deepspeed",
            version="DeepSpeed 0.10 and later, as `autoplan export` launches it",
            summary=(
                "DeepSpeed's engine: the model's own attention, reentrant activation "
                "checkpointing, PipelineEngine frees sent activations, ZeRO's bucketed "
                "gradient reduction"
            ),
            # deepspeed.checkpointing.CheckpointFunction is reentrant
            # (deepspeed/runtime/activation_checkpointing/checkpointing.py).
            full_recompute_early_stop=0.0,
            # PipelineEngine sends an activation and drops its reference once the next stage
            # holds it (deepspeed/runtime/pipe/engine.py, _exec_send_activations).
            pipeline_boundary_retention=0.0,
            # ZeRO reduces gradients in buckets as they are produced with overlap_comm, which
            # `autoplan export` sets (its default: on at ZeRO-3 only, zero/config.py
            # overlap_comm_valid; at ZeRO-1 the hooks reduce during the last micro-batch's
            # backward, zero/stage_1_and_2.py process_gradients). Without ZeRO the engine
            # all-reduces after the backward (engine.py allreduce_gradients, buffered fallback),
            # and with a PipelineModule it turns overlap_comm off ("Pipeline parallelism does
            # not support overlapped communication") and reduces after the schedule
            # (pipe/engine.py _exec_reduce_grads). DeepSpeed 0.19.8.
            dp_overlap=1.0,
            dp_overlap_zero_stages=(1, 2, 3),
            pipeline_dp_overlap=False,
            # ZeRO-3 gathers module by module, coalesced up to stage3_prefetch_bucket_size
            # (deepspeed/runtime/zero/partitioned_param_coordinator.py).
            zero3_gathers="per-module",
            # PipelineModule(partition_method="uniform"), as `autoplan export` writes it: the
            # layers evenly (deepspeed/runtime/utils.py, partition_uniform), autoplan's even split
            stage_cuts="own",
            # the pipeline engine's TrainSchedule, 1F1B (deepspeed/runtime/pipe/schedule.py)
            schedules=("1f1b",),
            # sequence_parallel_size is Ulysses attention-head parallelism (deepspeed/sequence)
            sequence_parallel=False,
            # PipelineModule(activation_checkpoint_interval=...): one setting for every stage
            recompute_scope="global",
            # deepspeed.checkpointing re-runs whole layers: no selective recompute
            recompute_modes=("none", "full"),
            # PipelineEngine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline
            # parallelism", and has no AutoTP path (tensor_parallel.autotp_size shards a model
            # in DeepSpeedEngine only; deepspeed/runtime/pipe/engine.py)
            pipeline_max_zero=1,
            pipeline_tensor_parallel=False,
            # PipeModelDataParallelTopology: pipe, data, model (deepspeed/runtime/pipe/topology.py)
            rank_layouts=(("pp", "dp", "tp"),),
            # its sequence parallelism is Ulysses (an all-to-all over attention heads,
            # deepspeed/sequence/layer.py), and its experts are a model-code argument
            # (deepspeed.moe.layer.MoE(ep_size=...)), not a plan degree
            context_parallel=False,
            expert_parallel=False,
            sources=(
                "deepspeedai/DeepSpeed deepspeed/runtime/activation_checkpointing/checkpointing.py",
                "deepspeedai/DeepSpeed deepspeed/runtime/pipe/engine.py",
            ),
        ),
        FrameworkProfile(
            name="torchtitan",
            version="torchtitan 0.1 and later",
            summary=(
                "torchtitan: SDPA/flex attention, op-level selective activation checkpointing "
                "(every second mm re-run), torch.distributed.pipelining, FSDP2"
            ),
            attention="fused",
            full_recompute_early_stop=1.0,
            # selective_ac_option = "op" (its llama3 configs' default): "Saves output of all
            # compute ops, except every second mm" (torchtitan parallelize_llama.py,
            # _custom_policy).
            selective_gemm_recompute_fraction=0.5,
            pipeline_boundary_retention=1.0,
            dp_overlap=1.0,
            # cross_entropy on the fp32 logits (torchtitan/components/loss.py).
            loss_saved_bytes_per_logit=4.0,
            # activation_checkpoint.mode: one setting for every block of every stage
            recompute_scope="global",
            # ParallelDims: pp, dp_replicate, dp_shard, cp, tp (torchtitan/distributed/
            # parallel_dims.py)
            rank_layouts=(("pp", "dp", "tp"),),
            # with cp > 1 FSDP shards the weights over dp_shard x cp (ParallelDims' fsdp mesh)
            cp_min_zero=1,
            # training.mixed_precision_param: bfloat16 or float32 (torchtitan/config/configs.py)
            dtypes=("bf16", "fp32"),
            sources=(
                "pytorch/torchtitan torchtitan/models/llama3/infra/parallelize.py",
                "pytorch/torchtitan torchtitan/components/loss.py",
            ),
        ),
        _LLM_FOUNDRY,
        dataclasses.replace(
            # Priced as llm-foundry's profile, whose every pricing setting this stack shares
            # (bench/data/validation_assumptions_more.yaml, family fa-training2211): flash
            # attention, 16-bit logits kept for the loss's backward (apex xentropy,
            # inplace_backward), DDP overlapping the all-reduce; its own limits below.
            _LLM_FOUNDRY,
            name="flash-attn-training",
            version="Dao-AILab/flash-attention training/ (4a6eaa9f, 2022-11), as its configs run",
            summary=(
                "flash-attention's GPT training code on PyTorch Lightning: flash attention, "
                "apex's in-place cross-entropy, DDP or DDP with torch's ZeroRedundancyOptimizer"
            ),
            # its experiment configs: trainer strategy ddp, or src.utils.ddp_zero1.DDPStrategyZero1
            # with optimizer adamw-zero (torch.distributed.optim.ZeroRedundancyOptimizer: ZeRO-1;
            # training/configs/experiment/owt/gpt2l-flash.yaml, pile/gpt3l-flash.yaml); its
            # flash_attn/models/gpt.py of then has no process group (no tensor parallelism)
            expert_parallel=False,
            zero_stages=(0, 1),
            sources=(
                "Dao-AILab/flash-attention 4a6eaa9f training/configs/experiment/",
                "Dao-AILab/flash-attention 4a6eaa9f training/src/utils/ddp_zero1.py",
                "Dao-AILab/flash-attention 4a6eaa9f flash_attn/models/gpt.py",
            ),
        ),
    )
}


def framework_profile(spec: str) -> FrameworkProfile:
    """The profile ``NAME[:option=value,...]`` names (``megatron-lm-2021:ddp=torch``), named by
    the spec in its normal form (spaces and empty options dropped: ``megatron-lm:`` is
    ``megatron-lm``); `FrameworkError` lists the known names, or the options the profile has."""
    name, _, rest = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    name = name.strip()
    if not isinstance(spec, str) or name not in FRAMEWORKS:
        raise FrameworkError(
            f"unknown framework {shown(spec)}; use one of {', '.join(FRAMEWORKS)} "
            f"(default {DEFAULT_FRAMEWORK})"
        )
    profile = FRAMEWORKS[name]
    changes: dict[str, OptionValue] = {}
    given: list[str] = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, _, value = (part.strip() for part in item.partition("="))
        choices = profile.options.get(key, {})
        if value not in choices:
            known = "; ".join(
                f"{option}={'|'.join(values)}" for option, values in profile.options.items()
            )
            raise FrameworkError(
                f"framework {shown(spec)}: {name} has no option {shown(item)}; "
                + (f"its options: {known}" if known else "it takes no options")
            )
        earlier = next((g for g in given if g.partition("=")[0] == key), None)
        if earlier is not None:
            raise FrameworkError(
                f"framework {shown(spec)}: option {shown(key)} is given twice ({earlier}, "
                f"{key}={value}); give it once"
            )
        changes.update(choices[value])
        given.append(f"{key}={value}")
    if not given:
        return profile
    return dataclasses.replace(profile, name=f"{name}:{','.join(given)}", **changes)  # type: ignore[arg-type]
