"""Pictures: a what-if's throughput and scaling, and one simulated step of a pipeline schedule.

Expects a `WhatIfResult` or a `Timeline`. Guarantees: each function returns a new matplotlib
``Figure`` built without pyplot (no global figure registry, no display backend needed; files are
written with the Agg renderer), so tests can inspect its axes, labels and series:

- `whatif_figure`: two axes, throughput (tokens/s) and scaling efficiency (%) against the
  number of devices, one line per cluster type on each (sizes without a plan are left out of the
  line and marked "no plan", or "not run" when the what-if's total budget ran out first, along
  the x axis), a dashed 100% line, labelled axes with units, and one legend below both axes;
  every point and note lies inside its axes, clear of the frame.
- `timeline_figure`: one row per pipeline rank, forward, backward, tail (DP sync and optimizer)
  and idle spans in distinct colours, idle the only colour between a rank's bars, pipeline sends
  as arrows between the rows, time on the x axis with its unit, one legend below (an entry per
  kind shown, sends with their link time). When a bar per action would be narrower than
  `MIN_BAR_PX`, an overview of each rank's share of time per kind in narrow bins over a zoom
  on the rank that ends the step and its peers, in a window where the bars are wide.

matplotlib is imported by this module only; the CLI imports it when a picture is asked for.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from autoplan.analysis.timeline import EVENT_KINDS, EventKind, SendKind, Timeline
from autoplan.analysis.whatif import WhatIfResult
from cost_model.files import atomic_output

__all__ = [
    "KIND_COLOURS",
    "KIND_LABELS",
    "MIN_BAR_PX",
    "SAVE_DPI",
    "SEND_COLOURS",
    "TimelineView",
    "bar_width_px",
    "save_figure",
    "time_shares",
    "timeline_figure",
    "timeline_view",
    "whatif_figure",
]

# Pictures are written at this resolution (`save_figure`'s default); the timeline judges
# its bars' widths in these pixels.
SAVE_DPI = 120

# Colour-blind-safe palette (Okabe and Ito 2008), one colour per kind of span.
KIND_COLOURS: dict[EventKind, str] = {
    "forward": "#0072B2",  # blue
    "backward": "#E69F00",  # orange
    "weight": "#CC79A7",  # purple
    "tail": "#009E73",  # green
    "idle": "#C4C4C4",  # grey: dark enough not to pass for the white background
}
KIND_LABELS: dict[EventKind, str] = {
    "forward": "forward (incl. TP collectives)",
    "backward": "backward (incl. recompute, TP; input half if split)",
    "weight": "backward-weight (zero-bubble)",
    "tail": "DP gradient sync + optimizer",
    "idle": "idle (bubble)",
}


def save_figure(figure: Figure, path: str | Path, *, dpi: int = SAVE_DPI, what: str = "") -> Path:
    """Write ``figure`` with the Agg renderer (PNG, or what the suffix names); return the path.

    Written atomically (`cost_model.files.atomic_output`): on a failure (disk full, ...) the
    old picture stays whole and `OutputFileError` names the path and the reason; ``what``
    names the file in that message (``"--plot"``)."""
    out = Path(path)
    FigureCanvasAgg(figure)  # attach a non-interactive canvas: no display, no pyplot state
    with atomic_output(out, what=what) as temporary:
        figure.savefig(temporary, dpi=dpi, format=out.suffix.lstrip(".").lower() or None)
    return out


def whatif_figure(result: WhatIfResult) -> Figure:
    """Throughput and scaling efficiency against devices, one line per cluster type; one legend
    below both axes (never over the data) and room above the highest point and its note."""
    figure = Figure(figsize=(12, 5.2), layout="constrained")
    throughput, efficiency = figure.subplots(1, 2)
    highest = 100.0
    unproven = False
    for index, label in enumerate(result.clusters):
        rows = result.rows_of(label)
        ok = [r for r in rows if r.tokens_per_s is not None and r.scaling_efficiency is not None]
        x = [r.num_devices for r in ok]
        # a shape and size per type: a point drawn over another's (both 100% at the smallest
        # size) leaves the one below visible
        marker = {"marker": _MARKERS[index % len(_MARKERS)], "markersize": max(3.0, 7.0 - index)}
        (line,) = throughput.plot(x, [r.tokens_per_s for r in ok], label=label, **marker)
        # the throughput at the ends of the step's 80% range
        ranged = [r for r in ok if r.tokens_per_s_range is not None]
        if ranged:
            throughput.fill_between(
                [r.num_devices for r in ranged],
                [r.tokens_per_s_range[0] for r in ranged],  # type: ignore[index]
                [r.tokens_per_s_range[1] for r in ranged],  # type: ignore[index]
                color=line.get_color(),
                alpha=0.2,
                linewidth=0,
                label=f"{label}: 80% range",
            )
        # above 100% only against a proven baseline (`WhatIfResult.shown_efficiency`)
        shown = [(r.num_devices, result.shown_efficiency(r)) for r in ok]
        percent = [100.0 * e for _, e in shown if e is not None]
        highest = max([highest, *percent])
        efficiency.plot(
            [n for n, e in shown if e is not None],
            percent,
            label=label,
            color=line.get_color(),
            **marker,
        )
        for r in ok:
            # the search's unproven gap: a plan up to this much faster may exist
            if r.optimality_gap > 0:
                throughput.annotate(
                    f"gap {r.optimality_gap:.0%}",
                    xy=(r.num_devices, r.tokens_per_s),
                    xytext=(0, 6),
                    textcoords="offset points",
                    fontsize=7,
                    color=line.get_color(),
                    ha="center",
                )
            if result.shown_efficiency(r) is None:
                unproven = True
                efficiency.annotate(
                    ">100%?",
                    xy=(r.num_devices, 100.0),
                    xytext=(0, 4 + 9 * index),  # one above the other, per type
                    textcoords="offset points",
                    fontsize=7,
                    color=line.get_color(),
                    ha="center",
                )
        for row in rows:
            if not row.fits:
                for ax in (throughput, efficiency):
                    ax.annotate(
                        "no plan" if row.searched else "not run",  # the total budget ran out
                        xy=(row.num_devices, 0.02),
                        xycoords=("data", "axes fraction"),
                        rotation=90,
                        fontsize=7,
                        color=line.get_color(),
                        ha="center",
                        va="bottom",
                    )
    # perfect scaling: every device as productive as at the smallest size
    reference = efficiency.axhline(
        100.0, color="0.45", linestyle="--", linewidth=1, label="100%: linear scaling"
    )
    sizes = sorted({r.num_devices for r in result.rows})
    for ax in (throughput, efficiency):
        ax.set_xscale("log", base=2)
        # a third of a doubling beyond the ends: the end points clear of the frame
        ax.set_xlim(sizes[0] / 2 ** (1 / 3), sizes[-1] * 2 ** (1 / 3))
        ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
        ax.set_xlabel("number of devices")
        ax.grid(True, which="both", alpha=0.3)
    throughput.set_yscale("log")
    # room above the highest point for its "gap" note, below the lowest for the range band
    throughput.margins(y=0.15)
    throughput.yaxis.set_major_formatter(FuncFormatter(_compact))
    throughput.yaxis.set_minor_formatter(FuncFormatter(_compact_minor))
    throughput.set_ylabel("throughput (tokens/s)")
    throughput.set_title("training throughput")
    efficiency.set_ylabel("scaling efficiency (%)")
    efficiency.set_title(
        "throughput per device vs the smallest size"
        + ("\n>100%?: above 100% against an unproven smallest plan, not drawn" if unproven else ""),
        fontsize=10 if unproven else None,
    )
    # room above the highest point, and above 100% for the ">100%?" notes of every type
    efficiency.set_ylim(0, max(1.12 * highest, 100.0 + 6.0 + 3.0 * len(result.clusters)))
    handles, labels = throughput.get_legend_handles_labels()
    handles.append(reference)
    labels.append(str(reference.get_label()))
    figure.legend(
        handles,
        labels,
        loc="outside lower center",
        ncol=min(len(handles), 5),
        fontsize=8,
        title="cluster type",
        title_fontsize=8,
        frameon=False,
    )
    figure.suptitle(f"{result.model}, global batch {result.global_batch}: best plan per size")
    return figure


_MARKERS = ("o", "s", "^", "D", "v", "P")


def _compact(value: float, _: object = None) -> str:
    """Tick label with a K/M/B suffix: 9M, 1.5B."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _compact_minor(value: float, _: object = None) -> str:
    """Minor log ticks: label 2x and 5x a power of ten only, to keep the axis readable."""
    if value <= 0:
        return ""
    leading = value / 10.0 ** math.floor(math.log10(value) + 1e-9)
    return _compact(value) if round(leading, 6) in (2.0, 5.0) else ""


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1.0:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


