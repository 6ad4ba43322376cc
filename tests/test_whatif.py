"""`autoplan.whatif` and `autoplan whatif`: rows against the planner and hand-worked formulas,
sizes without a plan, cluster types and overrides, the picture, and one-line input errors."""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

import autoplan.cli.progress as progress_module
from autoplan.analysis.plots import save_figure, whatif_figure
from autoplan.analysis.whatif import (
    WhatIfInputError,
    WhatIfProgress,
    WhatIfResult,
    cluster_type,
    infeasible_reason,
    parse_positive,
    split_cluster_specs,
    whatif,
)
from autoplan.cli import cli
from autoplan.cli.common import trace_spec
from autoplan.contract.errors import InputError, NoFeasiblePlanError, PlanError
from autoplan.contract.plan import Plan, StagePlan
from autoplan.planner.search import search_plans
from cost_model.errors import ClusterError
from cost_model.hardware import Cluster
from cost_model.workload import ModelProfile
from tests.conftest import run_cli, shared_by_workers

# ~110M parameters: 16 bytes each of weights, grads and Adam state do not fit one device with
# 4 GiB (2 GiB of it reserved by the preset's calibration, 10% kept free beyond the upper end of
# the peak's range), but fit 2 or more. No host link: the search would otherwise fit one device
# with its optimizer on the host (autoplan's runtime offloads it, passes/optimizer_offload.py).
MODEL = "gpt:num_layers=8,hidden_size=1024,num_heads=16,seq_len=256,vocab_size=8192"
SMALL_MEMORY = {"memory": "4GiB", "host_link_bandwidth": "0"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A search budget in reference seconds of work (`autoplan.planner.work`): the same plans in a
# pool and here whatever the machine's load (budget None takes what is left of the what-if's
# wall-clock total, which a loaded machine spends differently; once it gave another 4-device
# plan in the pool than here). Far above what these small searches need to prove their plans.
DETERMINISTIC_BUDGET_S = 60.0


@pytest.fixture(scope="module")
def profile() -> ModelProfile:
    result: ModelProfile = trace_spec(MODEL).profile
    return result


@pytest.fixture(scope="module")
def sweep(
    profile: ModelProfile, tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> WhatIfResult:
    def run(_: Path) -> WhatIfResult:
        return whatif(
            profile,
            ["dgx-a100-80g", "dgx-h100-80g"],
            num_devices=[8, 1, 2, 16],  # unsorted on purpose
            global_batch=16,
            tokens=2e9,
            price_per_device_hour=2.5,
            cluster_overrides=SMALL_MEMORY,
            budget_s=None,  # compared with a search below: no wall clock in the comparison
        )

    # ~25 s: one sweep for every worker that runs a test of this module
    return shared_by_workers(tmp_path_factory, worker_id, "whatif-sweep", run)


def test_rows_are_the_planners_best_plans_in_order(
    sweep: WhatIfResult, profile: ModelProfile
) -> None:
    assert sweep.clusters == ("dgx-a100-80g", "dgx-h100-80g")
    assert [(r.cluster, r.num_devices) for r in sweep.rows] == [
        (c, n) for c in sweep.clusters for n in (1, 2, 8, 16)
    ]
    row = next(r for r in sweep.rows if r.cluster == "dgx-h100-80g" and r.num_devices == 16)
    assert (row.num_nodes, row.devices_per_node) == (2, 8)
    assert row.memory_capacity_bytes == 4 * 2**30  # the override reached every type
    cluster = Cluster.preset("dgx-h100-80g", nodes=2, **SMALL_MEMORY)
    best = search_plans(profile, cluster, global_batch=16, budget_s=None).plans[0]
    assert row.plan == best
    assert best.estimate is not None
    assert row.step_time_s == pytest.approx(best.estimate.step_time_s, rel=1e-12)
    assert row.tokens_per_s == pytest.approx(best.estimate.tokens_per_s, rel=1e-12)
    assert row.mfu == pytest.approx(best.estimate.mfu, rel=1e-12)


def test_partial_node_and_no_plan_rows(sweep: WhatIfResult) -> None:
    for label in sweep.clusters:
        one, two = sweep.rows_of(label)[:2]
        # Fewer devices than a node: one node with that many devices.
        assert (one.num_nodes, one.devices_per_node) == (1, 1)
        assert (two.num_nodes, two.devices_per_node) == (1, 2)
        # One device: the planner's NoFeasiblePlanError, shortened, and no numbers.
        assert not one.fits and one.plan is None and one.step_time_s is None
        assert one.reason is not None
        assert one.reason.startswith("does not fit: needs ")
        assert one.reason.endswith(" per device of 4.0 GiB")
        assert one.training is None and one.scaling_efficiency is None
        assert two.fits


def test_scaling_and_training_cost_against_hand_worked_numbers(sweep: WhatIfResult) -> None:
    for label in sweep.clusters:
        rows = [r for r in sweep.rows_of(label) if r.fits]
        base = rows[0]  # 2 devices: the smallest size with a plan is the baseline
        assert base.num_devices == 2 and base.scaling_efficiency == pytest.approx(1.0)
        assert base.tokens_per_s is not None
        for row in rows:
            assert row.scaling_baseline_devices == 2
            assert row.tokens_per_s is not None and row.training is not None
            per_device = row.tokens_per_s / row.num_devices
            assert row.scaling_efficiency == pytest.approx(per_device / (base.tokens_per_s / 2))
            seconds = 2e9 / row.tokens_per_s
            assert row.training.days == pytest.approx(seconds / 86400)
            assert row.training.device_hours == pytest.approx(row.num_devices * seconds / 3600)
            assert row.training.cost == pytest.approx(row.training.device_hours * 2.5)


def test_progress_reports_every_search(profile: ModelProfile) -> None:
    seen: list[WhatIfProgress] = []
    whatif(
        profile,
        "dgx-a100-80g",
        num_devices=[2, 4],
        global_batch=16,
        progress=seen.append,
        workers=1,
    )
    assert [(p.completed, p.total, p.num_devices) for p in seen] == [
        (0, 2, 2),
        (1, 2, 4),
        (2, 2, 4),
    ]


def test_parallel_searches_match_serial_ones(profile: ModelProfile) -> None:
    seen: list[WhatIfProgress] = []
    sizes = [2, 4, 8]
    parallel = whatif(
        profile,
        "dgx-a100-80g",
        num_devices=sizes,
        global_batch=16,
        progress=seen.append,
        workers=2,
        budget_s=DETERMINISTIC_BUDGET_S,
    )
    serial = whatif(
        profile,
        "dgx-a100-80g",
        num_devices=sizes,
        global_batch=16,
        workers=1,
        budget_s=DETERMINISTIC_BUDGET_S,
    )
    assert [r.plan for r in parallel.rows] == [r.plan for r in serial.rows]
    assert [r.step_time_s for r in parallel.rows] == [r.step_time_s for r in serial.rows]
    done = [p.completed for p in seen]
    assert done[0] == 0 and done[-1] == len(sizes) and done == sorted(done)
    assert done.count(len(sizes)) == 1  # the end is reported once
    assert {p.num_devices for p in seen} == set(sizes)


@pytest.mark.parametrize("start_s", [math.inf, 0.0])
def test_searches_run_here_until_a_pool_would_finish_sooner(
    profile: ModelProfile, monkeypatch: pytest.MonkeyPatch, start_s: float
) -> None:
    """By default the first search runs here; the rest follow it here while, at its pace, they
    would end before a search process could start (`_POOL_START_S`, set by the test: no wall
    clock decides the outcome), else in a pool. The rows are the same either way."""
    import autoplan.analysis.whatif as module

    pools: list[int] = []

    def counted_pool(*args: Any, max_workers: int, **kwargs: Any) -> ProcessPoolExecutor:
        pools.append(max_workers)
        return ProcessPoolExecutor(*args, max_workers=max_workers, **kwargs)

    monkeypatch.setattr(module, "_POOL_START_S", start_s)
    monkeypatch.setattr(module.os, "cpu_count", lambda: 2)  # the default pool has two workers
    monkeypatch.setattr(module, "ProcessPoolExecutor", counted_pool)
    sizes = [2, 4]
    seen: list[WhatIfProgress] = []
    result = whatif(
        profile, "dgx-a100-80g", num_devices=sizes, global_batch=16, progress=seen.append,
        budget_s=DETERMINISTIC_BUDGET_S,
    )  # fmt: skip
    # never a pool when processes cannot pay for themselves; else one for the last search
    assert pools == ([] if start_s == math.inf else [1])
    done = [p.completed for p in seen]
    assert done[0] == 0 and done[-1] == len(sizes) and done == sorted(done)
    assert done.count(len(sizes)) == 1
    serial = whatif(
        profile,
        "dgx-a100-80g",
        num_devices=sizes,
        global_batch=16,
        workers=1,
        budget_s=DETERMINISTIC_BUDGET_S,
    )
    assert [r.plan for r in result.rows] == [r.plan for r in serial.rows]


def test_a_changed_link_is_its_own_cluster_type(profile: ModelProfile) -> None:
    slow = "dgx-a100-80g:inter_node_bandwidth=1GB/s"
    result = whatif(profile, ["dgx-a100-80g", slow], num_devices=[16], global_batch=16)
    fast_row, slow_row = result.rows
    assert slow_row.cluster == slow
    assert fast_row.tokens_per_s is not None and slow_row.tokens_per_s is not None
    # 1 GB/s between nodes can only slow a 2-node plan down.
    assert slow_row.tokens_per_s < fast_row.tokens_per_s


def test_a_cluster_object_is_a_template_for_its_node(profile: ModelProfile) -> None:
    template = Cluster.preset("dgx-h100-80g", nodes=4)  # the node count is replaced
    (row,) = whatif(profile, template, num_devices=[2], global_batch=16).rows
    assert row.cluster == "dgx-h100-80g"
    assert (row.num_nodes, row.devices_per_node) == (1, 2)
    assert row.plan is not None and row.plan.num_devices == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (dict(num_devices=[12]), WhatIfInputError, "num_devices 12 is not whole nodes of"),
        (dict(num_devices=[0]), WhatIfInputError, "must be whole numbers >= 1"),
        (dict(num_devices=[]), WhatIfInputError, "num_devices is empty"),
        (dict(tokens=-1.0), WhatIfInputError, "tokens = -1.0 must be a finite positive number"),
        (dict(tokens=math.nan), WhatIfInputError, "must be a finite positive number"),
        (dict(tokens="lots"), WhatIfInputError, "is not a number"),
        (dict(tokens=1e9, price_per_device_hour=0), WhatIfInputError, "price_per_device_hour"),
        (dict(price_per_device_hour=2.0), WhatIfInputError, "needs tokens"),
        (dict(cluster_overrides={"nodes": 4}), WhatIfInputError, "node count comes from"),
        (dict(cluster_overrides={"bandwidth": 1}), ClusterError, "unknown cluster override"),
        (dict(tpp=2), InputError, "unknown search constraint 'tpp'"),
        (dict(global_batch=0), WhatIfInputError, "global_batch = 0"),
    ],
)
def test_bad_requests_fail_before_any_search(
    profile: ModelProfile, kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    args: dict[str, Any] = dict(num_devices=[8], global_batch=16) | kwargs
    with pytest.raises(error, match=None) as raised:
        whatif(profile, "dgx-a100-80g", **args)
    assert fragment in str(raised.value)


def test_cluster_types_are_checked() -> None:
    with pytest.raises(ClusterError, match="unknown cluster preset 'dgx-z100'"):
        cluster_type("dgx-z100")
    with pytest.raises(WhatIfInputError, match="sets the node count"):
        cluster_type("dgx-a100-80g:nodes=4")
    with pytest.raises(WhatIfInputError, match="is given twice"):
        whatif(object(), ["dgx-a100-80g", "dgx-a100-80g"], num_devices=[8], global_batch=8)
    assert split_cluster_specs("dgx-a100-80g,dgx-h100-80g:memory=40GiB,inter_node_latency=5us") == [
        "dgx-a100-80g",
        "dgx-h100-80g:memory=40GiB,inter_node_latency=5us",
    ]


def test_parse_positive_reads_suffixes() -> None:
    assert parse_positive("300e9", "tokens", example="300e9") == 300e9
    assert parse_positive("300B", "tokens", example="300e9") == 300e9
    assert parse_positive("1.4T", "tokens", example="300e9") == pytest.approx(1.4e12)
    assert parse_positive("$2.5", "price", example="2.5") == 2.5
    with pytest.raises(WhatIfInputError):
        parse_positive(True, "tokens", example="300e9")


def test_infeasible_reason_keeps_the_numbers() -> None:
    error = NoFeasiblePlanError(
        "no plan for 'm' fits 'c': ...; use more devices",
        least_memory_bytes=97.3 * 2**30,
        capacity_bytes=80.0 * 2**30,
    )
    assert infeasible_reason(error) == "does not fit: needs 97.3 GiB per device of 80.0 GiB"
    # other planner errors: their first clause
    assert infeasible_reason(InputError("tp=16 does not divide; fix it")) == "tp=16 does not divide"


def test_figure_has_a_line_per_cluster_type(sweep: WhatIfResult, tmp_path: Path) -> None:
    figure = whatif_figure(sweep)
    throughput, efficiency = figure.axes
    assert throughput.get_xlabel() == "number of devices"
    assert throughput.get_ylabel() == "throughput (tokens/s)"
    assert efficiency.get_ylabel() == "scaling efficiency (%)"
    # one legend for both axes: each line, its shaded 80% range, and the 100% reference
    (legend,) = figure.legends
    ranges = [f"{c}: 80% range" for c in sweep.clusters]
    assert sorted(t.get_text() for t in legend.get_texts()) == sorted(
        [*sweep.clusters, *ranges, "100%: linear scaling"]
    )
    reference = efficiency.get_lines()[-1]
    assert np.asarray(reference.get_ydata()).tolist() == [100.0, 100.0]
    for ax in (throughput, efficiency):
        for line, label in zip(ax.get_lines(), sweep.clusters, strict=False):
            # sizes without a plan are left out of the line
            assert np.asarray(line.get_xdata()).tolist() == [
                r.num_devices for r in sweep.rows_of(label) if r.fits
            ]
    _assert_clear_of_the_data(figure)
    a100 = sweep.rows_of("dgx-a100-80g")
    assert np.asarray(throughput.get_lines()[0].get_ydata()).tolist() == [
        r.tokens_per_s for r in a100 if r.fits
    ]
    assert np.asarray(efficiency.get_lines()[0].get_ydata()).tolist() == pytest.approx(
        [100 * (r.scaling_efficiency or 0) for r in a100 if r.fits]
    )
    # the A100 band spans the throughput at the ends of each size's step range
    band = throughput.collections[0].get_paths()[0].vertices
    ranged = [r.tokens_per_s_range for r in a100 if r.fits and r.tokens_per_s_range]
    assert ranged
    assert band[:, 1].min() == pytest.approx(min(low for low, _ in ranged))
    assert band[:, 1].max() == pytest.approx(max(high for _, high in ranged))
    out = save_figure(figure, tmp_path / "whatif.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE and out.stat().st_size > 10_000


def _assert_clear_of_the_data(figure: Figure) -> None:
    """The legend overlaps neither axes (so no point or line), and every point and note lies
    inside its axes, at least a marker's radius from the frame."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    (legend,) = figure.legends
    box = legend.get_window_extent(renderer)
    for ax in figure.axes:
        frame = ax.get_window_extent(renderer)
        assert not box.overlaps(frame)
        for line in ax.get_lines():
            if not line.get_marker() or line.get_marker() == "None":
                continue  # the reference line spans the axes
            margin = line.get_markersize() / 2 * figure.dpi / 72  # points to pixels
            for x, y in ax.transData.transform(line.get_xydata()):
                assert frame.x0 + margin <= x <= frame.x1 - margin
                assert frame.y0 + margin <= y <= frame.y1 - margin
        for text in ax.texts:
            extent = text.get_window_extent(renderer)
            assert frame.x0 <= extent.x0 and extent.x1 <= frame.x1, text.get_text()
            assert frame.y0 <= extent.y0 and extent.y1 <= frame.y1, text.get_text()


# ------------------------------------------------------------------------------ command line


def test_cli_json_table_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "whatif.png"
    result = run_cli(
        "whatif",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100-80g,dgx-h100-80g",
        "--num-devices",
        "1,2,8",
        "--global-batch",
        "16",
        "--tokens",
        "2e9",
        "--price-per-device-hour",
        "2.5",
        "--set",
        "memory=4GiB",
        "--set",
        "host_link_bandwidth=0",
        "--plot",
        str(plot),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["clusters"] == ["dgx-a100-80g", "dgx-h100-80g"]
    assert data["cluster_overrides"] == SMALL_MEMORY
    assert data["tokens"] == 2e9 and data["price_per_device_hour"] == 2.5
    assert data["plot"] == str(plot)
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
    rows = data["rows"]
    assert [(r["cluster"], r["num_devices"]) for r in rows] == [
        (c, n) for c in data["clusters"] for n in (1, 2, 8)
    ]
    for row in rows:
        if row["num_devices"] == 1:  # the size without a plan says why and has no numbers
            assert not row["fits"] and row["plan"] is None and row["step_time_s"] is None
            assert row["reason"].startswith("does not fit: needs ")
            continue
        assert row["fits"] and row["reason"] is None
        assert row["optimality_gap"] == 0.0  # small problems: the solver proves its plans
        assert (
            row["plan"]["dp_degree"] * row["plan"]["tp_degree"] * row["plan"]["pp_degree"]
            == (row["num_devices"])
        )
        seconds = 2e9 / row["tokens_per_s"]
        assert row["training"]["days"] == pytest.approx(seconds / 86400)
        assert row["training"]["cost"] == pytest.approx(row["num_devices"] * seconds / 3600 * 2.5)
        assert row["peak_memory_bytes"] <= row["memory_capacity_bytes"] == 4 * 2**30
    assert [r["scaling_efficiency"] for r in rows if r["num_devices"] == 2] == [1.0, 1.0]


def test_cli_table_shows_rows_for_sizes_without_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process (the console-script runs above and below cover the entry point): the table.
    # (progress lines from the start: these searches take less than the CPU seconds before one)
    monkeypatch.setattr(progress_module, "FIRST_LINE_S", 0.0)
    result = CliRunner().invoke(
        cli,
        [
            "whatif",
            "--model",
            MODEL,
            "--cluster",
            "dgx-a100-80g:memory=4GiB,host_link_bandwidth=0",
            "--num-devices",
            "1,2",
            "--global-batch",
            "16",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "best plan per size" in result.output
    assert "no plan: does not fit: needs" in result.output
    assert "2 searches in" in result.output
    # not a terminal: no live bar, so a line a search, on stderr
    assert "what-if: 1/2 searches done" in result.stderr
    assert "what-if: 2/2 searches done" in result.stderr and "what-if:" not in result.stdout


def test_cli_no_plan_at_any_size_is_an_input_error() -> None:
    result = CliRunner().invoke(
        cli,
        [
            "whatif",
            "--model",
            MODEL,
            "--cluster",
            "dgx-a100-80g:memory=2.1GiB",
            "--num-devices",
            "1,2",
            "--global-batch",
            "16",
        ],
    )
    assert isinstance(result.exception, WhatIfInputError)
    assert "fits any of the sizes: dgx-a100-80g:memory=2.1GiB x 1: does not fit: needs" in str(
        result.exception
    )
    assert str(result.exception).endswith(
        "; try more devices, devices with more memory or a smaller global batch"
    )


def test_cli_no_plan_for_a_stacks_refusal_names_that_fix_not_memory() -> None:
    """DeepSpeed's pipeline engine has no tensor parallelism: the sizes fail on the
    constraints, not on memory, and the fix says so."""
    result = CliRunner().invoke(
        cli,
        [
            "whatif",
            "--model",
            MODEL,
            "--cluster",
            "dgx-a100-80g",
            "--num-devices",
            "8",
            "--global-batch",
            "16",
            "--framework",
            "deepspeed",
            "--tp",
            "2",
            "--pp",
            "2",
        ],
    )
    assert isinstance(result.exception, WhatIfInputError)
    message = str(result.exception)
    assert "deepspeed runs none of the plans the constraints allow" in message
    assert message.endswith("; change what the reasons name, or price another --framework")
    assert "more memory" not in message


def test_a_plan_or_a_what_if_beyond_the_largest_cluster_names_its_own_input(
    profile: ModelProfile,
) -> None:
    """10^7 devices: the error names the plan's degrees or the what-if's device count (not a
    cluster override the user never wrote)."""
    with pytest.raises(WhatIfInputError, match=r"num_devices 10,000,000: more than the 1,048,576"):
        whatif(profile, ["dgx-a100-80g"], num_devices=[10_000_000], global_batch=16)
    with pytest.raises(PlanError, match=r"= 10,000,000 x 1 x 1 x 1 = 10,000,000 devices is more"):
        Plan(
            dp_degree=10_000_000,
            tp_degree=1,
            pp_degree=1,
            stages=(StagePlan(first_unit=0, last_unit=0),),
            micro_batch_size=1,
            num_micro_batches=1,
            global_batch_size=10_000_000,
            schedule="1f1b",
        )


def _one_line_error(result: Any, fragment: str) -> None:
    assert result.returncode == 2, result.stdout
    # progress lines (stdout is not a terminal here) may come before the error's one line
    lines = [
        line
        for line in result.stderr.strip().splitlines()
        if not re.fullmatch(r"what-if: (\d+/\d+ searches done|.* \(\d+ s\))", line)
    ]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("autoplan: error: ") and fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--num-devices", "12,20"], "num_devices 12, 20 are not whole nodes of 'dgx-a100-80g'"),
        (["--num-devices", "8,x"], "'x' is not a whole number"),
        (
            ["--num-devices", "8", "--tokens", "-3"],
            "--tokens = '-3' must be a finite positive number",
        ),
        (
            ["--num-devices", "8", "--tokens", "1e9", "--price-per-device-hour", "free"],
            "not a number",
        ),
        (["--num-devices", "8", "--cluster", "dgx-z100"], "unknown cluster preset 'dgx-z100'"),
        (
            ["--num-devices", "8", "--tokens", "1e9", "--price", "dgx-h100-80g=2"],
            "--price names 'dgx-h100-80g', which is not in --cluster",
        ),
        (["--num-devices", "8", "--tokens", "1e9", "--price", "2.5"], "must be TYPE=PRICE"),
        (
            ["--num-devices", "8", "--tokens", "1e9", "--price", "dgx-a100-80g=0"],
            "must be a finite positive number",
        ),
        (["--num-devices", "8", "--price", "dgx-a100-80g=2"], "prices need tokens"),
        (["--num-devices", "8", "--set", "nodes=2"], "the node count comes from num_devices"),
        (["--num-devices", "8", "--plot", "whatif.txt"], "use a file ending in .png"),
    ],
)
def test_cli_bad_input_is_one_line(extra: list[str], fragment: str) -> None:
    args = ["whatif", "--model", MODEL, "--global-batch", "16", *extra]
    if "--cluster" not in extra:
        args += ["--cluster", "dgx-a100-80g"]
    _one_line_error(run_cli(*args), fragment)


def test_superlinear_scaling_shows_only_against_a_proven_baseline(sweep: WhatIfResult) -> None:
    """Above 100% only when the baseline's plan is proven within 1% (else its unproven gap may
    be what the extra devices "gain"): then the note names the shapes."""
    import dataclasses

    from autoplan.cli.whatif_cmd import _efficiency_cell, plan_label, scaling_note

    label = sweep.clusters[0]
    rows = [r for r in sweep.rows_of(label) if r.fits]
    base, faster = rows[0], rows[-1]

    def with_gap(gap: float) -> WhatIfResult:
        changed = {
            id(base): dataclasses.replace(base, optimality_gap=gap),
            id(faster): dataclasses.replace(faster, scaling_efficiency=1.2),
        }
        return dataclasses.replace(
            sweep, rows=tuple(changed.get(id(row), row) for row in sweep.rows)
        )

    unproven = with_gap(0.05)
    row = next(r for r in unproven.rows if r.scaling_efficiency == 1.2)
    assert unproven.shown_efficiency(row) is None
    assert _efficiency_cell(unproven, row) == ">100%?"
    assert "not proven within 1% (gap 5.0%)" in scaling_note(unproven)
    proven = with_gap(0.0)
    row = next(r for r in proven.rows if r.scaling_efficiency == 1.2)
    assert proven.shown_efficiency(row) == 1.2
    assert _efficiency_cell(proven, row) == "120%"
    note = scaling_note(proven)
    assert row.plan is not None and base.plan is not None
    assert f"120%, its plan ({plan_label(row.plan)}) beside" in note
    assert f"({plan_label(base.plan)}): more memory" in note and "buys a faster shape" in note


def test_each_cluster_type_is_priced_at_its_own_price(
    profile: ModelProfile, tmp_path: Path
) -> None:
    """Per-type prices (issue 42): a type priced by name, one priced by its cluster file, one
    at the price for all; each row's cost is its device-hours at its type's price."""
    filed = tmp_path / "h100.yaml"
    Cluster.preset("dgx-h100-80g").with_overrides(price_per_device_hour=4.0).to_yaml(filed)
    result = whatif(
        profile,
        ["dgx-a100-80g", str(filed)],
        num_devices=[8],
        global_batch=16,
        tokens=2e9,
        prices={"dgx-a100-80g": 1.5},
        budget_s=0.5,
        workers=1,
    )
    assert dict(result.prices) == {"dgx-a100-80g": 1.5, str(filed): 4.0}
    for row, price in zip(result.rows, (1.5, 4.0), strict=True):
        assert row.training is not None and row.training.cost is not None
        assert row.training.price_per_device_hour == price
        assert row.training.cost == pytest.approx(row.training.device_hours * price)
        per_million = row.training.cost_per_million_tokens
        assert per_million == pytest.approx(row.training.cost / 2e9 * 1e6)
    # the price for all types prices what no name or file does; names win over it
    both = whatif(
        profile,
        ["dgx-a100-80g", "dgx-h100-80g"],
        num_devices=[8],
        global_batch=16,
        tokens=2e9,
        price_per_device_hour=2.0,
        prices={"dgx-h100-80g": 3.0},
        budget_s=0.5,
        workers=1,
    )
    assert dict(both.prices) == {"dgx-a100-80g": 2.0, "dgx-h100-80g": 3.0}
    with pytest.raises(WhatIfInputError, match="price for 'dgx-b200', which is not a cluster"):
        whatif(profile, ["dgx-a100-80g"], num_devices=[8], global_batch=16, tokens=1e9,
               prices={"dgx-b200": 1.0})  # fmt: skip


def test_cli_prices_per_type_in_the_cost_table() -> None:
    result = run_cli(
        "whatif",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100-80g,dgx-h100-80g",
        "--num-devices",
        "8",
        "--global-batch",
        "16",
        "--tokens",
        "2e9",
        "--price",
        "dgx-a100-80g=1.5,dgx-h100-80g=4",
        "--budget",
        "0.5",
    )
    assert result.returncode == 0, result.stderr
    assert "priced per type in USD" in result.stdout
    header = next(line for line in result.stdout.splitlines() if "per 1M tokens" in line)
    assert "price" in header and "cost" in header
    assert "price and cost: USD per device-hour and USD" in " ".join(result.stdout.split())
    rows = [line for line in result.stdout.splitlines() if line.startswith("dgx-")]
    assert [row.split()[4] for row in rows[-2:]] == ["1.5", "4"]
