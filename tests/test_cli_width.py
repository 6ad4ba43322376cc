"""Every command's human-readable output fits the console, whole: at 80 and at 100 columns,
piped and on a terminal, no line of stdout wider and no cell cut short with an ellipsis (one-line
verdicts that name a user's path or model spec, such as `validate`'s, stay one line and are
checked elsewhere), and every column header of every table is explained in the command's
``--help``. Run in-process: ``COLUMNS`` sets the width, and ``TTY_COMPATIBLE=1`` makes rich
render as on a terminal (styles as ANSI codes); one test runs the console script in a real
pseudo-terminal. The plans are the widest a user meets: interleaved schedules with many
pipeline ranks, mixed recompute, what-if rows with and without a plan, costs, a cp=32 plan."""

from __future__ import annotations

import itertools
import os
import pty
import re
import select
import struct
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from autoplan._format import (
    WIDTH,
    Column,
    Row,
    collapse_runs,
    comment_lines,
    fitted_table,
    fmt_memory_cell,
    fmt_recompute,
    print_fitted,
    short_bytes,
    wrap_phrases,
)
from autoplan.cli import cli, error_text
from autoplan.cli.common import console_width

GPT = "gpt:num_layers=24,hidden_size=1024,num_heads=16,seq_len=1024,vocab_size=50304"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# rich's environment switch: the output is a terminal, whatever the file is
TERMINAL = {"TTY_COMPATIBLE": "1"}
PIPED = {"TTY_COMPATIBLE": ""}


def _check_fits(output: str, width: int) -> None:
    for line in output.splitlines():
        assert len(line.rstrip()) <= width, f"{len(line.rstrip())} columns: {line!r}"
    assert "…" not in output, output


def _run(args: list[str], width: int, terminal: bool) -> str:
    """The command's stdout at ``width`` columns, ANSI codes removed (checked present on a
    terminal: the output was rendered as for one)."""
    env = {"COLUMNS": str(width), **(TERMINAL if terminal else PIPED)}
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exit_code == 0, result.output
    if terminal:
        assert "\x1b[" in result.stdout, result.stdout
    else:
        assert "\x1b[" not in result.stdout
    return ANSI.sub("", result.stdout)


def _headers(output: str) -> list[str]:
    """The column headers of every compact table in ``output``: the line above each rule."""
    lines = output.splitlines()
    headers = []
    for above, line in itertools.pairwise(lines):
        if line.strip() and set(line.strip()) == {"─"}:
            headers += [h for h in re.split(r"\s{2,}", above.strip()) if h]
    return headers


