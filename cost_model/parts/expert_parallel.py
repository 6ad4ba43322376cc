"""Expert parallelism: the routed experts of a mixture-of-experts unit split over ``ep_degree``
consecutive data-parallel ranks, tokens sent to their experts and back by all-to-all.

Expects a unit's `MoELayerFacts` (already local to one cp rank: `context_parallel.local_unit`),
the strategy and the placements of its ep groups. Guarantees: per micro-batch on one device;
with ``ep_degree == 1`` no all-to-all, and every rank runs all experts on its own tokens.

Per micro-batch, a rank routes ``A = micro_batch x routed_tokens_per_sample`` token-expert
assignments (``seq_len x top_k`` per sample, divided by cp; divided by TP too when sequence
parallelism splits the tokens along the sequence; without it every TP rank routes the same
tokens):

- dispatch and combine (`all_to_all_time_s` over the ep group's real placement): each moves
  ``A x hidden x dtype bytes`` per rank, ``(ep - 1) / ep`` of which leaves it; two in
  the forward, two in the backward (the gradients travel the same way back), two more in the
  backward when full recompute re-runs the forward. Megatron-LM's ``MoEAlltoAllTokenDispatcher``
  and torchtitan's expert-parallel dispatch both move exactly this.
- expert GEMMs at the per-expert token count: a rank holds ``E / ep`` experts and receives
  ``A`` assignments, ``A x ep / E`` per expert when routing is balanced. Each expert
  runs ``num_gemms`` GEMMs of that many rows (`cost_model.compute.op_time`: the saturating
  efficiency by size and depth, so small per-expert batches run below the dense GEMM rate).
- routing imbalance: the busiest rank waits for its experts' largest load. A factor
  ``imbalance >= 1`` scales its assignments (its GEMM rows, the bytes it receives, and the
  activations it keeps beyond the balanced ones the trace counted in the unit's saved
  bytes). ``BALANCED_ROUTING = 1.0`` is the default: what the load-balancing loss aims at,
  and what dropless routing of a balanced router gives. ``SWITCH_CAPACITY_FACTOR = 1.25`` is
  the training capacity factor of Switch/ST-MoE (Fedus et al. 2021; Zoph et al. 2022;
  DeepSpeed-MoE's ``train_capacity_factor`` examples use it too), the imbalance that
  capacity-based routers provision for.
- expert weights, gradients and optimizer states: ``E / ep`` experts per rank, ZeRO-sharded
  and gradient-reduced over the expert-data-parallel group (dp x cp / ep ranks holding the
  same experts: `Strategy.expert_view`).

Expert tensor parallelism (``etp_degree`` > 1, Megatron-Core's ``--expert-tensor-parallel-size``):
each expert's weights split over ``etp`` consecutive ranks of the TP group as a dense MLP's are
(gate and up column-parallel, down row-parallel: megatron/core/transformer/moe/experts.py
builds them with the expert-TP group), so a rank stores ``1/etp`` of each of its ``E / ep``
experts, and their gradients reduce over ``dp x cp x tp / (ep x etp)`` ranks. After the
dispatch all-to-all (unchanged: each rank still sends its own ``A`` assignments) the etp ranks
all-gather the tokens they received, so each runs its slice of the GEMMs on ``etp`` times the
rows (the same FLOPs per rank), and reduce-scatter the outputs before the combine
(``MoEAlltoAllTokenDispatcher``: ``gather_from_sequence_parallel_region`` and
``reduce_scatter_to_sequence_parallel_region`` over its ``tp_group``, the expert-TP group,
megatron/core/transformer/moe/token_dispatcher.py). The backward runs the mirror collectives
(reduce-scatter of the input gradients, all-gather of the output gradients), and the GEMMs
keep their gathered input for the weight gradients: ``(etp - 1) x A x hidden`` bytes beyond
what the trace counted (unless full recompute re-runs them). When the TP ranks
route the same tokens (tp > 1 without sequence parallelism) nothing is gathered: each etp
rank runs ``1/etp`` of the GEMMs on the same rows and the outputs are all-reduced, as dense
row-parallel TP (Shoeybi et al. 2019), once forward and once backward. Those collectives are
priced over the etp group's placement (one scale-up domain when tp fits one) and counted with
the all-to-all, exposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.communication import (
    all_gather_time_s,
    all_reduce_time_s,
    all_to_all_time_s,
    reduce_scatter_time_s,
)
from cost_model.compute import op_time
from cost_model.hardware import Cluster
from cost_model.strategy import GroupPlacement, Strategy, group_placements
from cost_model.workload import GemmShape, MoELayerFacts, OpProfile

BALANCED_ROUTING = 1.0
SWITCH_CAPACITY_FACTOR = 1.25


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertCost:
    """The routed experts of one unit on one device, per micro-batch."""

    forward_compute_s: float
    backward_compute_s: float
    weight_backward_s: float  # of the backward, the weight gradients (a split backward's)
    forward_flops: float  # this device's expert FLOPs (balanced, model work)
    all_to_all_forward_s: float  # dispatch + combine
    all_to_all_backward_s: float  # their gradients (and the forward's again under full)
    tokens_per_expert: float  # rows of each local expert's GEMMs (imbalance included)
    local_params: float  # expert parameters this device stores (E / ep experts)
    # kept for the backward beyond the unit's traced (balanced) saved bytes, under the unit's
    # recompute mode / without recompute (working set, retained)
    activation_bytes: float
    all_activation_bytes: float


def rank_assignments(facts: MoELayerFacts, strategy: Strategy) -> float:
    """Token-expert assignments a device routes per micro-batch (``facts`` local to its cp
    rank)."""
    routed = strategy.micro_batch_size * facts.routed_tokens_per_sample
    return routed / (strategy.tp_degree if strategy.sequence_parallel else 1)


def expert_gemms(
    facts: MoELayerFacts, rows: float, dtype_bytes: int, etp: int = 1
) -> tuple[OpProfile, ...]:
    """One expert's GEMMs on ``rows`` tokens, as ops at the training dtype: ``num_gemms - 1``
    of (hidden -> F) and the last (F -> hidden), SwiGLU's gate, up and down; with ``etp`` > 1
    this rank's slice of them (F / etp columns of the first, rows of the last)."""
    h, f = facts.hidden_size, facts.expert_ffn_hidden_size // etp
    flops = 2.0 * rows * h * f
    m = max(1, round(rows))
    shapes = [(f, h)] * (facts.num_gemms - 1) + [(h, f)]
    return tuple(
        OpProfile(
            name=f"expert_gemm{i}",
            kind="matmul",
            tp="replicated",
            forward_flops=flops,
            backward_flops=2.0 * flops,
            activation_bytes=rows * (n + k) * dtype_bytes,
            param_bytes_read=h * f * dtype_bytes,
            gemm=GemmShape(m_per_sample=m, n=n, k=k),
        )
        for i, (n, k) in enumerate(shapes)
    )


