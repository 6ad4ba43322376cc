"""Plans with context and expert parallelism: the file format, the rules and their messages.

A plan with cp = ep = 1 must read and write as before the fields existed (same YAML bytes, same
digest); every bad input is a PlanError naming the value, the rule and the fix, raised before
anything runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import autoplan
from autoplan import Plan, PlanError
from autoplan.contract.plan import even_stages
from autoplan.runtime.parallelizer import _check_plan
from tests.cost_profiles import gpt_profile, round_cluster, with_routed_experts

# Written by autoplan before cp and ep existed (the main branch at 5bddcce): the same bytes and
# digest must come back.
OLD_PLAN = """\
# autoplan plan: every field is described in docs/plan-format.md.
# Edit freely; `autoplan validate` checks the result.
schema_version: 1
dp_degree: 4
tp_degree: 2
pp_degree: 2
virtual_stages: 1
stages:
- first_unit: 0
  last_unit: 2
  recompute: none
- first_unit: 3
  last_unit: 5
  recompute: none
micro_batch_size: 2
num_micro_batches: 4
global_batch_size: 32
schedule: 1f1b
zero_stage: 0
sequence_parallel: false
dtype: bf16
rank_layout:
- pp
- dp
- tp
framework: autoplan
"""
OLD_DIGEST = "48c9864fd0ff9ee"


def _plan(**changes: object) -> Plan:
    fields: dict[str, object] = dict(
        dp_degree=4,
        tp_degree=1,
        pp_degree=1,
        stages=even_stages(4, 1),
        micro_batch_size=1,
        num_micro_batches=2,
        global_batch_size=8,
    )
    fields.update(changes)
    return Plan(**fields)  # type: ignore[arg-type]


def test_old_plan_files_read_and_write_unchanged(tmp_path: Path) -> None:
    source = tmp_path / "old.yaml"
    source.write_text(OLD_PLAN)
    plan = Plan.from_yaml(source)
    assert (plan.cp_degree, plan.ep_degree, plan.num_devices) == (1, 1, 16)
    assert plan.digest() == OLD_DIGEST
    plan.to_yaml(tmp_path / "again.yaml")
    assert (tmp_path / "again.yaml").read_text() == OLD_PLAN


def test_cp_ep_plan_round_trip(tmp_path: Path) -> None:
    plan = _plan(
        dp_degree=2,
        cp_degree=2,
        ep_degree=2,
        rank_layout=("pp", "dp", "cp", "tp"),
        global_batch_size=4,
    )
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    text = path.read_text()
    assert "cp_degree: 2\nep_degree: 2\n" in text
    again = Plan.from_yaml(path)
    assert again == plan and again.digest() == plan.digest()
    assert plan.num_devices == 4 and plan.mesh_shape == (1, 2, 2, 1)
    # cp's ranks sit between dp's and tp's
    assert plan.group_ranks("cp", 0) == (0, 1) and plan.group_ranks("dp", 0) == (0, 2)


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"cp_degree": 0}, ["cp_degree = 0", ">= 1"]),
        ({"ep_degree": 3}, ["ep_degree = 3 does not divide dp_degree = 4", "divides dp_degree"]),
        ({"cp_degree": 2}, ["needs 'cp' in rank_layout", "[pp, dp, cp, tp]"]),
        ({"rank_layout": ("pp", "cp", "tp")}, ["rank_layout", "dp"]),
        ({"rank_layout": ("pp", "dp", "cp", "cp", "tp")}, ["cp once or not at all"]),
        (
            {"ep_degree": 3, "ep_folding": True},
            ["ep_degree = 3 with ep_folding does not fold over tp 1 x cp 1 x dp 4", "[1, 2, 4]"],
        ),
        (
            {"ep_degree": 2, "ep_folding": True, "tp_degree": 2, "dp_degree": 2},
            ["ep_folding with tp_degree = 2 needs sequence_parallel: true"],
        ),
        ({"ep_folding": "yes"}, ["ep_folding = 'yes' must be true or false"]),
        (
            {
                "ep_degree": 2,
                "tp_degree": 2,
                "dp_degree": 2,
                "global_batch_size": 4,
                "sequence_parallel": True,
                "framework": "megatron-lm",
            },
            ["framework 'megatron-lm' places an expert-parallel group", "set ep_folding: true"],
        ),
    ],
)
def test_plan_rules_on_construction(changes: dict[str, object], fragments: list[str]) -> None:
    with pytest.raises(PlanError) as error:
        _plan(**changes)
    for fragment in fragments:
        assert fragment in str(error.value)


DENSE = gpt_profile(num_layers=2, s=2048, h=256, a=8, e=2)
MOE = with_routed_experts(DENSE, num_experts=8, top_k=2, expert_ffn=128)
CLUSTER = round_cluster(num_nodes=1, devices_per_node=8)


@pytest.mark.parametrize(
    ("profile", "changes", "fragments"),
    [
        # 2 x cp must divide the sequence (torch's load-balanced causal sharding)
        (
            gpt_profile(num_layers=2, s=1000, h=256, a=8, e=2),
            {"cp_degree": 8, "dp_degree": 1, "global_batch_size": 2},
            ["cp_degree = 8", "2 x cp_degree = 16 must divide seq_len = 1000", "2 x cp"],
        ),
        # ep must divide the experts
        (
            with_routed_experts(DENSE, num_experts=6, top_k=2, expert_ffn=128),
            {"ep_degree": 4, "dp_degree": 8, "global_batch_size": 16},
            ["ep_degree = 4 does not divide num_experts = 6", "divides 6"],
        ),
        # an expert-parallel plan for a dense model
        (
            DENSE,
            {"ep_degree": 2, "dp_degree": 8, "global_batch_size": 16},
            ["ep_degree = 2", "is dense", "set ep_degree to 1"],
        ),
        # top-k above the experts
        (
            with_routed_experts(DENSE, num_experts=2, top_k=4, expert_ffn=128),
            {"dp_degree": 8, "global_batch_size": 16},
            ["top_k = 4", "num_experts = 2", "lower top_k or add experts"],
        ),
        # the devices: dp x tp x pp x cp
        (
            DENSE,
            {"cp_degree": 4, "dp_degree": 4, "global_batch_size": 8},
            ["x cp_degree = 4 x 1 x 1 x 4 = 16 devices", "has 8"],
        ),
    ],
)
def test_plan_rules_against_the_model(
    profile: object, changes: dict[str, object], fragments: list[str]
) -> None:
    if changes.get("cp_degree", 1) > 1:  # type: ignore[operator]
        changes = {**changes, "rank_layout": ("pp", "dp", "cp", "tp")}
    plan = _plan(**changes)
    with pytest.raises(PlanError) as error:
        plan.validate(profile, CLUSTER)  # type: ignore[arg-type]
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)


def test_valid_cp_ep_plans_validate_and_estimate() -> None:
    plan = _plan(
        dp_degree=4,
        cp_degree=2,
        ep_degree=4,
        rank_layout=("pp", "dp", "cp", "tp"),
        global_batch_size=8,
    )
    plan.validate(MOE, CLUSTER)
    result = autoplan.estimate(MOE, CLUSTER, plan)
    assert result.num_devices == 8 and result.step_time_s > 0
    # manual_plan: dp from the devices left by tp x pp x cp, cp's layout by default
    made = autoplan.manual_plan(MOE, CLUSTER, cp=2, ep=2, global_batch=8)
    assert (made.dp_degree, made.cp_degree, made.ep_degree) == (4, 2, 2)
    assert made.rank_layout == ("pp", "dp", "cp", "tp")
    assert made.estimate is not None


def test_parallelize_checks_cp_and_ep_plans_before_any_collective() -> None:
    """`parallelize` runs cp and ep plans (tests/test_parallelize_cp_ep.py); its checks before
    any collective count cp among the processes and refuse what its passes cannot run."""
    graph = dataclasses.make_dataclass("G", [("profile", object), ("front_end", str)])(MOE, "fx")
    plan = _plan(dp_degree=4, ep_degree=2, cp_degree=2, rank_layout=("pp", "dp", "cp", "tp"))
    _check_plan(plan, graph, CLUSTER, 8)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"dp x tp x pp x cp = 4 x 1 x 1 x 2 = 8 processes but"):
        _check_plan(plan, graph, CLUSTER, 4)  # type: ignore[arg-type]
    exported = dataclasses.replace(
        graph, profile=dataclasses.replace(MOE, exported=True), front_end="export"
    )
    with pytest.raises(PlanError, match=r"traced with torch\.export"):
        _check_plan(plan, exported, CLUSTER, 8)  # type: ignore[arg-type]
    # ZeRO-1 on DDP would broadcast one rank's experts over the whole dp group
    zero1 = _plan(dp_degree=8, ep_degree=2, zero_stage=1, dtype="fp32", global_batch_size=16)
    assert zero1.decisions.dp_wrapper == "ddp"
    with pytest.raises(PlanError, match="zero_stage 1 with ep_degree = 2"):
        _check_plan(zero1, graph, CLUSTER, 8)  # type: ignore[arg-type]
    # selective recompute around FSDP2's separately wrapped experts diverges
    selective = _plan(
        dp_degree=8,
        ep_degree=2,
        zero_stage=2,
        global_batch_size=16,
        stages=even_stages(4, 1, "selective"),
    )
    with pytest.raises(PlanError, match="recompute 'selective' with ep_degree = 2 under FSDP2"):
        _check_plan(selective, graph, CLUSTER, 8)  # type: ignore[arg-type]


def test_expert_groups_split_dp() -> None:
    """dp 4 = ep 2 x edp 2, cp 2, tp 2 (layout pp, dp, cp, tp: dp stride 4, cp stride 2)."""
    plan = _plan(
        dp_degree=4,
        cp_degree=2,
        tp_degree=2,
        ep_degree=2,
        rank_layout=("pp", "dp", "cp", "tp"),
        global_batch_size=8,
    )
    assert plan.group_ranks("dp", 0) == (0, 4, 8, 12)
    assert plan.ep_group_ranks(0) == (0, 4) and plan.ep_group_ranks(9) == (9, 13)
    # same experts: dp ranks 0 and 2 (positions 0 of their ep groups), both cp ranks
    assert plan.expert_data_group_ranks(0) == (0, 2, 8, 10)
    assert plan.expert_data_group_ranks(13) == (5, 7, 13, 15)
    for rank in range(plan.num_devices):
        assert rank in plan.ep_group_ranks(rank) and rank in plan.expert_data_group_ranks(rank)
        assert len(plan.expert_data_group_ranks(rank)) == 4


def test_folded_expert_groups_take_tp_and_cp_ranks() -> None:
    """Megatron-Core's folding: ep 4 over the dp 2 x cp 2 x tp 2 block (layout pp, dp, cp, tp,
    so the block is numbered as the global ranks): groups of 4 consecutive ranks, and the ranks
    holding the same experts 4 apart."""
    plan = _plan(
        dp_degree=2,
        cp_degree=2,
        tp_degree=2,
        ep_degree=4,
        ep_folding=True,
        sequence_parallel=True,
        rank_layout=("pp", "dp", "cp", "tp"),
        global_batch_size=4,
    )
    assert plan.ep_group_ranks(0) == (0, 1, 2, 3) and plan.ep_group_ranks(6) == (4, 5, 6, 7)
    assert plan.expert_data_group_ranks(1) == (1, 5)
    # another layout numbers the global ranks differently; the block keeps Megatron's order
    other = dataclasses.replace(plan, rank_layout=("tp", "cp", "dp", "pp"))
    # rank = tp x 4 + cp x 2 + dp: block index 1 (tp 1, cp 0, dp 0) is global rank 4
    assert other.ep_group_ranks(0) == (0, 4, 2, 6)
    assert other.expert_data_group_ranks(0) == (0, 1)
    for p in (plan, other):
        for rank in range(p.num_devices):
            assert rank in p.ep_group_ranks(rank) and rank in p.expert_data_group_ranks(rank)
            assert len(set(p.ep_group_ranks(rank)) & set(p.expert_data_group_ranks(rank))) == 1
    assert plan.to_data()["ep_folding"] is True and Plan.from_data(plan.to_data()) == plan
    assert "ep_folding" not in dataclasses.replace(plan, ep_folding=False, ep_degree=2).to_data()
