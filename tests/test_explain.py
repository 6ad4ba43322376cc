"""`autoplan.explain`, the pipeline-schedule simulation behind `--timeline`, its picture, and
`autoplan explain` through the real console script."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from autoplan.analysis.explain import explain
from autoplan.analysis.plots import (
    KIND_COLOURS,
    KIND_LABELS,
    MIN_BAR_PX,
    bar_width_px,
    save_figure,
    time_shares,
    timeline_figure,
    timeline_view,
)
from autoplan.analysis.timeline import EVENT_KINDS, Timeline, simulate_timeline, timeline_of
from autoplan.api import manual_plan
from autoplan.cli.common import trace_spec
from autoplan.contract.plan import Plan, PlanEstimate
from autoplan.planner.search import search_plans
from cost_model.hardware import Cluster, load_cluster
from cost_model.headroom import DEFAULT_MEMORY_HEADROOM
from cost_model.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    ScheduleSpec,
    StageTimes,
    pipeline_order,
)
from cost_model.uncertainty import memory_upper_factor
from cost_model.workload import ModelProfile
from tests.conftest import run_cli

MODEL = "gpt:num_layers=8,hidden_size=1024,num_heads=16,seq_len=256,vocab_size=8192"
# Devices whose predicted peak may take 2400 MiB (the default 10% memory headroom and the peak's
# range taken off; 2 GiB reserved by the preset's calibration): the ~110M-parameter model does
# not fit pure data parallelism on 8 devices, but fits with tensor parallelism. No host link:
# pure data parallelism would fit with its optimizer on the host (autoplan's runtime offloads
# it, passes/optimizer_offload.py), which is not what these tests are about.
TIGHT_BYTES = int(2400 * 2**20 * memory_upper_factor() / (1 - DEFAULT_MEMORY_HEADROOM)) + 1
TIGHT = f"dgx-a100-80g:memory={TIGHT_BYTES},host_link_bandwidth=0"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def profile() -> ModelProfile:
    result: ModelProfile = trace_spec(MODEL).profile
    return result


# ------------------------------------------------------------------------------ schedule orders


def _leading_forwards(actions: tuple[Action, ...]) -> int:
    return next((i for i, a in enumerate(actions) if a.kind != "F"), len(actions))


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"),
    [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("1f1b", 4, 4, 1), ("interleaved-1f1b", 4, 8, 3)],
)
def test_orders_run_every_action_once_with_the_warmup_counts(
    schedule: str, p: int, m: int, v: int
) -> None:
    spec = ScheduleSpec(schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=m)
    orders = pipeline_order(spec)
    everything = sorted((a.stage_idx, a.kind, a.microbatch_idx) for o in orders for a in o)
    expected = sorted((s, k, i) for s in range(p * v) for k in "FB" for i in range(m))
    assert everything == expected
    for r, actions in enumerate(orders):
        assert {a.stage_idx % p for a in actions} == {r}  # stage s runs on rank s % p
        if schedule == "gpipe":
            warmup = m - 1  # all forwards first
        elif schedule == "1f1b":
            warmup = min(p - r - 1, m)  # Narayanan et al. 2021, section 2.2.1
        else:
            warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)  # Megatron-LM interleaving
        # warm-up forwards, then the first steady forward, before the first backward
        assert _leading_forwards(actions) == min(warmup + 1, m * v)
    assert orders[0][0] == Action(0, "F", 0)


def _times(spec: ScheduleSpec, f: float, b: float, link: float = 0.0) -> list[StageTimes]:
    return [
        StageTimes(
            forward_s=f,
            backward_s=b,
            weight_s=b / 2 if spec.splits_backward else 0.0,
            transfer_s=link if spec.stage_rank(s) != spec.stage_rank(s + 1) else 0.0,
        )
        if s < spec.num_stages - 1
        else StageTimes(forward_s=f, backward_s=b, weight_s=b / 2 if spec.splits_backward else 0)
        for s in range(spec.num_stages)
    ]


# Uniform stages without links: the simulation reproduces the textbook pipelines exactly.
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_uniform_stages_reproduce_the_textbook_pipeline(schedule: str) -> None:
    checked = 0
    for p, m, v, backward_s in itertools.product((1, 2, 4, 8), (8, 16, 32), (1, 2, 3), (1.0, 2.0)):
        try:
            spec = ScheduleSpec(
                schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=m
            )
        except ScheduleError:
            continue
        if m % p:
            continue  # the textbook form assumes whole rounds
        timeline = simulate_timeline(spec, _times(spec, 1.0, backward_s))
        rank_time = v * (1.0 + backward_s)
        expected = (m + (p - 1) / v) * rank_time  # Narayanan et al. 2021, section 2.2.2
        assert timeline.pipeline_time_s == pytest.approx(expected, rel=1e-9), (p, m, v)
        checked += 1
    assert checked >= 24


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"),
    [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 32, 1), ("interleaved-1f1b", 4, 16, 2)],
)
def test_links_delay_the_peer_within_monotone_bounds(schedule: str, p: int, m: int, v: int) -> None:
    # Start times under fixed per-rank orders are max-plus expressions of the durations and
    # link delays, hence monotone in them: with a link delay c the pipeline lies between the
    # same schedule without it and with c added to every action (both uniform, textbook).
    f, b, c = 1.0, 2.0, 0.25
    spec = ScheduleSpec(schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=m)
    timeline = simulate_timeline(spec, _times(spec, f, b, link=c))
    x0 = (m + (p - 1) / v) * v * (f + b)
    x1 = (m + (p - 1) / v) * v * (f + b + 2 * c)
    assert x0 < timeline.pipeline_time_s <= x1


def _check_invariants(timeline: Timeline, spec: ScheduleSpec, stages: list[StageTimes]) -> None:
    p, m = timeline.pp_degree, timeline.num_micro_batches
    ends: dict[tuple[int, str, int], float] = {}
    starts: dict[tuple[int, str, int], float] = {}
    for r in range(p):
        events = timeline.rank_events(r)
        # the rank's spans tile [0, step end] without overlap
        assert events[0].start_s == 0.0
        assert events[-1].end_s == pytest.approx(timeline.step_time_s)
        for a, b in itertools.pairwise(events):
            assert b.start_s == pytest.approx(a.end_s, abs=1e-9)
        busy = sum(e.duration_s for e in events if e.kind in ("forward", "backward", "weight"))
        own = spec.rank_stages(r)
        assert busy == pytest.approx(
            m * sum(stages[s].forward_s + stages[s].backward_s for s in own), rel=1e-9
        )
        for e in events:
            if e.kind in ("forward", "backward"):
                assert e.stage_idx is not None and e.microbatch_idx is not None
                key = (e.stage_idx, e.kind, e.microbatch_idx)
                starts[key] = e.start_s
                ends[key] = e.end_s
    num_stages = len(stages)
    for (s, kind, i), start in starts.items():
        # dependencies: forwards flow down the stages, backwards up, each after its link
        if kind == "forward" and s > 0:
            assert start >= ends[(s - 1, "forward", i)] + stages[s - 1].transfer_s - 1e-9
        if kind == "backward":
            if s < num_stages - 1:
                assert start >= ends[(s + 1, "backward", i)] + stages[s].transfer_s - 1e-9
            else:
                assert start >= ends[(s, "forward", i)] - 1e-9
    chain = sum(t.forward_s + t.backward_s for t in stages)
    assert timeline.pipeline_time_s >= max(chain, max(timeline.rank_busy_s)) - 1e-9
    # every message between ranks leaves when its producer ends, takes the boundary's link
    # time, and arrives before its consumer starts; one per crossing, micro-batch and direction
    crossings = [s for s in range(num_stages - 1) if spec.stage_rank(s) != spec.stage_rank(s + 1)]
    assert len(timeline.sends) == 2 * m * len(crossings)
    for send in timeline.sends:
        s, i = send.stage_idx, send.microbatch_idx
        step = 1 if send.kind == "activation" else -1
        kind = "forward" if send.kind == "activation" else "backward"
        boundary = s if step == 1 else s - 1
        assert boundary in crossings
        assert (send.src_rank, send.dst_rank) == (spec.stage_rank(s), spec.stage_rank(s + step))
        assert send.start_s == pytest.approx(ends[(s, kind, i)], abs=1e-9)
        assert send.duration_s == pytest.approx(stages[boundary].transfer_s, abs=1e-9)
        assert starts[(s + step, kind, i)] >= send.end_s - 1e-9


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(SCHEDULES),
    p=st.integers(1, 4),
    rounds=st.integers(1, 3),
    v=st.integers(2, 3),
    times=st.lists(
        st.tuples(st.floats(0.1, 3.0), st.floats(0.1, 3.0), st.floats(0, 0.5)),
        min_size=12,
        max_size=12,
    ),
)
def test_any_stage_times_respect_dependencies_and_ranks(
    schedule: str, p: int, rounds: int, v: int, times: list[tuple[float, float, float]]
) -> None:
    m = 2 * p * rounds
    try:
        spec = ScheduleSpec(schedule=schedule, pp_degree=p, virtual_stages=v, num_micro_batches=m)
    except ScheduleError:
        spec = ScheduleSpec(schedule="1f1b", pp_degree=p, virtual_stages=1, num_micro_batches=m)
    stages = [
        StageTimes(
            forward_s=f,
            backward_s=b,
            weight_s=b / 3 if spec.splits_backward else 0.0,
            transfer_s=c
            if s < spec.num_stages - 1 and spec.stage_rank(s) != spec.stage_rank(s + 1)
            else 0.0,
        )
        for s, (f, b, c) in enumerate(times[: spec.num_stages])
    ]
    tails = [0.1 * r for r in range(p)]
    timeline = simulate_timeline(spec, stages, tails)
    _check_invariants(timeline, spec, stages)
    ends = [
        max(e.end_s for e in timeline.rank_events(r) if e.kind != "idle" and e.kind != "tail")
        for r in range(p)
    ]
    assert timeline.step_time_s == pytest.approx(
        max(e + t for e, t in zip(ends, tails, strict=True))
    )


def test_timeline_of_an_estimate_and_its_picture(profile: ModelProfile, tmp_path: Path) -> None:
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    plan = manual_plan(
        profile,
        cluster,
        tp=2,
        pp=4,
        micro_batch=1,
        global_batch=16,
        schedule="interleaved-1f1b",
        virtual_stages=2,
    )
    result = explain(plan, profile, cluster, alternatives=False).estimate
    timeline = timeline_of(result, plan)
    # one schedule model: the picture's step is the estimate's
    assert timeline.pipeline_time_s == pytest.approx(result.pipeline_time_s, rel=1e-12)
    assert timeline.step_time_s == pytest.approx(result.step_time_s, rel=1e-12)
    for rank in result.ranks:
        assert m_busy(timeline, rank.pp_rank) == pytest.approx(rank.busy_s, rel=1e-9)
        assert timeline.time_of(rank.pp_rank, "tail") == pytest.approx(rank.tail_s, rel=1e-9)

    figure = timeline_figure(timeline)
    assert bar_width_px(timeline) >= MIN_BAR_PX  # wide bars: one axes, a bar per action
    (ax,) = figure.axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == plan.pp_degree  # one row per pipeline rank
    assert sorted(labels) == [f"pp rank {r}" for r in range(plan.pp_degree)]
    assert ax.get_xlabel() == "time within one training step (ms)"
    texts = _legend_texts(figure)
    assert texts[:4] == [KIND_LABELS[k] for k in ("forward", "backward", "tail", "idle")]
    assert len(set(KIND_COLOURS.values())) == len(KIND_COLOURS)  # distinct colours
    # the sends: one arrow per message (a stub for the ring's wrap), named in the legend
    assert timeline.sends
    assert _arrows(ax) == len(timeline.sends)
    assert texts[4].startswith("send: activation to the next stage's rank (link ")
    assert texts[5].startswith("send: gradient to the previous stage's rank (link ")
    for r in range(plan.pp_degree):
        # every gap is idle: a rank's bars tile the step, and no bar is edged in white
        _assert_tiles(ax, r, (0.0, timeline.step_time_s * 1e3))
    _assert_legend_below(figure)
    out = save_figure(figure, tmp_path / "timeline.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE and out.stat().st_size > 10_000


def test_a_long_step_is_drawn_as_shares_and_a_zoom() -> None:
    """Bars narrower than `MIN_BAR_PX` (192 actions a rank): an overview of each rank's time shares per bin, whose
    layers fill every row (only idle is a gap), and a zoom on the rank that ends the step
    between its peers, with their sends."""
    p = 4
    spec = ScheduleSpec(
        schedule="interleaved-1f1b", pp_degree=p, virtual_stages=2, num_micro_batches=48
    )
    timeline = simulate_timeline(spec, _times(spec, 1.0, 2.0, link=0.05), [0.0, 0.0, 9.0, 0.0])
    assert bar_width_px(timeline) < MIN_BAR_PX
    figure = timeline_figure(timeline)
    overview, zoom = figure.axes
    # the overview: every rank; in every bin the kinds' shares sum to the whole bin
    assert [t.get_text() for t in overview.get_yticklabels()] == [
        f"pp rank {r}" for r in reversed(range(p))
    ]
    edges = np.linspace(0.0, timeline.step_time_s, 41)
    assert np.allclose(time_shares(timeline, edges).sum(axis=1), 1.0)
    for r in range(p):
        layers = [c for c in overview.collections if c.get_label().startswith(f"pp rank {r}: ")]
        kinds = [k for k in EVENT_KINDS if timeline.time_of(r, k) > 0]
        assert [c.get_label().split(": ")[1] for c in layers] == kinds
        # drawn: at every bin edge the top layer reaches the row's top
        top: dict[float, float] = {}
        for x, y in layers[-1].get_paths()[0].vertices:
            top[x] = max(top.get(x, -np.inf), y)
        assert len(top) > 100
        assert all(y == pytest.approx(p - 1 - r + 0.4) for y in top.values())
    # the zoom: rank 2 (its tail ends the step last) between the ranks it exchanges with, over a
    # window where the bars are wide, tiled by its events
    assert [t.get_text() for t in zoom.get_yticklabels()] == [
        "pp rank 3",
        "pp rank 2",
        "pp rank 1",
    ]
    low, high = zoom.get_xlim()
    view = timeline_view(timeline)
    assert view.aggregated and view.zoom_rank == 2 and view.zoom_rows == (1, 2, 3)  # top to bottom
    assert view.window_s == pytest.approx((low, high))
    assert bar_width_px(timeline) * timeline.step_time_s / (high - low) >= MIN_BAR_PX * 3
    _assert_tiles(zoom, 2, (low, high))
    in_window = [
        s for s in timeline.sends if low <= s.start_s < high and 2 in (s.src_rank, s.dst_rank)
    ]
    assert in_window and _arrows(zoom) == len(in_window)
    texts = _legend_texts(figure)
    assert any(t.startswith("send: activation") for t in texts)
    assert any(t.startswith("send: gradient") for t in texts)
    assert "zoom window" in texts
    _assert_legend_below(figure)


def _legend_texts(figure: Figure) -> list[str]:
    (legend,) = figure.legends
    return [t.get_text() for t in legend.get_texts()]


def _arrows(ax: Axes) -> int:
    """The sends drawn: one segment each in the axes' line collections."""
    return sum(len(c.get_segments()) for c in ax.collections if isinstance(c, LineCollection))


