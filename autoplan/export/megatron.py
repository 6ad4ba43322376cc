"""Megatron-LM: the ``pretrain_gpt.py`` arguments that run a plan.

Flags are those of Megatron-LM's ``megatron/training/arguments.py`` (NVIDIA/Megatron-LM at
d98e8a6, 2026-08-22). Many of them are generated from megatron-core dataclasses by
``ArgumentGroupFactory`` (``--field-name`` for each field of ``TransformerConfig`` and
``ModelParallelConfig``), so the flag, its dataclass field and megatron-core's check are one
thing; the rest are ``group.add_argument`` calls, cited by function below.

Plan field -> flag:

- ``tp_degree`` -> ``--tensor-model-parallel-size``, ``pp_degree`` ->
  ``--pipeline-model-parallel-size`` (``ModelParallelConfig`` fields).
- ``stages`` and ``virtual_stages`` -> ``--pipeline-model-parallel-layout``
  (``_add_distributed_args``): one ``|``-separated entry per stage in stage order, ``E`` the
  embedding, ``t`` a block, ``L`` the output layer and loss. Stage ``i`` runs on pipeline rank
  ``i % pp``, and the virtual stage count is the number of entries / pp (``validate_args``;
  parsed by megatron-core's ``PipelineParallelLayerLayout``). It states any cut exactly, so
  uneven plans need neither ``--decoder-first/last-pipeline-num-layers`` (first and last
  stage only) nor ``--num-virtual-stages-per-pipeline-rank`` (even split); it excludes both.
- ``schedule``: Megatron picks it from the degrees (``get_forward_backward_func`` in
  ``megatron/core/pipeline_parallel/schedules.py``): no pipelining for pp = 1, 1F1B for
  pp > 1, interleaved 1F1B with virtual stages. GPipe and the zero-bubble schedules have no
  flag (a gpipe plan with fewer micro-batches than stages is Megatron's 1F1B, which then runs
  in that order). Interleaved: Megatron runs a virtual stage's micro-batches in groups of
  ``--microbatch-group-size-per-virtual-pipeline-stage`` (default pp; it needs pp <= group <=
  m, m a multiple of it); the export states torch's group, m / max(1, m // pp), where it
  differs, so the order is the one autoplan priced, and refuses m < pp.
- ``micro_batch_size`` -> ``--micro-batch-size``; ``global_batch_size`` ->
  ``--global-batch-size`` (Megatron derives the micro-batches per step as
  global / (micro x data-parallel size), ``megatron/core/num_microbatches_calculator.py``).
- ``sequence_parallel`` -> ``--sequence-parallel`` (``ModelParallelConfig``).
- ``tp_comm_overlap`` -> ``--tp-comm-overlap`` (``ModelParallelConfig.tp_comm_overlap``):
  Transformer Engine's userbuffers with ``initialize_ub``'s default splits, the ones the plan is
  priced with (`cost_model.frameworks.megatron`, no ``--tp-comm-overlap-cfg``).
  ``validate_args`` asserts ``--sequence-parallel`` with it, as the plan does;
  ``_initialize_tp_communicators`` (megatron/training/initialize.py) needs Transformer Engine.
- ``stages[*].recompute`` (one mode for all) -> ``--recompute-granularity selective`` (which
  recomputes core attention, ``recompute_modules`` default ``["core_attn"]``, as autoplan's
  selective keeps the matmul outputs) or ``full`` with ``--recompute-method uniform
  --recompute-num-layers 1`` (every layer checkpointed; ``TransformerConfig``). Partial stages
  (``stages[*].recompute_units``) -> ``--recompute-granularity full --recompute-method block
  --recompute-num-layers N``: the first N layers of every pipeline (virtual) stage
  (``transformer_block.py``, ``_checkpointed_forward``), one N for all; selective partial
  stages or counts no single N states are refused (`limits.partial_refusals`).
- ``zero_stage``: 1 -> ``--use-distributed-optimizer`` (optimizer state sharded over the
  data-parallel group, ``_add_distributed_args``); 2 and 3 -> Megatron-FSDP,
  ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`` / ``optim_grads_params``
  with ``--ckpt-format fsdp_dtensor``, which ``validate_args`` requires for Megatron-FSDP, and
  ``--megatron-fsdp-version 1`` (the default, stated: version 2 refuses tp, pp and cp > 1).
  With pp_degree > 1 ZeRO-2/3 is refused (the profile's "pipeline-zero": nothing in Megatron-LM
  shows Megatron-FSDP running with pipeline parallelism; cost_model/frameworks/megatron.py).
  HSDP (``dp_shard_degree`` s) adds ``--num-distributed-optimizer-instances dp / s``
  (``_add_distributed_args``; ``DistributedDataParallelConfig``): the distributed optimizer or
  Megatron-FSDP shards within dp x cp / instances consecutive ranks of the dp-cp group (dp_shard
  s consecutive dp ranks x cp, the plan's groups; ``initialize_model_parallel``'s
  intra-partial data-parallel groups) and all-reduces each gradient shard across the instances
  (the partial distributed optimizer, ``param_and_grad_buffer.py``; Megatron-FSDP's HSDP with
  ``--outer-dp-sharding-strategy no_shard``, the default).
- ``dtype`` -> ``--bf16`` / ``--fp16`` (``_add_mixed_precision_args``; fp32 is the default).
  An fp8 recipe trains in bf16 (``--bf16``) with Transformer Engine's fp8 GEMMs
  (``TransformerConfig.fp8`` / ``fp8_recipe``, flags ``--fp8-format`` / ``--fp8-recipe``):
  ``fp8`` -> ``--fp8-format hybrid --fp8-recipe tensorwise`` (e4m3 forward, e5m2 gradients;
  TE's ``Float8CurrentScaling``, ``get_fp8_recipe`` in ``megatron/core/fp8_utils.py``, TE >= 2.2);
  ``mxfp8`` -> ``--fp8-format e4m3 --fp8-recipe mxfp8`` (``MXFP8BlockScaling``, e4m3 elements as
  NVIDIA's own mxfp8 runs set it, e.g. ``tests/functional_tests/test_cases/nemotron/
  nemotron3_super_release_gb200``). ``fp8-rowwise`` has no Megatron recipe (``fp8_recipe`` is
  tensorwise, delayed, mxfp8, blockwise or custom): refused in the profile's words.
- The precision policy (`Plan.precision`, `cost_model.precision`), from the flags and checks of
  ``_add_mixed_precision_args``, ``validate_args`` and megatron-core's ``OptimizerConfig``:
  ``grad_reduce_dtype`` bf16 -> ``--grad-reduce-in-bf16`` (Megatron accumulates and reduces bf16
  gradients in fp32 by itself, ``accumulate_allreduce_grads_in_fp32``), fp32 under fp16 ->
  ``--accumulate-allreduce-grads-in-fp32``; under Megatron-FSDP (zero_stage 2-3), whose own
  buffers follow ``--megatron-fsdp-main-grads-dtype`` (default ``auto``: the compute dtype, so
  bf16 gradients reduce in bf16 there unless stated), ``--megatron-fsdp-main-grads-dtype`` is
  always the plan's reduction dtype. ``master_dtype`` bf16 -> ``--megatron-fsdp-main-params-
  dtype auto`` (no main-weight buffer: the compute weights are the master), which exists under
  Megatron-FSDP only (``--main-params-dtype`` is fp32 or fp16; the profile refuses it below
  zero_stage 2). ``optimizer_state_dtype`` bf16 -> ``--use-precision-aware-optimizer
  --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`` (Transformer Engine's FusedAdam; megatron-core
  asserts the distributed optimizer, zero_stage >= 1, which the profile requires).
- ``optimizer_offload`` f -> ``--optimizer-cpu-offload --optimizer-offload-fraction f
  --overlap-cpu-optimizer-d2h-h2d`` with ``--use-precision-aware-optimizer``, which
  ``validate_args`` asserts beside the offload (Megatron-Core's HybridDeviceOptimizer steps the
  first f of the distributed optimizer's shard with torch's AdamW on the host; the profile
  allows it at zero_stage 1 only).
- ``stages[0].activation_offload`` N -> ``--cpu-offloading-num-layers N`` (``arguments.py`` sets
  ``cpu_offloading`` with it; Transformer Engine's ``get_cpu_offload_context`` moves the first N
  layers' saved activations to the host on side streams); ``TransformerConfig`` refuses it with
  pipeline parallelism, with recompute and for N >= num_layers, and so does the profile.
- ``fp8_all_gather`` -> ``--fp8-param-gather`` (``_add_transformer_engine_args``; Megatron-LM
  copies it into ``TransformerConfig.fp8_param``): the parameters kept in fp8 and all-gathered
  in fp8, which ``validate_args`` allows only with the distributed optimizer or Megatron-FSDP,
  i.e. zero_stage >= 1, as the plan requires.
- ``fp8_exclude``: Megatron-LM builds its output layer as a bf16 ``ColumnParallelLinear``
  outside TE's fp8 (``megatron/core/models/gpt/gpt_model.py``), except under mxfp8 with
  ``--fp8-output-proj`` (``TELMHeadColumnParallelLinear``), which a plan that converts ``head``
  under mxfp8 gets; under fp8 the head must stay in ``fp8_exclude``. Its MoE router computes in
  bf16 or fp32 (``router_gating_linear``, ``megatron/core/transformer/moe/router.py``), so a
  MoE plan keeps ``router`` in it; its routed experts run in fp8 where autoplan keeps them in
  bf16 (a note says so). Whole blocks kept in bf16 at the start and the end ->
  ``--first-last-layers-bf16 --num-layers-at-start-in-bf16 A --num-layers-at-end-in-bf16 B``
  (``TransformerConfig``: global layer indices, ``is_first_last_bf16_layer`` in fp8_utils.py;
  each count at most num_layers // pp, its ``__post_init__``); blocks in the middle or parts of
  a block are refused naming them.
- data parallelism -> ``--overlap-grad-reduce`` (bucketed gradient reduction during the
  backward, ``_add_distributed_args``; off by default) when the plan is priced with gradient
  sync overlapping the backward: its framework profile's ``dp_overlap`` with the options
  applied (``megatron-lm``, ``megatron-lm:overlap-grad-reduce=on``,
  ``megatron-lm-2021:ddp=torch``, and the other stacks, which overlap). A plan priced without
  it (``megatron-lm:overlap-grad-reduce=off``; ``megatron-lm-2021``, whose ``ddp=local``
  all-reduces after the backward) launches without it. The other framework options need no
  flag: ``split=...`` is how Megatron cuts stages when no cut is stated, and the layout below
  states the plan's; ``megatron-lm-2021:fork=zero-bubble`` prices sail-sg's zero-bubble fork,
  whose schedules NVIDIA's Megatron-LM lacks (refused with the schedule).
- ``rank_layout``: Megatron orders ranks ``tp-cp-ep-dp-pp`` (innermost first), or
  ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping`` (``megatron/training/initialize.py``,
  ``initialize_model_parallel(order=...)``): [pp, dp, cp, tp] or [dp, pp, cp, tp] outermost
  first (cp left out when it is 1).
- ``cp_degree`` -> ``--context-parallel-size`` (``ModelParallelConfig``) with ``--cp-comm-type
  p2p``, Megatron's ring attention (``_add_distributed_args``; the default, stated), run by
  Transformer Engine's attention (the default ``--transformer-impl``; the local attention
  asserts ``context_parallel_size == 1``). ``validate_args`` asserts that 2 x cp divides
  ``--seq-length`` (its load-balanced causal split, as autoplan's), and wants
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with CP as with TP.
- ``ep_degree`` -> ``--expert-model-parallel-size`` with ``--expert-tensor-parallel-size``
  ``etp_degree`` (``ModelParallelConfig``; 1 unless the plan splits experts over TP ranks:
  Megatron's own default would be tp) and
  ``--moe-token-dispatcher-type alltoall`` (the all-to-all autoplan prices; Megatron's default
  is ``allgather``). Megatron-Core builds the expert groups with a second rank generator over
  the same ranks, order ``tp-cp-ep-dp-pp`` read as ``etp-ep-edp-pp`` (``initialize_model_parallel``
  in ``megatron/core/parallel_state.py``): with etp = 1 an ep group is ep consecutive ranks of
  the dp x cp x tp block, which is autoplan's ``ep_folding`` (or any ep layout when
  tp = cp = 1); with etp > 1, ep consecutive groups of etp ranks (autoplan's folding over
  tp / etp, or ep inside dp when etp = tp and cp = 1). With ``--use-tp-pp-dp-mapping`` and
  pp > 1 it asserts that the experts' data-parallel size equals the dense one, i.e.
  ep = tp x cp.
- A mixture-of-experts model adds its expert args: ``--num-experts`` (``_add_moe_args``),
  ``--moe-router-topk``, ``--moe-ffn-hidden-size``, ``--moe-shared-expert-intermediate-size``,
  ``--moe-layer-freq`` for leading dense layers, ``--moe-router-pre-softmax`` when the top-k
  probabilities are not renormalised (softmax over all experts, then top-k; without it Megatron
  takes the softmax of the top-k logits, which is the renormalised form) and
  ``--moe-aux-loss-coeff`` (``TransformerConfig``; ``--moe-router-load-balancing-type
  aux_loss`` is the default). Sequence parallelism is required for a MoE model with TP:
  Megatron-LM's ``yaml_arguments.py`` asserts it ("When using MoE and tensor parallelism,
  sequence parallelism must be used"), megatron-core's ``ModelParallelConfig`` warns that EP
  with TP must use it, and autoplan's runtime routes each TP rank's sequence shard.
- The launch line: torchrun with ``--standalone`` on one node, a c10d rendezvous at
  ``$MASTER_ADDR:$MASTER_PORT`` on more (`autoplan.export.launch`), behind
  ``env CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP or CP (`environment`). The arguments are checked
  as Megatron-LM checks them when it starts (`autoplan.export.megatron_rules`: ``validate_args``
  and megatron-core's configs, each rule cited by file, function and lines).
- The model: ``--num-layers --hidden-size --ffn-hidden-size --num-attention-heads``
  (``TransformerConfig``), ``--group-query-attention --num-query-groups``, ``--seq-length``,
  ``--max-position-embeddings``, ``--kv-channels`` when a head is not hidden / heads wide, and
  for Llama ``--normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base
  --disable-bias-linear`` (``_add_network_size_args``).
"""

