"""Efficiency constants that turn datasheet peaks into achievable speeds.

A `Calibration` belongs to a Cluster: presets ship defaults fitted to published measurements
(each constant cites its source in the preset file), and `autoplan calibrate` measures them
on the machine at hand. Values are dimensionless fractions in (0, 1] unless the name carries a
unit. Every field is also a flat cluster override key (``dgx-a100-80g:gemm_efficiency=0.8``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.schema import unit_field

_FRACTIONS = (
    "gemm_efficiency",
    "attention_efficiency",
    "memory_efficiency",
    "intra_node_comm_efficiency",
    "inter_node_comm_efficiency",
    "all_gather_efficiency",
    "reduce_scatter_efficiency",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """Achievable fractions of peak compute, memory bandwidth and link bandwidth."""

    # Fraction of the dtype's peak FLOP/s that a large, well-shaped GEMM sustains.
    gemm_efficiency: float = 0.75
    # FLOPs of one GEMM (or attention kernel) at which its efficiency is half the maximum:
    # small kernels cannot fill the device (too few tiles for the SMs, launch cost).
    gemm_half_efficiency_flops: float = unit_field("flops", default=2e9)
    # Inner (reduction) dimension k of a GEMM at which its efficiency is half the maximum: each
    # output tile pays a fixed pipeline fill and epilogue on top of its k-loop, so shallow GEMMs
    # (small hidden sizes, row-parallel shards of k / tp) run below peak however large they
    # are. 0 disables the term.
    gemm_half_efficiency_depth: float = 0.0
    # Fraction of the dtype's peak that a large fused attention kernel (SDPA) sustains.
    # Its FLOPs count the scores a causal kernel computes (half the square: the trace's
    # `causal_fraction`), as FlashAttention's and Megatron-LM's figures do.
    attention_efficiency: float = 0.25
    # The attention kernel's backward where its rate differs from the forward's (an unfused
    # core moves fewer bytes per FLOP backward than forward: `unfused_attention_efficiency`);
    # 0: the forward's rate.
    attention_backward_efficiency: float = 0.0
    # Fraction of peak memory bandwidth that element-wise, reduction and optimizer kernels get.
    memory_efficiency: float = 0.7
    # Fraction of the link bandwidth that collectives reach (NCCL bus bandwidth / link peak).
    intra_node_comm_efficiency: float = 0.8
    inter_node_comm_efficiency: float = 0.8
    # Fraction of that rate the library's all-gather and reduce-scatter reach relative to its
    # all-reduce (the ring model prices each at half an all-reduce). NCCL: 1 (same bus
    # bandwidth for all three); gloo on CPU is much slower at both (measured by calibrate).
    all_gather_efficiency: float = 1.0
    reduce_scatter_efficiency: float = 1.0
    # Fixed cost of one kernel launch or framework dispatch.
    kernel_overhead_s: float = unit_field("time", default=5e-6)
    # Host time of the training stack's wrappers, in seconds of the worker's own CPU. On CPU
    # workers, whose core both dispatches and computes, it adds to the step. On a GPU the host
    # runs ahead of asynchronous kernels: a unit's wrapper time per micro-batch is a floor
    # under its time (with `tp_block_host_floor_s`), the per-step one under its optimizer
    # step, paid only where the device would finish first. The GPU presets leave them 0;
    # `autoplan calibrate` fits them on the GPUs at hand.
    # Per tensor-parallel module (linear, embedding, head) per micro-batch, forward+backward:
    # wrapping and unwrapping sharded tensors (DTensor dispatch), beyond the collectives.
    tp_module_overhead_s: float = unit_field("time", default=0.0)
    # Per unit per micro-batch when the unit is its own data-parallel group (FSDP2's per-unit
    # pre/post forward and backward hooks, copy-in/copy-out of the flat buffers).
    dp_unit_overhead_s: float = unit_field("time", default=0.0)
    # Per unit per optimizer step when its parameters are distributed tensors (sharded by TP or
    # FSDP2): the optimizer dispatches through the tensor subclass.
    sharded_optimizer_unit_overhead_s: float = unit_field("time", default=0.0)
    # Per parameter tensor per optimizer step, on the host: an optimizer that loops over its
    # tensors (torch's Adam/AdamW on CPU, where neither foreach nor fused is the default)
    # dispatches about a dozen ops for each. Added on CPU workers; 0 on the GPU presets
    # (foreach/fused kernels: `kernel_overhead_s` per unit). Measured by the `local` preset.
    optimizer_tensor_overhead_s: float = unit_field("time", default=0.0)
    # Per pipeline message (an activation sent forward or a gradient sent back, per
    # micro-batch and stage boundary): the schedule's bookkeeping around the send/recv
    # (buffers, shape checks, waits), beyond the link's latency.
    pp_message_overhead_s: float = unit_field("time", default=0.0)
    # Least time one transformer block takes per micro-batch (forward + backward, its recompute
    # and collectives included) when it is tensor parallel, on a GPU: the training stack's host
    # work for the block (Python, autograd, kernel and collective launches), which the device,
    # fed asynchronously, cannot outrun. Below it the device idles. 0: the device's own time
    # stands (the host keeps ahead). A property of the stack (`cost_model.frameworks`).
    tp_block_host_floor_s: float = unit_field("time", default=0.0)
    # Per optimizer step: the training loop's own fixed time that no parallelism shrinks (data
    # loading, loss-scale checks, logging and timers between steps), after the rank tail.
    step_overhead_s: float = unit_field("time", default=0.0)
    # Fraction of the compute during which data-parallel communication runs concurrently: the
    # last micro-batch's backward for gradient sync, each unit's own compute for ZeRO-3
    # prefetched gathers (1: bucketed DDP/FSDP overlap on a GPU's separate streams; 0: sync
    # after backward, or CPU workers whose one core also moves the bytes).
    dp_overlap_fraction: float = 1.0
    # Compute time lost per second of ZeRO-3 communication (each unit's prefetched gathers and
    # its gradient scatter) hidden behind that unit's compute: the collective's kernels run on
    # the same device, taking SMs (one per NCCL channel) and memory bandwidth from it. DDP and
    # ZeRO-1/2 gradient sync behind the last backward is not charged. 0: no interference (CPU
    # workers, where nothing overlaps anyway).
    overlapped_comm_slowdown: float = 0.0
    # Share of a unit's trailing forward (the ops after the last tensor autograd saves, e.g. a
    # pre-LN block's last GEMM, its all-reduce and the residual add) that full recompute skips:
    # torch's non-reentrant checkpoint stops once every saved tensor is back (early stop, the
    # default since torch 2.1, pytorch PR #96866; autoplan's runtime, FSDP, torchtitan): 1.
    # Megatron-LM's reentrant checkpoint, and torch before 2.1, re-run the whole forward: 0.
    full_recompute_early_stop: float = 1.0
    # Fraction of a block's forward GEMM work that selective recompute re-runs in the backward
    # (0: every matmul output is kept, autoplan's policy; 0.5: torchtitan's op-level selective
    # checkpointing, which recomputes every second mm). A property of the training stack.
    selective_gemm_recompute_fraction: float = 0.0
    # Share of the pipeline boundary tensors that torch's pipelining keeps which the training
    # stack keeps too (`cost_model.schedule_memory.HeldProfile.sends`: outputs until their backward,
    # every send until the step ends). 1: torch.distributed.pipelining (autoplan's runtime,
    # torchtitan). 0: Megatron-LM, which frees an output's data once it is sent
    # (schedules.py, deallocate_output_tensor) and waits for each batch of sends before its
    # next compute (p2p_communication.py, wait_on_reqs), and DeepSpeed's pipeline engine.
    pipeline_boundary_retention: float = 1.0
    # 1: each linear's bias is added in a pass of its own over the output, and its gradient
    # reduced in another (torch before F.linear called addmm for 3-D inputs: matmul, then add;
    # Megatron-LM 2019); 0: in the GEMM or a fused epilogue.
    separate_bias_add: float = 0.0
    # 1: a dropout pass of its own (output and 1-byte mask, forward and backward) on each
    # row-parallel linear's output, the attention's and the MLP's (Megatron-LM 2019's hidden
    # dropout); 0: none, or fused with the bias and the residual add (the traced model's add).
    separate_output_dropout: float = 0.0
    # fp8 GEMMs (`cost_model.precision`): the share of the fp8 peak a GEMM sustains, as a
    # multiple of `gemm_efficiency`'s share of the 16-bit peak. 1: the same share. torchao's
    # float8 roofline uses one achievable fraction (0.78 on H100, "based on experimental
    # observation") for bf16 and fp8 GEMMs alike (pytorch/ao
    # torchao/testing/float8/roofline_utils.py, pct_achievable_gemm_tops); cuBLASLt's e4m3
    # 8192^3 GEMM sustains ~1,610 of H100 SXM's 1,979 TFLOP/s (0.81), as bf16 sustains ~0.8.
    fp8_gemm_efficiency_ratio: float = 1.0
    # How the stack casts a GEMM's operands to fp8 (`cost_model.parts.fp8`): 1, torch eager's
    # separate kernels (torchao without torch.compile: abs, max, upcast, scale, clamp, cast);
    # 0, fused amax and cast kernels (Transformer Engine, or torchao under torch.compile).
    fp8_eager_casts: float = 1.0
    # 1: the stack casts each weight to fp8 once per step and keeps the fp8 copy and its
    # transpose for every micro-batch (Transformer Engine's is_first_microbatch caching in
    # Megatron-LM); 0: it casts the weights again in each micro-batch (torchao).
    fp8_cached_weights: float = 0.0
    # Bytes a transformer block copies synchronously between host and device (the device idles
    # meanwhile) each time its forward runs, a full recompute's re-run included, and bytes a
    # checkpointed block copies once per micro-batch on top (priced in its backward), both at
    # the device's host link: Megatron-LM 2019's saves and restores of torch 1.1's CUDA RNG
    # state (`cost_model.frameworks`). 0: none.
    block_sync_copy_bytes: float = unit_field("bytes", default=0.0)
    checkpoint_sync_copy_bytes: float = unit_field("bytes", default=0.0)
    # Memory traffic of the optimizer step per parameter it updates, in bytes; 0: a fused Adam's
    # (`cost_model.parts.optimizer.ADAM_TRAFFIC_BYTES_PER_PARAM`).
    optimizer_bytes_per_param: float = 0.0
    # Bytes the loss keeps per logit for its backward (and needs again as working set): 4 for
    # F.cross_entropy on fp32 logits, autoplan's runtime (its fp32 log-probabilities); the
    # training dtype's width for a fused cross-entropy that keeps only the logits and redoes
    # the softmax in its backward (flash-attn's CrossEntropyLoss saves logits, per-row
    # log-sum-exp and labels: 2 in bf16; it is the default loss_fn of llm-foundry's MPT).
    loss_saved_bytes_per_logit: float = 4.0
    # Bytes the loss's kernels move per fp32 logit, beyond the cast from the training dtype
    # (`cost_model.parts.compute.loss_cost`): forward and backward. F.cross_entropy on fp32
    # logits (autoplan's runtime): log-softmax reads and writes (8); the NLL gradient's
    # zero-filled write and log-softmax's backward (16).
    loss_forward_bytes_per_logit: float = 8.0
    loss_backward_bytes_per_logit: float = 16.0
    # Device memory the job cannot use for tensors: runtime context, communication buffers of
    # the library, workspaces.
    reserved_memory_bytes: float = unit_field("bytes", default=0.0)
    # Caching-allocator fragmentation, as a fraction of the tensor bytes.
    allocator_overhead_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in _FRACTIONS:
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(
                    f"calibration.{name} = {value!r} must be a fraction in (0, 1]; "
                    "it is the achievable share of the datasheet peak"
                )
        if not 0.1 <= self.fp8_gemm_efficiency_ratio <= 2.0:
            raise ValueError(
                f"calibration.fp8_gemm_efficiency_ratio = {self.fp8_gemm_efficiency_ratio!r} "
                "must be in [0.1, 2] (1: fp8 GEMMs reach the same share of their peak as bf16's)"
            )
        for name in (
            "attention_backward_efficiency",
            "dp_overlap_fraction",
            "overlapped_comm_slowdown",
            "full_recompute_early_stop",
            "selective_gemm_recompute_fraction",
            "pipeline_boundary_retention",
            "separate_bias_add",
            "separate_output_dropout",
            "fp8_eager_casts",
            "fp8_cached_weights",
        ):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"calibration.{name} = {value!r} must be in [0, 1]")
        for name in (
            "gemm_half_efficiency_flops",
            "gemm_half_efficiency_depth",
            "kernel_overhead_s",
            "tp_module_overhead_s",
            "dp_unit_overhead_s",
            "sharded_optimizer_unit_overhead_s",
            "optimizer_tensor_overhead_s",
            "pp_message_overhead_s",
            "tp_block_host_floor_s",
            "step_overhead_s",
            "reserved_memory_bytes",
            "allocator_overhead_fraction",
            "loss_saved_bytes_per_logit",
            "loss_forward_bytes_per_logit",
            "loss_backward_bytes_per_logit",
            "optimizer_bytes_per_param",
            "block_sync_copy_bytes",
            "checkpoint_sync_copy_bytes",
        ):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"calibration.{name} = {value!r} must be >= 0")