# ------------------------------------------------------------------------------ timeline

# The time axis spans about the figure's width less the rank labels and margins.
_FIGURE_WIDTH_IN = 13.0
_AXES_WIDTH_PX = 11.6 * SAVE_DPI
# Below this median width a bar per action reads as a barcode (seen on gpt3-175b's plans: at
# 4.6 px the edges and a send arrow a bar cover the colours): the picture shows each rank's
# time shares per bin instead, and a zoom.
MIN_BAR_PX = 12.0
_BIN_PX = 12.0  # the overview's bin width: a few actions, so a bin shows shares, not one bar
_ZOOM_BAR_PX = 44.0  # the zoom's window holds actions of about this median width
_LABEL_CHAR_PX = 5.5  # a digit of the 6-point bar labels at SAVE_DPI (6 pt = 10 px)
_STUB_LABEL_PX = 28.0  # a "to 7" label's width at 6 points, with a gap to the next
_ACTION_KINDS: tuple[EventKind, ...] = ("forward", "backward", "weight")
_ROW = 0.8  # a bar's height, in rows; the gap between rows carries the sends
SEND_COLOURS: dict[SendKind, str] = {"activation": "#000000", "gradient": "#D55E00"}
_SEND_LABELS: dict[SendKind, str] = {
    "activation": "send: activation to the next stage's rank",
    "gradient": "send: gradient to the previous stage's rank",
}


