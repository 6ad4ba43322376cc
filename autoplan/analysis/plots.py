"""Pictures: a what-if's throughput and scaling, and one simulated step of a pipeline schedule.

Expects a `WhatIfResult` or a `Timeline`. Guarantees: each function returns a new matplotlib
``Figure`` built without pyplot (no global figure registry, no display backend needed; files are
written with the Agg renderer), so tests can inspect its axes, labels and series:

- `whatif_figure`: two axes, throughput (tokens/s) and scaling efficiency (%) against the
  number of devices, one line per cluster type on each (sizes without a plan are left out of the
  line and marked "no plan" along the x axis), labelled axes with units and a legend.
- `timeline_figure`: one row per pipeline rank, forward, backward, communication, tail (DP sync
  and optimizer) and idle spans in distinct colours, a legend entry per kind shown, time on the
  x axis with its unit.

matplotlib is imported by this module only; the CLI imports it when a picture is asked for.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from autoplan.analysis.timeline import EVENT_KINDS, EventKind, Timeline
from autoplan.analysis.whatif import WhatIfResult
from cost_model.files import atomic_output

__all__ = ["KIND_COLOURS", "KIND_LABELS", "save_figure", "timeline_figure", "whatif_figure"]

# Colour-blind-safe palette (Okabe and Ito 2008), one colour per kind of span.
KIND_COLOURS: dict[EventKind, str] = {
    "forward": "#0072B2",  # blue
    "backward": "#E69F00",  # orange
    "weight": "#CC79A7",  # purple
    "tail": "#009E73",  # green
    "idle": "#E8E8E8",  # light grey
}
KIND_LABELS: dict[EventKind, str] = {
    "forward": "forward (incl. TP collectives)",
    "backward": "backward (incl. recompute, TP; input half if split)",
    "weight": "backward-weight (zero-bubble)",
    "tail": "DP gradient sync + optimizer",
    "idle": "idle (bubble)",
}


def save_figure(figure: Figure, path: str | Path, *, dpi: int = 120, what: str = "") -> Path:
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
    """Throughput and scaling efficiency against devices, one line per cluster type."""
    figure = Figure(figsize=(12, 4.8), layout="constrained")
    throughput, efficiency = figure.subplots(1, 2)
    for label in result.clusters:
        rows = result.rows_of(label)
        ok = [r for r in rows if r.tokens_per_s is not None and r.scaling_efficiency is not None]
        x = [r.num_devices for r in ok]
        (line,) = throughput.plot(x, [r.tokens_per_s for r in ok], marker="o", label=label)
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
        efficiency.plot(
            [n for n, e in shown if e is not None],
            [100.0 * e for _, e in shown if e is not None],
            marker="o",
            label=label,
            color=line.get_color(),
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
                efficiency.annotate(
                    ">100%?",
                    xy=(r.num_devices, 100.0),
                    fontsize=7,
                    color=line.get_color(),
                    ha="center",
                )
        for row in rows:
            if not row.fits:
                for ax in (throughput, efficiency):
                    ax.annotate(
                        "no plan",
                        xy=(row.num_devices, 0.02),
                        xycoords=("data", "axes fraction"),
                        rotation=90,
                        fontsize=7,
                        color=line.get_color(),
                        ha="center",
                        va="bottom",
                    )
    sizes = sorted({r.num_devices for r in result.rows})
    for ax in (throughput, efficiency):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
        ax.set_xlabel("number of devices")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="cluster type")
    throughput.set_yscale("log")
    throughput.yaxis.set_major_formatter(FuncFormatter(_compact))
    throughput.yaxis.set_minor_formatter(FuncFormatter(_compact_minor))
    throughput.set_ylabel("throughput (tokens/s)")
    throughput.set_title("training throughput")
    efficiency.set_ylabel("scaling efficiency (%)")
    efficiency.set_title("throughput per device vs the smallest size")
    efficiency.set_ylim(bottom=0)
    figure.suptitle(f"{result.model}, global batch {result.global_batch}: best plan per size")
    return figure


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


def timeline_figure(timeline: Timeline, *, title: str | None = None) -> Figure:
    """One step of the schedule: a row per pipeline rank, rank 0 on top."""
    p = timeline.pp_degree
    figure = Figure(figsize=(13, 1.2 + 0.45 * p), layout="constrained")
    ax = figure.subplots()
    scale, unit = _time_unit(timeline.step_time_s)
    # Micro-batch numbers inside the spans, when there is room for them.
    label_spans = len(timeline.events) <= 40 * p and timeline.num_micro_batches <= 32
    shown: list[EventKind] = []
    for r in range(p):
        y = p - 1 - r
        for kind in EVENT_KINDS:
            spans = [
                (e.start_s * scale, e.duration_s * scale)
                for e in timeline.events
                if e.pp_rank == r and e.kind == kind
            ]
            if not spans:
                continue
            if kind not in shown:
                shown.append(kind)
            ax.broken_barh(
                spans,
                (y - 0.4, 0.8),
                facecolors=KIND_COLOURS[kind],
                edgecolors="white" if kind in ("forward", "backward", "weight") else "none",
                linewidth=0.5,
            )
        if label_spans:
            for e in timeline.events:
                if e.pp_rank == r and e.kind in ("forward", "backward", "weight"):
                    ax.text(
                        (e.start_s + e.duration_s / 2) * scale,
                        y,
                        str(e.microbatch_idx),
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white",
                    )
    ax.set_yticks(range(p), [f"pp rank {p - 1 - y}" for y in range(p)])
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlim(0, timeline.step_time_s * scale)
    ax.set_xlabel(f"time within one training step ({unit})")
    ax.set_ylabel("pipeline rank")
    ax.legend(
        handles=[
            Patch(facecolor=KIND_COLOURS[k], label=KIND_LABELS[k])
            for k in EVENT_KINDS
            if k in shown
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18 if p > 2 else -0.35),
        ncol=len(shown),
        fontsize=8,
        frameon=False,
    )
    schedule = timeline.schedule + (
        f", v={timeline.virtual_stages}" if timeline.virtual_stages > 1 else ""
    )
    ax.set_title(
        title
        or (
            f"{schedule}: p={p}, m={timeline.num_micro_batches}; step "
            f"{timeline.step_time_s * scale:.3g} {unit} (pipeline "
            f"{timeline.pipeline_time_s * scale:.3g} {unit})"
        )
    )
    return figure
