"""HSDP (`Plan.dp_shard_degree`): its groups, its price worked by hand, its memory, its
refusals (one line each, at plan time), the stacks that run it and the search's choice."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autoplan import Cluster, Plan, PlanError, StagePlan, manual_plan
from cost_model.estimate import CostModel
from cost_model.frameworks import FrameworkError
from cost_model.parts.data_parallel import data_parallel_cost
from cost_model.strategy import GroupPlacement, Strategy, group_placements
from tests.cost_profiles import gpt_profile, round_cluster, with_routed_experts

# round_cluster's links at its 0.5 efficiency: intra-node 50 GB/s and 10 us, inter-node 5 GB/s
# and 20 us per device per direction
INTRA_BW, INTRA_LAT, INTER_BW, INTER_LAT = 50e9, 10e-6, 5e9, 20e-6


def _plan(**changes: object) -> Plan:
    fields: dict[str, object] = dict(
        dp_degree=8,
        tp_degree=1,
        pp_degree=1,
        stages=(StagePlan(first_unit=0, last_unit=5),),
        micro_batch_size=1,
        num_micro_batches=1,
        global_batch_size=8,
        zero_stage=3,
        dp_shard_degree=4,
    )
    fields.update(changes)
    return Plan(**fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- groups


def test_shard_groups_are_consecutive_dp_ranks_and_replicas_the_rest() -> None:
    """dp 8 x tp 2 ([pp, dp, tp]) with shard groups of 4: a shard group is 4 consecutive dp
    ranks (8 consecutive devices), its replicas the dp ranks 4 apart."""
    plan = _plan(tp_degree=2)
    assert plan.shard_group_ranks(0) == (0, 2, 4, 6)
    assert plan.shard_group_ranks(11) == (9, 11, 13, 15)
    assert plan.replicate_group_ranks(3) == (3, 11)
    # without HSDP: the whole dp group, and no replicas
    whole = _plan(tp_degree=2, dp_shard_degree=None)
    assert whole.shard_group_ranks(3) == whole.group_ranks("dp", 3)
    assert whole.replicate_group_ranks(3) == (3,)


def test_group_placements_follow_the_shard_groups() -> None:
    """On 4 nodes of 8, dp 32 sharded in 8s: one node per shard group, its replicas one a node;
    under cp 2 the shard group is 8 dp ranks x 2 cp ranks (16 devices over 2 nodes)."""
    cluster = round_cluster(num_nodes=4)
    hsdp = Strategy(dp_degree=32, zero_stage=3, dp_shard_degree=8)
    assert group_placements(hsdp, cluster, "dp_shard_cp") == (
        GroupPlacement(size=8, num_nodes=1, ranks_per_node=8),
    )
    assert group_placements(hsdp, cluster, "dp_replicate") == (
        GroupPlacement(size=4, num_nodes=4, ranks_per_node=1),
    )
    plain = Strategy(dp_degree=32, zero_stage=3)
    assert group_placements(plain, cluster, "dp_shard_cp") == group_placements(
        plain, cluster, "dp_cp"
    )
    assert group_placements(plain, cluster, "dp_replicate") == (
        GroupPlacement(size=1, num_nodes=1, ranks_per_node=1),
    )
    cp = Strategy(
        dp_degree=16,
        cp_degree=2,
        zero_stage=3,
        dp_shard_degree=8,
        rank_layout=("pp", "dp", "cp", "tp"),
    )
    assert group_placements(cp, cluster, "dp_shard_cp") == (
        GroupPlacement(size=16, num_nodes=2, ranks_per_node=8),
    )
    assert group_placements(cp, cluster, "dp_replicate") == (
        GroupPlacement(size=2, num_nodes=2, ranks_per_node=1),
    )
    assert cp.weights_view.shard_degree == 16 and cp.weights_view.replicate_degree == 2  # fmt: skip


# ---------------------------------------------------------------------------------- price


def _ring_half(size_bytes: float, ranks: int) -> float:
    """A ring reduce-scatter or all-gather inside one node (cost_model.communication)."""
    return (ranks - 1) / ranks * size_bytes / INTRA_BW + (ranks - 1) * INTRA_LAT


def test_hsdp_collectives_by_hand() -> None:
    """1e8 bf16 parameters, dp 32 on 4 nodes of 8, shard groups of 8 (one node each).
    ZeRO-3: the weights (2e8 bytes) gathered inside the node before the forward and again
    before the backward, the fp32 gradients (4e8 bytes) reduce-scattered there, then each
    rank's 1/8 (5e7 bytes) all-reduced over its 4 replicas, one a node: 2 (n - 1) / n of it
    over each rank's own NIC, 2 log2(4) = 4 inter-node steps (cost_model.communication).
    autoplan's FSDP2 runs that all-reduce on its own stream (the longer of the two counts),
    Megatron-Core's partial distributed optimizer after the reduce-scatter (they add)."""
    cluster = round_cluster(num_nodes=4)
    params = 1e8
    gather = _ring_half(2e8, 8)
    scatter = _ring_half(4e8, 8)
    replicas = 2 * 3 / 4 * 5e7 / INTER_BW + 4 * INTER_LAT
    assert (gather, scatter, replicas) == pytest.approx((3.57e-3, 7.07e-3, 1.508e-2), rel=1e-3)
    for zero in (3, 2):
        strategy = Strategy(dp_degree=32, zero_stage=zero, dp_shard_degree=8)
        shard = group_placements(strategy, cluster, "dp_shard_cp")
        replicate = group_placements(strategy, cluster, "dp_replicate")
        windows = dict(forward_window_s=0.0, backward_window_s=0.0)
        beside = data_parallel_cost(params, strategy, cluster, shard, replicate_groups=replicate,
                                    replicas_beside=True, **windows)  # fmt: skip
        after = data_parallel_cost(params, strategy, cluster, shard, replicate_groups=replicate,
                                   **windows)  # fmt: skip
        if zero == 3:
            assert beside.zero3_forward_s == pytest.approx(gather)
            assert beside.zero3_backward_s == pytest.approx(max(gather + scatter, replicas))
            assert after.zero3_backward_s == pytest.approx(gather + scatter + replicas)
        else:
            # ZeRO-2: reduce-scatter + replica all-reduce during the backward, the updated
            # weights gathered inside the node after the step
            assert beside.sync_s == pytest.approx(max(scatter, replicas))
            assert after.sync_s == pytest.approx(scatter + replicas)
            assert beside.post_sync_s == pytest.approx(gather)