def bar_width_px(timeline: Timeline) -> float:
    """The median width of an action's bar when the whole step is drawn, in pixels at
    `SAVE_DPI` (infinite for a step without actions)."""
    durations = [e.duration_s for e in timeline.events if e.kind in _ACTION_KINDS]
    if not durations or timeline.step_time_s <= 0:
        return math.inf
    return statistics.median(durations) / timeline.step_time_s * _AXES_WIDTH_PX


def time_shares(timeline: Timeline, edges_s: Sequence[float] | np.ndarray) -> np.ndarray:
    """``shares[r, k, i]``: the fraction of bin ``i`` (between ``edges_s[i]`` and the next
    edge) that pipeline rank ``r`` spends in events of ``EVENT_KINDS[k]``."""
    edges = np.asarray(edges_s, dtype=float)
    out = np.zeros((timeline.pp_degree, len(EVENT_KINDS), len(edges) - 1))
    for r in range(timeline.pp_degree):
        events = timeline.rank_events(r)
        for k, kind in enumerate(EVENT_KINDS):
            starts = np.array([e.start_s for e in events if e.kind == kind])
            if starts.size == 0:
                continue
            lengths = np.array([e.duration_s for e in events if e.kind == kind])
            # covered[i]: seconds of this kind before edges[i]
            covered = np.clip(edges[:, None] - starts[None, :], 0.0, lengths[None, :]).sum(1)
            out[r, k] = np.diff(covered) / np.diff(edges)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineView:
    """How `timeline_figure` draws a timeline: a bar per action when the median bar
    (``bar_px`` wide over the whole step) is at least `MIN_BAR_PX` wide; else (``aggregated``)
    each rank's time shares in bins of ``bin_s`` over a zoom on ``zoom_rank`` (the rank that
    finishes the step last) between its peers (``zoom_rows``, top to bottom), over
    ``window_s``."""

    bar_px: float
    aggregated: bool
    bin_s: float = 0.0
    zoom_rank: int | None = None
    zoom_rows: tuple[int, ...] = ()
    window_s: tuple[float, float] | None = None