from __future__ import annotations

from typing import NamedTuple

from autoplan.contract.plan import Plan
from autoplan.export._common import (
    Export,
    ExportError,
    ExportProblem,
    Framework,
    Launch,
    ModelDims,
    cp_sequence_problem,
    effective_layout,
    expert_problems,
    overlaps_grad_sync,
    stack_problems,
    stage_layers,
    uniform_recompute,
    units_problem,
)
from autoplan.export.fp8 import Fp8Layers, exclude_text, fp8_layers, unknown_problem
from autoplan.export.launch import launch_variables, torchrun_command
from autoplan.export.megatron_rules import check_megatron_args
from cost_model.frameworks import framework_profile
from cost_model.partial_recompute import block_method_count
from cost_model.precision import compute_dtype
from cost_model.schedules import interleaved_rounds
from cost_model.strategy import is_subsequence

FRAMEWORK: Framework = "megatron-lm"
ARGS_FILE = "megatron_args.txt"

# Megatron's rank orders, outermost first (initialize.py: 'tp-cp-ep-dp-pp' read innermost first)
_DEFAULT_ORDER = ("pp", "dp", "cp", "tp")


def megatron_args(plan: Plan, dims: ModelDims) -> tuple[str, ...]:
    """The Megatron-LM arguments of ``plan`` on model ``dims``; raises `ExportError` listing
    every field Megatron-LM cannot express."""
    problems = _problems(plan, dims)
    if problems:
        raise ExportError(FRAMEWORK, problems)
    args: list[str] = []
    args += _model_args(dims)
    args += ["--tensor-model-parallel-size", str(plan.tp_degree)]
    args += ["--pipeline-model-parallel-size", str(plan.pp_degree)]
    if plan.num_stages > 1:
        args += ["--pipeline-model-parallel-layout", pipeline_layout(plan, dims)]
    if (group := _microbatch_group(plan)) is not None:
        args += ["--microbatch-group-size-per-virtual-pipeline-stage", str(group)]
    if plan.sequence_parallel:
        args += ["--sequence-parallel"]
    if plan.tp_comm_overlap:
        args += ["--tp-comm-overlap"]
    if plan.cp_degree > 1:
        args += ["--context-parallel-size", str(plan.cp_degree), "--cp-comm-type", "p2p"]
    if dims.moe is not None:
        args += ["--expert-model-parallel-size", str(plan.ep_degree)]
        args += ["--expert-tensor-parallel-size", str(plan.etp_degree)]
        if plan.ep_degree > 1:
            args += ["--moe-token-dispatcher-type", "alltoall"]
    if _tp_pp_dp_mapping(plan):
        args += ["--use-tp-pp-dp-mapping"]
    args += ["--micro-batch-size", str(plan.micro_batch_size)]
    args += ["--global-batch-size", str(plan.global_batch_size)]
    recompute = uniform_recompute(plan)
    if recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif recompute == "full" and (blocks := _recompute_blocks(plan)) is not None:
        # partial recompute: the first N layers of every pipeline (virtual) stage
        args += ["--recompute-granularity", "full", "--recompute-method", "block"]
        args += ["--recompute-num-layers", str(blocks)]
    elif recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        args += ["--recompute-num-layers", "1"]
    if plan.dp_degree > 1 and overlaps_grad_sync(plan):
        # the overlap the plan's framework profile prices, options applied (cost_model.frameworks)
        args += ["--overlap-grad-reduce"]
    if plan.zero_stage == 1:
        args += ["--use-distributed-optimizer"]
    elif plan.zero_stage >= 2:
        strategy = "optim_grads" if plan.zero_stage == 2 else "optim_grads_params"
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
        # version 1 (the default) stated: version 2 refuses tp, pp or cp > 1
        # (mcore_fsdp_adapter.py FullyShardedDataParallelV2._validate_config L601-650)
        args += ["--megatron-fsdp-version", "1"]
        args += ["--ckpt-format", "fsdp_dtensor"]
    if plan.dp_shard_degree is not None:  # HSDP (zero_stage >= 1, checked by the plan)
        instances = plan.dp_degree // plan.dp_shard_degree
        args += ["--num-distributed-optimizer-instances", str(instances)]
    if compute_dtype(plan.dtype) == "bf16":
        args += ["--bf16"]
    elif plan.dtype == "fp16":
        args += ["--fp16"]
    args += _precision_args(plan)
    if (layers := fp8_layers(plan, dims)) is not None:
        args += _fp8_args(plan, layers)
    # the exporter's own line checked as Megatron-LM checks it when it starts
    check_megatron_args(args, world_size=plan.num_devices, env=environment(plan))
    return tuple(args)


