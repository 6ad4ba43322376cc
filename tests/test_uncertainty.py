"""The 80% ranges (`cost_model.uncertainty`): sized by held-out residuals, calibrated, widened
where a plan's features were never validated, carried by every estimate and used by the search's
objective; the coverage lines of `autoplan.analysis.coverage`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
from click.testing import CliRunner

from autoplan.analysis.coverage import coverage
from autoplan.api import estimate as api_estimate
from autoplan.api import manual_plan
from autoplan.cli import cli
from autoplan.contract.errors import NoFeasiblePlanError
from autoplan.planner.search import search_plans
from cost_model.estimate import estimate
from cost_model.hardware import Cluster
from cost_model.uncertainty import (
    MIN_ROWS,
    TIE_FRACTION,
    RangeLevelError,
    Residual,
    ResidualModel,
    plan_features,
    shipped,
    step_interval,
)
from tests.cost_profiles import gpt_profile, round_cluster


def _residual(source: str, value: float, features: tuple[str, ...] = ("a",)) -> Residual:
    return Residual(run_id=f"{source}-{value}", source=source, features=features, value=value)


def test_the_shipped_residuals_cover_the_benches() -> None:
    step, memory = shipped()
    # every scored published row (bench/validate_published.py: 442 from 14 sources)
    assert len(step.residuals) >= 400
    assert len({r.source for r in step.residuals}) >= 10
    # published peaks and bench/memory.py's rank measurements on this machine
    assert len(memory.residuals) >= 100
    assert all(r.features for r in step.residuals)


def test_the_shipped_step_ranges_are_calibrated_on_held_out_sources() -> None:
    # each row against the range sized without its own source: about 80% inside
    inside, total, per_source = shipped()[0].coverage()
    assert 0.75 <= inside / total <= 0.88, inside / total
    assert sum(n for _, n in per_source.values()) == total


def test_a_source_never_sizes_its_own_range() -> None:
    # source "far" is off by 50%; the other sources within 1%: held out, far's rows fall
    # outside the range the others size, so its coverage is 0 (and the others' is not)
    rows = [_residual("far", math.log(1.5) + i * 1e-3) for i in range(6)]
    for source in ("x", "y"):
        rows += [_residual(source, (i - 3) * 2e-3) for i in range(7)]
    _, _, per = ResidualModel(rows).coverage()
    assert per["far"] == (0, 6)
    assert per["x"][0] > 0 and per["y"][0] > 0


def test_an_unvalidated_feature_widens_the_range() -> None:
    model = shipped()[0]
    known = ("schedule 1f1b", "recompute full", "1f1b with full recompute", "dtype bf16")
    assert all(model.rows(f) >= MIN_ROWS for f in known)
    base = model.interval(known)
    wider = model.interval((*known, "a feature nothing validates"))
    assert base.low <= 1.0 <= base.high
    assert wider.high > base.high and wider.low < base.low
    assert wider.unvalidated == (("a feature nothing validates", 0),)


def test_every_estimate_carries_its_ranges() -> None:
    profile = gpt_profile(num_layers=4, h=256, s=128)
    cluster = round_cluster(num_nodes=1)
    plan = manual_plan(profile, cluster, global_batch=16, pp=2, micro_batch=2)
    result = estimate(profile, cluster, plan)
    low, high = result.step_time_range_s
    assert 0 < low <= result.step_time_s <= high
    mem_low, mem_high = result.peak_memory_range_bytes
    assert mem_low <= result.peak_memory_bytes <= mem_high
    assert result.features == plan_features(plan, plan.framework)
    interval = step_interval(result.features)
    assert high == pytest.approx(result.step_time_s * interval.high)
    # a stack that re-times the step keeps the range's proportions
    slower = result.with_step_time(2 * result.step_time_s)
    assert slower.step_time_range_s == pytest.approx((2 * low, 2 * high))
    # the plan file records them
    assert plan.estimate is not None
    assert plan.estimate.step_time_high_s == pytest.approx(high)


def test_the_objectives_pick_by_their_own_figure() -> None:
    profile = gpt_profile(num_layers=6, h=512, s=256)
    cluster = round_cluster(num_nodes=2)
    picks = {
        objective: search_plans(
            profile, cluster, global_batch=32, objective=objective, budget_s=None, top_k=3
        )
        for objective in ("expected", "pessimistic")
    }
    expected = picks["expected"].plans[0].estimate
    pessimistic = picks["pessimistic"].plans[0].estimate
    assert expected is not None and pessimistic is not None
    # each pick is (up to a tie) the best by its own objective
    assert expected.step_time_s <= pessimistic.step_time_s * (1 + TIE_FRACTION)
    assert pessimistic.step_time_high_s <= expected.step_time_high_s * (1 + TIE_FRACTION)
    assert picks["pessimistic"].stats.best_objective_s == pytest.approx(
        min(p.estimate.step_time_high_s for p in picks["pessimistic"].plans if p.estimate)
    )


def test_an_unknown_objective_is_named() -> None:
    profile = gpt_profile(num_layers=2, h=128, s=64)
    with pytest.raises(
        NoFeasiblePlanError, match=r"objective=fastest is not one.*pessimistic, expected"
    ):
        search_plans(profile, round_cluster(num_nodes=1), global_batch=8, objective="fastest")
    args = ["plan", "--model", "gpt2-small", "--cluster", "dgx-a100-80g", "--global-batch", "8"]
    result = CliRunner().invoke(cli, [*args, "--objective", "fastest"])
    assert result.exit_code == 2
    assert "'fastest' is not one of 'pessimistic', 'expected'" in result.output


def test_estimate_json_and_text_show_the_range() -> None:
    args = ["estimate", "--model", "gpt2-small", "--cluster", "dgx-a100-80g", "--pp", "2"]
    args += ["--global-batch", "64", "--micro-batch", "4"]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0, text.output
    assert "80% range" in text.output
    data = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
    low, high = data["step_time_range_s"]
    assert low < data["step_time_s"] < high


def test_gpt3_175b_at_the_edge_of_what_was_validated() -> None:
    # the plan: interleaved zero-bubble, no recompute, ZeRO-2 on 1024 A100s
    from autoplan import models
    from autoplan.tracing import trace

    profile = trace(models.preset("gpt3-175b")).profile
    cluster = Cluster.preset("dgx-a100-80g", nodes=128)
    plan = manual_plan(
        profile,
        cluster,
        global_batch=1536,
        tp=2,
        pp=8,
        micro_batch=1,
        schedule="interleaved-zb",
        virtual_stages=6,
        zero=2,
        sequence_parallel=True,
        recompute="none",
    )
    found = coverage(plan, profile, cluster)
    lines = "\n".join(found.lines())
    assert "interleaved-zb without recompute: 0 published rows" in lines
    assert "ZeRO-2: 0 published rows" in lines
    # A100 runs of 175B reach ~51% MFU (Korthikanti et al. 2022); the plan is priced above
    assert found.above_published and found.best_published_mfu is not None
    assert found.best_published_mfu < found.mfu
    assert "is above the best published run of this size on this GPU" in lines
    # each unvalidated feature priced against the same plan with its validated alternative
    gain = {g.feature: g for g in found.gains}
    assert gain["schedule interleaved-zb"].alternative == "interleaved-1f1b"
    variant = dataclasses.replace(plan, schedule="interleaved-1f1b", estimate=None)
    step = estimate(profile, cluster, plan).step_time_s
    assert gain["schedule interleaved-zb"].relative == pytest.approx(
        step / estimate(profile, cluster, variant).step_time_s - 1.0
    )
    assert gain["ZeRO-2"].alternative in ("ZeRO-1", "ZeRO-3", "no ZeRO")


@pytest.mark.parametrize("level", [float("nan"), -0.2, 0.0, 1.0, 1.5, True, "0.8"])
def test_a_bad_range_level_is_named(level: object) -> None:
    profile = gpt_profile(num_layers=2, h=128, s=64)
    cluster = round_cluster(num_nodes=1)
    plan = manual_plan(profile, cluster, global_batch=8)
    with pytest.raises(RangeLevelError, match="must be a fraction between 0 and 1"):
        api_estimate(profile, cluster, plan, range_level=level)  # type: ignore[arg-type]


def test_a_wider_level_gives_a_wider_range() -> None:
    profile = gpt_profile(num_layers=2, h=128, s=64)
    cluster = round_cluster(num_nodes=1)
    plan = manual_plan(profile, cluster, global_batch=8)
    ranges = [api_estimate(profile, cluster, plan, range_level=lv) for lv in (0.5, 0.8, 0.95)]
    assert ranges[1].step_time_range_s == estimate(profile, cluster, plan).step_time_range_s
    for narrow, wide in itertools.pairwise(ranges):
        assert wide.step_time_range_s[0] < narrow.step_time_range_s[0]
        assert wide.step_time_range_s[1] > narrow.step_time_range_s[1]
    args = ["estimate", "--model", "gpt2-small", "--cluster", "dgx-a100-80g"]
    result = CliRunner().invoke(cli, [*args, "--global-batch", "8", "--range-level", "nan"])
    assert result.exit_code == 2
    assert "range level nan must be a fraction between 0 and 1" in result.output
