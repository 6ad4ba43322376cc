"""DeepSpeed's pipeline engine with its BF16_Optimizer (Megatron-DeepSpeed, as BigScience
trained BLOOM-176B in 2022): the step time of a plan run that way.

It differs from the runtime the rest of the cost model describes in four documented ways, each
priced with the cost model's own collective, p2p and memory-bandwidth formulas (nothing fitted):

1. Gradients accumulate in an unsharded fp32 buffer: after every micro-batch's backward the
   bf16 gradients are added into it (BF16_Optimizer.update_hp_grads, called from the pipeline
   engine's backward pass), a memory-bound pass on every stage.
2. The data-parallel sync is an all-reduce of that fp32 buffer after the pipeline flush
   (PipelineEngine._exec_reduce_grads -> buffered_allreduce_fallback over
   get_grads_for_reduction, the fp32 buffer; the BLOOM README: the fp32 buffer is not sharded
   "but since it's not sharding it saves on communications"), not a reduce-scatter of bf16
   gradients; the tied embedding's fp32 gradient is all-reduced between the first and last
   stage before it (_exec_reduce_tied_grads uses weight._hp_grad).
3. The optimizer step then clips with a norm over the whole fp32 buffer, runs Adam on this
   rank's 1/dp shard and all-gathers the updated bf16 weights over data parallelism
   (update_lp_params -> all_gather_dp_groups): ZeRO-1 by all-reduce + all-gather.
4. Activations and their gradients cross pipeline stages as 1/t slices that the receiver
   all-gathers inside its tensor-parallel group (DeepSpeed's pipeline config defaults
   pipe_partitioned and grad_partitioned to true).

Sources: deepspeedai/DeepSpeed deepspeed/runtime/bf16_optimizer.py and
deepspeed/runtime/pipe/engine.py (2022; BLOOM used the olruwase/bf16-updates branch), and
bigscience-workshop/bigscience train/tr11-176B-ml/README.md.

Expects the estimate of the same plan under the profile's cluster; guarantees a step time from
the schedule's own simulation (`cost_model.schedules.simulate`): the per-micro-batch terms (1,
4) change the stages' times, the per-step terms (2, 3) replace the ranks' tails.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.communication import collective_time_s, p2p_time_s
from cost_model.hardware import Cluster
from cost_model.parts.pipeline import tied_pair_placement
from cost_model.results import Estimate
from cost_model.schedules import StageTimes, simulate
from cost_model.strategy import Strategy, group_placements, pipeline_link_crosses_nodes
from cost_model.unit_cost import UnitCost
from cost_model.workload import ModelProfile

# Bytes of device memory traffic per locally stored parameter in DeepSpeed's BF16_Optimizer.
# Every micro-batch, update_hp_grads adds each bf16 gradient into the fp32 gradient buffer:
# read bf16 (2), write the fp32 copy (4), read it and the buffer (4 + 4), write the buffer (4).
BF16_OPTIMIZER_ACCUMULATE_BYTES = 18.0
# Every step, on the unsharded fp32 gradient buffer: the gradient averaging over data
# parallelism (div_ by the DP size: read + write 8), the global norm (read 4), the clip
# (read + write 8) and the clear (write 4).
BF16_OPTIMIZER_STEP_BYTES = 24.0
# Adam on this rank's 1/dp shard of the fp32 master weights, and the bf16 copy back.
BF16_OPTIMIZER_SHARD_BYTES = 30.0


def deepspeed_pipe_bf16_step_s(
    profile: ModelProfile,
    cluster: Cluster,
    strategy: Strategy,
    est: Estimate,
    costs: Sequence[UnitCost],
) -> float:
    """Step time of the plan behind ``est`` under DeepSpeed's pipeline engine and BF16_Optimizer
    (module docstring); ``costs`` are the plan's unit costs (any recompute mode: only their
    output bytes are read)."""
    cal = cluster.calibration
    mem_bw = cluster.device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    dp = strategy.dp_degree
    dp_groups = group_placements(strategy, cluster, "dp")
    tp_groups = group_placements(strategy, cluster, "tp")
    width = strategy.dtype_bytes
    tied_params = sum(u.num_params_shared for u in profile.units) / strategy.tp_degree

    times = []
    for s in est.stages:
        # (1) the fp32 accumulation after every micro-batch's backward of this stage's weights
        params = s.param_bytes / width  # ZeRO-1: weights unsharded
        backward = s.backward_s + params * BF16_OPTIMIZER_ACCUMULATE_BYTES / mem_bw
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
    for rank in est.ranks:
        params = sum(est.stages[s].param_bytes for s in rank.stages) / width
        # (2) and (3): fp32 all-reduce, Adam on the shard, bf16 all-gather
        tail = collective_time_s("all_reduce", 4.0 * params, dp_groups, cluster)
        tail += collective_time_s("all_gather", width * params, dp_groups, cluster)
        if pair is not None and tied_params and rank.pp_rank in (first_rank, last_rank):
            tail += collective_time_s("all_reduce", 4.0 * tied_params, (pair,), cluster)
        tail += params * (BF16_OPTIMIZER_STEP_BYTES + BF16_OPTIMIZER_SHARD_BYTES / dp) / mem_bw
        rank_tail.append(tail)
    return simulate(strategy.schedule_spec, times, rank_tail).step_time_s