def environment(plan: Plan) -> dict[str, str]:
    """The environment Megatron-LM needs for ``plan``: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with
    TP or CP (one hardware queue, so each layer's TP/CP collective is issued before the GEMM
    that follows it and overlaps it; validate_args L1453-1481 asserts it before Blackwell),
    except under Megatron-FSDP, which asserts it is not 1 (L1166-1167: its all-gathers and
    reduce-scatters run beside compute on streams of their own)."""
    if (plan.tp_degree > 1 or plan.cp_degree > 1) and plan.zero_stage < 2:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def _recompute_blocks(plan: Plan) -> int | None:
    """The one ``--recompute-num-layers`` of the block method that states the plan's partial
    stages (`block_method_count`; None: no stage is partial). A plan no single N states was
    refused before (`limits.partial_refusals`)."""
    stages = [(s.first_unit, s.last_unit, s.recompute_units) for s in plan.stages]
    blocks, why = block_method_count(stages, plan.num_units)
    assert why is None, why
    return blocks


def _precision_args(plan: Plan) -> list[str]:
    """The plan's precision policy as Megatron-LM's flags (module doc)."""
    policy, args = plan.precision, []
    if plan.zero_stage >= 2:
        # Megatron-FSDP's own buffers (its MixedPrecisionPolicy), not the DDP flags
        args += ["--megatron-fsdp-main-grads-dtype", policy.grad_reduce]
        if not policy.master_copy and policy.compute != "fp32":
            args += ["--megatron-fsdp-main-params-dtype", "auto"]
    elif policy.grad_reduce == "bf16":
        args += ["--grad-reduce-in-bf16"]
    elif policy.grad_reduce == "fp32" and policy.compute == "fp16":
        args += ["--accumulate-allreduce-grads-in-fp32"]
    if policy.optimizer_state == "bf16" or plan.optimizer_offload > 0:
        # (arguments.py asserts it with --optimizer-cpu-offload: the hybrid device optimizer
        # reuses its code path)
        args += ["--use-precision-aware-optimizer"]
    if policy.optimizer_state == "bf16":
        args += ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    if plan.optimizer_offload > 0:
        args += ["--optimizer-cpu-offload"]
        args += ["--optimizer-offload-fraction", f"{plan.optimizer_offload:g}"]
        # the copies pipelined with the host's step, as `cost_model.parts.offload` prices them
        args += ["--overlap-cpu-optimizer-d2h-h2d"]
    offloaded = sum(stage.activation_offload for stage in plan.stages)
    if offloaded:
        # the first N layers' saved activations on the host (arguments.py sets cpu_offloading
        # with it; Transformer Engine's get_cpu_offload_context, transformer_block.py); the
        # profile keeps it to one stage, no recompute and N below the model's layers
        args += ["--cpu-offloading-num-layers", str(offloaded)]
    return args


