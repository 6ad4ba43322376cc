"""Context and expert parallelism in the cost model, against numbers worked by hand.

The cluster is `round_cluster` (tests/cost_profiles.py): 100 TFLOP/s bf16 at efficiency 0.5
(50 TFLOP/s, no size penalty, no kernel overhead), 1 TB/s memory at 0.5 (500 GB/s), links at
0.5 of 100 GB/s + 10 us inside a node (50 GB/s) and 10 GB/s + 20 us across nodes (5 GB/s).
The profiles are traced "in bf16" (2-byte elements), so the plan's bf16 scales nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

import pytest

from cost_model.communication import all_to_all_time_s
from cost_model.estimate import CostModel
from cost_model.parts.context_parallel import kv_block_bytes, local_unit, ring_attention_cost
from cost_model.parts.expert_parallel import SWITCH_CAPACITY_FACTOR, expert_cost
from cost_model.strategy import (
    GroupPlacement,
    Strategy,
    _group_placements,
    folded_ep_factors,
    group_placements,
    mesh_groups,
)
from tests.cost_profiles import gpt_profile, round_cluster, with_routed_experts

CP_LAYOUT = ("pp", "dp", "cp", "tp")


def close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-9, abs=1e-15)


# ------------------------------------------------------------------------- context parallel


def test_local_unit_divides_token_work_not_weights() -> None:
    profile = gpt_profile(num_layers=2, s=2048, h=1024, a=8, e=2)
    block = profile.units[1]
    half = local_unit(block, 2)
    assert local_unit(block, 1) is block
    assert close(half.forward_flops, block.forward_flops / 2)
    assert close(half.saved_bytes, block.saved_bytes / 2)
    assert close(half.output_bytes, block.output_bytes / 2)
    assert half.num_params == block.num_params and half.param_bytes == block.param_bytes
    # GEMM rows: 2048 tokens -> 1024 per rank; weights' shape unchanged
    q = next(op for op in half.ops if op.name == "q_proj")
    assert q.gemm is not None and (q.gemm.m_per_sample, q.gemm.n, q.gemm.k) == (1024, 1024, 1024)


def test_ring_attention_exposed_across_nodes_by_hand() -> None:
    """cp = 2 over two one-device nodes, s = 2048, h = 1024, 8 heads of 128 (KV heads = heads).

    K/V block: 2 x 1024 local tokens x 8 heads x 128 x 2 bytes = 4,194,304 B; across nodes:
    20 us + 4,194,304 / 5e9 = 858.8608 us. The rank's causal attention: 4 s^2 h / cp =
    8.589934592e9 FLOPs at 50 TFLOP/s = 171.79869184 us (compute-bound: its 8.4 MB at 500 GB/s
    take 16.8 us), two equal steps (head-tail balance) of 85.89934592 us. Exposed forward:
    (cp - 1) x (858.8608 - 85.89934592) = 772.96145408 us. Backward: twice the FLOPs (steps of
    171.79869184 us) and twice the bytes (K/V and dK/dV: 20 + 1677.7216 = 1697.7216 us):
    1525.92290816 us.
    """
    profile = gpt_profile(num_layers=2, s=2048, h=1024, a=8, e=2)
    cluster = round_cluster(num_nodes=2, devices_per_node=1)
    strategy = Strategy(cp_degree=2, rank_layout=CP_LAYOUT)
    assert kv_block_bytes(profile, strategy) == 4_194_304
    cp_groups = group_placements(strategy, cluster, "cp")
    assert cp_groups == (GroupPlacement(size=2, num_nodes=2, ranks_per_node=1),)
    ring = ring_attention_cost(
        local_unit(profile.units[1], 2), profile, strategy, cluster, cp_groups, "none"
    )
    assert ring.steps == 1
    assert close(ring.forward_s, 772.96145408e-6)
    assert close(ring.backward_s, 1525.92290816e-6)
    # full recompute runs the forward's ring again in the backward
    full = ring_attention_cost(
        local_unit(profile.units[1], 2), profile, strategy, cluster, cp_groups, "full"
    )
    assert close(full.backward_s, 1525.92290816e-6 + 772.96145408e-6)
    # the unit's costs carry it, on top of the halved compute
    costs = CostModel(profile, cluster).unit_costs(strategy, "none")[1]
    assert close(costs.cp_forward_s, 772.96145408e-6)
    assert close(costs.cp_backward_s, 1525.92290816e-6)


def test_ring_attention_hidden_inside_a_node() -> None:
    """s = 8192 inside one node: a step computes 4 x 8192^2 x 1024 / 2 / 2 / 50e12 = 1.374 ms,
    the K/V block (16,777,216 B) takes 10 us + 335.5 us over NVLink: fully hidden."""
    profile = gpt_profile(num_layers=1, s=8192, h=1024, a=8, e=2)
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    strategy = Strategy(cp_degree=2, dp_degree=4, rank_layout=CP_LAYOUT)
    groups = group_placements(strategy, cluster, "cp")
    ring = ring_attention_cost(
        local_unit(profile.units[1], 2), profile, strategy, cluster, groups, "none"
    )
    assert ring.kv_block_bytes == 16_777_216 and ring.forward_s == 0.0 and ring.backward_s == 0.0


def test_cp_halves_compute_and_activations_and_reduces_weights_like_dp() -> None:
    """cp = 2 against cp = 1 on the same tokens per rank: compute and activations per
    micro-batch halve (every op is linear in the tokens, causal attention too with the
    load-balanced layout); the weights' gradients reduce over dp x cp, so one cp pair's sync
    equals that of a dp pair on the same two nodes."""
    profile = gpt_profile(num_layers=2, s=2048, h=1024, a=8, e=2)
    cluster = round_cluster(num_nodes=2, devices_per_node=1)
    model = CostModel(profile, cluster)
    cp2 = model.unit_costs(Strategy(cp_degree=2, rank_layout=CP_LAYOUT), "none")
    dp2 = model.unit_costs(Strategy(dp_degree=2), "none")
    for with_cp, plain in zip(cp2, dp2, strict=True):
        assert close(with_cp.forward_compute_s, plain.forward_compute_s / 2)
        assert close(with_cp.activation_bytes, plain.activation_bytes / 2)
        assert close(with_cp.dp_sync_s, plain.dp_sync_s)
        assert with_cp.param_bytes == plain.param_bytes
        assert plain.dp_sync_s > 0


# ------------------------------------------------------------------------- expert parallel


def test_all_to_all_by_hand() -> None:
    """8 ranks, 4 on each of 2 nodes, 8 MB each: 1 MB to every member; 3 MB over NVLink
    (60 us at 50 GB/s) while 4 MB leave by the NIC (800 us at 5 GB/s), + one inter-node
    latency (20 us) = 820 us. Inside one node of 8: 7 MB at 50 GB/s + 10 us = 150 us."""
    cluster = round_cluster(num_nodes=2, devices_per_node=4)
    across = GroupPlacement(size=8, num_nodes=2, ranks_per_node=4)
    assert close(all_to_all_time_s(8e6, across, cluster), 820e-6)
    inside = GroupPlacement(size=8, num_nodes=1, ranks_per_node=8)
    assert close(all_to_all_time_s(8e6, inside, round_cluster()), 150e-6)
    assert (
        all_to_all_time_s(8e6, GroupPlacement(size=1, num_nodes=1, ranks_per_node=1), cluster) == 0
    )


MOE = dict(num_experts=8, top_k=2, expert_ffn=512)


def _moe_profile() -> object:
    return with_routed_experts(gpt_profile(num_layers=2, s=1024, h=1024, a=8, e=2), **MOE)


def test_expert_cost_by_hand() -> None:
    """8 experts of width F = 512 on h = 1024, top-2, s = 1024: 2048 assignments per sample.
    ep = 4 over 4 consecutive ranks of one node, micro-batch 1: the rank holds 2 experts and
    gets 2048 x 4 / 8 = 1024 rows per expert. Each GEMM: 2 x 1024 x 1024 x 512 = 1.0737e9
    FLOPs at 50 TFLOP/s = 21.47483648 us (compute-bound: 4.2 MB at 500 GB/s is 8.4 us); 2
    experts x 3 GEMMs: 128.84901888 us forward, twice that backward. All-to-all: 2048 x 1024
    x 2 B = 4,194,304 B per rank, 3/4 of it to 3 peers over NVLink: 3 x 1,048,576 / 50e9 +
    10 us = 72.91456 us; dispatch + combine = 145.82912 us each way."""
    profile = _moe_profile()
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    strategy = Strategy(dp_degree=8, ep_degree=4)
    facts = profile.units[1].moe
    assert facts is not None
    groups = group_placements(strategy, cluster, "ep")
    assert groups == (GroupPlacement(size=4, num_nodes=1, ranks_per_node=4),)
    cost = expert_cost(facts, strategy, cluster, groups, "none", 2)
    assert cost.tokens_per_expert == 1024
    assert close(cost.forward_compute_s, 128.84901888e-6)
    assert close(cost.backward_compute_s, 2 * 128.84901888e-6)
    assert close(cost.all_to_all_forward_s, 145.82912e-6)
    assert close(cost.all_to_all_backward_s, 145.82912e-6)
    assert cost.local_params == 2 * 3 * 1024 * 512
    assert cost.forward_flops == 2048 * 6 * 1024 * 512  # model work on this rank
    # Imbalance 1.25 (Switch's capacity factor): the busiest rank's rows, bytes and time scale
    skewed = expert_cost(
        facts, strategy, cluster, groups, "none", 2, imbalance=SWITCH_CAPACITY_FACTOR
    )
    assert skewed.tokens_per_expert == 1280
    assert close(skewed.forward_compute_s, 1.25 * 128.84901888e-6)
    assert close(skewed.all_to_all_forward_s, 2 * (3 * 1_310_720 / 50e9 + 10e-6))
    # beyond the balanced bytes the trace counted: 0.25 x 2048 x (1024 + 3 x 512) x 2 B
    assert skewed.activation_bytes == 0.25 * 2048 * (1024 + 3 * 512) * 2
    with pytest.raises(ValueError, match="imbalance"):
        expert_cost(facts, strategy, cluster, groups, "none", 2, imbalance=0.5)


def test_unit_costs_with_experts() -> None:
    """In the unit: the experts op leaves the unit's own compute and comes back priced by
    expert parallelism; expert weights divide by ep; their gradients reduce over the
    expert-data-parallel group (dp / ep ranks), the dense ones over dp."""
    profile = _moe_profile()
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    model = CostModel(profile, cluster)
    per_expert = 3 * 1024 * 512
    dense = model.unit_costs(Strategy(dp_degree=8), "none")[1]
    ep4 = model.unit_costs(Strategy(dp_degree=8, ep_degree=4), "none")[1]
    assert dense.local_params - ep4.local_params == (8 - 2) * per_expert
    assert ep4.ep_forward_s == pytest.approx(145.82912e-6) and dense.ep_forward_s == 0.0
    # same FLOPs, same GEMM rate on this cluster (no size penalty): same compute
    assert close(ep4.forward_compute_s, dense.forward_compute_s)
    assert close(ep4.forward_s - dense.forward_s, 145.82912e-6)
    # the traced experts op is not counted twice: the unit's FLOPs are its other ops' and
    # the experts' as expert parallelism prices them (2048 assignments x 6 h F)
    others = sum(op.forward_flops for op in profile.units[1].ops if op.name != "experts")
    assert dense.forward_flops == pytest.approx(others + 2048 * 6 * 1024 * 512)
    assert dense.forward_flops == pytest.approx(profile.units[1].forward_flops)
    # expert gradients over 2 ranks, dense over 8: both positive, the expert sync smaller
    assert ep4.dp_sync_s < dense.dp_sync_s


# ------------------------------------------------------------------------- placements


def test_group_placements_match_every_rank() -> None:
    """The residue shortcut (a group's spread depends only on where its base falls in a node)
    against enumerating every group of random meshes, layouts and node sizes."""
    rng = random.Random(0)
    for case in range(190):
        pp, dp, cp, tp = (rng.choice([1, 2, 3, 4]) for _ in range(4))
        if case >= 150:
            # groups above `_VECTOR_GROUP` ranks (placed with numpy)
            dp = rng.choice([48, 64, 96, 128])
        ep = rng.choice([e for e in range(1, dp + 1) if dp % e == 0])
        layout = tuple(rng.sample(["pp", "dp", "cp", "tp"], 4))
        strategy = Strategy(
            pp_degree=pp,
            dp_degree=dp,
            cp_degree=cp,
            tp_degree=tp,
            ep_degree=ep,
            rank_layout=layout,  # type: ignore[arg-type]
        )
        per_node = rng.choice([1, 2, 4, 6, 8])
        for group in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp_cp"):
            inside, outside = mesh_groups(strategy, group)  # type: ignore[arg-type]
            offsets, bases = [0], [0]
            for step, count in inside:
                offsets = [o + i * step for o in offsets for i in range(count)]
            for step, count in outside:
                bases = [b + i * step for b in bases for i in range(count)]
            # the groups tile the mesh
            assert sorted(b + o for b in bases for o in offsets) == list(
                range(strategy.num_devices)
            )
            found = set()
            for base in bases:
                counts = list(Counter((base + o) // per_node for o in offsets).values())
                found.add(
                    GroupPlacement(
                        size=len(offsets), num_nodes=len(counts), ranks_per_node=max(counts)
                    )
                )
            want = tuple(sorted(found, key=lambda g: (g.num_nodes, g.ranks_per_node)))
            assert _group_placements(inside, outside, per_node) == want


def test_three_axis_layout_is_cp_one() -> None:
    """A layout without cp (plans written before cp) places every group as before."""
    old = Strategy(dp_degree=4, tp_degree=2, pp_degree=2)
    cluster = round_cluster(num_nodes=2, devices_per_node=8)
    for axis in ("pp", "dp", "tp"):
        assert group_placements(old, cluster, axis) == group_placements(  # type: ignore[arg-type]
            dataclasses.replace(old, rank_layout=CP_LAYOUT),
            cluster,
            axis,  # type: ignore[arg-type]
        )
    assert group_placements(old, cluster, "dp_cp") == group_placements(old, cluster, "dp")
    assert [
        old.global_rank(pp=p, dp=d, tp=t)
        for p, d, t in itertools.product(range(2), range(4), range(2))
    ] == list(range(16))


def test_expert_groups_are_the_plan_s_groups() -> None:
    """The cost model's ep and expert-data groups (`mesh_groups`) are the ranks the plan gives
    the runtime (`Plan.ep_group_ranks`, `Plan.expert_data_group_ranks`), folded or not, over
    random meshes and layouts."""
    from autoplan.contract.plan import Plan, even_stages

    rng = random.Random(1)
    checked = 0
    for _ in range(300):
        pp, dp, cp, tp = (rng.choice([1, 2, 4]) for _ in range(4))
        folding = rng.random() < 0.6
        block = dp * cp * tp
        choices = [
            e
            for e in range(1, block + 1)
            if (folded_ep_factors(e, tp, cp, dp) if folding else dp % e == 0)
        ]
        ep = rng.choice(choices)
        layout = tuple(["pp", *rng.sample(["dp", "cp", "tp"], 3)])
        plan = Plan(
            dp_degree=dp,
            cp_degree=cp,
            tp_degree=tp,
            pp_degree=pp,
            ep_degree=ep,
            ep_folding=folding,
            sequence_parallel=tp > 1 and (folding or rng.random() < 0.5),
            rank_layout=layout,  # type: ignore[arg-type]
            stages=even_stages(pp, pp),
            micro_batch_size=1,
            num_micro_batches=pp,
            global_batch_size=dp * pp,
        )
        strategy = Strategy.of(plan)
        for group, of_plan in (
            ("ep", plan.ep_group_ranks),
            ("edp_cp", plan.expert_data_group_ranks),
        ):
            inside, _ = mesh_groups(strategy, group)  # type: ignore[arg-type]
            offsets = [0]
            for step, count in inside:
                offsets = [o + i * step for o in offsets for i in range(count)]
            for rank in range(plan.num_devices):
                want = set(of_plan(rank))
                if group == "edp_cp" and strategy.experts_span_tp and not folding:
                    # SP without folding: the experts also reduce over the TP ranks
                    want = {r for w in want for r in plan.group_ranks("tp", w)}
                base = min(want)
                assert {base + o for o in offsets} == want, (plan, group, rank)
                checked += 1
    assert checked > 1000


def test_ring_messages_use_the_traced_head_size() -> None:
    """A model whose heads are wider than hidden / heads (Qwen3: 128 at hidden 4096, 64 heads):
    the K/V block is kv_heads x head_dim wide, read off the traced attention."""
    import autoplan

    wide = autoplan.trace(autoplan.models.llama(1, 256, 4, 1024, 100, num_kv_heads=2, head_dim=128))
    profile = wide.profile
    assert profile.head_dim == 128 and profile.hidden_size / profile.num_heads == 64
    strategy = Strategy(cp_degree=2, rank_layout=CP_LAYOUT)
    # 2 (K and V) x 512 local tokens x 2 kv heads x 128 x 2 bytes (bf16)
    assert kv_block_bytes(profile, strategy) == 2 * 512 * 2 * 128 * 2


def test_shared_expert_runs_whole_under_sequence_parallelism() -> None:
    """autoplan's runtime runs a MoE layer's shared expert whole on each TP rank's own tokens
    under sequence parallelism (passes/moe_sequence_parallel.py): the cost model stores its
    parameters unsharded and prices one TP region (all-gather + reduce-scatter) fewer."""
    import autoplan
    from cost_model.memory import local_num_params
    from cost_model.parts.tensor_parallel import tp_cost

    graph = autoplan.trace(
        autoplan.models.moe(
            2, 256, 8, 512, 100, 8, 2, 128, num_shared_experts=1, num_dense_layers=1
        )
    )
    unit = next(u for u in graph.profile.units if u.moe is not None)
    shared = unit.moe.shared_expert_params  # type: ignore[union-attr]
    assert shared == 3 * 256 * 128  # gate, up, down of width 128
    whole = local_num_params(unit, 2, shared_expert_whole=True)
    assert whole - local_num_params(unit, 2) == shared / 2
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    strategy = Strategy(tp_degree=2, dp_degree=4, sequence_parallel=True)
    groups = group_placements(strategy, cluster, "tp")
    moe_whole = tp_cost(unit, strategy, cluster, 4, groups, "none", shared_expert_whole=True)
    dense = next(u for u in graph.profile.units if u.kind == "block" and u.moe is None)
    # the MoE block: the attention region alone (a dense block keeps both)
    assert tp_cost(dense, strategy, cluster, 4, groups, "none").forward_s == pytest.approx(
        2 * moe_whole.forward_s
    )
    # which the cost model applies for autoplan's runtime under SP, not for Megatron-LM's
    # tensor-parallel shared expert, nor without SP
    assert CostModel(graph.profile, cluster).shared_expert_whole(strategy)
    assert not CostModel(graph.profile, cluster, "megatron-lm").shared_expert_whole(strategy)
    no_sp = dataclasses.replace(strategy, sequence_parallel=False)
    assert not CostModel(graph.profile, cluster).shared_expert_whole(no_sp)


def test_a_moe_layer_on_sequence_shards_sums_its_gradients_over_tp() -> None:
    """Under SP each TP rank's router and shared expert see its own tokens:
    `ReplicatedGradientSum` all-reduces their gradients over tp after the backward
    (passes/moe_sequence_parallel.py). The cost model prices that all-reduce in the unit's
    post-sync time (fp32 gradients of hidden x experts + the shared expert, each rank's
    data-parallel shard from ZeRO-1 on); the routed experts' sum over tp is in their
    data-parallel group (dp x tp); nothing for Megatron-LM's tensor-parallel shared expert."""
    import autoplan
    from cost_model.communication import collective_time_s
    from cost_model.parts.tensor_parallel import replicated_grad_sum_s

    graph = autoplan.trace(
        autoplan.models.moe(
            2, 256, 8, 512, 100, 8, 2, 128, num_shared_experts=1, num_dense_layers=1
        )
    )
    index, unit = next((i, u) for i, u in enumerate(graph.profile.units) if u.moe is not None)
    assert unit.moe is not None
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    sp = Strategy(tp_degree=2, dp_degree=4, sequence_parallel=True)
    groups = group_placements(sp, cluster, "tp")
    summed = 256 * 8 + unit.moe.shared_expert_params  # router + shared expert
    expected = collective_time_s("all_reduce", summed * 4.0, groups, cluster)
    assert replicated_grad_sum_s(unit, sp, cluster, groups) == pytest.approx(expected, rel=1e-12)
    z3 = dataclasses.replace(sp, zero_stage=3)  # each rank sums its shard of them
    sharded = collective_time_s("all_reduce", summed * 4.0 / 4, groups, cluster)
    assert replicated_grad_sum_s(unit, z3, cluster, groups) == pytest.approx(sharded, rel=1e-12)
    no_sp = dataclasses.replace(sp, sequence_parallel=False)
    assert replicated_grad_sum_s(unit, no_sp, cluster, groups) == 0.0
    assert sp.expert_dp_degree == 8 and no_sp.expert_dp_degree == 4  # experts reduce over tp

    def post_sync(strategy: Strategy, framework: str = "autoplan") -> float:
        costs = CostModel(graph.profile, cluster, framework).unit_costs(strategy, "none")
        return costs[index].post_sync_s

    # in the unit's cost (DDP: no other post-sync term), and not for Megatron-LM's
    assert post_sync(sp) == pytest.approx(expected, rel=1e-12)
    assert post_sync(no_sp) == 0.0
    assert post_sync(sp, "megatron-lm") == 0.0
