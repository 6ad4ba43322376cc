"""autoplan's own runtime: the identity profile (a cluster's calibration describes it)."""

from __future__ import annotations

from cost_model.frameworks.limits import Explanation
from cost_model.frameworks.profile import Capabilities, FrameworkProfile
from cost_model.frameworks.torch_async_tp import TORCH_ASYNC_TP

AUTOPLAN = FrameworkProfile(
    name="autoplan",
    version="this project (torch >= 2.13)",
    summary=(
        "autoplan's runtime: SDPA attention, torch's non-reentrant checkpoint, "
        "torch.distributed.pipelining, DDP/FSDP2 overlapped gradient sync"
    ),
    capabilities=Capabilities(
        # it runs the traced graph itself (`Capabilities.runs_traced_graph`): passes/ shard
        # and wrap the graph's modules, and a torch.export graph cannot be re-cast or split
        runs_traced_graph=True,
        # passes/data_parallel.py: ZeRO-1 is DDP + ZeroRedundancyOptimizer, which broadcasts
        # each updated parameter over the whole data-parallel group; under FSDP2 the experts
        # are wrapped on their own, so its hooks run inside a selectively recomputed block
        expert_wrapper_limits=True,
        # passes/mesh.py builds HSDP's 2-D mesh from dp ranks only
        hsdp_context_parallel=False,
        # passes/expert_parallel.py splits each routed expert over etp ranks of the TP group;
        # below tp on the expert layer's own mesh (passes/mesh.py), where each TP rank routes
        # its own tokens
        etp_below_tp_needs_sp_folding=True,
        explained={
            "etp": Explanation(
                why="its expert-parallel pass (passes/expert_parallel.py) runs 1 < etp < tp on "
                "the expert layer's own (edp, ep, etp) mesh of Megatron-Core's groups "
                "(passes/mesh.py), where every TP rank routes its own tokens, as Megatron-LM "
                "requires of MoE with tp > 1 (megatron/training/arguments.py, validate_args)",
                fix="set sequence_parallel: true and ep_folding: true, or etp_degree to "
                "tp_degree or 1",
            ),
            "dtype:mxfp8": Explanation(
                why="its fp8 is torchao's float8 training, whose MXFP8 linears run on Blackwell "
                "(SM100) GPUs only (torchao 0.18's Triton kernels, torchao/prototype/mx_formats/"
                "kernels.py), so it does not offer them untested",
                fix="use dtype fp8 or fp8-rowwise, or price it for megatron-lm or torchtitan",
            ),
            "master-states": Explanation(
                why="it updates the master weights as the module's own parameters, and torch's "
                "AdamW keeps its moments in the parameters' dtype (torch/optim/adamw.py: "
                "torch.zeros_like(param) in _init_group)",
                fix="set optimizer_state_dtype equal to master_dtype, or price it for "
                "megatron-lm (--use-precision-aware-optimizer) or deepspeed",
            ),
        },
    ),
    # torchao's float8 training (`passes.fp8`): tensor-wise and row-wise dynamic scaling
    fp8_recipes=("fp8", "fp8-rowwise"),
    # each stage's blocks torch.compile'd as the plan says, stage by stage (`passes.compile`)
    compile_scope="stage",
    # each stage's first recompute_units blocks checkpointed (passes/recompute.py)
    partial_recompute="stage",
    # FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype) over parameters in the master
    # dtype (passes/data_parallel.py), AdamW's moments in that dtype too
    master_and_states=(("fp32", "fp32", 0), ("bf16", "bf16", 0)),
    # FSDP2 on a 2-D (replicate, shard) mesh (passes/data_parallel.py); ZeRO-1 runs as ZeRO-2
    hsdp_zero_stages=(1, 2, 3),
    # torch's async TP under torch.compile (passes/async_tp.py; CUDA only, refused on CPU by
    # parallelize)
    tp_comm_overlap=TORCH_ASYNC_TP,
    # passes/optimizer_offload.py: each optimizer's first parameters up to the share, whole,
    # stepped by the user's optimizer on host copies (Megatron-Core's split), under every
    # data-parallel wrapper (DDP, ZeroRedundancyOptimizer's partition, FSDP2's local shards);
    # its step copies the gradients out and waits, steps the host beside the device, and
    # copies the weights back on the compute stream (OffloadedOptimizer.step): "blocking"
    optimizer_offload_zero_stages=(0, 1, 2, 3),
    optimizer_offload_partial_zero_stages=(0, 1, 2, 3),
    optimizer_offload_overlap="blocking",
    # torchao's fp8 all-gather makes the weights a tensor subclass (passes/fp8.py) whose
    # local shards the offloaded optimizer does not copy to the host
    optimizer_offload_fp8_gather_why="offloads the optimizer by copying plain local shards "
    "to the host, and under fp8_all_gather the weights are torchao's fp8 all-gather wrapper "
    "(passes/fp8.py)",
    # torch.autograd.graph.save_on_cpu around a stage's offloaded blocks (passes/offload.py;
    # CUDA only: a CPU worker is its own host, refused by the host-link rule)
    activation_offload="blocking",
    # each routed expert split over etp ranks of the TP group: gate and up by columns, down by
    # rows (passes/expert_parallel.py; below tp with sequence parallelism and folded ep groups,
    # `Capabilities.etp_below_tp_needs_sp_folding`)
    expert_tensor_parallel=True,
    sources=("autoplan passes/ and cost_model/calibration.py (the defaults)",),
)