# Megatron-LM's --fp8-format and --fp8-recipe for autoplan's recipes (TransformerConfig fp8,
# fp8_recipe); the formats as NVIDIA's Megatron-LM examples and tests set them
_FP8_FLAGS = {"fp8": ("hybrid", "tensorwise"), "mxfp8": ("e4m3", "mxfp8")}


def _fp8_args(plan: Plan, layers: Fp8Layers) -> list[str]:
    fp8_format, recipe = _FP8_FLAGS[layers.recipe.name]
    args = ["--fp8-format", fp8_format, "--fp8-recipe", recipe]
    if plan.fp8_all_gather:
        args += ["--fp8-param-gather"]
    bf16 = _bf16_ends(layers)
    if bf16.start or bf16.end:
        args += ["--first-last-layers-bf16"]
        args += ["--num-layers-at-start-in-bf16", str(bf16.start)]
        args += ["--num-layers-at-end-in-bf16", str(bf16.end)]
    if layers.recipe.name == "mxfp8" and not layers.head_kept:
        args += ["--fp8-output-proj"]
    return args


class _Bf16Ends(NamedTuple):
    """The blocks kept in bf16 as Megatron counts them: the first ``start`` and the last
    ``end``, and those kept that are neither (``middle``)."""

    start: int
    end: int
    middle: tuple[int, ...]


