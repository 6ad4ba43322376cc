"""Megatron-LM: Megatron-Core (`megatron-lm`), its 2020-2022 releases (`megatron-lm-2021`), its
first release (`megatron-lm-2019`) and BigScience's Megatron-DeepSpeed (`megatron-deepspeed`)."""

from __future__ import annotations

import itertools

from cost_model.frameworks.limits import Explanation
from cost_model.frameworks.profile import (
    Capabilities,
    EngineBehaviour,
    FrameworkProfile,
    OptionValue,
    Pricing,
)
from cost_model.memory import RECOMPUTE_MODULES
from cost_model.tp_overlap import OverlapSplit, TpCommOverlap


def _recompute_module_options() -> dict[str, dict[str, OptionValue]]:
    """Option values for every non-empty set of `RECOMPUTE_MODULES`, in their order."""
    sets = (
        names
        for size in range(1, len(RECOMPUTE_MODULES) + 1)
        for names in itertools.combinations(RECOMPUTE_MODULES, size)
    )
    return {"+".join(names): {"recompute_modules": names} for names in sets}


# --tp-comm-overlap: Transformer Engine's userbuffers as Megatron-LM starts them without a
# --tp-comm-overlap-cfg (megatron/training/initialize.py, _initialize_tp_communicators ->
# initialize_ub with no ub_cfgs), i.e. initialize_ub's defaults (transformer_engine/pytorch/
# module/base.py at NVIDIA/TransformerEngine d0067d0): qkv_fprop, fc1_fprop, proj_dgrad and
# fc2_dgrad "ring_exchange" (num_splits = tp, num_sm 1, use_ce: copy engines move the shards);
# proj_fprop and fc2_fprop "pipeline" (num_splits 4, num_sm 16 with set_sm_margin: the GEMM runs
# on the SMs left); qkv/fc1 dgrad and wgrad "bulk" (num_sm 16): the input gradient's reduce-
# scatter beside the weight gradient's GEMM (layernorm_linear.py: "Overlap dgrad reduce-scatter
# with wgrad compute"; Megatron's tp_comm_overlap_rs_dgrad defaults to False). The slowdown of
# a GEMM beside a collective is the share of SMs the collective takes, over those left, on an
# H100 SXM's 132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper): 16 / 116 = 0.138
# for the pipeline and bulk splits, 1 / 131 = 0.008 for the ring; taken on every device
# (assumed: an A100's 108 SMs would give 0.174). achieved_fraction 1: assumed, the splits'
# own arithmetic (cost_model.tp_overlap); no published measurement separates how much of the
# communication Transformer Engine hides.
TE_SM_SLOWDOWN = 16 / (132 - 16)
TE_RING_SLOWDOWN = 1 / (132 - 1)
TE_USERBUFFERS = TpCommOverlap(
    name="--tp-comm-overlap (Transformer Engine's userbuffers)",
    forward_all_gather=OverlapSplit(method="ring", slowdown=TE_RING_SLOWDOWN),
    forward_reduce_scatter=OverlapSplit(method="pipeline", chunks=4, slowdown=TE_SM_SLOWDOWN),
    backward_all_gather=OverlapSplit(method="ring", slowdown=TE_RING_SLOWDOWN),
    backward_reduce_scatter=OverlapSplit(method="bulk", slowdown=TE_SM_SLOWDOWN),
    achieved_fraction=1.0,
)

