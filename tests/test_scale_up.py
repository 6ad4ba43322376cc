"""Scale-up domains wider than a node (`Cluster.scale_up_devices`, issue 42): collectives and
transfers inside a domain run at the fast link's rate even across nodes, tensor parallelism may
span the domain without asking, and the search offers it; out-of-domain groups stay on the
scale-out network."""

from __future__ import annotations

import dataclasses

import pytest

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.planner.search import search_plans
from cost_model.errors import ClusterError
from cost_model.estimate import estimate
from cost_model.hardware import Cluster
from cost_model.strategy import Strategy, group_placements
from tests.cost_profiles import gpt_profile, with_routed_experts

PROFILE = gpt_profile(num_layers=4, s=1024, h=2048, a=16, vocab=8192)


def _h100(nodes: int, domain: int | None = None) -> Cluster:
    if domain is None:
        return Cluster.preset("dgx-h100-80g", nodes=nodes)
    return Cluster.preset("dgx-h100-80g", nodes=nodes, scale_up_devices=domain)


def _one_node(devices: int) -> Cluster:
    """The same devices and links, all of them in one node."""
    return Cluster.preset("dgx-h100-80g", devices_per_node=devices)


def test_a_group_inside_a_domain_spans_nodes_on_the_fast_link() -> None:
    wide = _h100(4, domain=32)
    tp16 = Strategy(tp_degree=16, dp_degree=2)
    (inside,) = group_placements(tp16, wide, "tp")
    assert not inside.crosses_nodes and inside.ranks_per_node == 16
    (outside,) = group_placements(tp16, _h100(4), "tp")
    assert outside.crosses_nodes and outside.num_nodes == 2
    # the data-parallel peers of a tp16 group: two groups of one 32-device domain
    (dp,) = group_placements(tp16, wide, "dp")
    assert not dp.crosses_nodes
    assert wide.domain_of(31) == 0 and wide.domain_of(32) == 1 and wide.node_of(31) == 3


def test_tp16_inside_a_domain_is_priced_as_on_one_node_and_needs_no_permission() -> None:
    wide, plain, whole = _h100(2, domain=16), _h100(2), _one_node(16)
    plan = autoplan.manual_plan(PROFILE, wide, tp=16, global_batch=8, sequence_parallel=True)
    # the same plan on the same devices in one 16-device node: the same time and memory
    same = estimate(PROFILE, whole, plan)
    assert plan.estimate is not None
    assert plan.estimate.step_time_s == pytest.approx(same.step_time_s)
    assert plan.estimate.peak_memory_bytes == pytest.approx(same.peak_memory_bytes)
    # on 8-device nodes tp16 crosses the scale-out network: refused unless allowed, slower
    with pytest.raises(PlanError, match="across nodes of 8 devices"):
        plan.validate(PROFILE, plain)
    slow = estimate(PROFILE, plain, plan)  # (the cost model prices what it is given)
    tp_fast = sum(s.tp_comm_s for s in estimate(PROFILE, wide, plan).stages)
    tp_slow = sum(s.tp_comm_s for s in slow.stages)
    # (across two nodes the all-reduce is hierarchical over the 8 rails: slower, not 8x)
    assert tp_slow > 1.02 * tp_fast
    assert slow.step_time_s > same.step_time_s


def test_ep32_all_to_alls_stay_on_the_fast_link_inside_the_domain() -> None:
    moe = with_routed_experts(PROFILE, num_experts=32, top_k=2, expert_ffn=1024)

    def ep_comm(cluster: Cluster) -> float:
        plan = autoplan.manual_plan(moe, cluster, ep=32, global_batch=64)
        return sum(s.ep_comm_s for s in estimate(moe, cluster, plan).stages)

    assert ep_comm(_h100(4, domain=32)) == pytest.approx(ep_comm(_one_node(32)))
    assert ep_comm(_h100(4)) > 2 * ep_comm(_h100(4, domain=32))


def test_the_search_offers_tp_up_to_the_domain() -> None:
    wide = _h100(2, domain=16)
    found = search_plans(PROFILE, wide, global_batch=8, budget_s=0.5, top_k=4, tp=(16,))
    assert {plan.tp_degree for plan in found.plans} == {16}
    with pytest.raises(Exception, match="does not fit inside a node of 8 devices"):
        search_plans(PROFILE, _h100(2), global_batch=8, budget_s=0.5, tp=(16,))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"nodes": 3, "scale_up_devices": 16}, "does not divide the cluster's 24 devices"),
        ({"nodes": 2, "scale_up_devices": 12}, "whole nodes of 8 devices"),
        ({"nodes": 2, "scale_up_devices": 64}, "more than the cluster's 16 devices"),
        ({"nodes": 2, "scale_up_devices": 0}, "whole number of devices >= 1"),
        ({"price_per_device_hour": -1}, "positive number"),
        ({"price_per_device_hour": "inf"}, "expected a number"),
    ],
)
def test_bad_domains_and_prices_are_refused_in_one_line(
    overrides: dict[str, object], match: str
) -> None:
    with pytest.raises(ClusterError, match=match) as error:
        Cluster.preset("dgx-h100-80g", **overrides)  # type: ignore[arg-type]
    assert "\n" not in str(error.value)