def _bf16_ends(layers: Fp8Layers) -> _Bf16Ends:
    kept = set(layers.kept_blocks)
    start = next((i for i in range(layers.num_blocks) if i not in kept), layers.num_blocks)
    end = 0
    while end < layers.num_blocks - start and layers.num_blocks - 1 - end in kept:
        end += 1
    middle = tuple(sorted(i for i in kept if start <= i < layers.num_blocks - end))
    return _Bf16Ends(start=start, end=end, middle=middle)


def _model_args(dims: ModelDims) -> list[str]:
    args = [
        "--num-layers", str(dims.num_layers),
        "--hidden-size", str(dims.hidden_size),
        "--ffn-hidden-size", str(dims.ffn_hidden_size),
        "--num-attention-heads", str(dims.num_heads),
        "--seq-length", str(dims.seq_len),
        "--max-position-embeddings", str(dims.seq_len),
    ]  # fmt: skip
    if dims.attention_head_dim != dims.hidden_size // dims.num_heads:
        # TransformerConfig.kv_channels: hidden_size // num_attention_heads when not given
        args += ["--kv-channels", str(dims.attention_head_dim)]
    if dims.num_kv_heads != dims.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(dims.num_kv_heads)]
    if dims.family == "llama":
        args += ["--normalization", "RMSNorm", "--norm-epsilon", repr(dims.norm_eps)]
        args += ["--swiglu", "--disable-bias-linear"]
        args += ["--position-embedding-type", "rope"]
        # --rotary-base is an int flag (type=int in _add_network_size_args)
        args += ["--rotary-base", str(round(dims.rope_theta or 10000.0))]
    else:
        # GPT-2/3: LayerNorm, GeLU, biases and learned positions are Megatron's defaults
        args += ["--norm-epsilon", repr(dims.norm_eps)]
    # Megatron's dropouts default to 0.1 (TransformerConfig hidden_dropout / attention_dropout)
    args += ["--attention-dropout", repr(dims.dropout), "--hidden-dropout", repr(dims.dropout)]
    if not dims.tie_embeddings:
        args += ["--untie-embeddings-and-output-weights"]
    if (moe := dims.moe) is not None:
        args += ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.top_k)]
        args += ["--moe-ffn-hidden-size", str(moe.moe_ffn_hidden_size)]
        if moe.shared_ffn_hidden_size:
            args += ["--moe-shared-expert-intermediate-size", str(moe.shared_ffn_hidden_size)]
        if moe.num_dense_layers:
            # a Python list expression: 0 a dense layer, 1 a MoE layer (moe_freq_type)
            num_moe = dims.num_layers - moe.num_dense_layers
            args += ["--moe-layer-freq", f"([0]*{moe.num_dense_layers}+[1]*{num_moe})"]
        if not moe.norm_topk_prob:
            args += ["--moe-router-pre-softmax"]
        args += ["--moe-aux-loss-coeff", repr(moe.aux_loss_coef)]
    return args


