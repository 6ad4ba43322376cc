"""DeepSpeed's engine, as `autoplan export` launches it."""

from __future__ import annotations

from cost_model.frameworks.limits import Explanation
from cost_model.frameworks.profile import (
    Capabilities,
    EngineBehaviour,
    FrameworkProfile,
    Pricing,
)

# Its limits as `autoplan export` words them (`Capabilities.explained`), in DeepSpeed 0.19.8's
# terms and files.
DEEPSPEED_WORDS = {
    "etp": Explanation(
        why="deepspeed splits experts over TP ranks only where the model's own code builds "
        "its MoE layer with enable_expert_tensor_parallelism (deepspeed/moe/layer.py, a "
        "constructor argument): ds_config has no such setting",
        fix="set etp_degree 1 (leave it out), or export to megatron-lm "
        "(--expert-tensor-parallel-size)",
    ),
    "pipeline-tp": Explanation(
        why="deepspeed's tensor parallelism for training (tensor_parallel.autotp_size) shards a "
        "model in DeepSpeedEngine, not a PipelineModule (deepspeed/runtime/pipe/engine.py has "
        "no AutoTP path)",
        fix="use tp_degree 1 with pipeline parallelism, or pp_degree 1 with TP, e.g. autoplan "
        "plan ... --tp 1; Megatron-DeepSpeed runs both (export to megatron-lm)",
    ),
    "sequence-parallel": Explanation(
        why="deepspeed has no Megatron-style sequence parallelism (sequence_parallel_size is "
        "Ulysses attention-head parallelism, deepspeed/sequence)",
        fix="set sequence_parallel: false",
    ),
    "tp-comm-overlap": Explanation(
        why="deepspeed's ds_config has no overlap of TP collectives with the GEMMs: AutoTP "
        "all-reduces between them, and its Domino engine (deepspeed/runtime/domino), which "
        "hides TP all-reduces behind the other half of a split micro-batch, is a transformer "
        "layer of its own, not a setting",
        fix="set tp_comm_overlap: false, or export to megatron-lm (--tp-comm-overlap)",
    ),
    "pipeline-zero": Explanation(
        why="deepspeed's PipelineEngine asserts 'ZeRO-2 and ZeRO-3 are incompatible with "
        "pipeline parallelism' (zero_optimization.stage <= 1; deepspeed/runtime/pipe/engine.py)",
        fix="use zero_stage 1, e.g. autoplan plan ... --zero 0,1",
    ),
    "schedule": Explanation(
        value="{schedule} (virtual_stages {v})",
        why="deepspeed's PipelineEngine runs one schedule, TrainSchedule (1F1B, one stage per "
        "rank; deepspeed/runtime/pipe/schedule.py)",
        fix="use schedule 1f1b with virtual_stages 1, e.g. autoplan plan ... --schedules 1f1b",
    ),
    "stage-cuts": Explanation(
        # partition_uniform (deepspeed/runtime/utils.py) is autoplan's even split
        why="deepspeed's PipelineModule places layers by partition_method (uniform, parameters "
        "or type:<regex>; deepspeed/runtime/pipe/module.py), not by explicit cuts",
        fix="use the uniform split {own_cuts} (autoplan.manual_plan's even stages)",
    ),
    "recompute-scope": Explanation(
        why="deepspeed has one recompute setting for all layers (PipelineModule "
        "activation_checkpoint_interval); this plan mixes {modes} over its stages",
        fix="",
    ),
    "recompute": Explanation(
        why="deepspeed recomputes whole layers (PipelineModule activation_checkpoint_interval, "
        "deepspeed.checkpointing); it has no selective recompute",
        fix="use recompute=full on every stage, e.g. autoplan plan ... --recompute full",
    ),
    "cp": Explanation(
        why="deepspeed's context parallelism is Ulysses (sequence_parallel_size: an all-to-all "
        "over attention heads, deepspeed/sequence/layer.py), not the ring attention the plan "
        "runs",
        fix="set cp_degree to 1 (e.g. autoplan plan ... --cp 1), or export to megatron-lm "
        "(--context-parallel-size) or torchtitan",
    ),
    "ep": Explanation(
        why="deepspeed's expert parallelism is set in the model code "
        "(deepspeed.moe.layer.MoE(ep_size=...)), not in ds_config, so the export cannot carry it",
        fix="set ep_degree to 1 (e.g. autoplan plan ... --ep 1), or export to megatron-lm "
        "(--expert-model-parallel-size)",
    ),
    "dtype": Explanation(
        # its only refused dtypes are the fp8 recipes (fp8_recipes is empty)
        why="deepspeed's config has no fp8 training recipe (ds_config's precision sections are "
        "fp16 and bf16, deepspeed/runtime/precision_config.py); fp8 GEMMs under DeepSpeed come "
        "from Transformer Engine layers in the model code, which a ds_config cannot set",
        fix="use dtype bf16 (e.g. autoplan plan ... --dtype bf16), or export to megatron-lm "
        "(--fp8-format) or torchtitan (its float8 converter)",
    ),
    "hsdp": Explanation(
        why="its HSDP, MiCS (zero_optimization.mics_shard_size, ZeRO-3), was removed: DeepSpeed "
        "0.19 rejects the key (deepspeed/runtime/config.py _REMOVED_ZERO_CONFIG_KEYS, "
        "deepspeedai/DeepSpeed#8489); ZeRO++'s hpZ (zero_hpz_partition_size) keeps a second "
        "copy of the weights within each group for the backward's gathers but still shards "
        "gradients and optimizer state over all of dp, which is not HSDP",
        fix="leave dp_shard_degree out (ZeRO over all of dp), or export to megatron-lm "
        "(--num-distributed-optimizer-instances) or torchtitan (data_parallel_replicate_degree)",
    ),
    "master-states": Explanation(
        why="deepspeed keeps a bf16 master (bf16.bf16_master_weights_and_grads) with ZeRO 1-3 "
        "only (deepspeed/runtime/config.py, _do_error_check), and Adam's moments in its "
        "master's dtype (FusedAdam zeros_like the master partition, deepspeed/ops/adam/"
        "fused_adam.py; bf16.bf16_optimizer_states, which needs the bf16 master, for its CPU "
        "Adam)",
        fix="use zero_stage 1-3 with bf16 master weights and states, or fp32 for both; or "
        "export to megatron-lm (--use-precision-aware-optimizer)",
    ),
    "rank-layout": Explanation(
        why="deepspeed orders its process groups pipe, data, model (outermost first; "
        "PipeModelDataParallelTopology in deepspeed/runtime/pipe/topology.py)",
        fix="use rank_layout [pp, dp, tp]",
    ),
}