# Its limits as `autoplan export` words them (`Capabilities.explained`), in Megatron-Core's
# terms and files.
MEGATRON_LM_WORDS = {
    "compile": Explanation(
        why="no option compiles it, its fusions are kernels of its own (Transformer Engine's "
        "fused norms, attention and fp8 casts; TransformerConfig's bias_activation_fusion, "
        "bias_dropout_fusion and apply_rope_fusion, small functions megatron/core/jit.py's "
        "jit_fuser compiles)",
        fix="set compile: false (leave out --compile): the megatron-lm profile prices its "
        "own kernels",
    ),
    "dtype:fp8-rowwise": Explanation(
        why="megatron-lm's --fp8-recipe is tensorwise, delayed, mxfp8, blockwise or custom "
        "(TransformerConfig.fp8_recipe, megatron/core/transformer/transformer_config.py); none "
        "scales per row",
        fix="use dtype fp8 (--fp8-recipe tensorwise), or export to torchtitan (its float8 "
        "converter's rowwise recipe)",
    ),
    "schedule:gpipe": Explanation(
        why="megatron-lm runs 1F1B, or interleaved 1F1B with virtual stages, chosen from the "
        "degrees (megatron/core/pipeline_parallel/schedules.py get_forward_backward_func); it "
        "has no GPipe schedule",
        fix="use schedule 1f1b (the same stages; fewer micro-batches in flight)",
    ),
    "schedule:interleaved-zb": Explanation(
        why="megatron-lm has no zero-bubble schedule (no flag; get_forward_backward_func picks "
        "1F1B or interleaved 1F1B){fork_note}",
        fix="use schedule interleaved-1f1b with the same virtual_stages",
    ),
    # zbv and dualpipev
    "schedule": Explanation(
        why="megatron-lm has no zero-bubble schedule (no flag; get_forward_backward_func picks "
        "1F1B or interleaved 1F1B){fork_note}",
        fix="use schedule interleaved-1f1b (virtual_stages 2; the V's stages become "
        "loop-placed), e.g. autoplan plan ... --schedules interleaved-1f1b",
    ),
    "interleaved": Explanation(
        why="megatron-lm's interleaved schedule runs groups of at least pp = {pp} micro-batches "
        "per virtual stage (forward_backward_pipelining_with_interleaving)",
        fix="use at least {pp} micro-batches (a smaller micro-batch or a larger global batch), "
        "or virtual_stages 1",
    ),
    "recompute-scope": Explanation(
        # --recompute-granularity/--recompute-method/--recompute-num-layers apply to every
        # stage alike (megatron/core/transformer/transformer_block.py)
        why="megatron-lm has one recompute setting for all layers (--recompute-granularity); "
        "this plan mixes {modes} over its stages",
        fix="",
    ),
    "rank-layout": Explanation(
        why="megatron-lm orders its process groups tp-cp-ep-dp-pp, or tp-cp-ep-pp-dp with "
        "--use-tp-pp-dp-mapping (innermost first; megatron/training/initialize.py), so TP is "
        "innermost, then CP",
        fix="use rank_layout [pp, dp, cp, tp] or [dp, pp, cp, tp] (without cp when cp_degree is 1)",
    ),
    "master-states": Explanation(
        why="megatron-lm's --main-params-dtype is fp32 or fp16, so a bf16 master exists only "
        "under Megatron-FSDP (--megatron-fsdp-main-params-dtype, zero_stage 2-3), and lower-"
        "precision AdamW states come from --use-precision-aware-optimizer, which asserts the "
        "distributed optimizer (zero_stage >= 1; megatron/core/optimizer/optimizer_config.py, "
        "megatron/training/arguments.py)",
        fix="use zero_stage 1 or more for bf16 states of an fp32 master, 2 or more for a bf16 "
        "master",
    ),
    # NVIDIA/Megatron-LM d98e8a6: validate_args (megatron/training/arguments.py L1118-1190)
    # does not assert pp == 1 for Megatron-FSDP v1, but nothing shows the pair runs: the docs
    # list it "Integrated with TP, CP, EP" (docs/user-guide/parallelism-guide.md L78), its v1
    # tests compose it with TP and EP only (tests/unit_tests/distributed/mfsdp_v1/
    # test_mcore_fully_sharded_data_parallel.py L894-900), every functional test of it runs
    # pp 1, and its v2 refuses pp > 1 (megatron/core/distributed/fsdp/mcore_fsdp_adapter.py,
    # FullyShardedDataParallelV2._validate_config L601-650)
    "pipeline-zero": Explanation(
        why="megatron-lm runs ZeRO-{zero} as Megatron-FSDP (--use-megatron-fsdp), which its "
        "docs and tests pair with TP, CP and EP but not with --pipeline-model-parallel-size "
        "{pp} (docs/user-guide/parallelism-guide.md; mcore_fsdp_adapter.py's version 2 "
        "refuses pp > 1)",
        fix="use zero_stage 1 (--use-distributed-optimizer, which Megatron runs with pipeline "
        "parallelism), or pp_degree 1 for Megatron-FSDP",
    ),
    "moe-tp-sp": Explanation(
        why="megatron-lm needs --sequence-parallel for a MoE model with "
        "--tensor-model-parallel-size {tp} ('When using MoE and tensor parallelism, sequence "
        "parallelism must be used', megatron/training/yaml_arguments.py)",
        fix="set sequence_parallel: true (or tp_degree 1)",
    ),
    "expert-layout": Explanation(
        why="megatron-lm places an expert-parallel group on ep_degree = {ep} consecutive ranks of "
        "the dp x cp x tp block (--expert-model-parallel-size with --expert-tensor-parallel-size "
        "1; megatron/core/parallel_state.py, the expert rank generator), which takes TP/CP ranks "
        "here (tp_degree = {tp}, cp_degree = {cp}); the plan keeps ep inside dp at one tp/cp "
        "coordinate",
        fix="set ep_folding: true (with sequence_parallel: true when tp_degree > 1), e.g. "
        "autoplan plan ... --framework megatron-lm, which plans folded ep",
    ),
    "expert-groups": Explanation(
        why="with --use-tp-pp-dp-mapping (rank_layout [{layout}]) and pipeline parallelism, "
        "megatron-core asserts that the experts' data-parallel size equals the dense one "
        "(initialize_model_parallel), so ep must be tp x cp = {tp_cp}",
        fix="use rank_layout [pp, dp, cp, tp] (Megatron's default order), or ep_degree {tp_cp} "
        "with ep_folding",
    ),
}