def test_without_hsdp_the_price_is_unchanged() -> None:
    """A plan whose shard group is all of dp is the plan without one: the same strategy, the
    same file, the same estimate."""
    profile = gpt_profile(num_layers=4, s=512, h=512, a=8, e=2)
    cluster = round_cluster(num_nodes=2, devices_per_node=4)
    default = manual_plan(profile, cluster, micro_batch=1, global_batch=8, zero=3)
    explicit = manual_plan(profile, cluster, micro_batch=1, global_batch=8, zero=3, dp_shard=8)
    assert explicit.dp_shard_degree is None and explicit == default
    assert "dp_shard_degree" not in explicit.to_data()
    assert explicit.estimate == default.estimate
    assert Strategy(dp_degree=8, zero_stage=3, dp_shard_degree=8) == Strategy(dp_degree=8, zero_stage=3)  # fmt: skip


def test_state_memory_is_sharded_over_the_shard_group() -> None:
    """FSDP2 keeps fp32 parameter shards, gradients and AdamW moments (4 + 4 + 8 bytes a
    parameter) sharded: over 8 ranks under HSDP, 4 times the bytes of all 32; the unsharded
    bf16 weights ZeRO-2 keeps for the step are the same."""
    profile = gpt_profile(num_layers=2, s=256, h=512, a=8, e=2)
    cluster = round_cluster(num_nodes=4)
    model = CostModel(profile, cluster)
    for zero in (2, 3):
        full = model.unit_costs(Strategy(dp_degree=32, zero_stage=zero), "none")
        hsdp = model.unit_costs(Strategy(dp_degree=32, zero_stage=zero, dp_shard_degree=8), "none")
        for a, b in zip(full, hsdp, strict=True):
            assert b.optimizer_bytes == pytest.approx(4 * a.optimizer_bytes)
            assert b.grad_bytes == pytest.approx(4 * a.grad_bytes)
            unsharded = 0.0 if zero == 3 else 2 * a.local_params
            assert b.param_bytes - unsharded == pytest.approx(4 * (a.param_bytes - unsharded))