@cache
def _help(command: tuple[str, ...]) -> str:
    result = CliRunner().invoke(cli, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


def _check_columns_explained(args: list[str], output: str) -> None:
    command = tuple(args[:2]) if args[0] == "cluster" else (args[0],)
    headers = _headers(output)
    assert headers, output
    glossary = _help(command)
    for header in headers:
        assert f" {header}: " in glossary, f"{header!r} is not explained in {command} --help"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("width") / "plan.yaml"
    args = [
        *("plan", "--model", GPT, "--cluster", "dgx-a100-80g:nodes=16", "--global-batch", "512"),
        *("--pp", "8", "--schedules", "interleaved-1f1b", "--budget", "1", "--top", "5"),
        *("-o", str(path)),
    ]
    output = _run(args, WIDTH, terminal=False)
    _check_fits(output, WIDTH)
    assert "best plans (rank 1 is chosen)" in output
    assert "per pipeline rank" in output
    _check_columns_explained(args, output)
    return path


ESTIMATE = [
    *("estimate", "--model", GPT, "--cluster", "dgx-a100-80g:nodes=16"),
    *("--global-batch", "512", "--tp", "8", "--pp", "8", "--virtual-stages", "3"),
    *("--recompute", "selective", "--zero", "1"),
]
# a context-parallel plan: its communication has a column
ESTIMATE_CP = [
    *("estimate", "--model", "llama3-8b:seq_len=131072,num_layers=4"),
    *("--cluster", "dgx-h100-80g:nodes=32", "--global-batch", "64", "--tp", "8", "--cp", "32"),
]
# the commands whose searches take seconds
SEARCHING = [
    ["explain", "{plan}", "--model", GPT, "--budget", "1"],
    [
        # 8 blocks: the search is quick, the plan cells as wide
        *(
            "whatif",
            "--model",
            GPT.replace("=24,", "=8,"),
            "--cluster",
            "dgx-a100-40g,dgx2-v100-32g",
        ),
        *("--num-devices", "1,128", "--global-batch", "512", "--budget", "0.5"),
        *("--tokens", "3e11", "--price-per-device-hour", "2.5", "--currency", "EUR"),
    ],
]
QUICK = [
    ESTIMATE,
    ESTIMATE_CP,
    ["trace", "--model", "gpt2-small", "--all"],
    ["trace", "--model", "llama3-405b"],
    ["trace", "--model", "deepseek-moe-16b"],  # its experts' line
    ["models"],
    ["cluster", "list"],
    ["cluster", "show", "dgx2-v100-32g"],
    [
        "export",
        "{plan}",
        "--to",
        "megatron-lm",
        "--model",
        GPT,
        "--cluster",
        "dgx-a100-80g:nodes=16",
    ],
    # its verdict names the plan's path and the model spec, wrapped at words
    ["validate", "{plan}", "--model", GPT],
]
# every command at both widths, piped and on a terminal
CASES = [
    pytest.param(args, width, terminal, id=f"{' '.join(args[:3])}-{width}-{mode}")
    for args in (*SEARCHING, *QUICK)
    for width in (80, WIDTH)
    for terminal, mode in ((False, "piped"), (True, "terminal"))
]


@pytest.mark.parametrize(("args", "width", "terminal"), CASES)
def test_command_output_fits_and_explains_its_columns(
    args: list[str], width: int, terminal: bool, plan_file: Path
) -> None:
    args = [a.replace("{plan}", str(plan_file)) for a in args]
    output = _run(args, width, terminal)
    if args[0] == "export":
        # the command's own lines: its comments and the launch line (wrapped with the shell's
        # continuations); the exported files' lines are checked in tests/test_export.py
        lines = output.splitlines()
        launch = next(i for i, line in enumerate(lines) if line.startswith("# launch"))
        output = "\n".join(
            line for i, line in enumerate(lines) if line.startswith("#") or i > launch
        )
    _check_fits(output, width)
    if args[:2] != ["cluster", "show"] and args[0] not in ("export", "validate"):  # no table
        _check_columns_explained(args, output)
    if args == ESTIMATE_CP:
        assert "CP comm" in _headers(output)


@pytest.mark.parametrize(
    ("width", "terminal"),
    [(80, True), (80, False), (WIDTH, True)],
    ids=["80-terminal", "80-piped", "100-terminal"],
)
def test_plan_fits_and_keeps_its_memory_cells_whole(width: int, terminal: bool) -> None:
    # issue 44: the memory cell was cut ("73.6G+5.68G/8…") when the layout column appeared
    # (the module's plan runs at 100 columns piped)
    args = [
        *("plan", "--model", "llama3-70b:num_layers=8", "--cluster", "dgx-a100-80g:nodes=8"),
        *("--global-batch", "512", "--budget", "0.5", "--top", "5"),
    ]
    output = _run(args, width, terminal=terminal)
    _check_fits(output, width)
    memory = re.findall(r"\d[\d.]*[GM]\+\d[\d.]*[GM]\s*$", output, re.MULTILINE)
    assert len(memory) == 5, output  # one whole cell a plan
    assert "memory per device: predicted + reserve and allocator margin of 80G" in " ".join(
        output.split()
    )
    _check_columns_explained(args, output)


def test_wide_shows_every_column_uncut() -> None:
    narrow = _run(ESTIMATE, 80, terminal=False)
    wide = _run([*ESTIMATE, "--wide"], 80, terminal=False)
    assert "not shown at 80 columns: " in " ".join(narrow.split())
    assert set(_headers(narrow)) < set(_headers(wide))
    assert {"PP comm", "DP comm"} <= set(_headers(wide))
    assert "…" not in wide and max(len(line) for line in wide.splitlines()) > 80


def test_fitted_table_leaves_out_droppable_columns_in_order() -> None:
    columns = [
        Column(header="name", meaning="n", justify="left"),
        Column(header="a", meaning="a", drop=1),
        Column(header="b", meaning="b", drop=2),
        Column(header="c", meaning="c", drop=1),
    ]
    rows = [Row(["x" * 10, "1" * 10, "2" * 10, "3" * 10])]
    # four columns of 10 and three gaps of 2: 46 columns
    assert [c.header for c in fitted_table(None, columns, rows, width=46).columns] == [
        "name",
        "a",
        "b",
        "c",
    ]
    # the highest drop first, then the rightmost of equals
    table = fitted_table(None, columns, rows, width=45)
    assert [c.header for c in table.columns] == ["name", "a", "c"]
    assert table.caption == "not shown at 45 columns: b (--wide shows them)"
    # a column's note is said only while the column is shown
    notes = {"b": "b: bee", "a": "a: ay", "z": "z: not a column here"}
    table = fitted_table(None, columns, rows, width=45, notes=notes)
    assert table.caption == "a: ay; not shown at 45 columns: b (--wide shows them)"
    table = fitted_table(None, columns, rows, width=30, caption="x: y")
    assert [c.header for c in table.columns] == ["name", "a"]
    assert table.caption == "x: y; not shown at 30 columns: b, c (--wide shows them)"
    # a folding column wraps only once no column is left to drop
    folding = [Column(header="text", meaning="t", justify="left", fold=True), *columns[1:]]
    text_rows = [Row([" ".join(["word"] * 4), "1" * 10, "2" * 10, "3" * 10])]
    table = fitted_table(None, folding, text_rows, width=43)  # 19 + 10 + 10 and two gaps
    assert [c.header for c in table.columns] == ["text", "a", "c"]
    table = fitted_table(None, folding, text_rows, width=20)
    assert [c.header for c in table.columns] == ["text"] and table.natural_width == 4
    # wide: every column, printed whole on a narrower console
    table = fitted_table(None, columns, rows, width=30, wide=True)
    assert len(table.columns) == 4 and table.natural_width == 46
    out = Console(width=30, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    print_fitted(out, table)
    text = out.export_text()
    assert "…" not in text and "3333333333" in text


def test_messages_wrap_at_word_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    message = "stages = [0-2, 3-4]: deepspeed's PipelineModule " * 8
    assert error_text(message, None) == f"autoplan: error: {message}"  # piped: one line
    wrapped = error_text(message, 80)
    assert all(len(line) <= 80 for line in wrapped.splitlines())
    assert " ".join(wrapped.split()) == " ".join(f"autoplan: error: {message}".split())
    comment = comment_lines("note: " + "a long note that says something " * 10, 100)
    assert all(line.startswith("# ") and len(line) <= 100 for line in comment.splitlines())
    # the example's plan line breaks between its phrases only
    phrases = ["plan for 2 processes: dp 1 x tp 1 x pp 2", "schedule interleaved-zb"]
    phrases += ["1 micro-batches of 4", "ZeRO-0", "recompute none", "fp32"]
    lines = wrap_phrases(phrases, 60).splitlines()
    assert all(len(line) <= 60 for line in lines)
    assert len(lines) > 1
    assert all(any(phrase in line for line in lines) for phrase in phrases)  # none split
    monkeypatch.setenv("COLUMNS", "80")
    assert console_width() == 80
    monkeypatch.delenv("COLUMNS")
    assert console_width() == WIDTH  # pytest's stdout is not a terminal


def test_an_error_on_a_terminal_wraps_and_piped_stays_one_line() -> None:
    """The console script in a real pseudo-terminal of 60 columns: the error wraps at words;
    piped, the same error is one line."""
    args = [str(Path(sys.executable).parent / "autoplan"), "cluster", "show", "no-such-preset"]
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TTY_COMPATIBLE")}
    piped = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert piped.returncode == 2 and piped.stderr.count("\n") == 1, piped.stderr
    leader, follower = pty.openpty()
    # the terminal's size: 24 rows of 60 columns (TIOCSWINSZ)
    import fcntl
    import termios

    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 60, 0, 0))
    process = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=120) == 2
    shown = ANSI.sub("", b"".join(chunks).decode()).replace("\r", "")
    lines = [line for line in shown.splitlines() if line.strip()]
    assert len(lines) > 1 and all(len(line) <= 60 for line in lines), shown
    assert " ".join(shown.split()) == " ".join(piped.stderr.split())


