"""Human-readable numbers and compact tables for the CLI: bytes, FLOP/s, bandwidth, time."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from rich import box
from rich.console import Console, RenderableType
from rich.measure import Measurement
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


def compact_table(
    title: str | None = None, *, caption: str | None = None, cls: type[Table] = Table
) -> Table:
    """A table with a rule under its header and two spaces between columns (no outer border),
    so a dozen numeric columns fit `WIDTH`; a caption under it says what terse headers mean.
    ``cls``: a subclass of rich's `Table` to build (`FittedTable`)."""
    return cls(
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


def short_bytes(value: float) -> str:
    """Bytes with a one-letter binary suffix: "71.4G", "512M" (G = GiB, M = MiB)."""
    for scale, suffix in ((2**40, "T"), (2**30, "G"), (2**20, "M"), (2**10, "K")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def fmt_memory_cell(peak_bytes: float, reserve_bytes: float, capacity_bytes: float) -> str:
    """A table cell for a device's peak: "71.4G+5.57G/80G" (predicted tensors + reserve and
    allocator margin / capacity; `fmt_memory` spells the same figures out)."""
    if capacity_bytes <= 0:
        return short_bytes(peak_bytes)
    if reserve_bytes <= 0:
        return f"{short_bytes(peak_bytes)}/{short_bytes(capacity_bytes)}"
    predicted = short_bytes(peak_bytes - reserve_bytes)
    return f"{predicted}+{short_bytes(reserve_bytes)}/{short_bytes(capacity_bytes)}"


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


# ---- tables that fit the console ------------------------------------------------------------
# A table is declared as its columns (header, meaning, how the narrow layout treats it) and its
# rows; `fitted_table` leaves out the columns marked droppable, highest `drop` first, until the
# table's natural width fits the console, and says in its caption which it left out (``--wide``
# shows every column, `print_fitted` then widens the console for it instead of cutting cells).
# The meanings make each command's ``--help`` glossary (`columns_help`), so no column goes
# unexplained and the glossary cannot drift from the tables.


@dataclass(frozen=True, kw_only=True, slots=True)
class Column:
    """One table column: ``header``, what it holds (``meaning``, for ``--help``), ``drop``
    (0: always shown; n > 0: the narrow layout leaves it out, larger n first) and ``fold``
    (free text that wraps inside its cell instead of widening the table)."""

    header: str
    meaning: str
    justify: Literal["left", "right"] = "right"
    drop: int = 0
    fold: bool = False


class Row(NamedTuple):
    """A table row: one cell per column (dropped columns' cells are dropped with them), a rich
    style for the whole row, and whether a rule separates it from the rows above."""

    cells: Sequence[str]
    style: str | None = None
    section: bool = False


class FittedTable(Table):
    """A rich `Table` that knows the columns it needs whole (`natural_width`): no cell cut,
    its folding columns wrapped at their longest word."""

    natural_width: int = 0


def _natural_width(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], *, folded: bool = True
) -> int:
    # the table measured on a console wide enough that nothing wraps, a folding column's cells
    # as their longest word (the narrowest it can wrap to) when ``folded``, else whole
    table = compact_table()
    for column in columns:
        table.add_column(column.header, justify=column.justify, no_wrap=True)
    for cells in rows:
        table.add_row(
            *(
                max(cell.split() or [""], key=len) if column.fold and folded else cell
                for column, cell in zip(columns, cells, strict=True)
            )
        )
    measuring = Console(file=io.StringIO(), width=10_000, color_system=None)
    return Measurement.get(measuring, measuring.options, table).maximum


def fitted_table(
    title: str | None,
    columns: Sequence[Column],
    rows: Sequence[Row],
    *,
    width: int = WIDTH,
    wide: bool = False,
    caption: str | None = None,
    notes: Mapping[str, str] | None = None,
) -> FittedTable:
    """A `compact_table` of ``columns`` and ``rows`` whose width is at most ``width`` (unless
    ``wide``, or its always-shown columns alone are wider): droppable columns are left out,
    highest ``drop`` first (the rightmost of equals first), until the table fits with its
    folding columns unwrapped (or none is left to drop), and the caption names them.
    ``notes`` (header -> "PP comm: ...") join the caption for the columns shown."""
    keep = list(range(len(columns)))
    droppable = sorted(
        (i for i, c in enumerate(columns) if c.drop > 0), key=lambda i: (columns[i].drop, i)
    )

    def natural(indices: Sequence[int], *, folded: bool = True) -> int:
        cells = [[row.cells[i] for i in indices] for row in rows]
        return _natural_width([columns[i] for i in indices], cells, folded=folded)

    # columns are left out until the folding columns' text fits unwrapped, if it can
    while not wide and droppable and natural(keep, folded=False) > width:
        keep.remove(droppable.pop())
    shown = [columns[i] for i in keep]
    text = _caption(caption, notes or {}, shown, [c for c in columns if c not in shown], width)
    table = compact_table(title, caption=text, cls=FittedTable)
    assert isinstance(table, FittedTable)
    table.natural_width = natural(keep)
    for i in keep:
        column = columns[i]
        if column.fold:
            table.add_column(column.header, justify=column.justify, overflow="fold", ratio=1)
        else:
            table.add_column(column.header, justify=column.justify, no_wrap=True)
    for row in rows:
        if row.section:
            table.add_section()
        table.add_row(*(row.cells[i] for i in keep), style=row.style)
    return table


def _caption(
    caption: str | None,
    notes: Mapping[str, str],
    shown: Sequence[Column],
    left_out: Sequence[Column],
    width: int,
) -> str | None:
    """The caption, the notes of the columns shown and which columns were left out."""
    headers = {column.header for column in shown}
    said = [text for header, text in notes.items() if header in headers]
    names = ", ".join(column.header for column in left_out)
    note = f"not shown at {width} columns: {names} (--wide shows them)" if left_out else None
    return "; ".join(part for part in (caption, *said, note) if part) or None


def print_fitted(out: Console, *tables: RenderableType) -> None:
    """Print ``tables`` whole: on a console narrower than one (a ``--wide`` table), the console
    is widened for it rather than cutting its cells with an ellipsis."""
    for table in tables:
        needed = table.natural_width if isinstance(table, FittedTable) else 0
        if needed <= out.width:
            out.print(table)
            continue
        saved = out.width
        out.width = needed
        try:
            out.print(table)
        finally:
            out.width = saved


def columns_help(tables: Sequence[tuple[str, Sequence[Column]]], width: int = 78) -> str:
    """The ``--help`` epilog that explains every column of a command's tables: a paragraph per
    table ("per pipeline rank:") with a line per column ("  PP comm: host time ..."), wrapped
    to ``width`` and marked so that click keeps its lines (``\\b``)."""
    paragraphs = []
    for name, columns in tables:
        lines = ["\b", f"Columns of {name}:"]
        for column in columns:
            narrow = " [left out when narrow]" if column.drop else ""
            lines += textwrap.wrap(
                f"{column.header}: {column.meaning}{narrow}",
                width=width - 2,
                initial_indent="  ",
                subsequent_indent="      ",
                break_on_hyphens=False,
            )
        paragraphs.append("\n".join(lines))
    note = "--wide shows every column, whatever the terminal's width."
    return "\n\n".join([*paragraphs, note])


def wrap_words(text: str, width: int = WIDTH, *, indent: str = "") -> str:
    """``text`` wrapped at word boundaries to ``width`` columns (later lines indented by
    ``indent``); a word longer than the line (a path, a model spec) stays whole."""
    return "\n".join(
        textwrap.wrap(
            text,
            width=width,
            subsequent_indent=indent,
            break_long_words=False,
            break_on_hyphens=False,
        )
    )


def wrap_phrases(phrases: Sequence[str], width: int = WIDTH, *, indent: str = "  ") -> str:
    """Phrases joined by ", " and wrapped only between them, so that none is split across
    lines ("schedule interleaved-1f1b, 8 micro-batches of 1, ..."); a phrase longer than a
    line is wrapped at its words."""
    lines: list[str] = []
    current = ""
    for index, phrase in enumerate(phrases):
        piece = phrase + ("," if index < len(phrases) - 1 else "")
        candidate = f"{current} {piece}" if current else piece
        if not current or len(candidate) <= width:
            current = candidate
            continue
        lines.append(current)
        current = indent + piece
    if current:
        lines.append(current)
    return "\n".join(
        wrap_words(line, width, indent=indent) if len(line) > width else line for line in lines
    )


def shell_lines(words: Sequence[str], width: int = WIDTH, *, indent: str = "    ") -> str:
    """A shell command of already quoted ``words`` as lines of at most ``width`` columns, each
    but the last ending in `` \\`` (the shell joins them back); a word longer than a line
    stays whole on its own line. Pasted into a shell it runs as the one-line command does."""
    lines: list[str] = []
    line = ""
    for word in words:
        candidate = f"{line} {word}" if line else word
        # room for the " \" that ends every line but the last
        if line and len(candidate) + 2 > width:
            lines.append(line + " \\")
            line = indent + word
        else:
            line = candidate
    lines.append(line)
    return "\n".join(lines)


def comment_lines(text: str, width: int = WIDTH, *, prefix: str = "# ") -> str:
    """A comment of any length as lines of at most ``width`` columns, each starting with
    ``prefix`` (the export's notes: "# note: ..."); words longer than a line stay whole."""
    return "\n".join(
        textwrap.wrap(
            text,
            width=width,
            initial_indent=prefix,
            subsequent_indent=prefix + "  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    )