DEEPSPEED = FrameworkProfile(
    name="deepspeed",
    version="DeepSpeed 0.10 and later, as `autoplan export` launches it",
    summary=(
        "DeepSpeed's engine: the model's own attention, reentrant activation "
        "checkpointing, PipelineEngine frees sent activations, ZeRO's bucketed "
        "gradient reduction"
    ),
    pricing=Pricing(
        # deepspeed.checkpointing.CheckpointFunction is reentrant
        # (deepspeed/runtime/activation_checkpointing/checkpointing.py).
        full_recompute_early_stop=0.0,
        # PipelineEngine sends an activation and drops its reference once the next stage
        # holds it (deepspeed/runtime/pipe/engine.py, _exec_send_activations).
        pipeline_boundary_retention=0.0,
    ),
    # ZeRO reduces gradients in buckets as they are produced with overlap_comm, which
    # `autoplan export` sets (its default: on at ZeRO-3 only, zero/config.py
    # overlap_comm_valid; at ZeRO-1 the hooks reduce during the last micro-batch's
    # backward, zero/stage_1_and_2.py process_gradients). Without ZeRO the engine
    # all-reduces after the backward (engine.py allreduce_gradients, buffered fallback),
    # and with a PipelineModule it turns overlap_comm off ("Pipeline parallelism does
    # not support overlapped communication") and reduces after the schedule
    # (pipe/engine.py _exec_reduce_grads). DeepSpeed 0.19.8.
    dp_overlap=1.0,
    # the overlap rule of the comment above: ZeRO stages 1-3 only, and none with a pipeline
    engine_behaviour=EngineBehaviour(
        dp_overlap_zero_stages=(1, 2, 3),
        pipeline_dp_overlap=False,
    ),
    # ZeRO-3 gathers module by module, coalesced up to stage3_prefetch_bucket_size
    # (deepspeed/runtime/zero/partitioned_param_coordinator.py).
    zero3_gathers="per-module",
    # Its limits, each cited in DEEPSPEED_WORDS: its own cut (PipelineModule's "uniform"
    # partition_method, autoplan's even split, as `autoplan export` writes it), TrainSchedule's
    # 1F1B, no Megatron-style sequence parallelism, one recompute setting without a selective
    # mode, a pipeline engine with ZeRO <= 1 and no tensor parallelism, its topology's rank
    # order, and neither ring-attention context parallelism nor ep as a plan degree.
    stage_cuts="own",
    schedules=("1f1b",),
    sequence_parallel=False,
    recompute_scope="global",
    partial_recompute_why="ds_config's activation_checkpointing section says how checkpoints "
    "are kept (partition_activations, cpu_checkpointing, number_checkpoints), not which layers, "
    "and PipelineModule's activation_checkpoint_interval checkpoints every layer",
    recompute_modes=("none", "full"),
    pipeline_max_zero=1,
    pipeline_tensor_parallel=False,
    rank_layouts=(("pp", "dp", "tp"),),
    context_parallel=False,
    expert_parallel=False,
    capabilities=Capabilities(explained=DEEPSPEED_WORDS),
    # DeepSpeedEngine.compile() (deepspeed/runtime/engine.py): the engine's module compiled
    # whole, once (the ds_config "compile" section configures DeepCompile, not this)
    compile_scope="global",
    # zero_optimization.offload_optimizer (ZeRO-Offload, "valid with stage 1, 2, and 3"); its
    # ratio (a share below 1) "only valid with ZeRO Stage 3" (deepspeed/runtime/zero/
    # offload_config.py DeepSpeedZeroOffloadOptimizerConfig)
    optimizer_offload_zero_stages=(1, 2, 3),
    optimizer_offload_partial_zero_stages=(3,),
    activation_offload_why="deepspeed's one activation offload, activation_checkpointing."
    "cpu_checkpointing, moves the inputs its recompute checkpoints (with partition_activations; "
    "deepspeed/runtime/activation_checkpointing/config.py), not the saved activations of a "
    "block that is not recomputed",
    # bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states (DEEPSPEED_WORDS)
    master_and_states=(("fp32", "fp32", 0), ("bf16", "bf16", 1)),
    sources=(
        "deepspeedai/DeepSpeed deepspeed/runtime/activation_checkpointing/checkpointing.py",
        "deepspeedai/DeepSpeed deepspeed/runtime/pipe/engine.py",
    ),
)