def _tp_pp_dp_mapping(plan: Plan) -> bool:
    """Whether the plan's layout is Megatron's ``tp-cp-ep-pp-dp`` order, not its default."""
    layout = effective_layout(plan)
    return bool(layout) and not is_subsequence(layout, _DEFAULT_ORDER)


def pipeline_layout(plan: Plan, dims: ModelDims) -> str:
    """``--pipeline-model-parallel-layout`` of the plan's stages, e.g. ``Et*3|t*4|t*4|t*3L``."""
    entries = []
    for stage in stage_layers(plan, dims):
        blocks = "t" * stage.num_layers if stage.num_layers <= 2 else f"t*{stage.num_layers}"
        entries.append(("E" if stage.embedding else "") + blocks + ("L" if stage.head else ""))
    return "|".join(entries)


def _microbatch_group(plan: Plan) -> int | None:
    """Megatron's micro-batches per virtual-stage group for an interleaved plan when it is
    not its default (the pipeline size): the group torch's ScheduleInterleaved1F1B runs,
    m / max(1, m // pp), so that the order is the one autoplan priced. Megatron needs
    pp <= group <= m and m a multiple of the group (forward_backward_pipelining_with_
    interleaving; ``ModelParallelConfig.microbatch_group_size_per_vp_stage``)."""
    if plan.pp_degree == 1 or plan.virtual_stages == 1:
        return None
    group = plan.num_micro_batches // interleaved_rounds(plan.num_micro_batches, plan.pp_degree)
    return None if group == plan.pp_degree else group


