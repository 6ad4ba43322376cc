"""torchtitan: torch.distributed.pipelining, FSDP2, op-level selective checkpointing."""

from __future__ import annotations

from cost_model.frameworks.limits import Explanation
from cost_model.frameworks.profile import Capabilities, FrameworkProfile, Pricing
from cost_model.frameworks.torch_async_tp import TORCH_ASYNC_TP

# Its limits as `autoplan export` words them (`Capabilities.explained`).
TORCHTITAN_WORDS = {
    "etp": Explanation(
        why="torchtitan 0.3's ParallelismConfig has expert_parallel_degree only (no "
        "expert_tensor_parallel_degree): its sparse region is efsdp x ep over dp_shard x cp x "
        "tp, the experts never split over TP ranks (torchtitan/config/configs.py)",
        fix="set etp_degree 1 (leave it out), or export to megatron-lm "
        "(--expert-tensor-parallel-size)",
    ),
    "dtype:fp8": Explanation(
        why="torchtitan 0.3's float8 converter scales per row only "
        "(Float8LinearConverter.Config.recipe_name rowwise or rowwise_with_gw_hp; tensor-wise "
        "scaling and its FSDP fp8 all-gather went in pytorch/torchtitan#3127)",
        fix="use dtype fp8-rowwise, or price it for megatron-lm (--fp8-recipe tensorwise)",
    ),
    "dtype": Explanation(
        why="torchtitan's training.mixed_precision_param is bfloat16 or float32 "
        "(torchtitan/config/configs.py TrainingConfig)",
        fix="use dtype bf16, e.g. autoplan plan ... --dtype bf16",
    ),
    "grad-reduce": Explanation(
        why="torchtitan 0.3's training.mixed_precision_reduce is float32 only "
        "(torchtitan/config/configs.py TrainingConfig)",
        fix="leave grad_reduce_dtype out (fp32), or export to megatron-lm (--grad-reduce-in-bf16)",
    ),
    "master-states": Explanation(
        why="torchtitan keeps its parameters, gradients and optimizer states in one dtype, "
        "training.dtype (float32, or bfloat16 'without an extra copy of fp32 weights'; "
        "torchtitan/config/configs.py TrainingConfig)",
        fix="set optimizer_state_dtype equal to master_dtype, or export to megatron-lm "
        "(--use-precision-aware-optimizer)",
    ),
    "tp-overlap-compile": Explanation(
        why="torchtitan's async TP (compile.enable_async_tensor_parallel) is inductor's "
        "micro-pipeline TP pass over the compiled blocks: CompileConfig refuses it without "
        "compile ('Async TP requires 'model' in --compile.components and --compile.enable', "
        "torchtitan/config/configs.py)",
        fix="set compile: true (on every stage), or tp_comm_overlap: false",
    ),
    "optimizer_offload": Explanation(
        why="torchtitan's one offload, training.enable_cpu_offload, is FSDP2's "
        "CPUOffloadPolicy: the parameters and gradients on the host too, the step on the CPU "
        "(a parameter offload autoplan does not price; torchtitan/config/configs.py)",
        fix="set optimizer_offload: 0 (leave it out), or export to megatron-lm "
        "(--optimizer-cpu-offload) or deepspeed (offload_optimizer)",
    ),
    "rank-layout": Explanation(
        why="torchtitan orders its process groups pp, dp_replicate, dp_shard, cp, tp (outermost "
        "first; torchtitan/distributed/parallel_dims.py)",
        fix="use rank_layout [pp, dp, cp, tp] (without cp when cp_degree is 1)",
    ),
    "cp-zero": Explanation(
        why="with context_parallel_degree = {cp} torchtitan shards the weights over "
        "data_parallel_shard_degree x cp (FSDP on its fsdp mesh, "
        "torchtitan/distributed/parallel_dims.py); it cannot replicate them",
        fix="use zero_stage 2 (FSDP keeping the gathered weights, the nearest to replicated) or "
        "3, e.g. autoplan plan ... --zero 2,3",
    ),
    "recompute-scope": Explanation(
        # activation_checkpoint.mode applies to every block of every stage
        why="torchtitan has one recompute setting for all layers (activation_checkpoint); this "
        "plan mixes {modes} over its stages",
        fix="",
    ),
}

