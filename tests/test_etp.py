"""Expert tensor parallelism (issue 43 item 6, `Plan.etp_degree`): the plan field and its
one-line refusals, the expert groups against Megatron-Core's own rank generator, the cost by
hand (`cost_model.parts.expert_parallel`), the stacks' refusals and the Megatron-LM export."""

from __future__ import annotations

from typing import Any

import pytest

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.export import model_dims
from autoplan.export.megatron import megatron_args
from cost_model.communication import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from cost_model.estimate import CostModel
from cost_model.frameworks import framework_profile
from cost_model.frameworks.limits import outer_refusals
from cost_model.parts.expert_parallel import expert_cost
from cost_model.strategy import GroupPlacement, Strategy, group_placements, mesh_groups
from tests.cost_profiles import gpt_profile, round_cluster, with_routed_experts
from tests.test_export import _cp_ep_plan, _flags


def _moe_profile() -> Any:
    return with_routed_experts(
        gpt_profile(num_layers=2, s=1024, h=1024, a=8, e=2),
        num_experts=8,
        top_k=2,
        expert_ffn=512,
    )


def _groups(strategy: Strategy, group: str) -> list[list[int]]:
    inside, outside = mesh_groups(strategy, group)  # type: ignore[arg-type]
    offsets, bases = [0], [0]
    for step, count in inside:
        offsets = [o + i * step for o in offsets for i in range(count)]
    for step, count in outside:
        bases = [b + i * step for b in bases for i in range(count)]
    return sorted(sorted(b + o for o in offsets) for b in bases)


# ------------------------------------------------------------------------------ the plan


def test_default_is_not_written_and_etp_round_trips() -> None:
    plan = _cp_ep_plan()
    assert plan.etp_degree == 1 and "etp_degree" not in plan.to_data()
    split = _cp_ep_plan(etp_degree=2, ep_degree=2, framework="megatron-lm")
    data = split.to_data()
    assert data["etp_degree"] == 2
    assert Plan.from_data(data) == split


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"etp_degree": 3},
            r"^etp_degree = 3 does not divide tp_degree = 2: .* use one of \[1, 2\]$",
        ),
        ({"etp_degree": 0}, r"^etp_degree = 0 must be a whole number >= 1$"),
        ({"etp_degree": "2"}, r"^etp_degree = '2' must be a whole number >= 1$"),
        (
            {"etp_degree": 2, "ep_degree": 8},
            r"^ep_degree = 8 with ep_folding does not fold over tp 2 / etp 2 x cp 2 x dp 2: .*"
            r"use one of \[1, 2, 4\]$",
        ),
    ],
)
def test_bad_etp_is_one_line(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message) as caught:
        _cp_ep_plan(**changes)
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------------------ groups


@pytest.mark.parametrize(("tp", "etp", "ep"), [(4, 2, 2), (4, 2, 4), (4, 4, 2), (2, 1, 4)])
def test_groups_are_megatron_core_s(tp: int, etp: int, ep: int) -> None:
    """initialize_model_parallel's expert generator (order tp-cp-ep-dp-pp read as
    etp-ep-edp-pp, megatron/core/parallel_state.py) builds the strategy's etp, ep and
    expert-data-parallel groups, folded, on dp 4 x tp ranks and pp 2."""
    pytest.importorskip("megatron.core.parallel_state")
    from megatron.core.parallel_state import RankGenerator

    dp, pp = 4, 2
    strategy = Strategy(
        dp_degree=dp,
        tp_degree=tp,
        pp_degree=pp,
        ep_degree=ep,
        etp_degree=etp,
        ep_folding=True,
        sequence_parallel=True,
    )
    world = dp * tp * pp
    generator = RankGenerator(
        tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
    )

    def theirs(token: str) -> list[list[int]]:
        return sorted(sorted(g) for g in generator.get_ranks(token))

    assert _groups(strategy, "etp") == theirs("tp")
    assert _groups(strategy, "ep") == theirs("ep")
    assert _groups(strategy, "edp_cp") == theirs("dp")
    assert strategy.expert_dp_degree == world // (etp * ep * pp)


# ------------------------------------------------------------------------------ the cost