def _problems(plan: Plan, dims: ModelDims) -> list[ExportProblem]:
    problems: list[ExportProblem] = []
    if (units := units_problem(plan, dims)) is not None:
        return [units]
    problems += stack_problems(plan, dims, FRAMEWORK)
    if (cp := cp_sequence_problem(plan, dims, "--context-parallel-size")) is not None:
        problems.append(cp)
    problems += expert_problems(plan, dims)
    problems += _fp8_problems(plan, dims)
    return problems


def _fp8_problems(plan: Plan, dims: ModelDims) -> list[ExportProblem]:
    """What of an fp8 plan's layers Megatron-LM cannot run as the plan states them (a recipe
    it lacks is its profile's limit, refused by `stack_problems`)."""
    layers = fp8_layers(plan, dims)
    if layers is None or layers.recipe.name not in framework_profile(FRAMEWORK).fp8_recipes:
        return []
    problems = [p for p in (unknown_problem(plan, layers, dims),) if p is not None]
    value = exclude_text(plan)
    if not layers.head_kept and layers.recipe.name == "fp8":
        problems.append(
            ExportProblem(
                field="fp8_exclude",
                value=value,
                option=(
                    "Megatron-LM runs its output layer in bf16 under --fp8-recipe tensorwise (a "
                    "ColumnParallelLinear outside Transformer Engine's fp8; --fp8-output-proj "
                    "needs mxfp8, megatron/core/models/gpt/gpt_model.py), and the plan converts "
                    "the head"
                ),
                fix="add head to fp8_exclude (the default) in the plan file",
            )
        )
    if routers := layers.converted_routers:
        problems.append(
            ExportProblem(
                field="fp8_exclude",
                value=value,
                option=(
                    "Megatron-LM's MoE router computes in bf16 or fp32 (router_gating_linear, "
                    "--moe-router-dtype; megatron/core/transformer/moe/router.py), and the plan "
                    f"converts {len(routers)} router(s) to fp8"
                ),
                fix="add router to fp8_exclude in the plan file",
            )
        )
    if parts := layers.kept_parts:
        shown = ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")
        problems.append(
            ExportProblem(
                field="fp8_exclude",
                value=value,
                option=(
                    "Megatron-LM keeps only whole transformer layers in bf16 "
                    f"(--first-last-layers-bf16), not parts of one: {shown}"
                ),
                fix=(
                    "keep whole blocks (blocks.<i>) in bf16, or export to torchtitan (filter_fqns)"
                ),
            )
        )
    problems += _bf16_ends_problems(plan, layers)
    return problems


def _bf16_ends_problems(plan: Plan, layers: Fp8Layers) -> list[ExportProblem]:
    bf16 = _bf16_ends(layers)
    problems = []
    if bf16.middle:
        blocks = ", ".join(f"blocks.{i}" for i in bf16.middle)
        problems.append(
            ExportProblem(
                field="fp8_exclude",
                value=exclude_text(plan),
                option=(
                    "Megatron-LM keeps the first and the last layers in bf16 (--num-layers-at-"
                    f"start-in-bf16, --num-layers-at-end-in-bf16), not {blocks} between them"
                ),
                fix=(
                    "keep blocks in bf16 from the start or the end only, or export to "
                    "torchtitan (filter_fqns)"
                ),
            )
        )
    # TransformerConfig.__post_init__: each count at most num_layers // pipeline size
    most = layers.num_blocks // plan.pp_degree
    if max(bf16.start, bf16.end) > most:
        problems.append(
            ExportProblem(
                field="fp8_exclude",
                value=exclude_text(plan),
                option=(
                    f"Megatron-LM keeps at most num_layers // pp = {layers.num_blocks} // "
                    f"{plan.pp_degree} = {most} layers in bf16 at each end (TransformerConfig); "
                    f"the plan keeps {bf16.start} at the start and {bf16.end} at the end"
                ),
                fix=f"keep at most {most} blocks at each end in bf16, or lower pp_degree",
            )
        )
    return problems