def test_zero1_runs_as_zero2_under_hsdp() -> None:
    """HSDP runs on FSDP2 (a 2-D mesh), never DDP: fp32 ZeRO-1, which would be DDP +
    ZeroRedundancyOptimizer, runs as ZeRO-2 there, and says so."""
    plan = _plan(dtype="fp32", zero_stage=1)
    assert plan.decisions.dp_wrapper == "fsdp" and plan.decisions.zero_stage == 2
    assert plan.zero_text == "ZeRO-1 (runs as ZeRO-2) HSDP (shard 4 x replicate 2)"
    assert _plan(dtype="fp32", zero_stage=1, dp_shard_degree=None).decisions.dp_wrapper == "ddp"


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"dp_shard_degree": 3}, "dp_shard_degree = 3 does not divide dp_degree = 8"),
        ({"dp_shard_degree": 16}, "use 4 (the nearest divisor of 8), or leave dp_shard_degree out"),
        ({"dp_shard_degree": 0}, "dp_shard_degree = 0 must be a whole number >= 1"),
        ({"dp_shard_degree": "4"}, "dp_shard_degree = '4' must be a whole number"),
        ({"zero_stage": 0}, "dp_shard_degree = 4 with zero_stage 0: HSDP shards"),
        ({"dp_shard_degree": 1}, "dp_shard_degree = 1 shards nothing"),
    ],
)
def test_a_bad_shard_group_is_refused_in_one_line(changes: dict[str, object], words: str) -> None:
    with pytest.raises(PlanError) as caught:
        _plan(**changes)
    message = str(caught.value)
    assert words in message and "\n" not in message
    # the rule and the fix
    fixes = ("use ", "set ", "leave ", "left out")
    assert "dp_shard_degree" in message and any(fix in message for fix in fixes)


def test_a_shard_group_of_one_rank_may_shard_over_cp() -> None:
    """dp_shard_degree 1 with cp 2 shards over the two cp ranks (torchtitan's dp_shard 1,
    cp 2): a real HSDP."""
    plan = _plan(dp_degree=4, cp_degree=2, dp_shard_degree=1, global_batch_size=4,
                 rank_layout=("pp", "dp", "cp", "tp"))  # fmt: skip
    assert Strategy.of(plan).weights_view.shard_degree == 2


def test_hsdp_of_routed_experts_is_refused() -> None:
    with pytest.raises(PlanError, match="dp_shard_degree = 2 with ep_degree = 2: autoplan prices"):
        _plan(dp_degree=4, global_batch_size=4, ep_degree=2, dp_shard_degree=2)
    moe = with_routed_experts(gpt_profile(num_layers=2), num_experts=4, top_k=2, expert_ffn=256)
    cluster = round_cluster(num_nodes=1, devices_per_node=4)
    with pytest.raises(PlanError, match=r"on mixture-of-experts model .* dense models only"):
        manual_plan(moe, cluster, global_batch=4, zero=3, dp_shard=2)


def test_a_stack_without_hsdp_refuses_it_in_its_own_words() -> None:
    profile = gpt_profile(num_layers=2, s=256, h=512, a=8, e=2)
    cluster = round_cluster(num_nodes=2, devices_per_node=4)
    for framework, words in (
        ("deepspeed", "its HSDP, MiCS (zero_optimization.mics_shard_size, ZeRO-3), was removed"),
        ("nanotron", "nanotron has no HSDP"),
    ):
        with pytest.raises(FrameworkError) as caught:
            manual_plan(profile, cluster, global_batch=8, zero=1, dp_shard=4, framework=framework)
        assert words in str(caught.value) and "leave dp_shard_degree out" in str(caught.value)
    for framework in ("autoplan", "megatron-lm", "torchtitan"):
        plan = manual_plan(
            profile, cluster, global_batch=8, zero=3, dp_shard=4, framework=framework
        )
        assert plan.dp_shard_degree == 4


def test_megatron_prices_the_replica_all_reduce_after_the_reduce_scatter() -> None:
    """The same HSDP plan: Megatron-Core's partial distributed optimizer all-reduces each
    bucket's shard after its reduce-scatter on one stream, FSDP2 on a stream of its own, so
    Megatron's data-parallel time is the longer (the rest of the step priced alike)."""
    profile = gpt_profile(num_layers=2, s=256, h=1024, a=8, e=2)
    cluster = round_cluster(num_nodes=4)
    fsdp2 = CostModel(profile, cluster).unit_costs(
        Strategy(dp_degree=32, zero_stage=2, dp_shard_degree=8), "none"
    )
    megatron = CostModel(profile, cluster, framework="megatron-lm").unit_costs(
        Strategy(dp_degree=32, zero_stage=2, dp_shard_degree=8), "none"
    )
    assert sum(c.dp_sync_s for c in megatron) > sum(c.dp_sync_s for c in fsdp2) > 0


def test_a_plan_file_with_the_field_round_trips(tmp_path: Path) -> None:
    plan = _plan()
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    text = path.read_text()
    assert "dp_shard_degree: 4" in text
    assert Plan.from_yaml(path) == plan
    path.write_text(text.replace("dp_shard_degree: 4", "dp_shard_degree: 3"))
    with pytest.raises(PlanError, match=r"plan\.yaml.*dp_shard_degree = 3 does not divide"):
        Plan.from_yaml(path)