MEGATRON_LM = FrameworkProfile(
    name="megatron-lm",
    version="Megatron-Core 0.5 and later (2024-), as `autoplan export` launches it",
    summary=(
        "Megatron-LM with Transformer Engine's fused attention, reentrant full "
        "recompute, outputs freed once sent, --overlap-grad-reduce"
    ),
    pricing=Pricing(
        attention="fused",
        # Transformer Engine's DotProductAttention runs cuDNN's fused attention on Hopper.
        # cuDNN on H100 SXM5, head dim 128, sequences 2k-16k, no causal mask: 595-617
        # TFLOP/s forward and 465-518 backward (Shah et al. 2024, FlashAttention-3, Fig. 5),
        # 1.6x FlashAttention-2's 362-370 and 291-322 there. Forward and backward weighted
        # by their FLOPs (1 : 2.5): 3.5 / (989 / 607 + 2.5 x 989 / 516) = 0.54 of the peak.
        # H200 runs the same kernel on the same Hopper SMs. On Blackwell, FlashAttention-4
        # reaches 1,613 TFLOP/s forward on B200 in bf16, "up to 1.3x" cuDNN 9.13
        # (arXiv:2603.05451, 2026), so cuDNN's forward is at least 1,613 / 1.3 = 1,241; its
        # backward is assumed at H100 cuDNN's backward/forward ratio (516 / 607), 1,055:
        # 3.5 / (2250 / 1241 + 2.5 x 2250 / 1055) = 0.49 of B200's peak (GB200 alike).
        attention_efficiency_by_device={"H100": 0.54, "H200": 0.54, "B200": 0.49, "GB200": 0.49},
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
        # Transformer Engine casts with fused amax/cast-transpose kernels, and casts each
        # weight once per step: its modules take is_first_microbatch and keep the fp8 weight
        # and its transpose for the step's other micro-batches (transformer_engine/pytorch/
        # module/linear.py; Megatron passes it from schedules.py's forward_step).
        fp8_eager_casts=0.0,
        fp8_cached_weights=1.0,
    ),
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
    # Its limits, each cited in MEGATRON_LM_WORDS: get_forward_backward_func's two
    # schedules, one recompute setting for every stage, its rank generator's two orders, and
    # the rules over several axes below.
    schedules=("1f1b", "interleaved-1f1b"),
    recompute_scope="global",
    # --recompute-granularity full --recompute-method block --recompute-num-layers N: the
    # first N layers of each pipeline (virtual) stage (megatron-core TransformerConfig's
    # recompute_method; transformer_block.py, _checkpointed_forward); selective granularity
    # always covers every layer (recompute_num_layers must be None)
    partial_recompute="block",
    rank_layouts=(("pp", "dp", "tp"), ("dp", "pp", "tp")),
    # Megatron-FSDP (ZeRO 2-3) with pipeline parallelism: not shown to run (MEGATRON_LM_WORDS
    # "pipeline-zero"); the distributed optimizer (ZeRO-1) runs with it
    pipeline_max_zero=1,
    capabilities=Capabilities(
        moe_tp_needs_sequence_parallel=True,
        interleaved_microbatches="pp-or-more",
        dp_outer_ep_is_tp_cp=True,
        explained=MEGATRON_LM_WORDS,
    ),
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
    # Transformer Engine's fp8 through --fp8-format hybrid with --fp8-recipe tensorwise (current
    # scaling) or mxfp8 (Blackwell); its delayed and blockwise recipes have no autoplan name
    fp8_recipes=("fp8", "mxfp8"),
    # --grad-reduce-in-bf16 (or fp32 accumulation and reduction, its default for bf16); bf16
    # AdamW states through --use-precision-aware-optimizer from the distributed optimizer (ZeRO
    # 1) on, a bf16 master under Megatron-FSDP only (ZeRO 2-3; MEGATRON_LM_WORDS)
    master_and_states=(
        ("fp32", "fp32", 0),
        ("fp32", "bf16", 1),
        ("bf16", "fp32", 2),
        ("bf16", "bf16", 2),
    ),
    # --num-distributed-optimizer-instances R (megatron/training/arguments.py): the distributed
    # optimizer (ZeRO-1) or Megatron-FSDP (ZeRO-2/3) shards within dp x cp / R consecutive
    # ranks of the dp-cp group and replicates across R (megatron/core/parallel_state.py,
    # intra-partial data-parallel groups; mcore_fsdp_adapter.py enable_hsdp); the partial
    # distributed optimizer all-reduces across instances after each bucket's reduce-scatter,
    # on the same stream (param_and_grad_buffer.py start_grad_sync)
    hsdp_zero_stages=(1, 2, 3),
    # --expert-tensor-parallel-size: the expert rank generator's tp (etp innermost, then ep,
    # then edp; megatron/core/parallel_state.py initialize_model_parallel), the experts'
    # linears column/row-parallel over that group (megatron/core/transformer/moe/experts.py)
    expert_tensor_parallel=True,
    engine_behaviour=EngineBehaviour(hsdp_all_reduce_beside=False),
    tp_comm_overlap=TE_USERBUFFERS,
    # --optimizer-cpu-offload --optimizer-offload-fraction f: Megatron-Core's
    # HybridDeviceOptimizer over the distributed optimizer's shard (megatron/core/optimizer/
    # cpu_offloading/hybrid_optimizer.py; arguments.py asserts --use-precision-aware-optimizer,
    # which asserts the distributed optimizer, OptimizerConfig.__post_init__)
    optimizer_offload_zero_stages=(1,),
    optimizer_offload_partial_zero_stages=(1,),
    # validate_args (megatron/training/arguments.py L1884-1892 at d98e8a6) asserts
    # --fp8-param-gather beside --optimizer-cpu-offload only with --fp8-recipe delayed
    optimizer_offload_fp8_gather_why="offloads the optimizer beside fp8 all-gathered weights "
    "(--fp8-param-gather) only with --fp8-recipe delayed, which no autoplan fp8 recipe is "
    "(megatron/training/arguments.py validate_args L1884-1892)",
    # --cpu-offloading-num-layers N (arguments.py sets cpu_offloading with it): Transformer
    # Engine's get_cpu_offload_context over the first N layers (transformer_block.py), copies
    # on their own streams; TransformerConfig refuses it with pipeline parallelism, with
    # recompute, and for N >= num_layers (transformer_config.py __post_init__)
    activation_offload="overlapped",
    activation_offload_rules="megatron-core",
    sources=(
        "NVIDIA/Megatron-LM megatron/core/tensor_parallel/random.py (CheckpointFunction)",
        "NVIDIA/Megatron-LM megatron/core/parallel_state.py (expert rank generator)",
        "Shah et al. 2024, FlashAttention-3 (arXiv:2407.08608), Fig. 5 (cuDNN on H100)",
        "NVIDIA/Megatron-LM megatron/core/pipeline_parallel/schedules.py",
        "NVIDIA/Megatron-LM megatron/training/arguments.py (--overlap-grad-reduce)",
        "NVIDIA/TransformerEngine transformer_engine/pytorch/module/base.py (initialize_ub)",
    ),
)