def _assert_tiles(ax: Axes, rank: int, window: tuple[float, float]) -> None:
    """``rank``'s bars cover ``window`` without a gap, in the colours of their kinds, and no
    bar has a white edge (a white line between two bars reads as idle time)."""
    spans: list[tuple[float, float]] = []
    for c in ax.collections:
        label = c.get_label()
        if not label.startswith(f"pp rank {rank}: "):
            continue
        kind = label.split(": ")[1]
        assert to_hex(c.get_facecolor()[0]) == KIND_COLOURS[kind].lower()
        assert all(to_hex(e) != "#ffffff" for e in c.get_edgecolor())
        for path in c.get_paths():
            xs = path.vertices[:, 0]
            spans.append((float(xs.min()), float(xs.max())))
    spans.sort()
    tolerance = 1e-9 * (window[1] - window[0])
    assert spans[0][0] <= window[0] + tolerance and spans[-1][1] >= window[1] - tolerance
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start <= end + tolerance


def _assert_legend_below(figure: Figure) -> None:
    """The legend lies below every axes, without an empty band between them."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    (legend,) = figure.legends
    box = legend.get_window_extent(renderer)
    lowest = min(ax.get_tightbbox(renderer).y0 for ax in figure.axes)  # type: ignore[union-attr]
    for ax in figure.axes:
        assert not box.overlaps(ax.get_window_extent(renderer))
    assert 0 <= lowest - box.y1 < 0.25 * figure.dpi  # under a quarter inch


def m_busy(timeline: Timeline, rank: int) -> float:
    return sum(timeline.time_of(rank, kind) for kind in ("forward", "backward", "weight"))


# ------------------------------------------------------------------------------ explanation


def test_the_critical_path_names_the_hosts_share(profile: ModelProfile) -> None:
    """A stack whose host work bounds its tensor-parallel blocks (nanotron on a GPU,
    `Calibration.tp_block_host_floor_s`), and a CPU worker's wrapper time: the critical path
    shows it as the host's, not as exposed ZeRO-3 gathers (which these plans have none of)."""
    gpu = Cluster.preset("dgx-h100-80g")
    plan = manual_plan(profile, gpu, tp=2, micro_batch=1, global_batch=16, framework="nanotron")
    path = explain(plan, profile, gpu, alternatives=False).critical_path
    assert path.zero3_exposed_s == 0.0
    assert path.host_s > path.compute_s  # a small model: the host's floor is most of the step
    parts = path.compute_s + path.tp_comm_s + path.pp_comm_s + path.host_s
    assert parts == pytest.approx(path.busy_s, rel=1e-9)
    assert "host" in path.summary() and path.dominant == "the host"
    local = Cluster.preset("local", devices_per_node=2)
    plan = manual_plan(profile, local, tp=2, micro_batch=1, global_batch=4)
    path = explain(plan, profile, local, alternatives=False).critical_path
    assert path.zero3_exposed_s == 0.0 and path.host_s > 0  # tp_module_overhead_s, additive
    parts = path.compute_s + path.tp_comm_s + path.pp_comm_s + path.host_s
    assert parts == pytest.approx(path.busy_s, rel=1e-9)