def test_manual_plan_names_the_field() -> None:
    profile = gpt_profile(num_layers=2, s=256, h=512, a=8, e=2)
    cluster = round_cluster(num_nodes=2, devices_per_node=4)
    with pytest.raises(PlanError, match="dp_shard_degree = 3 does not divide dp_degree = 8"):
        manual_plan(profile, cluster, global_batch=8, zero=3, dp_shard=3)
    cluster_h100 = Cluster.preset("dgx-h100-80g", nodes=2)
    plan = manual_plan(profile, cluster_h100, global_batch=16, zero=3, dp_shard=8)
    assert dataclasses.replace(plan, estimate=None).dp_shard_degree == 8


# ---------------------------------------------------------------------------------- search


def test_the_search_shards_within_a_node_where_that_pays() -> None:
    """dp 128 over 16 nodes: a ring over 128 ranks pays 127 latencies a collective, HSDP's
    all-reduce over one rank a node a tree of 2 log2(16); the search takes ZeRO-3 sharded
    within each node, faster than anything without HSDP (ZeRO-0 here)."""
    from autoplan.planner.search import search_plans

    profile = gpt_profile(num_layers=4, s=512, h=1024, a=8, e=2)
    cluster = round_cluster(num_nodes=16)
    found = search_plans(profile, cluster, global_batch=128, tp=1, pp=1).plans[0]
    assert (found.zero_stage, found.dp_shard_degree) == (3, 8)
    without = search_plans(profile, cluster, global_batch=128, tp=1, pp=1, hsdp=False).plans[0]
    assert without.dp_shard_degree is None
    assert found.estimate is not None and without.estimate is not None
    assert found.estimate.step_time_s < 0.9 * without.estimate.step_time_s


def test_the_search_offers_one_shard_group_a_layout_and_only_across_domains() -> None:
    """`hsdp_shards`: the dp ranks of one scale-up domain, for the layouts where they are 2 or
    more and fewer than dp; none inside one domain, for MoE models or without a domain."""
    from autoplan.planner.space import SearchSpace, Shape, hsdp_shards

    profile = gpt_profile(num_layers=4)
    space = SearchSpace(hsdp_domain=8)
    layouts = [("pp", "dp", "tp"), ("dp", "pp", "tp")]
    # 64 devices: tp 2 x pp 2 x dp 16; [pp, dp, tp] steps dp by 2 (4 a node), [dp, pp, tp] by 4
    shape = Shape(tp=2, pp=2, cp=1, dp=16, ep=1, ep_folding=False, micro_batch_size=1,
                  num_micro_batches=4)  # fmt: skip
    assert hsdp_shards(space, profile, shape, layouts) == ((layouts[0], 4), (layouts[1], 2))
    one_node = dataclasses.replace(shape, dp=2)
    assert hsdp_shards(space, profile, one_node, layouts) == ()
    assert hsdp_shards(SearchSpace(), profile, shape, layouts) == ()
    assert hsdp_shards(dataclasses.replace(space, hsdp=False), profile, shape, layouts) == ()
    moe = with_routed_experts(profile, num_experts=4, top_k=2, expert_ffn=256)
    assert hsdp_shards(space, moe, shape, layouts) == ()


# ---------------------------------------------------------------------------------- CLI


def test_cli_estimate_takes_dp_shard_and_refuses_a_bad_one_in_one_line() -> None:
    from tests.conftest import run_cli

    common = ("estimate", "--model", "gpt2-small", "--cluster", "dgx-a100-80g:nodes=2")
    good = run_cli(*common, "--global-batch", "16", "--zero", "3", "--dp-shard", "8")
    assert good.returncode == 0, good.stderr
    assert "ZeRO-3 HSDP (shard 8 x replicate 2)" in " ".join(good.stdout.split())
    for extra, words in (
        (("--zero", "3", "--dp-shard", "5"), "dp_shard_degree = 5 does not divide dp_degree = 16"),
        (("--dp-shard", "8"), "dp_shard_degree = 8 with zero_stage 0"),
    ):
        bad = run_cli(*common, "--global-batch", "16", *extra)
        assert bad.returncode != 0
        lines = [line for line in bad.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in bad.stderr


def test_cli_plan_shows_a_searched_hsdp_plan() -> None:
    """A small model on 256 GPUs: the search shards within nodes, and the ranked table says
    so in its ZeRO column."""
    from tests.conftest import run_cli

    found = run_cli(
        "plan", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g:nodes=32",
        "--global-batch", "256", "--tp", "1", "--pp", "1", "--top", "2",
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert "HSDP 8" in found.stdout