def expert_cost(
    facts: MoELayerFacts,
    strategy: Strategy,
    cluster: Cluster,
    ep_groups: Sequence[GroupPlacement],
    recompute: str,
    traced_dtype_bytes: int,
    *,
    imbalance: float = BALANCED_ROUTING,
) -> ExpertCost:
    """The routed experts of one unit on one device (see the module docstring)."""
    if imbalance < 1.0:
        raise ValueError(f"routing imbalance = {imbalance} must be >= 1 (1: balanced)")
    ep, experts, etp = strategy.ep_degree, facts.num_experts, strategy.etp_degree
    local_experts = experts // ep
    pairs = rank_assignments(facts, strategy)
    # the etp ranks gather each other's tokens when they route different ones
    gathers = etp > 1 and strategy.sequence_parallel
    rows = pairs * ep / experts * imbalance * (etp if gathers else 1)
    width = strategy.dtype_bytes
    forward = backward = weight = 0.0
    for op in expert_gemms(facts, rows, width, etp):
        times = op_time(
            op,
            device=cluster.device,
            calibration=cluster.calibration,
            dtype=strategy.dtype,
            micro_batch_size=1,
            traced_dtype_bytes=width,
        )
        forward += local_experts * times.forward_s
        backward += local_experts * times.backward_s
        weight += local_experts * times.weight_backward_s
    message = pairs * imbalance * facts.hidden_size * width
    one = max((all_to_all_time_s(message, g, cluster) for g in ep_groups), default=0.0)
    if etp > 1:
        # the expert-TP collectives over the etp group (module docstring)
        etp_groups = group_placements(strategy, cluster, "etp")
        if gathers:
            gathered = message * etp
            pair_s = max(
                all_gather_time_s(gathered, g, cluster)
                + reduce_scatter_time_s(gathered, g, cluster)
                for g in etp_groups
            )
        else:
            pair_s = max(all_reduce_time_s(message, g, cluster) for g in etp_groups)
        one += pair_s / 2.0
    a2a_forward = 2.0 * one
    a2a_backward = 2.0 * one + (a2a_forward if recompute == "full" else 0.0)
    # the busiest rank's assignments beyond the balanced share, each keeping its input and
    # the GEMM outputs (hidden + num_gemms x F elements)
    per_assignment = (facts.hidden_size + facts.num_gemms * facts.expert_ffn_hidden_size) * width
    saved = pairs * (imbalance - 1.0) * per_assignment
    if gathers:
        # the expert GEMMs keep their gathered input for the weight gradients: the other
        # etp - 1 ranks' tokens beyond this rank's own (the slices of the outputs are the
        # balanced bytes: etp x the rows at F / etp)
        saved += pairs * imbalance * (etp - 1) * facts.hidden_size * width
    return ExpertCost(
        forward_compute_s=forward,
        backward_compute_s=backward,
        weight_backward_s=weight,
        forward_flops=pairs * facts.flops_per_routed_token / (1 if gathers else etp),
        all_to_all_forward_s=a2a_forward,
        all_to_all_backward_s=a2a_backward,
        tokens_per_expert=rows,
        local_params=float(local_experts * facts.params_per_expert) / etp,
        # full recompute keeps only the unit's input; selective keeps GEMM outputs (the
        # experts' are GEMM outputs, kept)
        activation_bytes=0.0 if recompute == "full" else saved,
        all_activation_bytes=saved,
    )


def recompute_expert_s(cost: ExpertCost, recompute: str) -> float:
    """Expert compute re-run in the backward: all of the forward under full recompute."""
    return cost.forward_compute_s if recompute == "full" else 0.0