MEGATRON_LM_2021 = FrameworkProfile(
    name="megatron-lm-2021",
    version="Megatron-LM 2.x-3.0 (2020-2022: before flash attention and Megatron-Core)",
    summary=(
        "Megatron-LM as in Narayanan et al. 2021 and Korthikanti et al. 2022: unfused "
        "attention core, reentrant full recompute, outputs freed once sent, local DDP "
        "(gradient all-reduce after the backward)"
    ),
    pricing=Pricing(
        attention="unfused",
        full_recompute_early_stop=0.0,
        selective_gemm_recompute_fraction=0.0,
        pipeline_boundary_retention=0.0,
    ),
    # --hidden-dropout and --attention-dropout default to 0.1 (megatron/arguments.py):
    # Korthikanti et al. 2022's activation count assumes both (section 4.1)
    dropout=0.1,
    # --recompute-activations / --recompute-granularity selective: CoreAttention only
    # (megatron/model/transformer.py, _checkpointed_attention_forward)
    selective_recompute="modules",
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
            "zero-bubble": {"schedules": ("1f1b", "interleaved-1f1b", "zbv", "interleaved-zb")}
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
    capabilities=Capabilities(
        # the interleaved schedule: megatron/schedules.py asserts num_microbatches % pp == 0,
        # megatron/arguments.py pp > 2 (v2.5, 3d718bfc)
        interleaved_microbatches="multiple-of-pp",
    ),
    # --use-distributed-optimizer (ZeRO-1) from d07d29df (2022-06-08, absent at v2.5
    # and v2.6); no FSDP, ZeRO-2 or -3 in megatron/arguments.py before Megatron-Core
    zero_stages=(0, 1),
    # --context-parallel-size came with Megatron-Core (292543d3, 2023-10)
    context_parallel=False,
    # Float16OptimizerWithFloat16Params' fp32 main params and Adam states; gradients reduced
    # in fp32 (--accumulate-allreduce-grads-in-fp32, forced for bf16) or fp16 (megatron/
    # arguments.py, megatron/optimizer/optimizer.py at v2.5); no bf16 reduction
    grad_reduce_dtypes=("fp32", "fp16"),
    master_and_states=(("fp32", "fp32", 0),),
    sources=(
        "NVIDIA/Megatron-LM v2.5 megatron/model/transformer.py (CoreAttention)",
        "NVIDIA/Megatron-LM v2.5 megatron/arguments.py (--DDP-impl local)",
    ),
)