def test_a_domain_round_trips_through_a_cluster_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    wide = dataclasses.replace(_h100(4, domain=32), price_per_device_hour=3.5)
    wide.to_yaml(tmp_path / "c.yaml")
    again = Cluster.from_yaml(tmp_path / "c.yaml")
    assert again == wide and again.scale_up_domain == 32
    # a preset's own domain may outsize a job on part of it (clamped), not one asked for
    assert dataclasses.replace(_h100(4, domain=32), num_nodes=2).scale_up_domain == 16


def test_tp16_and_ep32_on_gb200_nvl72_on_nvlink_on_dgx_b200_on_the_network() -> None:
    """The issue's pair: the same plan on a GB200 NVL72 rack (one 72-GPU NVLink domain of
    4-GPU trays) is priced on NVLink, on DGX B200 nodes (8 GPUs each) on the scale-out NICs."""
    nvl72 = Cluster.preset("gb200-nvl72", nodes=8)  # 32 GPUs of one rack
    b200 = Cluster.preset("dgx-b200-180g", nodes=4)
    assert nvl72.scale_up_domain == 32 and b200.scale_up_domain == 8
    plan = autoplan.manual_plan(PROFILE, nvl72, tp=16, global_batch=8, sequence_parallel=True)
    (tp_rack,) = group_placements(Strategy.of(plan), nvl72, "tp")
    (tp_nodes,) = group_placements(Strategy.of(plan), b200, "tp")
    assert not tp_rack.crosses_nodes and tp_nodes.crosses_nodes
    rack_tp = sum(s.tp_comm_s for s in estimate(PROFILE, nvl72, plan).stages)
    nodes_tp = sum(s.tp_comm_s for s in estimate(PROFILE, b200, plan).stages)
    assert nodes_tp > rack_tp
    with pytest.raises(PlanError, match="across nodes of 8 devices"):
        plan.validate(PROFILE, b200)
    moe = with_routed_experts(PROFILE, num_experts=32, top_k=2, expert_ffn=1024)
    expert_plan = autoplan.manual_plan(moe, nvl72, ep=32, global_batch=64)
    rack_ep = sum(s.ep_comm_s for s in estimate(moe, nvl72, expert_plan).stages)
    nodes_ep = sum(s.ep_comm_s for s in estimate(moe, b200, expert_plan).stages)
    assert nodes_ep > 2 * rack_ep


def test_a_job_of_part_racks_runs_in_whole_node_segments_of_a_rack() -> None:
    """256 GB200 GPUs are not whole 72-GPU racks: a scheduler places them as 4 segments of 64
    (16 trays) in 4 racks, so the job's domain is 64; 144 are two whole racks; 100 (25 trays)
    segments of 20."""
    domains = {
        trays * 4: Cluster.preset("gb200-nvl72", nodes=trays).scale_up_domain
        for trays in (16, 18, 36, 64, 25)
    }
    assert domains == {64: 64, 72: 72, 144: 72, 256: 64, 100: 20}


def test_a_cluster_file_may_name_a_known_device_and_an_unknown_one_is_refused(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """`device: <name>` takes a shipped preset's device (issue 42's bad input: an unknown
    device name in a cluster file is one line naming the value, the closest name and the fix)."""
    text = (
        "schema_version: 1\nname: my-b200\nnum_nodes: 2\ndevices_per_node: 16\n"
        "device: {device}\n"
        "intra_node: {{bandwidth_bytes_per_s: 900GB/s, latency_s: 8us}}\n"
        "inter_node: {{bandwidth_bytes_per_s: 100GB/s, latency_s: 12us}}\n"
    )
    good = tmp_path / "good.yaml"
    good.write_text(text.format(device="B200-SXM-180GB"))
    cluster = Cluster.from_yaml(good)
    assert cluster.device == Cluster.preset("dgx-b200-180g").device
    assert cluster.num_devices == 32
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.format(device="B200-SXM-18GB"))
    with pytest.raises(ClusterError) as error:
        Cluster.from_yaml(bad)
    said = str(error.value)
    assert "\n" not in said and "bad.yaml" in said and "'B200-SXM-18GB'" in said
    assert "did you mean 'B200-SXM-180GB'" in said and "describe the device as a mapping" in said
