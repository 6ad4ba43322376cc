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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from cost_model.errors import InputError
from cost_model.hardware import Cluster
from cost_model.schedules import ScheduleName, runs_in_gpipe_order
from cost_model.stage_splits import PipelineSplit
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
    # False: the stack has no pipeline parallelism; its largest ZeRO stage (``None``: any).
    pipeline_parallel: bool = True
    max_zero: int | None = None
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

    def refusal(self, strategy: Strategy, *, moe: bool = False) -> str | None:
        """Why the stack cannot run ``strategy``'s outer choices on a model (``moe``: with
        experts), in a phrase; None when it can."""
        if not self.context_parallel and strategy.cp_degree > 1:
            return f"{self.name} has no ring-attention context parallelism (cp 1)"
        if not self.expert_parallel and strategy.ep_degree > 1:
            return f"{self.name} has no expert parallelism as a plan degree (ep 1)"
        if not self.pipeline_parallel and strategy.pp_degree > 1:
            return f"{self.name} has no pipeline parallelism (pp 1)"
        if self.max_zero is not None and strategy.zero_stage > self.max_zero:
            return f"{self.name} has no ZeRO beyond stage {self.max_zero} (zero <= {self.max_zero})"
        if (
            self.cp_min_zero is not None
            and strategy.cp_degree > 1
            and strategy.zero_stage < self.cp_min_zero
        ):
            return (
                f"{self.name} shards the weights over dp x cp with context parallelism "
                f"(zero >= {self.cp_min_zero} with cp > 1)"
            )
        if (
            self.moe_tp_needs_sequence_parallel
            and moe
            and strategy.tp_degree > 1
            and not strategy.sequence_parallel
        ):
            return f"{self.name} needs sequence parallelism for experts with tp > 1"
        if strategy.pp_degree == 1:
            return None
        m, p = strategy.num_micro_batches, strategy.pp_degree
        interleaved = strategy.schedule == "interleaved-1f1b"
        if interleaved and self.interleaved_microbatches == "pp-or-more" and m < p:
            return (
                f"{self.name}'s interleaved schedule needs at least pp micro-batches "
                "(m >= pp for interleaved-1f1b)"
            )
        strict = self.interleaved_microbatches == "multiple-of-pp"
        if interleaved and strict and (m % p or p <= 2):
            return (
                f"{self.name}'s interleaved schedule needs more than 2 pipeline ranks and a "
                "multiple of pp micro-batches (pp > 2, m % pp = 0 for interleaved-1f1b)"
            )
        if not self.pipeline_tensor_parallel and strategy.tp_degree > 1:
            return f"{self.name}'s pipeline engine has no tensor parallelism (tp 1 with pp > 1)"
        if self.pipeline_max_zero is not None and strategy.zero_stage > self.pipeline_max_zero:
            return (
                f"{self.name}'s pipeline engine runs ZeRO {self.pipeline_max_zero} at most "
                f"(zero <= {self.pipeline_max_zero} with pp > 1)"
            )
        return None

    def plan_refusal(self, plan: PlanLike, *, moe: bool = False) -> str | None:
        """Why the stack cannot run ``plan``: `refusal` of its outer choices, its schedule,
        sequence parallelism, dtype, rank order and its stages' recompute; None when it can."""
        strategy = Strategy.of(plan)
        if (why := self.refusal(strategy, moe=moe)) is not None:
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
            return f"{self.name} runs only {', '.join(self.schedules)} (schedule)"
        if self.sequence_parallel is False and strategy.sequence_parallel:
            return f"{self.name} has no Megatron-style sequence parallelism (sequence_parallel)"
        if self.dtypes is not None and strategy.dtype not in self.dtypes:
            return f"{self.name} trains in {' or '.join(self.dtypes)} (dtype)"
        modes = sorted({stage.recompute for stage in plan.stages})
        if self.recompute_modes is not None and not set(modes) <= set(self.recompute_modes):
            return f"{self.name} has only {' and '.join(self.recompute_modes)} recompute"
        if self.recompute_scope == "global" and len(modes) > 1:
            return (
                f"{self.name} has one recompute setting for all stages; the plan mixes "
                f"{' and '.join(modes)}"
            )
        if self.rank_layouts is not None:
            # as the stack sees it: the axes of degree > 1, cp just outside tp
            used = [axis for axis in strategy.rank_layout if strategy.degree(axis) > 1]
            allowed: list[list[str]] = [
                [*layout[:-1], "cp", layout[-1]] for layout in self.rank_layouts
            ]
            if not any(is_subsequence(used, order) for order in allowed):
                return (
                    f"{self.name} orders its process groups "
                    f"{' or '.join(map(str, map(list, self.rank_layouts)))} (rank_layout)"
                )
        return None

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
            full_recompute_early_stop=0.0,
            selective_gemm_recompute_fraction=0.0,
            pipeline_boundary_retention=0.0,
            # --DDP-impl defaulted to 'local': one all-reduce of the contiguous gradient buffer
            # after the backward (megatron/arguments.py, megatron/model/distributed.py);
            # 'torch' is torch's DDP, whose buckets overlap the backward.
            dp_overlap=0.0,
            options={
                "ddp": {"local": {"dp_overlap": 0.0}, "torch": {"dp_overlap": 1.0}},
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
            max_zero=0,
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
            # ZeRO reduces gradients in buckets as they are produced (reduce_bucket_size;
            # deepspeed/runtime/zero/stage_1_and_2.py).
            dp_overlap=1.0,
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
        FrameworkProfile(
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
            sources=(
                "mosaicml/llm-foundry scripts/train/benchmarking/sweep.sh (torch 2.0.1 image)",
                "mosaicml/llm-foundry llmfoundry/models/mpt/modeling_mpt.py (loss_fn)",
                "Dao-AILab/flash-attention flash_attn/ops/triton/cross_entropy.py",
            ),
        ),
    )
}


def framework_profile(spec: str) -> FrameworkProfile:
    """The profile ``NAME[:option=value,...]`` names (``megatron-lm-2021:ddp=torch``);
    `FrameworkError` lists the known names, or the options the profile has."""
    name, _, rest = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not isinstance(spec, str) or name not in FRAMEWORKS:
        raise FrameworkError(
            f"unknown framework {spec!r}; use one of {', '.join(FRAMEWORKS)} "
            f"(default {DEFAULT_FRAMEWORK})"
        )
    profile = FRAMEWORKS[name]
    changes: dict[str, OptionValue] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, _, value = item.partition("=")
        choices = profile.options.get(key.strip(), {})
        if value.strip() not in choices:
            known = "; ".join(
                f"{option}={'|'.join(values)}" for option, values in profile.options.items()
            )
            raise FrameworkError(
                f"framework {spec!r}: {name} has no option {item!r}; "
                + (f"its options: {known}" if known else "it takes no options")
            )
        changes.update(choices[value.strip()])
    if not rest:
        return profile
    return dataclasses.replace(profile, name=spec, **changes)  # type: ignore[arg-type]