def test_explain_the_searched_plan_on_a_tight_cluster(profile: ModelProfile) -> None:
    cluster = load_cluster(TIGHT)
    best = search_plans(profile, cluster, global_batch=16, budget_s=None).plans[0]
    result = explain(best, profile, cluster, top_k=2)
    path = result.critical_path
    assert path.busy_s + path.bubble_s + path.tail_s == pytest.approx(path.step_time_s, rel=1e-9)
    assert path.step_time_s == pytest.approx(result.estimate.step_time_s)
    slowest = max(result.estimate.ranks, key=lambda r: r.time_per_microbatch_s)
    assert path.bottleneck_rank == slowest.pp_rank
    assert path.compute_s + path.tp_comm_s + path.pp_comm_s + path.zero3_exposed_s == (
        pytest.approx(path.busy_s, rel=1e-9)
    )
    assert "this plan is the search's rank 1" in " ".join(result.notes)
    assert all(m.fits and m.total_bytes <= m.capacity_bytes for m in result.memory)

    by_name = {a.name.split(",")[0]: a for a in result.alternatives}
    assert set(by_name) == {
        "search rank 2",
        "search rank 3",
        "pure DP",
        "pure TP within a node",
        "Megatron-style t=8",
    }
    pure_dp = by_name["pure DP"]
    assert pure_dp.plan is None and pure_dp.reason is not None
    assert pure_dp.line == (
        "why not pure DP (tp=1 pp=1 dp=8)? does not fit: needs 2.4 GiB per device, over the "
        f"2.3 GiB its headroom leaves of {TIGHT_BYTES / 2**30:.1f} GiB"
    )
    for alternative in result.alternatives:
        if alternative.plan is None:
            continue
        assert alternative.plan.estimate is not None
        expected = alternative.plan.estimate.step_time_s / result.estimate.step_time_s - 1
        assert alternative.relative is not None
        assert alternative.relative == pytest.approx(expected)
        assert alternative.relative >= -1e-9  # nothing beats the search's best
        if alternative.name.startswith("search rank"):
            assert alternative.line.startswith(f"why not {alternative.name} (tp=")
    megatron = by_name["Megatron-style t=8"]
    assert megatron.plan is not None and megatron.plan.tp_degree == 8
    assert megatron.name == "Megatron-style t=8, smallest pp that fits"


