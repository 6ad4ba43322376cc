"""`autoplan plan` through the real console script: table, JSON, the YAML it writes (which
`autoplan validate` accepts), and one-line errors for impossible requests."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from autoplan import Cluster
from autoplan.contract.plan import Plan
from cost_model.headroom import DEFAULT_MEMORY_HEADROOM, usable_capacity_bytes
from tests.conftest import run_cli

MODEL = "gpt:num_layers=4,hidden_size=256,num_heads=8,seq_len=128,vocab_size=4096"


def test_plan_writes_a_valid_yaml_with_its_estimate(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    result = run_cli(
        "plan",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100-80g:nodes=2",
        "--global-batch",
        "32",
        "-o",
        str(out),
        "--top",
        "3",
    )
    assert result.returncode == 0, result.stderr
    assert "best plans (rank 1 is chosen)" in result.stdout
    assert "per pipeline rank" in result.stdout and f"wrote {out}" in result.stdout
    plan = Plan.from_yaml(out)
    assert plan.num_devices == 16 and plan.global_batch_size == 32
    assert plan.estimate is not None and plan.estimate.step_time_s > 0
    # the headroom is recorded: the preset reserves 2 GiB, plus the allocator's margin
    assert plan.estimate.memory_capacity_bytes == 80 * 2**30
    assert 2 * 2**30 < plan.estimate.memory_reserve_bytes < plan.estimate.peak_memory_bytes
    assert "reserve/margin" in result.stdout
    assert plan.model is not None and plan.model.fingerprint
    check = run_cli("validate", str(out), "--cluster", "dgx-a100-80g:nodes=2", "--model", MODEL)
    assert check.returncode == 0, check.stderr
    # the verdict wraps at the console's words
    assert "valid for dgx-a100-80g (16 devices) and model" in " ".join(check.stdout.split())


def test_plan_json_ranks_plans_and_obeys_constraints() -> None:
    result = run_cli(
        "plan",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100-80g",
        "--global-batch",
        "16",
        "--top",
        "2",
        "--tp",
        "2,4",
        "--zero",
        "0",
        "--recompute",
        "none",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    plans = [Plan.from_data(p) for p in data["plans"]]
    assert len(plans) == 2
    # ranked by the upper end of the step's 80% range (the default objective), plans within
    # 2% of the best tied
    highs = [p.estimate.step_time_high_s for p in plans if p.estimate]
    best = data["stats"]["best_objective_s"]
    assert min(highs) == pytest.approx(best)
    assert all(h <= best * 1.02 * (1 + 1e-9) or h == max(highs) for h in highs)
    for plan in plans:
        assert plan.tp_degree in (2, 4) and plan.zero_stage == 0
        assert {s.recompute for s in plan.stages} == {"none"}
    assert data["stats"]["candidates"] >= data["stats"]["solver_calls"] >= 1


def _one_line_error(result: object, fragment: str) -> None:
    assert result.returncode == 2, result.stdout  # type: ignore[attr-defined]
    # (a slow run's status lines, "plan: ... (10 s)", may come before the error's one line)
    lines = [
        line
        for line in result.stderr.strip().splitlines()  # type: ignore[attr-defined]
        if not re.fullmatch(r"plan: .* \(\d+ s\)", line)
    ]
    assert len(lines) == 1 and "Traceback" not in result.stderr  # type: ignore[attr-defined]
    assert fragment in lines[0], lines[0]


def test_no_feasible_plan_is_one_line_with_the_numbers() -> None:
    result = run_cli(
        "plan", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--global-batch", "8"
    )
    _one_line_error(
        result, "no plan for 'gpt3-175b' fits 'dgx-a100-80g': the least memory per device"
    )
    assert "the device has 80.0 GiB" in result.stderr and "more devices" in result.stderr
    # 175e9 parameters x 16 bytes (bf16 weights and grads, fp32 Adam), 2,602 GiB, over the
    # tensor bytes a device may hold: 80 GiB less the 10% memory headroom, over the peak's range
    # factor, less the 2 GiB reserve, over the 5% allocator margin (about 58.6 GiB): 45 devices
    peak = usable_capacity_bytes(80 * 2**30, DEFAULT_MEMORY_HEADROOM)
    usable = (peak - 2 * 2**30) / 1.05
    found = re.search(
        r"alone need at least (\d+) devices of this type \(([\d,]+) GiB\)", result.stderr
    )
    assert found is not None, result.stderr
    state = float(found[2].replace(",", "")) * 2**30
    assert int(found[1]) == math.ceil(state / usable)
    assert f"a predicted peak may use {peak / 2**30:.1f} GiB (memory headroom 10%" in result.stderr


def test_contradictory_constraints_are_one_line() -> None:
    _one_line_error(
        run_cli(
            "plan",
            "--model",
            MODEL,
            "--cluster",
            "dgx-a100-80g",
            "--global-batch",
            "8",
            "--tp",
            "16",
        ),
        "tp=16 does not divide the 8 devices",
    )
    _one_line_error(
        run_cli(
            "plan",
            "--model",
            MODEL,
            "--cluster",
            "dgx-a100-80g",
            "--global-batch",
            "8",
            "--recompute",
            "most",
        ),
        "recompute: unknown 'most'",
    )


def test_validate_rejects_a_plan_for_another_model(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    assert (
        run_cli(
            "plan",
            "--model",
            MODEL,
            "--cluster",
            "dgx-a100-80g",
            "--global-batch",
            "8",
            "-o",
            str(out),
        ).returncode
        == 0
    )
    other = MODEL.replace("hidden_size=256", "hidden_size=512")
    _one_line_error(
        run_cli("validate", str(out), "--cluster", "dgx-a100-80g", "--model", other),
        "plan was made for model",
    )


def test_validate_checks_memory_as_parallelize_does(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    made = run_cli(
        "plan", "--model", MODEL, "--cluster", "dgx-a100-80g", "--global-batch", "8", "-o", str(out)
    )
    assert made.returncode == 0, made.stderr
    # the model comes from the plan file's model.name: memory is checked without --model
    fits = run_cli("validate", str(out), "--cluster", "dgx-a100-80g")
    assert fits.returncode == 0, fits.stderr
    # the verdict's line, then the memory check's
    assert "\n  peak memory " in fits.stdout and "GiB of 80.0 GiB" in fits.stdout
    # 2049 MiB devices: the 2 GiB framework reserve leaves 1 MiB, too little for the plan
    small = "dgx-a100-80g:memory=2049MiB"
    _one_line_error(
        run_cli("validate", str(out), "--cluster", small),
        "plan does not fit: pipeline rank 0 needs",
    )
    forced = run_cli("validate", str(out), "--cluster", small, "--allow-over-memory")
    assert forced.returncode == 0, forced.stderr
    assert "WARNING (--allow-over-memory): plan does not fit: pipeline rank" in forced.stderr


def test_a_plan_saved_from_python_needs_no_model_or_cluster_flags(tmp_path: Path) -> None:
    """A zoo model's plan records a spec that rebuilds it; validate and explain read the model
    and the cluster from the file."""
    import autoplan
    from autoplan.models import llama

    model = llama(2, 64, 4, 32, 128, num_kv_heads=2, device="meta")
    graph = autoplan.trace(model)
    assert graph.profile.name.startswith("llama:num_layers=2,hidden_size=64,num_heads=4,")
    plan = autoplan.manual_plan(
        graph, autoplan.Cluster.preset("dgx-a100-80g"), dp=8, global_batch=8
    )
    out = tmp_path / "plan.yaml"
    plan.to_yaml(out)
    check = run_cli("validate", str(out))
    assert check.returncode == 0, check.stderr
    assert "valid for dgx-a100-80g (8 devices) and model llama:" in " ".join(check.stdout.split())
    assert "peak memory" in check.stdout and "from " in check.stdout
    explained = run_cli("explain", str(out), "--no-alternatives", "--json")
    assert explained.returncode == 0, explained.stderr


def test_each_device_defaults_to_its_fastest_dtype() -> None:
    gpu = Cluster.preset("dgx-a100-80g")
    cpu = Cluster.preset("local")
    assert gpu.device.fastest_training_dtype() == "bf16"
    assert cpu.device.fastest_training_dtype() == "fp32"  # a tie at the preset's rates
    faster = dataclasses.replace(cpu.device, peak_flops={"fp32": 1e11, "bf16": 4e11})
    assert faster.fastest_training_dtype() == "bf16"
    done = run_cli("plan", "--model", MODEL, "--cluster", "local", "--global-batch", "4", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["plans"][0]["dtype"] == "fp32"


def test_the_ranked_table_shows_rank_layouts_when_they_tell_plans_apart() -> None:
    from rich.console import Console

    import autoplan
    from autoplan.cli.plan_cmd import ranked_table

    graph = autoplan.trace(autoplan.models.gpt(2, 64, 4, 32, 128))
    same = [
        autoplan.manual_plan(graph, "dgx-a100-80g", pp=2, global_batch=64, micro_batch=m)
        for m in (1, 2)
    ]
    apart = [
        autoplan.manual_plan(graph, "dgx-a100-80g", pp=2, global_batch=64, rank_layout=layout)
        for layout in (("pp", "dp", "tp"), ("dp", "pp", "tp"))
    ]

    def text(plans: list[autoplan.Plan]) -> str:
        console = Console(width=100, record=True)
        console.print(ranked_table(tuple(plans)))
        return console.export_text()

    assert "layout" not in text(same)
    shown = text(apart)
    assert "layout" in shown and "pp/dp/tp" in shown and "dp/pp/tp" in shown
