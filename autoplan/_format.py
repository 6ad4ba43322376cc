"""Human-readable numbers and compact tables for the CLI: bytes, FLOP/s, bandwidth, time."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich import box
from rich.table import Table

from cost_model.units import format_bytes
from cost_model.units import scaled as _scaled

fmt_bytes = format_bytes


def fmt_flops(value: float) -> str:
    return _scaled(value, ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1.0, "FLOP/s")))


def fmt_bandwidth(value: float) -> str:
    return _scaled(value, ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1.0, "B/s")))


_TIME_UNITS = (
    (86400.0, "days"),
    (3600.0, "h"),
    (60.0, "min"),
    (1.0, "s"),
    (1e-3, "ms"),
    (1e-6, "us"),
    (1e-9, "ns"),
)


def fmt_time(seconds: float) -> str:
    return _scaled(seconds, _TIME_UNITS)


def fmt_time_bounds(seconds: float, bounds: Sequence[float]) -> str:
    """An 80% range in the unit of its prediction ``seconds``: "15.9-18.8 s" ("-" if none)."""
    low, high = bounds
    if high <= 0:
        return "-"
    scale, unit = next(
        ((scale, unit) for scale, unit in _TIME_UNITS if abs(seconds) >= scale), _TIME_UNITS[-1]
    )
    return f"{low / scale:.3g}-{high / scale:.3g} {unit}"


def fmt_range_percent(seconds: float, bounds: Sequence[float]) -> str:
    """An 80% range relative to its prediction, for narrow table cells: "-8/+14%"."""
    low, high = bounds
    if high <= 0 or seconds <= 0:
        return "-"
    return f"{100 * (low / seconds - 1):.0f}/+{100 * (high / seconds - 1):.0f}%"


def fmt_time_range(seconds: float, bounds: Sequence[float], level: float = 0.8) -> str:
    """A predicted time with its range: "16.6 s, 80% range 15.9-18.8 s" (without a range,
    bounds (0, 0), the time alone)."""
    if bounds[1] <= 0:
        return fmt_time(seconds)
    return f"{fmt_time(seconds)}, {level:.0%} range {fmt_time_bounds(seconds, bounds)}"


def fmt_count(value: float) -> str:
    return _scaled(value, ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"), (1.0, "")))


def fmt_memory(peak_bytes: float, reserve_bytes: float, capacity_bytes: float) -> str:
    """A device's peak with its headroom explicit: "predicted 72.4 GiB + 7.5 GiB
    reserve/margin of 80 GiB" (the reserve is the framework's, the margin the allocator's;
    without a recorded reserve or capacity, what is known)."""
    if capacity_bytes <= 0:
        return fmt_bytes(peak_bytes)
    if reserve_bytes <= 0:
        return f"{fmt_bytes(peak_bytes)} of {fmt_bytes(capacity_bytes)}"
    return (
        f"predicted {fmt_bytes(peak_bytes - reserve_bytes)} + {fmt_bytes(reserve_bytes)} "
        f"reserve/margin of {fmt_bytes(capacity_bytes)}"
    )


def fmt_headroom(
    peak_bytes: float, capacity_bytes: float, headroom: float, usable_bytes: float = 0.0
) -> str:
    """What a device's peak leaves free, with the headroom it is checked with: "8.8 GiB free
    (headroom 10%)"; given the largest peak that fits (`Estimate.usable_memory_bytes`), also
    that: "15.9 GiB free (headroom 10% and the peak's range: fits up to 63.5 GiB)"."""
    free = capacity_bytes - peak_bytes
    left = f"{fmt_bytes(free)} free" if free >= 0 else f"{fmt_bytes(-free)} over the device"
    if usable_bytes <= 0:
        return f"{left} (headroom {headroom:.0%})"
    fits = f"fits up to {fmt_bytes(usable_bytes)}"
    return f"{left} (headroom {headroom:.0%} and the peak's range: {fits})"


# Columns the CLI lays its output out for: a table's natural width stays within it (a test runs
# every command and checks), and output that is not a terminal is printed this wide.
WIDTH = 100

_RECOMPUTE_SHORT = {"none": "none", "selective": "sel", "full": "full"}


def compact_table(title: str | None = None, *, caption: str | None = None) -> Table:
    """A table with a rule under its header and two spaces between columns (no outer border),
    so a dozen numeric columns fit `WIDTH`; a caption under it says what terse headers mean."""
    return Table(
        title=title,
        caption=caption,
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
        show_edge=False,
        title_justify="left",
        caption_justify="left",
        title_style="bold",
        caption_style="dim",
    )


def fmt_gib(value: float) -> str:
    """Bytes as GiB, three significant digits, no unit ("71.4", "0.512", "80")."""
    return f"{value / 2**30:.3g}"


def _short_bytes(value: float) -> str:
    """Bytes with a one-letter binary suffix: "71.4G", "512M" (G = GiB, M = MiB)."""
    for scale, suffix in ((2**40, "T"), (2**30, "G"), (2**20, "M"), (2**10, "K")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def fmt_memory_cell(peak_bytes: float, reserve_bytes: float, capacity_bytes: float) -> str:
    """A table cell for a device's peak: "71.4G+5.57G/80G" (predicted tensors + reserve and
    allocator margin / capacity; `fmt_memory` spells the same figures out)."""
    if capacity_bytes <= 0:
        return _short_bytes(peak_bytes)
    if reserve_bytes <= 0:
        return f"{_short_bytes(peak_bytes)}/{_short_bytes(capacity_bytes)}"
    predicted = _short_bytes(peak_bytes - reserve_bytes)
    return f"{predicted}+{_short_bytes(reserve_bytes)}/{_short_bytes(capacity_bytes)}"


MEMORY_CELL_CAPTION = (
    "memory per device: predicted + reserve and allocator margin / capacity (G = GiB, M = MiB)"
)


def fmt_schedule(schedule: str) -> str:
    """A schedule's name for a table cell: "interleaved-" shortened to "intl-" (the plan file
    and every other output keep the full name)."""
    return schedule.replace("interleaved-", "intl-")


def fmt_recompute(modes: Iterable[str]) -> str:
    """The recompute modes of a plan's stages: "selective", "none+sel" when two differ, "mixed"
    when all three appear (the per-rank table names them)."""
    distinct = sorted(set(modes))
    if len(distinct) == 1:
        return distinct[0]
    if len(distinct) > 2:
        return "mixed"
    return "+".join(_RECOMPUTE_SHORT.get(mode, mode) for mode in distinct)


def fmt_compile(stages_compiled: Sequence[bool]) -> str | None:
    """What torch.compile a plan runs (`Plan.stage_compiled` of each stage), in one phrase;
    None for an eager plan."""
    compiled = [idx for idx, flag in enumerate(stages_compiled) if flag]
    if not compiled:
        return None
    what = "torch.compile of each block (inductor's fused element-wise and normalisation ops)"
    if len(compiled) == len(stages_compiled):
        return what
    listed = ", ".join(map(str, compiled))
    return f"{what} on stage{'s' if len(compiled) > 1 else ''} {listed}; the others eager"


def collapse_runs(rows: Sequence[tuple[int, Sequence[str]]]) -> list[tuple[str, list[str]]]:
    """Merge consecutive rows whose cells are equal into one labelled with their index range
    ("1-14"): a 64-rank pipeline whose middle ranks agree prints as three rows."""
    runs: list[tuple[int, int, list[str]]] = []
    for index, cells in rows:
        if runs and runs[-1][2] == list(cells) and runs[-1][1] == index - 1:
            first, _, same = runs[-1]
            runs[-1] = (first, index, same)
        else:
            runs.append((index, index, list(cells)))
    return [(str(a) if a == b else f"{a}-{b}", cells) for a, b, cells in runs]