def test_expert_cost_with_etp_by_hand() -> None:
    """tp 2 with sequence parallelism, ep 4 folded over tp x dp (etp 1) or over dp (etp 2) on
    one 8-device node. etp 2: each rank stores half of each of its 2 experts; the pair
    all-gathers the tokens it received (2 x 1024 assignments x 1024 x 2 B) and reduce-
    scatters the outputs, forward and backward; each GEMM runs on twice the rows and half the
    width, the same FLOPs."""
    facts = _moe_profile().units[1].moe
    assert facts is not None
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    common: dict[str, Any] = dict(
        dp_degree=4, tp_degree=2, ep_degree=4, ep_folding=True, sequence_parallel=True
    )
    one = Strategy(**common)
    two = Strategy(**common, etp_degree=2)
    base = expert_cost(facts, one, cluster, group_placements(one, cluster, "ep"), "none", 2)
    split = expert_cost(facts, two, cluster, group_placements(two, cluster, "ep"), "none", 2)
    etp_group = group_placements(two, cluster, "etp")
    assert etp_group == (GroupPlacement(size=2, num_nodes=1, ranks_per_node=2),)
    assert split.local_params == base.local_params / 2 == 2 * 3 * 1024 * 512 / 2
    assert split.tokens_per_expert == 2 * base.tokens_per_expert
    assert split.forward_flops == base.forward_flops
    # ep 4 spans 2 tp x 2 dp ranks at etp 1, 4 dp ranks at etp 2: both one node, 4 ranks
    message = 1024 * 1024 * 2  # a rank's 1024 assignments (2048 / tp) of 1024 bf16
    gathered = 2 * message
    pair = all_gather_time_s(gathered, etp_group[0], cluster) + reduce_scatter_time_s(
        gathered, etp_group[0], cluster
    )
    assert split.all_to_all_forward_s == pytest.approx(base.all_to_all_forward_s + pair)
    assert split.all_to_all_backward_s == pytest.approx(base.all_to_all_backward_s + pair)
    # without sequence parallelism the TP ranks hold the same tokens: nothing gathered, the
    # GEMMs' FLOPs halve and the outputs are all-reduced once each way
    plain: dict[str, Any] = dict(dp_degree=4, tp_degree=2, ep_degree=4)
    whole, halves = Strategy(**plain), Strategy(**plain, etp_degree=2)
    w = expert_cost(facts, whole, cluster, group_placements(whole, cluster, "ep"), "none", 2)
    h = expert_cost(facts, halves, cluster, group_placements(halves, cluster, "ep"), "none", 2)
    reduce = all_reduce_time_s(2 * message, group_placements(halves, cluster, "etp")[0], cluster)
    assert h.tokens_per_expert == w.tokens_per_expert
    assert h.forward_flops == w.forward_flops / 2
    assert h.all_to_all_forward_s == pytest.approx(w.all_to_all_forward_s + reduce)


def test_unit_costs_and_memory_with_etp() -> None:
    """In the unit: etp 2 halves the expert weights a rank stores, and the plan's estimate
    prices it (Megatron-LM, the stack that runs it)."""
    profile = _moe_profile()
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    model = CostModel(profile, cluster)
    common: dict[str, Any] = dict(
        dp_degree=4, tp_degree=2, ep_degree=4, ep_folding=True, sequence_parallel=True
    )
    one = model.unit_costs(Strategy(**common), "none")[1]
    two = model.unit_costs(Strategy(**common, etp_degree=2), "none")[1]
    per_expert = 3 * 1024 * 512
    assert one.local_params - two.local_params == 2 * per_expert / 2
    assert two.ep_forward_s > one.ep_forward_s


# ------------------------------------------------------------------------------ stacks


@pytest.mark.parametrize("stack", ["autoplan", "torchtitan", "deepspeed"])
def test_stacks_without_etp_refuse_it_in_their_words(stack: str) -> None:
    strategy = Strategy(
        dp_degree=4,
        tp_degree=2,
        ep_degree=2,
        etp_degree=2,
        ep_folding=True,
        sequence_parallel=True,
    )
    model = _moe_profile()
    profile = framework_profile(stack)
    found = [r for r in outer_refusals(profile, strategy, model) if r.limit == "etp"]
    assert len(found) == 1
    text = str(found[0])
    assert text.startswith("etp_degree 2: ") and "\n" not in text
    assert profile.capabilities.explained["etp"].why in text
    megatron = framework_profile("megatron-lm")
    assert not [r for r in outer_refusals(megatron, strategy, model) if r.limit == "etp"]


def test_megatron_layout_agrees_with_ep_inside_dp_when_etp_is_tp() -> None:
    """Megatron-LM places ep over the tp / etp groups first: ep inside dp is its layout when
    etp = tp (and cp = 1), so it is not refused there, and is at etp 1."""
    megatron = framework_profile("megatron-lm")
    common: dict[str, Any] = dict(dp_degree=4, tp_degree=2, ep_degree=2, sequence_parallel=True)
    layouts = [
        r.limit
        for etp in (1, 2)
        for r in outer_refusals(megatron, Strategy(**common, etp_degree=etp), _moe_profile())
        if r.limit == "expert-layout"
    ]
    assert layouts == ["expert-layout"]


def test_megatron_export_states_etp() -> None:
    plan = _cp_ep_plan(etp_degree=2, ep_degree=2, framework="megatron-lm")
    flags = _flags(megatron_args(plan, model_dims("mixtral-8x7b")))
    assert flags["--expert-tensor-parallel-size"] == "2"
    assert flags["--expert-model-parallel-size"] == "2"
    pytest.importorskip("megatron.core.model_parallel_config")
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(
        tensor_model_parallel_size=int(flags["--tensor-model-parallel-size"]),  # type: ignore[arg-type]
        expert_model_parallel_size=int(flags["--expert-model-parallel-size"]),  # type: ignore[arg-type]
        expert_tensor_parallel_size=int(flags["--expert-tensor-parallel-size"]),  # type: ignore[arg-type]
        sequence_parallel=True,
    )
    assert config.expert_tensor_parallel_size == 2