def timeline_view(timeline: Timeline) -> TimelineView:
    """The view `timeline_figure` draws ``timeline`` in (`TimelineView`)."""
    bar_px = bar_width_px(timeline)
    if bar_px >= MIN_BAR_PX:
        return TimelineView(bar_px=bar_px, aggregated=False)
    rank = _last_rank(timeline)
    # the zoom: a window of about _AXES_WIDTH_PX / _ZOOM_BAR_PX actions around the rank's
    # first backward (the end of its warm-up and the start of its steady state)
    width_s = timeline.step_time_s * bar_px / _ZOOM_BAR_PX
    first_backward = min(
        (e.start_s for e in timeline.rank_events(rank) if e.kind == "backward"), default=0.0
    )
    start = min(max(0.0, first_backward - width_s / 2), timeline.step_time_s - width_s)
    return TimelineView(
        bar_px=bar_px,
        aggregated=True,
        bin_s=timeline.step_time_s / max(1, round(_AXES_WIDTH_PX / _BIN_PX)),
        zoom_rank=rank,
        zoom_rows=tuple(_peers(timeline, rank)),
        window_s=(start, start + width_s),
    )


def timeline_figure(timeline: Timeline, *, title: str | None = None) -> Figure:
    """One step of the schedule: a row per pipeline rank, rank 0 on top.

    Bars a micro-batch's action wide when they are at least `MIN_BAR_PX` wide (median), with
    every send between ranks as an arrow in the gap between their rows. Narrower, an overview
    (each rank's share of time per kind in bins `_BIN_PX` wide) over a zoom on the rank that
    ends the step and its peers, in a window of actions `_ZOOM_BAR_PX` wide
    (`timeline_view` says which)."""
    view = timeline_view(timeline)
    if not view.aggregated:
        return _detailed_figure(timeline, title)
    return _aggregated_figure(timeline, view, title)


def _detailed_figure(timeline: Timeline, title: str | None) -> Figure:
    p = timeline.pp_degree
    figure = Figure(figsize=(_FIGURE_WIDTH_IN, 1.3 + 0.45 * p), layout="constrained")
    ax = figure.subplots()
    scale, unit = _time_unit(timeline.step_time_s)
    rows = list(range(p))
    window = (0.0, timeline.step_time_s)
    kinds = _draw_bars(ax, timeline, rows, window, scale)
    sends = _draw_sends(ax, timeline, rows, window, scale, of_rank=None)
    _rank_axis(ax, rows)
    ax.set_xlim(0, timeline.step_time_s * scale)
    ax.set_xlabel(f"time within one training step ({unit})")
    ax.set_title(title or _schedule_title(timeline, scale, unit), fontsize=10)
    _timeline_legend(figure, timeline, kinds, sends, aggregated=False)
    return figure


