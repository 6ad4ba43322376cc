"""torch's async tensor parallelism: how torchtitan and autoplan's runtime overlap the
sequence-parallel TP collectives with the GEMMs (`cost_model.tp_overlap`).

Inductor's micro-pipeline TP pass (torch/_inductor/fx_passes/micro_pipeline_tp.py, on with
``torch._inductor.config._micro_pipeline_tp`` and the TP group's symmetric memory enabled, as
torchtitan's ``_maybe_enable_async_tp`` does in torchtitan/distributed/compile.py) rewrites an
all-gather feeding matmuls into ``fused_all_gather_matmul`` and a matmul feeding a
reduce-scatter into ``fused_matmul_reduce_scatter`` (torch/distributed/_symmetric_memory), in
the forward and the backward graph alike, where the pattern is a matmul's own: the pass fuses
a reduce-scatter with the one matmul that produces it (``_find_producer_matmul``), so the
backward's input gradient of several column-parallel linears (q, k and v apart, or gate and up:
their gradients are summed first) reduce-scatters exposed, as without the overlap (the forward
all-gather feeds all of a region's matmuls at once, and the backward all-gather the row-parallel
linear's). Both fused ops move one shard a step by peer copies into
symmetric memory and run the GEMM on the shard that arrived, on two streams, the local shard
first: the ``ring`` split, ``tp`` steps. No collective kernel takes SMs from the GEMM
(slowdown 0; what the copies take of memory bandwidth is not priced). It is a compiler pass,
so the blocks must be compiled (torchtitan's ``CompileConfig``: "Async TP requires 'model' in
--compile.components and --compile.enable"), and it needs NCCL and CUDA (the pass returns
without NCCL). The TP collectives outside the compiled blocks (the head's) stay as they were.

achieved_fraction 1: assumed, the ring's own arithmetic. The PyTorch post that introduced it
("[Distributed w/ TorchTitan] Introducing Async Tensor Parallelism in PyTorch", 2024) reports
up to ~20-29% forward and ~8% end-to-end speed-ups on Llama 3 8B and 70B, and torchtitan's
benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md 8-10% end to end on 64 and 256 H100s;
those are what the bench compares the prediction with (bench/validate_published.py), not
what this constant was fitted to.
"""

from __future__ import annotations

from cost_model.tp_overlap import OverlapSplit, TpCommOverlap

_RING = OverlapSplit(method="ring")

TORCH_ASYNC_TP = TpCommOverlap(
    name="torch's async TP (inductor's micro-pipeline TP under torch.compile)",
    forward_all_gather=_RING,
    forward_reduce_scatter=_RING,
    backward_all_gather=_RING,
    backward_reduce_scatter=_RING,
    achieved_fraction=1.0,
    needs_compile=True,
    backward_reduce_scatter_needs_one_gemm=True,
)