def test_cells_are_compact_and_runs_collapse() -> None:
    # the peak includes the reserve and margin; the cell splits them
    gib, mib = 2**30, 2**20
    assert fmt_memory_cell((71.4 + 5.57) * gib, 5.57 * gib, 80 * gib) == "71.4G+5.57G/80G"
    assert fmt_memory_cell((14.9 + 512) * mib, 512 * mib, 5.89 * gib) == "14.9M+512M/5.89G"
    assert fmt_memory_cell(3 * 2**30, 0, 16 * 2**30) == "3G/16G"
    assert fmt_recompute(["selective", "selective"]) == "selective"
    assert fmt_recompute(["selective", "none", "full"]) == "mixed"
    assert fmt_recompute(["none", "full"]) == "full+none"
    rows = [(0, ["a"]), (1, ["b"]), (2, ["b"]), (3, ["b"]), (4, ["a"]), (6, ["a"])]
    assert collapse_runs(rows) == [("0", ["a"]), ("1-3", ["b"]), ("4", ["a"]), ("6", ["a"])]


def cell_of(predicted_bytes: float, reserve_bytes: float) -> str:
    return f"{short_bytes(predicted_bytes)}+{short_bytes(reserve_bytes)}"


@pytest.mark.parametrize("width", [80, WIDTH])
def test_the_ranked_table_with_its_layout_column_keeps_every_cell_whole(width: int) -> None:
    # issue 44: with the layout column the memory cell was cut ("73.6G+5.68G/8…")
    import autoplan
    from autoplan.cli.plan_cmd import ranked_table

    graph = autoplan.trace(autoplan.models.gpt(2, 64, 4, 32, 128))
    plans = tuple(
        autoplan.manual_plan(graph, "dgx-a100-80g", pp=2, global_batch=64, rank_layout=layout)
        for layout in (("pp", "dp", "tp"), ("dp", "pp", "tp"))
    )
    console = Console(width=width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    print_fitted(console, ranked_table(plans, width=width))
    text = console.export_text()
    _check_fits(text, width)
    for plan in plans:
        e = plan.estimate
        assert e is not None
        # predicted + reserve, the capacity (shared) said in the caption
        predicted = e.peak_memory_bytes - e.memory_reserve_bytes
        assert re.search(rf"\s{re.escape(cell_of(predicted, e.memory_reserve_bytes))}\n", text)
    assert "margin of 80G" in " ".join(text.split())
    headers = _headers(text)
    assert "memory" in headers and ("layout" in headers) == (width == WIDTH)


@pytest.mark.parametrize("width", [60, 80, 100])
def test_a_launch_line_wraps_as_the_shell_joins_it_back(width: int) -> None:
    """The exported launch line at any width: each line fits (a word longer than a line stays
    whole), every line but the last ends in the shell's continuation, and the shell's words of
    the joined lines are the command's."""
    import shlex

    from autoplan._format import shell_lines

    command = ["CUDA_DEVICE_MAX_CONNECTIONS=1", "torchrun", "--nnodes=4", "--nproc-per-node=8"]
    command += ["--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"]
    command += ["pretrain_gpt.py", "--data-path", "/a/very/long/path/" + "x" * 90, "--bf16"]
    text = shell_lines(command, width)
    lines = text.splitlines()
    assert len(lines) > 1 and all(line.endswith(" \\") for line in lines[:-1])
    assert all(len(line) <= width for line in lines if "x" * 90 not in line), lines
    assert shlex.split(text.replace("\\\n", " ")) == command