def export_megatron(plan: Plan, dims: ModelDims, launch: Launch) -> Export:
    args = megatron_args(plan, dims)
    env = environment(plan)
    command = torchrun_command(launch, ("pretrain_gpt.py", *args), env=env)
    text = " \\\n".join(_arg_lines(args)) + "\n"
    notes: tuple[str, ...] = (
        "add your data and tokenizer flags (--data-path, --tokenizer-type, ...), optimizer and "
        "schedule (--lr, --train-iters, ...); Megatron pads the vocabulary to a multiple of "
        f"--make-vocab-size-divisible-by x TP (128 x {plan.tp_degree} by default), "
        f"{dims.vocab_size} in the plan's model",
        "run from a Megatron-LM checkout (flags checked against NVIDIA/Megatron-LM d98e8a6, "
        "and by its validate_args rules: autoplan.export.megatron_rules)",
    )
    if env:
        notes += (
            "CUDA_DEVICE_MAX_CONNECTIONS=1 (in the launch line): Megatron-LM's validate_args "
            "asserts it with TP or CP before Blackwell, so each TP/CP collective is queued "
            "ahead of the GEMM it overlaps",
        )
    if plan.optimizer_state_dtype == "bf16":
        notes += (
            "--use-precision-aware-optimizer runs Transformer Engine's FusedAdam (megatron/core/"
            "optimizer/optimizer_config.py asks for its master_weight_dtype and exp_avg_dtype "
            "arguments): install Transformer Engine >= 2.1",
        )
    if plan.optimizer_offload > 0:
        notes += (
            "--optimizer-cpu-offload steps its share with torch.optim.AdamW on the host "
            "(megatron/core/optimizer/__init__.py), priced at the host's DRAM bandwidth (a "
            "lower bound); the host needs pinned memory for the gradients and weights it copies",
        )
    if any(stage.activation_offload for stage in plan.stages):
        notes += (
            "--cpu-offloading-num-layers needs Transformer Engine (transformer_block.py asserts "
            "it) and pinned host memory for the offloaded layers' activations",
        )
    if plan.tp_comm_overlap:
        notes += (
            "--tp-comm-overlap runs Transformer Engine's userbuffers (megatron/training/"
            "initialize.py, _initialize_tp_communicators): install Transformer Engine; its "
            "default splits are the ones the plan is priced with (no --tp-comm-overlap-cfg)",
        )
    if plan.cp_degree > 1:
        notes += (
            "context parallelism runs in Transformer Engine's attention (the default "
            "--transformer-impl transformer_engine): install Transformer Engine",
        )
    if (layers := fp8_layers(plan, dims)) is not None:
        version = "2.2 (Float8CurrentScaling)" if layers.recipe.name == "fp8" else "2.1"
        notes += (
            "fp8 runs in Transformer Engine's layers (the default --transformer-impl "
            f"transformer_engine): install Transformer Engine >= {version}, as "
            "megatron/core/fp8_utils.py get_fp8_recipe asks",
        )
    if layers is not None and layers.converts_experts:
        notes += (
            "Megatron-LM runs the routed experts in fp8 (Transformer Engine linears inside its "
            "fp8 layers), where autoplan keeps them in bf16 (torchao converts nn.Linear only) "
            "and prices them so: the run's expert GEMMs are faster than the plan's estimate",
        )
    if dims.moe is not None:
        notes += (
            "the expert args (--num-experts, --moe-router-topk, --moe-ffn-hidden-size, ...) are "
            f"those of {dims.spec!r}; for another MoE model set them to its own "
            "(--moe-grouped-gemm is a faster expert kernel)",
        )
        shared_tp = framework_profile(plan.framework).moe_shared_expert == "tensor-parallel"
        if dims.moe.shared_ffn_hidden_size and plan.tp_degree > 1 and not shared_tp:
            notes += (
                "Megatron splits the shared expert over TP ranks, where autoplan's runtime (and "
                f"the plan's {plan.framework!r} estimate) keeps it whole on each TP rank: "
                "re-plan with --framework megatron-lm to price Megatron's",
            )
    return Export(
        framework=FRAMEWORK,
        files={ARGS_FILE: text},
        command=command,
        notes=notes,
        variables=launch_variables(command),
    )


def _arg_lines(args: tuple[str, ...]) -> list[str]:
    """One flag (with its value) a line, for the arguments file."""
    lines: list[str] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append(arg)
        else:
            lines[-1] += " " + (arg if "|" not in arg and "*" not in arg else f"'{arg}'")
    return lines