MEGATRON_LM_2019 = FrameworkProfile(
    name="megatron-lm-2019",
    version="Megatron-LM of Shoeybi et al. 2019 (NVIDIA/Megatron-LM 93ab4bea, torch 1.1)",
    summary=(
        "Megatron-LM's first release: tensor parallelism only, an unfused attention core "
        "with separate scale and mask passes, bias adds and hidden dropout as kernels of "
        "their own, reentrant full recompute, local DDP after the backward, apex's "
        "FP16_Optimizer over a per-tensor FusedAdam"
    ),
    pricing=Pricing(
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
    ),
    # hidden and attention dropout 0.1 (arguments.py defaults)
    dropout=0.1,
    # model/distributed.py: flatten the gradients, all-reduce, unflatten and copy back
    # after the backward (USE_TORCH_DDP = False in pretrain_gpt2.py)
    dp_overlap=0.0,
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
    # apex's FP16_Optimizer: fp32 master weights and Adam states, fp16 gradients all-reduced
    # by the local DDP (fp16/fp16.py, model/distributed.py)
    grad_reduce_dtypes=("fp32", "fp16"),
    master_and_states=(("fp32", "fp32", 0),),
    sources=(
        "NVIDIA/Megatron-LM 93ab4bea mpu/transformer.py, mpu/layers.py, mpu/cross_entropy.py",
        "NVIDIA/Megatron-LM 93ab4bea fp16/fp16.py, model/distributed.py, pretrain_gpt2.py",
        "NVIDIA/Megatron-LM 93ab4bea docker/Dockerfile (nvcr.io/nvidia/pytorch:19.05)",
        "NVIDIA/Megatron-LM 93ab4bea mpu/random.py (RNG tracker fork, CheckpointFunction)",
        "pytorch/pytorch aten/src/THC/THCTensorRandom.cu before 1.3 (RNG state copies)",
    ),
)

MEGATRON_DEEPSPEED = FrameworkProfile(
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
    pricing=Pricing(
        attention="unfused",
        full_recompute_early_stop=0.0,
        selective_gemm_recompute_fraction=0.0,
        pipeline_boundary_retention=0.0,
    ),
    # tr11-176B-ml.slurm passes no dropout flag: megatron/arguments.py's 0.1 for both
    dropout=0.1,
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
    # BF16_Optimizer (fp32 accumulation, all-reduce, master and states) or its fp16
    # optimizers (fp16 all-reduce, fp32 master and states): `deepspeed_pipeline`'s engine
    grad_reduce_dtypes=("fp32", "fp16"),
    master_and_states=(("fp32", "fp32", 0),),
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
)