def _aggregated_figure(timeline: Timeline, view: TimelineView, title: str | None) -> Figure:
    assert view.window_s is not None and view.zoom_rank is not None
    p = timeline.pp_degree
    rank, rows, window = view.zoom_rank, list(view.zoom_rows), view.window_s
    # a row 0.28 in high, less past 32 ranks (at most 9 in in all), labelled every few ranks
    # when lower than a label
    row_in = min(0.28, 9.0 / p)
    overview_in, zoom_in = 0.6 + row_in * p, 0.7 + 0.5 * len(rows)
    figure = Figure(figsize=(_FIGURE_WIDTH_IN, 1.1 + overview_in + zoom_in), layout="constrained")
    overview, zoom = figure.subplots(2, 1, height_ratios=[overview_in, zoom_in])
    scale, unit = _time_unit(timeline.step_time_s)
    edges = np.linspace(0.0, timeline.step_time_s, round(timeline.step_time_s / view.bin_s) + 1)
    kinds = _draw_shares(overview, timeline, edges, scale)
    _rank_axis(overview, list(range(p)), every=math.ceil(0.2 / row_in))
    overview.set_xlim(0, timeline.step_time_s * scale)
    overview.set_xlabel(f"time within one training step ({unit})")
    overview.set_title(
        (title or _schedule_title(timeline, scale, unit))
        + f"\neach row: the rank's share of time per kind in bins of {_fmt(view.bin_s * scale)} "
        f"{unit} (bars {view.bar_px:.1g} px wide would be a barcode)",
        fontsize=10,
    )
    kinds += [k for k in _draw_bars(zoom, timeline, rows, window, scale) if k not in kinds]
    sends = _draw_sends(zoom, timeline, rows, window, scale, of_rank=rank)
    _rank_axis(zoom, rows)
    zoom.set_xlim(window[0] * scale, window[1] * scale)
    zoom.set_xlabel(f"time within one training step ({unit})")
    label = "micro-batch/stage" if timeline.virtual_stages > 1 else "micro-batch"
    zoom.set_title(
        f"zoom on pp rank {rank} (the last to finish the step) and the ranks it exchanges with, "
        f"{_fmt(window[0] * scale)}-{_fmt(window[1] * scale)} {unit}: bars labelled "
        f"{label}, arrows: the messages it sends and receives",
        fontsize=10,
    )
    overview.add_patch(
        Rectangle(
            (window[0] * scale, p - 1 - rank - 0.5),
            (window[1] - window[0]) * scale,
            1.0,
            fill=False,
            edgecolor="black",
            linewidth=1.2,
            label="zoomed below",
        )
    )
    _timeline_legend(figure, timeline, kinds, sends, aggregated=True)
    return figure


