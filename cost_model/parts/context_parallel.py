"""Context parallelism: ring attention over ``cp_degree`` ranks that each hold ``1/cp`` of every
sequence.

Expects a unit and the strategy's ``cp_degree`` (with its TP degree, micro-batch and dtype) and
the placements of its cp groups. Guarantees: per micro-batch on one device; the identity (no
cost, the unit unchanged) when ``cp_degree == 1``.

What cp changes (torch's ``context_parallel``, Megatron-LM's context parallelism):

- every token-proportional figure of the unit divides by cp (`local_unit`): the FLOPs and
  bytes of every op (GEMMs see ``m / cp`` tokens; causal attention does ``1/cp`` of its
  FLOPs on each rank, see below), the saved activations, the unit's input and output (so TP
  collectives, pipeline sends and the loss shrink too). Weights do not divide.
- causal load balance: torch's load-balanced sharding (``_HeadTailLoadBalancer``) cuts each
  sequence into ``2 cp`` chunks and gives rank i chunks i and ``2cp-1-i``, so every rank's
  queries see the same number of unmasked keys: each rank does ``1/cp`` of the causal
  attention FLOPs, and every ring step does the same work, ``1/cp`` of the rank's.
- ring attention (`ring_attention_cost`): ``cp - 1`` exchanges of the local K/V block,
  ``2 x tokens_local x kv_heads_local x head_dim x dtype bytes``, each overlapped with the block
  attention of the step before: ``time = c + (cp - 1) max(c, p2p)`` with ``c`` one step's
  compute. Only ``(cp - 1) max(0, p2p - c)`` is added to the unit's attention compute. The
  backward sends K/V and their gradients (twice the bytes) around the ring
  (torch's ``_templated_ring_attention_backward``).
- weights are replicated over cp: their gradients reduce over dp x cp (`Strategy.weights_view`),
  as torchtitan's ``dp_shard_cp`` mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.communication import p2p_time_s
from cost_model.hardware import Cluster
from cost_model.parts.compute import op_cost
from cost_model.strategy import GroupPlacement, Strategy
from cost_model.workload import GemmShape, ModelProfile, OpProfile, UnitProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class RingAttentionCost:
    """What the ring adds to one unit's attention per micro-batch (exposed time only)."""

    forward_s: float
    backward_s: float  # the backward's ring, and the forward's again under full recompute
    kv_block_bytes: float  # one step's K/V block (the forward's message)
    steps: int  # exchanges per ring (cp - 1)


def local_op(op: OpProfile, cp_degree: int) -> OpProfile:
    """``op`` on one cp rank: its token-proportional FLOPs and bytes divided by cp."""
    if cp_degree == 1:
        return op
    gemm = op.gemm
    if gemm is not None:
        gemm = GemmShape(
            m_per_sample=max(1, gemm.m_per_sample // cp_degree),
            n=gemm.n,
            k=gemm.k,
            batch=gemm.batch,
        )
    return dataclasses.replace(
        op,
        forward_flops=op.forward_flops / cp_degree,
        backward_flops=op.backward_flops / cp_degree,
        activation_bytes=op.activation_bytes / cp_degree,
        fused_bytes=None if op.fused_bytes is None else op.fused_bytes / cp_degree,
        gemm=gemm,
    )


def local_unit(unit: UnitProfile, cp_degree: int) -> UnitProfile:
    """``unit`` as one cp rank runs it (see the module docstring); ``unit`` itself if cp = 1."""
    if cp_degree == 1:
        return unit
    moe = unit.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, routed_tokens_per_sample=max(1, moe.routed_tokens_per_sample // cp_degree)
        )
    return dataclasses.replace(
        unit,
        ops=tuple(local_op(op, cp_degree) for op in unit.ops),
        saved_bytes_sharded=unit.saved_bytes_sharded / cp_degree,
        saved_bytes_replicated=unit.saved_bytes_replicated / cp_degree,
        saved_bytes_selective_sharded=unit.saved_bytes_selective_sharded / cp_degree,
        saved_bytes_selective_replicated=unit.saved_bytes_selective_replicated / cp_degree,
        input_bytes=unit.input_bytes / cp_degree,
        output_bytes=unit.output_bytes / cp_degree,
        moe=moe,
    )


def kv_block_bytes(profile: ModelProfile, strategy: Strategy) -> float:
    """One ring step's message: the local K and V, ``2 x tokens_local x kv_heads_local x
    head_dim x dtype bytes`` with ``tokens_local = micro_batch x seq_len / cp`` and the KV heads
    split by TP."""
    heads = profile.num_heads or 1
    kv_heads = profile.num_kv_heads or heads
    head_dim = profile.head_dim
    tokens_local = strategy.micro_batch_size * profile.seq_len / strategy.cp_degree
    kv_local = kv_heads / strategy.tp_degree
    return 2.0 * tokens_local * kv_local * head_dim * strategy.dtype_bytes


def ring_attention_cost(
    local: UnitProfile,
    profile: ModelProfile,
    strategy: Strategy,
    cluster: Cluster,
    cp_groups: Sequence[GroupPlacement],
    recompute: str,
) -> RingAttentionCost:
    """The ring's exposed time for the attention ops of ``local`` (the unit on one cp rank,
    `local_unit`) under the unit's own ``recompute`` mode (see the module docstring)."""
    cp = strategy.cp_degree
    attention = [op for op in local.ops if op.kind == "attention"]
    if cp == 1 or not attention:
        return RingAttentionCost(forward_s=0.0, backward_s=0.0, kv_block_bytes=0.0, steps=0)
    block = kv_block_bytes(profile, strategy)
    # the ring's slowest hop sets each step: across nodes if any cp group spans nodes
    cross = any(group.crosses_nodes for group in cp_groups)
    p2p_forward = p2p_time_s(block, cluster, cross_node=cross)
    p2p_backward = p2p_time_s(2.0 * block, cluster, cross_node=cross)  # K/V and dK/dV
    forward_s = backward_s = 0.0
    for op in attention:
        times = op_cost(op, cluster, strategy, profile.traced_dtype_bytes)
        # equal steps (head-tail load balance): each 1/cp of the rank's attention
        forward_s += (cp - 1) * max(0.0, p2p_forward - times.forward_s / cp)
        backward_s += (cp - 1) * max(0.0, p2p_backward - times.backward_s / cp)
    if recompute == "full":
        backward_s += forward_s  # the recomputed forward runs its ring again
    return RingAttentionCost(
        forward_s=forward_s, backward_s=backward_s, kv_block_bytes=block, steps=cp - 1
    )