TORCHTITAN = FrameworkProfile(
    name="torchtitan",
    version="torchtitan 0.1 and later",
    summary=(
        "torchtitan: SDPA/flex attention, op-level selective activation checkpointing "
        "(every second mm re-run), torch.distributed.pipelining, FSDP2"
    ),
    pricing=Pricing(
        attention="fused",
        full_recompute_early_stop=1.0,
        # selective_ac_option = "op" (its llama3 configs' default): "Saves output of all
        # compute ops, except every second mm" (torchtitan parallelize_llama.py,
        # _custom_policy).
        selective_gemm_recompute_fraction=0.5,
        pipeline_boundary_retention=1.0,
        # cross_entropy on the fp32 logits (torchtitan/components/loss.py).
        loss_saved_bytes_per_logit=4.0,
    ),
    dp_overlap=1.0,
    # Its limits, each cited in TORCHTITAN_WORDS: one activation_checkpoint setting for every
    # block, ParallelDims' rank order, FSDP over dp_shard x cp with context parallelism, and
    # training.mixed_precision_param's two dtypes.
    recompute_scope="global",
    partial_recompute_why="torchtitan 0.3's activation_checkpoint policies (FullAC, per-op "
    "SelectiveAC, MemoryBudgetAC) wrap every transformer block (ActivationCheckpointing.apply; "
    "the per-layer selective_ac_option of earlier releases, every k-th block, is gone)",
    rank_layouts=(("pp", "dp", "tp"),),
    capabilities=Capabilities(cp_min_zero=1, explained=TORCHTITAN_WORDS),
    dtypes=("bf16", "fp32"),
    # parallelism.data_parallel_replicate_degree x data_parallel_shard_degree > 1 each: FSDP2
    # over its (dp_replicate, fsdp) mesh (torchtitan/config/configs.py ParallelismConfig,
    # torchtitan/distributed/parallel_dims.py); ZeRO-1 runs as ZeRO-2 there
    hsdp_zero_stages=(1, 2, 3),
    # Float8LinearConverter (recipe_name rowwise) and MXFP8LinearConverter (Blackwell), as
    # autoplan export writes them for torchtitan 0.3; its tensor-wise recipe and FSDP fp8
    # all-gather went in pytorch/torchtitan#3127, so fp8 (tensor-wise) is not offered
    fp8_recipes=("fp8-rowwise", "mxfp8"),
    # compile.enable with components ["model", "loss"]: each TransformerBlock compiled, one
    # setting for all (torchtitan/config/configs.py CompileConfig; torchtitan/distributed/
    # compile.py apply_compile)
    compile_scope="global",
    # training.mixed_precision_reduce (float32 only) and training.dtype (float32: fp32
    # master weights and states; bfloat16: both in bf16) (TORCHTITAN_WORDS)
    grad_reduce_dtypes=("fp32",),
    master_and_states=(("fp32", "fp32", 0), ("bf16", "bf16", 0)),
    # compile.enable_async_tensor_parallel (torchtitan/config/configs.py CompileConfig)
    tp_comm_overlap=TORCH_ASYNC_TP,
    sources=(
        "pytorch/torchtitan torchtitan/models/llama3/infra/parallelize.py",
        "pytorch/torchtitan torchtitan/components/loss.py",
    ),
    activation_offload_why="torchtitan recomputes activations (activation_checkpoint) and "
    "offloads FSDP2's parameters (training.enable_cpu_offload), but has no option that keeps a "
    "block's saved activations on the host (torchtitan/config/job_config.py)",
)
