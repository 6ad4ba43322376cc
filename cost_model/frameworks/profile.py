"""The profile type: `FrameworkProfile`, its nested records and `FrameworkError`.

A profile states one training stack's behaviour and limits (`cost_model.frameworks`); this
module holds the type and the pricing it reads (`FrameworkProfile.cluster_for`,
`overlaps_dp_sync`), `cost_model.frameworks.limits` the rules that read its limits
(`FrameworkProfile.refusal`, `plan_refusal`), the stacks' own modules the values with their
sources.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from cost_model.errors import InputError
from cost_model.frameworks.limits import (
    Explanation,
    ModelFacts,
    Refusal,
    outer_refusals,
    plan_refusals,
)
from cost_model.hardware import Cluster
from cost_model.memory import RecomputeModule, SelectiveScope, StackActivations
from cost_model.offload import OptimizerOffloadOverlap
from cost_model.schedules import ScheduleName
from cost_model.stage_splits import PipelineSplit, even_stage_starts, own_stage_starts
from cost_model.strategy import Axis, PlanLike, RecomputeMode, Strategy
from cost_model.tp_overlap import TpCommOverlap
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
class Pricing:
    """What the stack changes in the cluster's calibration (`FrameworkProfile.cluster_for`):
    its attention kernel and the `Calibration` fields of the same names; ``None``: as the
    cluster's calibration says."""

    # fused: one flash/memory-efficient kernel (the trace's SDPA op, at the calibration's
    # attention efficiency); unfused: Q K^T, softmax, dropout and x V with the s x s scores in
    # memory (`unfused_attention_efficiency`).
    attention: AttentionKernel | None = None
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
    # `Calibration.pipeline_boundary_retention`: 1 keeps every sent activation until its
    # backward (torch.distributed.pipelining), 0 frees it once sent.
    pipeline_boundary_retention: float | None = None
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
    # `Calibration.fp8_eager_casts` and `fp8_cached_weights`: how the stack casts to fp8.
    fp8_eager_casts: float | None = None
    fp8_cached_weights: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineBehaviour:
    """When the stack's engine overlaps the data-parallel gradient sync with the backward
    (`FrameworkProfile.overlaps_dp_sync`)."""

    # The ZeRO stages at which the stack can overlap the sync at all (``None``: every one), and
    # whether it can with pipeline parallelism; elsewhere the sync follows the backward
    # (`overlaps_dp_sync`).
    dp_overlap_zero_stages: tuple[int, ...] | None = None
    pipeline_dp_overlap: bool = True
    # Under HSDP: the replicas' all-reduce of a group's gradient shard runs on a stream of its
    # own, beside the next groups' reduce-scatters (FSDP2's all_reduce_stream,
    # torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce), or after each
    # reduce-scatter on the same stream (False: Megatron-Core's partial distributed optimizer,
    # one communication stream, param_and_grad_buffer.py start_grad_sync)
    hsdp_all_reduce_beside: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """Limits of the stack over several plan axes, or on its model, and its own words for
    each limit (the single-axis limits are `FrameworkProfile` fields; `cost_model.frameworks.
    limits` reads both)."""

    # The least ZeRO stage with context parallelism (a stack that shards the weights over
    # dp x cp whenever cp > 1); ``None``: any.
    cp_min_zero: int | None = None
    # A mixture-of-experts model with tensor parallelism needs sequence parallelism.
    moe_tp_needs_sequence_parallel: bool = False
    # What its interleaved schedule needs of the micro-batches: at least pp (Megatron-Core's
    # groups of pp or more), or a multiple of pp on more than 2 ranks (Megatron-LM 2021).
    interleaved_microbatches: Literal["pp-or-more", "multiple-of-pp"] | None = None
    # With data parallelism outside the pipeline ([dp, pp, ...]) and pp > 1, ep must be
    # tp x cp: the experts' data-parallel size must equal the dense one.
    dp_outer_ep_is_tp_cp: bool = False
    # The stack runs the traced graph itself (autoplan's runtime): a torch.export graph pins
    # its dtype (fp32), inlines its norms (no sequence parallelism) and fixes its sequence (no
    # context parallelism), and context parallelism splits the model's RoPE tables.
    runs_traced_graph: bool = False
    # Whether its HSDP runs with context parallelism (shard groups of dp_shard_degree x cp
    # ranks, torchtitan's dp_shard x cp); autoplan's runtime builds a 2-D (replicate, shard)
    # mesh of dp ranks only.
    hsdp_context_parallel: bool = True
    # Its expert parallelism runs neither beside DDP + ZeroRedundancyOptimizer (ZeRO-1) nor
    # with selective recompute around separately wrapped experts under FSDP2 (autoplan's
    # runtime).
    expert_wrapper_limits: bool = False
    # Its expert tensor parallelism below tp (1 < etp < tp) needs every TP rank to route its
    # own tokens (sequence parallelism) and Megatron-Core's expert groups (ep folded over the
    # expert-TP groups, or ep 1): autoplan's runtime builds the expert layer's own (edp, ep,
    # etp) mesh in that order then (passes/mesh.py); its words for why are `explained` "etp".
    etp_below_tp_needs_sp_folding: bool = False
    # Each limit in the stack's own terms, citing its code (`Explanation`): what `autoplan
    # export` says of a plan that breaks it. Keyed by `LimitKey`, or ``limit:value`` where
    # one value needs its own words (``schedule:gpipe``).
    explained: Mapping[str, Explanation] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameworkProfile:
    """A training stack's behaviour; ``None``: as the cluster's calibration says."""

    name: str
    # The releases whose behaviour this describes (behaviour changed at the stated versions).
    version: str
    summary: str
    # The calibration it prices the stack with (`Pricing`).
    pricing: Pricing = field(default_factory=Pricing)
    # How its engine overlaps the data-parallel sync (`EngineBehaviour`).
    engine_behaviour: EngineBehaviour = field(default_factory=EngineBehaviour)
    # Its limits over several axes or on its model, and its words for each (`Capabilities`).
    capabilities: Capabilities = field(default_factory=Capabilities)
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
    # Whether gradient sync overlaps the backward (1) or follows it (0); the cluster's
    # `dp_overlap_fraction` still bounds it (a CPU worker's one core cannot overlap).
    dp_overlap: float | None = None
    # `Calibration.tp_block_host_floor_s`: the least time a tensor-parallel block takes per
    # micro-batch on a GPU, set by the stack's host work for it (written on GPU clusters only:
    # a CPU worker's host time adds to its compute, `autoplan calibrate` measures it there).
    tp_block_host_floor_s: float | None = None
    # `Calibration.step_overhead_s`: the stack's own fixed time per step, where one is known.
    step_overhead_s: float | None = None
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
    # The ZeRO stages at which the stack runs HSDP (`Plan.dp_shard_degree`: sharding within
    # groups of consecutive data-parallel ranks, replicating across them); empty: none. Its
    # words for why not, where it states them, are `Capabilities.explained` "hsdp".
    hsdp_zero_stages: tuple[int, ...] = ()
    # Whether the stack splits routed experts over expert-tensor-parallel ranks
    # (`Plan.etp_degree` > 1); its words for why not are `Capabilities.explained` "etp".
    expert_tensor_parallel: bool = False
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
    # How the stack runs torch.compile on the model (`Plan.compile`, `cost_model.parts.fusion`):
    # "stage", a setting per pipeline stage (autoplan's runtime compiles each stage's blocks
    # as its plan says); "global", one setting for the whole model; ``None``: it does not
    # torch.compile the model, and a compiled plan is refused (`limits.compile_refusal`).
    compile_scope: Literal["stage", "global"] | None = None
    # Partial recompute (`stages[i].recompute_units`, `cost_model.partial_recompute`): "stage",
    # any count per stage under either mode (autoplan's runtime); "block", full recompute of
    # the first N blocks of every stage, one N for all (Megatron-LM's --recompute-method
    # block); ``None``: whole stages only, a partial plan refused (`limits.partial_refusals`)
    # with ``partial_recompute_why``, the stack's own reason where stated.
    partial_recompute: Literal["stage", "block"] | None = None
    partial_recompute_why: str = ""
    # The ZeRO stages at which the stack keeps and steps a share of the optimizer on the host
    # (`Plan.optimizer_offload`, `cost_model.parts.offload`), and those at which that share
    # may be below 1 (at the others it is all or nothing); empty: no optimizer offload, in
    # its own words where it states them (`Capabilities.explained` "optimizer_offload").
    optimizer_offload_zero_stages: tuple[int, ...] = ()
    optimizer_offload_partial_zero_stages: tuple[int, ...] = ()
    # How it orders the offloaded share's copies and host step with the device's step
    # (`cost_model.offload.OptimizerOffloadOverlap`, `cost_model.parts.offload.OffloadCost`).
    optimizer_offload_overlap: OptimizerOffloadOverlap = "pipelined"
    # Why its offloaded optimizer cannot run beside weights all-gathered in fp8
    # (`Strategy.fp8_all_gather`), in its words; "": it can.
    optimizer_offload_fp8_gather_why: str = ""
    # How the stack offloads a block's saved activations (`StagePlan.activation_offload`,
    # `cost_model.parts.offload.offloaded_unit_cost`): "overlapped" (copies on their own
    # streams), "blocking" (on the compute stream); ``None``: it does not, refused
    # (`limits.activation_offload_refusals`) with ``activation_offload_why`` where stated. Its
    # limits: ``activation_offload_rules`` "megatron-core", Megatron-Core's TransformerConfig
    # checks (no pipeline parallelism, no recompute, fewer layers than the model's).
    activation_offload: Literal["overlapped", "blocking"] | None = None
    activation_offload_why: str = ""
    activation_offload_rules: Literal["megatron-core"] | None = None
    # The training dtypes the stack runs (``None``: fp32, bf16 and fp16), and the fp8 recipes
    # (`cost_model.precision`; none unless stated).
    dtypes: tuple[str, ...] | None = None
    fp8_recipes: tuple[str, ...] = ()
    # The precision policies the stack runs (`cost_model.precision`): the gradient reduction
    # dtypes it has (``None``: every valid one), and its (master weights, AdamW states, least
    # ZeRO stage) combinations (``None``: every valid one at any stage), e.g. Megatron-LM's
    # bf16 moments from the distributed optimizer on (`limits.precision_refusal`).
    grad_reduce_dtypes: tuple[str, ...] | None = None
    master_and_states: tuple[tuple[str, str, int], ...] | None = None
    # How the stack overlaps its sequence-parallel TP collectives with the GEMMs
    # (`Plan.tp_comm_overlap`, `cost_model.tp_overlap`); ``None``: it does not (a plan asking
    # for it is refused, `limits`).
    tp_comm_overlap: TpCommOverlap | None = None
    sources: tuple[str, ...] = ()
    # The stack's own flags that change its behaviour, given as ``NAME:option=value``:
    # option -> value -> the profile fields it sets (e.g. Megatron-LM 2021's --DDP-impl).
    options: Mapping[str, Mapping[str, Mapping[str, OptionValue]]] = field(default_factory=dict)

    def refusal(
        self, strategy: Strategy, model: ModelFacts, *, running: bool = False
    ) -> Refusal | None:
        """Why the stack cannot run ``strategy``'s outer choices on ``model``; None when it
        can (`cost_model.frameworks.limits.outer_refusals`; ``running`` as there)."""
        return next(outer_refusals(self, strategy, model, running=running), None)

    def plan_refusal(
        self, plan: PlanLike, model: ModelFacts, *, running: bool = False
    ) -> Refusal | None:
        """Why the stack cannot run ``plan`` on ``model``: the first limit it breaks
        (`cost_model.frameworks.limits.plan_refusals`; ``running`` as there); None when it
        can."""
        return next(plan_refusals(self, plan, model, running=running), None)

    @property
    def saved_activations(self) -> StackActivations:
        """What the stack saves for backward beyond the traced model (`cost_model.memory`)."""
        return StackActivations(
            unfused_attention=self.pricing.attention == "unfused",
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
            self.engine_behaviour.dp_overlap_zero_stages is not None
            and strategy.zero_stage not in self.engine_behaviour.dp_overlap_zero_stages
        ):
            return False
        return self.engine_behaviour.pipeline_dp_overlap or strategy.pp_degree == 1

    def stage_starts(self, profile: ModelFacts, num_stages: int) -> tuple[int, ...]:
        """The first unit of each stage as this stack cuts ``num_stages`` stages when no cut
        is stated (`cost_model.stage_splits.own_stage_starts`): what `autoplan.manual_plan`
        and the search build for it; `StageSplitError` where its rule cuts inside a unit.
        A split rule reads the traced model (a `ModelProfile`); without one, its units."""
        if self.pipeline_split is None:
            return even_stage_starts(profile.num_units, num_stages)
        if not isinstance(profile, ModelProfile):
            raise TypeError(f"{self.name}'s pipeline split reads the traced model's units")
        return own_stage_starts(profile, num_stages, self.pipeline_split)

    def cluster_for(self, profile: ModelProfile, cluster: Cluster) -> Cluster:
        """``cluster`` with this stack's behaviour in its calibration."""
        cal = cluster.calibration
        changes: dict[str, float] = {}
        if self.pricing.attention == "unfused" and profile.num_heads:
            # an unfused core computes every score; the trace counts a causal kernel's half
            head_dim, fraction = round(profile.head_dim), profile.score_fraction
            forward, backward = self.pricing.unfused_score_bytes or (None, None)
            changes["attention_efficiency"] = (
                unfused_attention_efficiency(cluster, head_dim, "forward", forward) * fraction
            )
            changes["attention_backward_efficiency"] = (
                unfused_attention_efficiency(cluster, head_dim, "backward", backward) * fraction
            )
        if self.pricing.attention == "fused":
            for prefix, value in self.pricing.attention_efficiency_by_device.items():
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
            "fp8_eager_casts",
            "fp8_cached_weights",
        ):
            value = getattr(self.pricing, name)
            if value is not None:
                changes[name] = value
        if self.step_overhead_s is not None:
            changes["step_overhead_s"] = self.step_overhead_s
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
    2019's separate scale and mask: `Pricing.unfused_score_bytes`).

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
