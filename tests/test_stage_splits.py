"""The stacks' own pipeline splits (`cost_model.stage_splits`) against hand-worked examples,
and `autoplan.manual_plan` cutting a framework's plan as its stack does."""

from __future__ import annotations

import dataclasses

import pytest

import autoplan
from autoplan import models
from autoplan.contract.errors import InputError, PlanError
from cost_model.stage_splits import (
    StageSplitError,
    megatron_stage_starts,
    nanotron_stage_starts,
)
from cost_model.workload import ModelProfile

# A small llama whose nanotron costs are whole numbers of decoder layers L:
# decoder 4 a (h // a) h + 3 f h = 4 * 64 * 64 + 3 * 128 * 64 = 40960 = L,
# lm_head V h = 1280 * 64 = 81920 = 2 L; total 6 L + 2 L = 8 L.
# Units: 0 embedding, 1-6 blocks, 7 head (final norm, lm_head; nanotron's fp32 cast and loss).


@pytest.fixture(scope="module")
def llama() -> ModelProfile:
    profile: ModelProfile = autoplan.trace(
        models.llama(6, 64, 4, 16, 1280, num_kv_heads=4, ffn_hidden_size=128)
    ).profile
    return profile


def test_nanotron_split_moves_on_only_past_the_share(llama: ModelProfile) -> None:
    """pp 2, shares 4 L and 8 L. Running cost after each decoder layer: 1..6 L; after the 4th it
    equals the first share, which nanotron's strict ``>`` does not pass, so the 5th layer still
    goes to rank 0 and the rank moves on after it: rank 0 holds the embedding and 5 layers, rank
    1 the 6th layer and the head (Megatron's even split: 3 and 3)."""
    assert nanotron_stage_starts(llama, 2) == (0, 6)
    assert megatron_stage_starts(llama, 2) == (0, 4)


def test_nanotron_split_can_leave_the_head_alone(llama: ModelProfile) -> None:
    """pp 3, shares 8/3, 16/3, 8 L: rank 0 moves on after the 3rd layer (3 > 2.67), rank 1
    after the 6th (6 > 5.33); the head (2 L) is left alone on rank 2, as nanotron places the
    1.3B model's lm_head on 4 stages."""
    assert nanotron_stage_starts(llama, 3) == (0, 4, 7)


def test_nanotron_split_refuses_to_cut_the_head(llama: ModelProfile) -> None:
    """pp 4, shares 2, 4, 6, 8 L: layers 1-3 on rank 0 (3 > 2), 4-5 on rank 1 (5 > 4), the 6th
    (6, not > 6) and the final norm on rank 2, whose lm_head (8 > 6) moves the fp32 cast and the
    loss to rank 3: inside autoplan's head unit."""
    with pytest.raises(StageSplitError, match="different ranks"):
        nanotron_stage_starts(llama, 4)


def test_nanotron_split_reads_the_ffn_size_of_a_gqa_llama() -> None:
    """The ffn size comes from a block's parameters, the attention's with its kv heads: with 2
    kv heads of 4 the decoder still costs 4 a (h // a) h + 3 f h in nanotron's count, so the
    split is the MHA model's."""
    gqa = autoplan.trace(models.llama(6, 64, 4, 16, 1280, num_kv_heads=2, ffn_hidden_size=128))
    assert nanotron_stage_starts(gqa.profile, 2) == (0, 6)
    gpt = autoplan.trace(models.gpt(4, 64, 4, 16, 1280)).profile
    with pytest.raises(StageSplitError, match="Llama"):
        nanotron_stage_starts(gpt, 2)


def test_megatron_split_counts_the_embedding_and_the_loss_as_layers() -> None:
    profile = autoplan.trace(models.llama(10, 64, 4, 16, 97)).profile
    starts = megatron_stage_starts(profile, 4, edges_as_layers=True)
    assert starts is not None
    ends = [*starts[1:], profile.num_units]
    blocks = [i for i, u in enumerate(profile.units) if u.kind == "block"]
    per_stage = [sum(1 for i in blocks if a <= i < b) for a, b in zip(starts, ends, strict=True)]
    assert per_stage == [2, 3, 3, 2]  # (10 + 2) / 4 = 3 a stage, one fewer at either end
    assert megatron_stage_starts(profile, 4) is None  # 10 % 4: Megatron's rule does not apply


def test_manual_plan_cuts_a_frameworks_plan_as_its_stack_does(llama: ModelProfile) -> None:
    cluster = autoplan.Cluster.local(num_devices=12)

    def firsts(framework: str, pp: int) -> list[int]:
        plan = autoplan.manual_plan(
            llama, cluster, tp=1, pp=pp, global_batch=24, micro_batch=1, framework=framework
        )
        return [stage.first_unit for stage in plan.stages]

    assert firsts("autoplan", 2) == [0, 4]  # 8 units evenly
    assert firsts("nanotron", 2) == [0, 6]
    assert firsts("megatron-lm", 3) == [0, 3, 5]  # 2 blocks a stage, embedding and head at the ends
    assert firsts("megatron-lm:split=layers-with-edges", 2) == [0, 4]  # (6 + 2) / 2 = 4 slots
    with pytest.raises(PlanError, match="different ranks") as err:
        firsts("nanotron", 4)
    assert "\n" not in str(err.value)


def test_the_search_prices_a_stacks_own_cut_only(llama: ModelProfile) -> None:
    """A stack that cuts its stages itself (nanotron, DeepSpeed's uniform partition) gets plans
    with that cut and one recompute mode throughout; autoplan's runtime takes any cut."""
    cluster = autoplan.Cluster.local(num_devices=2)
    found = {}
    for framework, firsts in (("nanotron", [0, 6]), ("deepspeed", [0, 4])):
        plan = autoplan.search(
            llama, cluster, global_batch=8, pp=2, budget_s=None, framework=framework
        )
        assert [stage.first_unit for stage in plan.stages] == firsts, framework
        assert len({stage.recompute for stage in plan.stages}) == 1
        found[framework] = plan
    # autoplan's runtime takes any cut and any schedule: its proven best is at least as fast
    # as nanotron's plan priced for autoplan's runtime
    free = autoplan.search(llama, cluster, global_batch=8, pp=2, budget_s=None)
    theirs = dataclasses.replace(found["nanotron"], framework="autoplan", estimate=None)
    assert free.estimate is not None
    assert free.estimate.step_time_s <= autoplan.estimate(llama, cluster, theirs).step_time_s


def test_the_search_keeps_to_a_stacks_schedules(llama: ModelProfile) -> None:
    cluster = autoplan.Cluster.local(num_devices=2)
    plan = autoplan.search(llama, cluster, global_batch=8, pp=2, framework="megatron-lm")
    assert plan.schedule in ("1f1b", "interleaved-1f1b")
    with pytest.raises(InputError, match="megatron-lm runs only 1f1b, interleaved-1f1b"):
        autoplan.search(
            llama, cluster, global_batch=8, pp=2, schedules=["zbv"], framework="megatron-lm"
        )
