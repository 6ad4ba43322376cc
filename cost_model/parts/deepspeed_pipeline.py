"""DeepSpeed's pipeline engine (Megatron-DeepSpeed, as BigScience trained BLOOM-176B in 2022)
with the optimizer wrapper its engine puts around Adam: the step time of a plan run that way.

DeepSpeed picks the wrapper from the precision and the ZeRO stage (deepspeed/runtime/engine.py,
_configure_optimizer; `deepspeed_pipe_optimizer`): BF16_Optimizer for bf16 (BLOOM, from
2022-02-28), DeepSpeedZeroOptimizer for fp16 with ZeRO-1 (the BLOOM topology search before that
date), FP16_Optimizer for fp16 without ZeRO. The pipeline engine accepts ZeRO 0 and 1 only
(PipelineEngine.__init__ asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline
parallelism"); other plans are priced part by part.

The runtime differs from the one the rest of the cost model describes in four documented ways,
each priced with the cost model's own collective, p2p and memory-bandwidth formulas (nothing
fitted; the bytes of every pass are itemised in `OPTIMIZER_TRAFFIC`):

1. Gradient accumulation. BF16_Optimizer adds the bf16 gradients into an unsharded fp32 buffer
   after every micro-batch's backward (update_hp_grads, called from the pipeline engine's
   backward pass). Under fp16 nothing runs between micro-batches: autograd accumulates into the
   model's fp16 ``.grad`` (AccumulateGrad's in-place add, from the second micro-batch on);
   DeepSpeedZeroOptimizer registers no gradient hooks at ZeRO-1 without overlap_comm, which
   the engine turns off under pipeline parallelism (engine.py, _configure_zero_optimizer).
2. The data-parallel sync is an all-reduce after the pipeline flush (the schedule's
   ReduceTiedGrads, ReduceGrads), not a reduce-scatter overlapped with the backward: bf16 all-
   reduces the fp32 buffer (PipelineEngine._exec_reduce_grads -> buffered_allreduce_fallback
   over get_grads_for_reduction; the BLOOM README: the fp32 buffer is not sharded "but since
   it's not sharding it saves on communications"); fp16 all-reduces the fp16 gradients in
   buckets of reduce_bucket_size (5e8 elements): DeepSpeedZeroOptimizer.reduce_gradients ->
   buffered_reduce_fallback -> allreduce_bucket at ZeRO-1 (a full all-reduce, each bucket
   flattened, divided by the DP size and copied back), DeepSpeedEngine.allreduce_bucket at
   ZeRO-0. Before it the tied embedding's gradient is all-reduced between the first and the
   last stage (_exec_reduce_tied_grads: weight._hp_grad in fp32 under bf16, weight.grad in
   fp16 under fp16, PipelineModule.allreduce_tied_weight_gradients).
3. The optimizer step. bf16: a norm over the whole fp32 buffer, clip, Adam on this rank's 1/dp
   shard, and an all-gather of the updated bf16 weights over data parallelism (update_lp_params
   -> all_gather_dp_groups). fp16 ZeRO-1 (DeepSpeedZeroOptimizer.step) on this rank's 1/dp
   partition of the reduced fp16 gradients: the overflow check of dynamic loss scaling
   (``x.float().sum()`` a tensor), the gradient norm in float64 (get_grad_norm_direct:
   ``g.data.double().norm(2)``), the flat fp32 gradient, unscale and clip in one ``mul_``,
   Adam on the fp32 partition, its copy into the fp16 partition, and the all-gather of the fp16
   partitions over data parallelism in shards of allgather_bucket_size. fp16 ZeRO-0
   (FP16_Optimizer.step) does the same on every local parameter, without the all-gather.
4. Activations and their gradients cross pipeline stages as 1/t slices that the receiver
   all-gathers inside its tensor-parallel group (the engine partitions them whenever the model
   is tensor-parallel: is_pipe_partitioned = is_grad_partitioned = is_model_parallel).

Not priced: the host synchronisations of the overflow check and the norm (one ``.item()`` a
gradient tensor of the partition: a few hundred per rank, milliseconds against steps of
seconds), and the step skipped on an overflow (a published step time is a step that ran).

Sources: deepspeedai/DeepSpeed at 2151c787a (master of 2022-02-18, between v0.5.10 and v0.6.0;
BigScience built DeepSpeed from source, jz/envs/README.md) deepspeed/runtime/pipe/engine.py,
deepspeed/runtime/pipe/module.py, deepspeed/runtime/engine.py,
deepspeed/runtime/zero/stage_1_and_2.py, deepspeed/runtime/fp16/fused_optimizer.py; for bf16
deepspeed/runtime/bf16_optimizer.py (BLOOM used the olruwase/bf16-updates branch);
bigscience-workshop/bigscience train/tr11-176B-ml/README.md and chronicles-prequel.md (fp16
runs with ZeRO-1: tr11-200B-ml.slurm of 2022-02-26, ZERO_STAGE=1 and "fp16": {"enabled": true,
"loss_scale": 0}, dynamic loss scaling).

Expects the estimate of the same plan under the profile's cluster; guarantees a step time from
the schedule's own simulation (`cost_model.schedules.simulate`): the per-micro-batch terms (1,
4) change the stages' times, the per-step terms (2, 3) replace the ranks' tails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cost_model.communication import collective_time_s, p2p_time_s
from cost_model.hardware import Cluster
from cost_model.parts.pipeline import tied_pair_placement
from cost_model.results import Estimate
from cost_model.schedules import StageTimes, simulate
from cost_model.strategy import Strategy, group_placements, pipeline_link_crosses_nodes
from cost_model.unit_cost import UnitCost
from cost_model.workload import ModelProfile

# The optimizer wrapper DeepSpeed's engine runs for a plan (deepspeed/runtime/engine.py).
DeepSpeedOptimizer = Literal["BF16_Optimizer", "DeepSpeedZeroOptimizer", "FP16_Optimizer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerTraffic:
    """What one optimizer wrapper moves, per parameter: device-memory bytes of its passes and
    the width of the gradients it all-reduces."""

    # After a micro-batch's backward, per local parameter.
    accumulate_bytes: float
    # Whether the first micro-batch of a step pays it too (False: the first writes .grad).
    accumulates_first_micro_batch: bool
    # Once a step on every local parameter (the unsharded gradients).
    step_bytes: float
    # Once a step per element of this rank's 1/dp partition (ZeRO-1), or per local parameter
    # when the optimizer is not sharded.
    partition_bytes: float
    sharded: bool
    # Bytes per parameter of the data-parallel and of the tied-embedding gradient all-reduce.
    grad_allreduce_bytes: float
    # Whether the updated weights are all-gathered over data parallelism (ZeRO-1).
    gathers_weights: bool


OPTIMIZER_TRAFFIC: dict[DeepSpeedOptimizer, OptimizerTraffic] = {
    # bf16_optimizer.py. Every micro-batch, update_hp_grads adds each bf16 gradient into the
    # fp32 buffer: read bf16 (2), write the fp32 copy (4), read it and the buffer (4 + 4), write
    # the buffer (4) = 18. Every step on the unsharded fp32 buffer: the averaging over data
    # parallelism (div_ by the DP size: read + write 8), the global norm (read 4), the clip
    # (read + write 8), the clear (write 4) = 24. Adam on the shard of the fp32 master weights
    # and the bf16 copy back: 30.
    "BF16_Optimizer": OptimizerTraffic(
        accumulate_bytes=18.0,
        accumulates_first_micro_batch=True,
        step_bytes=24.0,
        partition_bytes=30.0,
        sharded=True,
        grad_allreduce_bytes=4.0,
        gathers_weights=True,
    ),
    # stage_1_and_2.py at ZeRO-1. Between micro-batches autograd's in-place add into the fp16
    # .grad: read 2 + 2, write 2 = 6. Every step on the unsharded fp16 gradients, the bucketed
    # all-reduce (allreduce_bucket, allreduce_and_copy): flatten (read 2, write 2), div_ by the
    # DP size (read 2, write 2), copy back (read 2, write 2) = 12. On the 1/dp partition
    # (step): overflow check x.float().sum() (read 2, write 4, read 4 = 10), norm in float64
    # g.double().norm(2) (read 2, write 8, read 8 = 18), flatten + .to(fp32) (read 2, write 2,
    # read 2, write 4 = 10), unscale and clip mul_ (read + write 8), Adam (apex FusedAdam: read
    # fp32 weight, grad, m, v 16, write weight, m, v 12 = 28), copy to the fp16 partition (read
    # 4, write 2 = 6) = 80.
    "DeepSpeedZeroOptimizer": OptimizerTraffic(
        accumulate_bytes=6.0,
        accumulates_first_micro_batch=False,
        step_bytes=12.0,
        partition_bytes=80.0,
        sharded=True,
        grad_allreduce_bytes=2.0,
        gathers_weights=True,
    ),
    # fused_optimizer.py (FP16_Optimizer) after DeepSpeedEngine.allreduce_bucket (flatten,
    # post-scale mul_, copy back = 12), on every local parameter: overflow check (10), .to(fp32)
    # a gradient and flatten (read 2, write 4, read 4, write 4 = 14), get_grad_norm over the
    # fp32 flat gradients (read 4), unscale and clip (8), Adam (28), copy into the fp16 weights
    # (6) = 70.
    "FP16_Optimizer": OptimizerTraffic(
        accumulate_bytes=6.0,
        accumulates_first_micro_batch=False,
        step_bytes=12.0,
        partition_bytes=70.0,
        sharded=False,
        grad_allreduce_bytes=2.0,
        gathers_weights=False,
    ),
}


def deepspeed_pipe_optimizer(strategy: Strategy) -> DeepSpeedOptimizer | None:
    """The optimizer wrapper DeepSpeed's engine runs for ``strategy`` (module docstring); None
    where this module does not describe the plan (fp32; fp16 beyond ZeRO-1, which the pipeline
    engine refuses; bf16 at ZeRO-3)."""
    if strategy.dtype == "bf16" and strategy.zero_stage < 3:
        return "BF16_Optimizer"
    if strategy.dtype == "fp16" and strategy.zero_stage == 1:
        return "DeepSpeedZeroOptimizer"
    if strategy.dtype == "fp16" and strategy.zero_stage == 0:
        return "FP16_Optimizer"
    return None


def deepspeed_pipe_step_s(
    optimizer: DeepSpeedOptimizer,
    profile: ModelProfile,
    cluster: Cluster,
    strategy: Strategy,
    est: Estimate,
    costs: Sequence[UnitCost],
) -> float:
    """Step time of the plan behind ``est`` under DeepSpeed's pipeline engine and ``optimizer``
    (module docstring); ``costs`` are the plan's unit costs (any recompute mode: only their
    output bytes and local parameters are read)."""
    traffic = OPTIMIZER_TRAFFIC[optimizer]
    cal = cluster.calibration
    mem_bw = cluster.device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    dp, m = strategy.dp_degree, strategy.num_micro_batches
    dp_groups = group_placements(strategy, cluster, "dp")
    tp_groups = group_placements(strategy, cluster, "tp")
    width = strategy.dtype_bytes
    tied_params = sum(u.num_params_shared for u in profile.units) / strategy.tp_degree
    # (1) the share of micro-batches that accumulate into an existing gradient
    accumulating = 1.0 if traffic.accumulates_first_micro_batch else (m - 1) / m

    # parameters each stage stores (ZeRO 0-1: weights and gradients unsharded)
    stage_params = [
        sum(costs[u].local_params for u in range(s.first_unit, s.last_unit + 1)) for s in est.stages
    ]
    times = []
    for s, params in zip(est.stages, stage_params, strict=True):
        backward = s.backward_s + accumulating * params * traffic.accumulate_bytes / mem_bw
        transfer = s.transfer_s
        if transfer > 0.0:
            # (4) a 1/t slice over the link, all-gathered by the receiver's TP group
            out = costs[s.last_unit].output_bytes
            here = strategy.pipeline_rank_of_stage(s.stage_idx)
            there = strategy.pipeline_rank_of_stage(s.stage_idx + 1)
            cross = pipeline_link_crosses_nodes(strategy, cluster, here, there)
            transfer = p2p_time_s(out / strategy.tp_degree, cluster, cross_node=cross)
            transfer += collective_time_s("all_gather", out, tp_groups, cluster)
        times.append(
            StageTimes(
                forward_s=s.forward_s,
                backward_s=backward,
                weight_s=min(s.weight_s, backward),
                transfer_s=transfer,
            )
        )
    rank_tail = []
    pair = tied_pair_placement(strategy, cluster)
    first_rank = 0
    last_rank = strategy.pipeline_rank_of_stage(strategy.num_stages - 1)
    grad_bytes = traffic.grad_allreduce_bytes
    updated_share = 1.0 / dp if traffic.sharded else 1.0
    for rank in est.ranks:
        params = sum(stage_params[s] for s in rank.stages)
        # (2) the tied embedding's and the data-parallel gradient all-reduce
        tail = collective_time_s("all_reduce", grad_bytes * params, dp_groups, cluster)
        if pair is not None and tied_params and rank.pp_rank in (first_rank, last_rank):
            tail += collective_time_s("all_reduce", grad_bytes * tied_params, (pair,), cluster)
        # (3) the optimizer's passes and the weight all-gather
        step_bytes = traffic.step_bytes + traffic.partition_bytes * updated_share
        tail += params * step_bytes / mem_bw
        if traffic.gathers_weights:
            tail += collective_time_s("all_gather", width * params, dp_groups, cluster)
        rank_tail.append(tail)
    return simulate(strategy.schedule_spec, times, rank_tail).step_time_s