def test_explain_a_plan_that_does_not_fit(profile: ModelProfile) -> None:
    cluster = load_cluster(TIGHT)
    plan = manual_plan(profile, cluster, tp=1, pp=1, micro_batch=2, global_batch=16)
    result = explain(plan, profile, cluster, top_k=1)
    assert not result.estimate.fits and not result.memory[0].fits
    assert result.notes[0].startswith("this plan does not fit: pp rank 0 (stages 0): ")
    found = [a for a in result.alternatives if a.plan is not None]
    assert found and all(not a.plan_fits for a in found)
    assert all(a.line.endswith("but it fits in memory and this plan does not") for a in found)


# ------------------------------------------------------------------------------ command line


def _write_plan(profile: ModelProfile, path: Path, **changes: object) -> Plan:
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    plan = manual_plan(
        profile,
        cluster,
        tp=2,
        pp=4,
        micro_batch=1,
        global_batch=16,
        schedule="interleaved-1f1b",
        virtual_stages=2,
    )
    plan = dataclasses.replace(plan, **changes)  # type: ignore[arg-type]
    plan.to_yaml(path)
    return plan


def test_cli_json_resolves_the_plan_files_model_and_cluster(
    profile: ModelProfile, tmp_path: Path
) -> None:
    plan_path = tmp_path / "plan.yaml"
    plan = _write_plan(profile, plan_path)
    picture = tmp_path / "timeline.png"
    result = run_cli("explain", str(plan_path), "--timeline", str(picture), "--top", "2", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["model"] == MODEL and data["cluster"] == "dgx-a100-80g"
    assert data["num_devices"] == 16
    resolved = " ".join(data["resolved"])
    assert "dgx-a100-80g with 16 devices (2 node(s) x 8)" in resolved
    assert "(estimate.cluster)" in resolved and "(model.name)" in resolved
    assert Plan.from_data(data["plan"]) == plan
    assert len(data["estimate"]["stages"]) == 8  # pp 4 x 2 chunks
    path = data["critical_path"]
    assert path["busy_s"] + path["bubble_s"] + path["tail_s"] == pytest.approx(path["step_time_s"])
    assert path["summary"].startswith(f"pipeline rank {path['bottleneck_rank']} bounds the step")
    assert [m["pp_rank"] for m in data["memory"]] == [0, 1, 2, 3]
    names = [a["name"].split(",")[0] for a in data["alternatives"]]
    assert names[:2] == ["search rank 1", "search rank 2"]
    assert names[2:] == ["pure DP", "pure TP within a node", "Megatron-style t=8"]
    for alternative in data["alternatives"]:
        assert alternative["line"].startswith("why not") or alternative["same_as_plan"]
        if alternative["step_time_s"] is not None:
            assert alternative["relative"] == pytest.approx(
                alternative["step_time_s"] / data["estimate"]["step_time_s"] - 1
            )
    timeline = data["timeline"]
    assert timeline["path"] == str(picture) and timeline["pp_degree"] == 4
    assert timeline["pipeline_time_s"] == pytest.approx(data["estimate"]["pipeline_time_s"])
    assert timeline["step_time_s"] == pytest.approx(data["estimate"]["step_time_s"])
    assert timeline["aggregated"] is False and timeline["zoom_rank"] is None  # 32 wide bars
    assert picture.read_bytes()[:8] == PNG_SIGNATURE


def _one_line_error(result: object, fragment: str) -> None:
    assert result.returncode == 2, result.stdout  # type: ignore[attr-defined]
    lines = result.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert fragment in lines[0], lines[0]


def test_cli_says_what_to_pass_when_the_plan_file_lacks_it(
    profile: ModelProfile, tmp_path: Path
) -> None:
    no_model = tmp_path / "no_model.yaml"
    _write_plan(profile, no_model, model=None)
    _one_line_error(run_cli("explain", str(no_model)), "has no model section; pass --model")

    no_estimate = tmp_path / "no_estimate.yaml"
    _write_plan(profile, no_estimate, estimate=None)
    _one_line_error(
        run_cli("explain", str(no_estimate)), "records no estimate.cluster; pass --cluster"
    )

    class_name = tmp_path / "class_name.yaml"
    plan = _write_plan(profile, class_name)
    assert plan.model is not None
    _write_plan(profile, class_name, model=dataclasses.replace(plan.model, name="GPT"))
    _one_line_error(run_cli("explain", str(class_name)), "model.name 'GPT' is not a --model spec")

    unknown = tmp_path / "unknown_cluster.yaml"
    assert plan.estimate is not None
    _write_plan(profile, unknown, estimate=dataclasses.replace(plan.estimate, cluster="my-cluster"))
    _one_line_error(
        run_cli("explain", str(unknown)), "cannot rebuild estimate.cluster 'my-cluster'"
    )

    _one_line_error(
        run_cli("explain", str(class_name), "--cluster", "dgx-a100-80g", "--model", MODEL),
        "devices, but cluster 'dgx-a100-80g' has 8",
    )


def test_plan_estimate_records_what_explain_reads() -> None:
    # explain rebuilds the cluster from these two fields of the plan file
    assert {f.name for f in dataclasses.fields(PlanEstimate)} >= {"cluster", "num_devices"}