def _fmt(value: float) -> str:
    """Three significant digits, without an exponent: 0.149, 17.3, 1,203."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _schedule_title(timeline: Timeline, scale: float, unit: str) -> str:
    schedule = timeline.schedule + (
        f", v={timeline.virtual_stages}" if timeline.virtual_stages > 1 else ""
    )
    return (
        f"{schedule}: p={timeline.pp_degree}, m={timeline.num_micro_batches}; step "
        f"{_fmt(timeline.step_time_s * scale)} {unit} (pipeline "
        f"{_fmt(timeline.pipeline_time_s * scale)} {unit})"
    )


def _last_rank(timeline: Timeline) -> int:
    """The rank whose last event (its tail, or its last action) ends the step."""
    ends = [
        max((e.end_s for e in timeline.rank_events(r) if e.kind != "idle"), default=0.0)
        for r in range(timeline.pp_degree)
    ]
    return max(range(timeline.pp_degree), key=ends.__getitem__)


def _peers(timeline: Timeline, rank: int) -> list[int]:
    """``rank`` between the rank it receives activations from and the one it sends them to
    (a ring under interleaving: rank 0 follows the last one), top to bottom."""
    peers = {s.src_rank for s in timeline.sends if s.dst_rank == rank}
    peers |= {s.dst_rank for s in timeline.sends if s.src_rank == rank}
    if timeline.pp_degree <= 2:  # the one peer is before and after: keep rank order
        return sorted({rank, *peers})
    before = [r for r in peers if r == (rank - 1) % timeline.pp_degree]
    after = [r for r in peers if r == (rank + 1) % timeline.pp_degree and r not in before]
    return [*before, rank, *after]


def _rank_axis(ax: Axes, rows: list[int], *, every: int = 1) -> None:
    """Rows top to bottom: ``rows[0]`` at y = len(rows) - 1; a label on every ``every``-th."""
    n = len(rows)
    ticks = [y for y in range(n) if (n - 1 - y) % every == 0]
    ax.set_yticks(ticks, [f"pp rank {rows[n - 1 - y]}" for y in ticks])
    ax.set_ylim(-0.6, n - 0.4)
    ax.tick_params(axis="y", length=0)


def _darker(colour: str) -> tuple[float, float, float]:
    red, green, blue = to_rgb(colour)
    return (0.6 * red, 0.6 * green, 0.6 * blue)


def _draw_bars(
    ax: Axes,
    timeline: Timeline,
    rows: list[int],
    window: tuple[float, float],
    scale: float,
) -> list[EventKind]:
    """A bar per event of each row's rank within ``window``; return the kinds drawn. Actions
    touch their neighbours: a darker edge of their own colour separates them (never white, so
    only idle reads as a gap). Bars wide enough carry their micro-batch (and stage) number."""
    start, end = window
    px_per_s = _AXES_WIDTH_PX / (end - start)
    shown: list[EventKind] = []
    for k, rank in enumerate(rows):
        y = len(rows) - 1 - k
        events = [e for e in timeline.rank_events(rank) if e.end_s > start and e.start_s < end]
        for kind in EVENT_KINDS:
            spans = [(e.start_s * scale, e.duration_s * scale) for e in events if e.kind == kind]
            if not spans:
                continue
            if kind not in shown:
                shown.append(kind)
            action = kind in _ACTION_KINDS
            ax.broken_barh(
                spans,
                (y - _ROW / 2, _ROW),
                facecolors=KIND_COLOURS[kind],
                edgecolors=_darker(KIND_COLOURS[kind]) if action else "none",
                linewidth=0.5 if action else 0.0,
                antialiased=False,  # no light seam where two bars touch
                label=f"pp rank {rank}: {kind}",
            )
        for e in events:
            if e.kind not in _ACTION_KINDS or e.microbatch_idx is None:
                continue
            # micro-batch/stage where it fits, else the micro-batch alone
            width_px = e.duration_s * px_per_s
            texts = [f"{e.microbatch_idx}/{e.stage_idx}"] if timeline.virtual_stages > 1 else []
            texts.append(str(e.microbatch_idx))
            fits = [t for t in texts if width_px >= _LABEL_CHAR_PX * len(t) + 3]
            if not fits:
                continue
            text = fits[0]
            ax.text(
                (e.start_s + e.duration_s / 2) * scale,
                y,
                text,
                ha="center",
                va="center",
                fontsize=6,
                color="black" if e.kind == "backward" else "white",
                clip_on=True,
            )
    return shown


def _draw_sends(
    ax: Axes,
    timeline: Timeline,
    rows: list[int],
    window: tuple[float, float],
    scale: float,
    *,
    of_rank: int | None,
) -> list[SendKind]:
    """Every send (of ``of_rank``, or all) leaving within ``window`` between two drawn rows,
    as an arrow from the sender's bar at its departure to the receiver's at its arrival, in
    the gap between their rows. A send to a rank drawn further away (the ring's wrap under
    interleaving) is a stub toward it labelled with that rank (where the label has room).
    Return the kinds drawn."""
    y_of = {rank: len(rows) - 1 - k for k, rank in enumerate(rows)}
    edge = _ROW / 2
    px_per_s = _AXES_WIDTH_PX / (window[1] - window[0])
    labelled_px: dict[tuple[int, bool], float] = {}  # the last stub label of a row, by direction
    shafts: dict[SendKind, list[list[tuple[float, float]]]] = {"activation": [], "gradient": []}
    heads: dict[SendKind, list[tuple[float, float, bool]]] = {"activation": [], "gradient": []}
    for send in timeline.sends:
        if not window[0] <= send.start_s < window[1]:
            continue
        if of_rank is not None and of_rank not in (send.src_rank, send.dst_rank):
            continue
        if send.src_rank not in y_of or send.dst_rank not in y_of:
            continue
        y_src, y_dst = y_of[send.src_rank], y_of[send.dst_rank]
        down = y_dst < y_src
        sign = -1.0 if down else 1.0
        x0, x1 = send.start_s * scale, send.end_s * scale
        if abs(y_src - y_dst) == 1:
            tip = y_dst - sign * edge
        else:  # a stub into the gap, toward the receiver's row
            x1, tip = x0, y_src + sign * (1 - edge)
            at_px = (send.start_s - window[0]) * px_per_s
            if at_px - labelled_px.get((y_src, down), -math.inf) >= _STUB_LABEL_PX:
                labelled_px[y_src, down] = at_px
                ax.annotate(
                    f"to {send.dst_rank}",
                    xy=(x0, tip),
                    xytext=(1, 0),
                    textcoords="offset points",
                    fontsize=6,
                    va="center",
                    color=SEND_COLOURS[send.kind],
                    annotation_clip=True,
                )
        shafts[send.kind].append([(x0, y_src + sign * edge), (x1, tip)])
        heads[send.kind].append((x1, tip, down))
    shown: list[SendKind] = []
    for kind in ("activation", "gradient"):
        if not shafts[kind]:
            continue
        shown.append(kind)
        colour = SEND_COLOURS[kind]
        ax.add_collection(
            LineCollection(shafts[kind], colors=colour, linewidths=0.8, label=_SEND_LABELS[kind])
        )
        for down in (True, False):
            tips = [(x, y) for x, y, d in heads[kind] if d == down]
            if tips:
                ax.scatter(
                    [x for x, _ in tips],
                    [y for _, y in tips],
                    marker="v" if down else "^",
                    s=9,
                    color=colour,
                    linewidths=0,
                    zorder=3,
                )
    return shown


def _draw_shares(ax: Axes, timeline: Timeline, edges: np.ndarray, scale: float) -> list[EventKind]:
    """Each rank's row split, in every bin, into its shares of time per kind stacked from the
    bottom (forward first, idle on top): the layers fill the row, so no bin is white."""
    shares = time_shares(timeline, edges)
    p = timeline.pp_degree
    x = edges * scale
    shown: list[EventKind] = []
    for r in range(p):
        bottom = np.full(len(edges) - 1, p - 1 - r - _ROW / 2)
        for k, kind in enumerate(EVENT_KINDS):
            if not shares[r, k].any():
                continue
            if kind not in shown:
                shown.append(kind)
            top = bottom + _ROW * shares[r, k]
            ax.fill_between(
                x,
                np.append(bottom, bottom[-1]),
                np.append(top, top[-1]),
                step="post",
                facecolor=KIND_COLOURS[kind],
                linewidth=0,
                antialiased=False,
                label=f"pp rank {r}: {kind}",
            )
            bottom = top
    return [k for k in EVENT_KINDS if k in shown]


def _timeline_legend(
    figure: Figure,
    timeline: Timeline,
    kinds: list[EventKind],
    sends: list[SendKind],
    *,
    aggregated: bool,
) -> None:
    """One legend below the axes (constrained layout: no band between them and it)."""
    handles: list[Artist] = [
        Patch(facecolor=KIND_COLOURS[k], label=KIND_LABELS[k]) for k in EVENT_KINDS if k in kinds
    ]
    link_s = sorted({s.duration_s for s in timeline.sends})
    if link_s:
        scale, unit = _time_unit(link_s[-1]) if link_s[-1] > 0 else (1e6, "us")
        low, high = _fmt(link_s[0] * scale), _fmt(link_s[-1] * scale)
        span = f"{low} {unit}" if low == high else f"{low}-{high} {unit}"
        for kind in sends:
            handles.append(
                Line2D(
                    [],
                    [],
                    color=SEND_COLOURS[kind],
                    marker="v" if kind == "activation" else "^",
                    markersize=4,
                    linewidth=0.8,
                    label=f"{_SEND_LABELS[kind]} (link {span})",
                )
            )
    if aggregated:
        handles.append(Patch(fill=False, edgecolor="black", label="zoom window"))
    figure.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 4),
        fontsize=8,
        frameon=False,
    )
