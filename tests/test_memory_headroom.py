"""Memory headroom (issue 38): every check keeps a plan's predicted peak, at the upper end of its
80% range, within the device's capacity less the headroom; the search never offers a plan that
`validate` or `parallelize` refuses; plans record the headroom they were made with; bad values
are one line (CLI, exit 2) or a `MemoryHeadroomError` (API)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from autoplan.api import estimate, manual_plan
from autoplan.contract.errors import InputError, NoFeasiblePlanError, PlanError
from autoplan.contract.plan import Plan
from autoplan.export.checks import check_memory
from autoplan.planner.search import search_plans
from cost_model.headroom import (
    DEFAULT_MEMORY_HEADROOM,
    MAX_MEMORY_HEADROOM,
    MemoryHeadroomError,
    check_memory_headroom,
    parse_memory_headroom,
    plan_memory_headroom,
    usable_capacity_bytes,
)
from cost_model.messages import shown
from cost_model.results import MemoryCapacityError
from cost_model.uncertainty import memory_upper_factor
from tests.conftest import run_cli
from tests.cost_profiles import gpt_profile, round_cluster

GIB = 2**30
PROFILE = gpt_profile(num_layers=4, h=1024, s=512)
# Solver limits far beyond the work and no visit budget: the result does not depend on the
# machine's load (no wall clock in a correctness test).
UNTIMED: dict[str, Any] = {"budget_s": None, "time_limit_s": 3600.0}

BAD_VALUES: list[object] = [
    -0.01, -1, MAX_MEMORY_HEADROOM, 0.95, 1, 10, math.nan, math.inf, -math.inf, "0.1", True,
    [0.1], 1e400,
]  # fmt: skip
BAD_TEXTS = ["abc", "", "-0.1", "0.9", "1", "10%", "nan", "inf", "-inf", "1e400", "0x10"]


@pytest.fixture(scope="module")
def edge_cluster() -> Any:
    """A cluster whose devices just hold the fastest plan with no headroom: its predicted peak
    at the upper end of its range is 99% of the device."""
    fastest = search_plans(
        PROFILE, round_cluster(), global_batch=8, memory_headroom=0.0, **UNTIMED
    ).plans[0]
    assert fastest.estimate is not None
    memory = int(fastest.estimate.peak_memory_bytes * memory_upper_factor() / 0.99)
    return round_cluster(memory_bytes=memory)


# ------------------------------------------------------------------------------ the rule


def test_usable_bytes_take_the_headroom_and_the_peak_range_off_the_capacity() -> None:
    factor = memory_upper_factor()
    assert factor >= 1.0
    for headroom in (0.0, 0.05, DEFAULT_MEMORY_HEADROOM, 0.5):
        usable = usable_capacity_bytes(80 * GIB, headroom)
        assert usable == pytest.approx(80 * GIB * (1 - headroom) / factor)
        # the upper end of the largest peak that fits leaves exactly the headroom free
        assert 80 * GIB - usable * factor == pytest.approx(headroom * 80 * GIB)


def test_the_default_is_at_least_five_percent_and_applies_when_not_given() -> None:
    assert 0.05 <= DEFAULT_MEMORY_HEADROOM < MAX_MEMORY_HEADROOM
    cluster = round_cluster()
    plan = manual_plan(PROFILE, cluster, dp=8, global_batch=8)
    assert plan.memory_headroom is None  # a hand-made plan records none
    assert plan_memory_headroom(plan) == DEFAULT_MEMORY_HEADROOM
    result = estimate(PROFILE, cluster, plan)
    assert result.memory_headroom == DEFAULT_MEMORY_HEADROOM
    assert result.usable_memory_bytes == pytest.approx(
        usable_capacity_bytes(80 * GIB, DEFAULT_MEMORY_HEADROOM)
    )
    # given: it wins over the plan's (none) and the default
    assert estimate(PROFILE, cluster, plan, memory_headroom=0.3).memory_headroom == 0.3
    recorded = Plan.from_data({**plan.to_data(), "memory_headroom": 0.2})
    assert estimate(PROFILE, cluster, recorded).memory_headroom == 0.2
    assert estimate(PROFILE, cluster, recorded, memory_headroom=0.0).memory_headroom == 0.0


def test_a_plan_within_the_device_but_not_the_headroom_does_not_fit_and_says_by_how_much() -> None:
    plan = manual_plan(PROFILE, round_cluster(), dp=8, global_batch=8)
    peak = estimate(PROFILE, round_cluster(), plan).peak_memory_bytes
    # 5% more memory than the predicted peak: within the device, not within 10% and the range
    cluster = round_cluster(memory_bytes=int(peak * 1.05))
    result = estimate(PROFILE, cluster, plan)
    assert result.peak_memory_bytes <= result.memory_capacity_bytes and not result.fits
    assert not any(r.fits for r in result.ranks if r.memory.total_bytes == peak)
    usable = usable_capacity_bytes(cluster.device.memory_bytes, DEFAULT_MEMORY_HEADROOM)
    over = (peak - usable) / GIB
    message = result.memory_problem()
    assert message.startswith("plan does not fit with the memory headroom: pipeline rank 0")
    assert "\n" not in message
    assert "a 10% memory headroom" in message
    assert f"over by {over:.3g} GiB" in message or f"over by {over * 1024:.3g} MiB" in message
    with pytest.raises(MemoryCapacityError, match="over by"):
        result.require_fits()
    # a device twice the peak holds it with up to 1 - factor / 2 (about 43%) free
    roomy = round_cluster(memory_bytes=int(peak * 2))
    assert estimate(PROFILE, roomy, plan, memory_headroom=0.4).fits
    assert not estimate(PROFILE, roomy, plan, memory_headroom=0.6).fits


# ------------------------------------------------------------------------------ search


@pytest.mark.parametrize("headroom", [0.0, 0.1, 0.3])
def test_search_keeps_every_plan_within_capacity_less_headroom(
    edge_cluster: Any, headroom: float
) -> None:
    result = search_plans(
        PROFILE, edge_cluster, global_batch=8, top_k=3, memory_headroom=headroom, **UNTIMED
    )
    capacity = edge_cluster.device.memory_bytes
    for plan in result.plans:
        assert plan.memory_headroom == headroom
        assert plan.estimate is not None and plan.estimate.memory_headroom == headroom
        upper = plan.estimate.peak_memory_bytes * memory_upper_factor()
        assert upper <= capacity * (1 - headroom) * (1 + 1e-9), (upper, capacity, headroom)
        # validate's check (the recorded headroom) and parallelize's accept it
        assert estimate(PROFILE, edge_cluster, plan).fits
        assert check_memory(plan, PROFILE, edge_cluster).fits


def test_a_larger_headroom_changes_the_plan_and_validate_refuses_the_old_one(
    edge_cluster: Any,
) -> None:
    """The fastest plan sits at 99% of the device at its range's upper end: it is the search's
    answer with no headroom, refused by validate with 30%, and the search with 30% picks a plan
    that validate with 30% accepts."""
    tight = search_plans(PROFILE, edge_cluster, global_batch=8, memory_headroom=0.0, **UNTIMED)
    roomy = search_plans(PROFILE, edge_cluster, global_batch=8, memory_headroom=0.3, **UNTIMED)
    edge, safe = tight.plans[0], roomy.plans[0]
    assert edge.estimate is not None and safe.estimate is not None
    assert edge.estimate.peak_memory_bytes > safe.estimate.peak_memory_bytes
    assert safe.estimate.step_time_s >= edge.estimate.step_time_s  # room costs speed
    with pytest.raises(MemoryCapacityError, match="30% memory headroom") as refused:
        check_memory(edge, PROFILE, edge_cluster, memory_headroom=0.3)
    assert "over by" in str(refused.value)
    assert check_memory(safe, PROFILE, edge_cluster, memory_headroom=0.3).fits


def test_no_plan_within_the_headroom_names_it_and_suggests_lowering_it() -> None:
    # the least memory any plan needs (from the search's own refusal on an 8 MiB device)
    with pytest.raises(NoFeasiblePlanError) as tiny:
        search_plans(PROFILE, round_cluster(memory_bytes=8 * 2**20), global_batch=8, **UNTIMED)
    least = tiny.value.least_memory_bytes
    assert least is not None
    # a device that holds it with its range and 10% free, not 60%
    cluster = round_cluster(memory_bytes=int(least * memory_upper_factor() / 0.9))
    search_plans(PROFILE, cluster, global_batch=8, memory_headroom=0.1, **UNTIMED)
    with pytest.raises(NoFeasiblePlanError) as info:
        search_plans(PROFILE, cluster, global_batch=8, memory_headroom=0.6, **UNTIMED)
    message = str(info.value)
    assert "(memory headroom 60% and the peak's range)" in message, message
    assert "lower the memory headroom" in message, message


# ------------------------------------------------------------------------------ plan files


def test_plan_files_record_the_headroom_and_old_files_read_as_the_default(
    edge_cluster: Any, tmp_path: Path
) -> None:
    plan = search_plans(
        PROFILE, edge_cluster, global_batch=8, memory_headroom=0.25, **UNTIMED
    ).plans[0]
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    assert "memory_headroom: 0.25" in path.read_text()
    loaded = Plan.from_yaml(path)
    assert loaded.memory_headroom == 0.25 and loaded == plan
    assert loaded.estimate is not None and loaded.estimate.memory_headroom == 0.25
    assert loaded.estimate.memory_usable_bytes == int(
        usable_capacity_bytes(edge_cluster.device.memory_bytes, 0.25)
    )
    # the headroom is a planning margin: the job, and so the digest, are the same without it
    data = plan.to_data()
    del data["memory_headroom"]
    old = Plan.from_data(data)
    assert old.memory_headroom is None and old.digest() == plan.digest()
    assert estimate(PROFILE, edge_cluster, old).memory_headroom == DEFAULT_MEMORY_HEADROOM
    for bad in (-0.1, 0.9, "lots", [0.1]):
        with pytest.raises(PlanError, match="memory_headroom"):
            Plan.from_data({**plan.to_data(), "memory_headroom": bad})


def test_validate_says_by_how_much_a_cluster_misses_the_recorded_headroom(
    edge_cluster: Any, tmp_path: Path
) -> None:
    model = "gpt:num_layers=2,hidden_size=256,num_heads=4,seq_len=128,vocab_size=512"
    path = tmp_path / "plan.yaml"
    made = run_cli(
        "plan", "--model", model, "--cluster", "dgx-a100-80g", "--global-batch", "8",
        "--memory-headroom", "0.2", "--budget", "2", "-o", str(path),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "headroom 20%" in made.stdout
    plan = Plan.from_yaml(path)
    assert plan.memory_headroom == 0.2 and plan.estimate is not None
    ok = run_cli("validate", str(path), "--model", model)
    assert ok.returncode == 0, ok.stderr
    assert "free (headroom 20%" in ok.stdout
    # a device that holds the predicted peak 10% over, and the range, but not 20% free
    memory = plan.estimate.peak_memory_bytes * memory_upper_factor() / 0.88
    small = f"dgx-a100-80g:memory={int(memory)}"
    refused = run_cli("validate", str(path), "--model", model, "--cluster", small)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "plan does not fit with the memory headroom" in lines[0]
    assert "over by" in lines[0] and "a 20% memory headroom" in lines[0]
    assert "the headroom is the plan file's memory_headroom, 0.2" in lines[0]
    # a smaller headroom given on the command line checks it with that one
    lower = run_cli(
        "validate", str(path), "--model", model, "--cluster", small, "--memory-headroom", "0.05"
    )
    assert lower.returncode == 0, lower.stderr
    assert "free (headroom 5%" in lower.stdout


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_a_bad_headroom_is_a_clear_input_error(value: object) -> None:
    with pytest.raises(MemoryHeadroomError) as info:
        check_memory_headroom(value)
    message = str(info.value)
    assert isinstance(info.value, InputError) and "\n" not in message
    assert "must be a fraction of device memory in [0, 0.9)" in message
    assert message.startswith(f"memory headroom {shown(value)} must be"), message
    with pytest.raises(MemoryHeadroomError):
        search_plans(PROFILE, round_cluster(), global_batch=8, memory_headroom=value)  # type: ignore[arg-type]
    plan = manual_plan(PROFILE, round_cluster(), dp=8, global_batch=8)
    with pytest.raises(MemoryHeadroomError):
        estimate(PROFILE, round_cluster(), plan, memory_headroom=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", BAD_TEXTS)
@pytest.mark.parametrize("command", ["estimate", "plan", "validate", "explain", "whatif"])
def test_a_bad_headroom_on_the_command_line_is_one_line_exit_2(command: str, text: str) -> None:
    with pytest.raises(MemoryHeadroomError):
        parse_memory_headroom(text)
    model = "gpt:num_layers=2,hidden_size=64,num_heads=4,seq_len=32,vocab_size=128"
    args = {
        "estimate": ("--model", model, "--cluster", "local", "--global-batch", "8"),
        "plan": ("--model", model, "--cluster", "local", "--global-batch", "8"),
        "whatif": ("--model", model, "--cluster", "local", "--num-devices", "1",
                   "--global-batch", "8"),
        "validate": ("/no/such/plan.yaml",),
        "explain": ("/no/such/plan.yaml",),
    }[command]  # fmt: skip
    result = run_cli(command, *args, f"--memory-headroom={text}")
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "--memory-headroom" in lines[0] and "[0, 0.9)" in lines[0], lines[0]
    assert repr(text)[:10] in lines[0] or text in lines[0], lines[0]


def test_parallelize_refuses_a_bad_headroom_before_any_process_group() -> None:
    from autoplan.runtime.parallelizer import parallelize
    from tests.numerics import build_model, loss_fn

    assert not dist.is_initialized()
    with pytest.raises(MemoryHeadroomError, match=r"memory headroom 1\.5 must be"):
        parallelize(build_model("gpt"), loss_fn=loss_fn, memory_headroom=1.5)
    assert not dist.is_initialized()


def test_parallelize_checks_the_plan_with_its_headroom_before_launch() -> None:
    """The memory check `parallelize` runs on every rank before any allocation (the same
    function, called alone: no process group is needed for it)."""
    from autoplan.runtime.parallelizer import _check_memory
    from autoplan.tracing import trace
    from tests.numerics import build_model, make_plan

    graph = trace(build_model("gpt"))
    plan = make_plan(dp=1)
    cluster = round_cluster(num_nodes=1, devices_per_node=1)
    peak = _check_memory(plan, graph, cluster, True).peak_memory_bytes
    # a device that holds the peak and its range with 5% free, not 10%
    snug = round_cluster(
        num_nodes=1, devices_per_node=1, memory_bytes=int(peak * memory_upper_factor() / 0.93)
    )
    with pytest.raises(MemoryCapacityError, match="10% memory headroom"):
        _check_memory(plan, graph, snug, True)
    lower = Plan.from_data({**plan.to_data(), "memory_headroom": 0.05})
    assert _check_memory(lower, graph, snug, True).fits
