"""Every command's human-readable output fits 100 columns, whole: no line wider, no cell cut
short with an ellipsis (one-line verdicts that name a user's path or model spec, such as
`validate`'s, stay one line and are checked elsewhere). Run in-process (the output is not a terminal, so the console is 100
columns wide), on plans with the widest cells a user meets: interleaved schedules with many
pipeline ranks, mixed recompute, what-if rows with and without a plan, costs."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from autoplan._format import WIDTH, collapse_runs, fmt_memory_cell, fmt_recompute
from autoplan.cli import cli

GPT = "gpt:num_layers=24,hidden_size=1024,num_heads=16,seq_len=1024,vocab_size=50304"


def _check_fits(output: str) -> None:
    for line in output.splitlines():
        assert len(line.rstrip()) <= WIDTH, f"{len(line.rstrip())} columns: {line!r}"
    assert "…" not in output, output


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("width") / "plan.yaml"
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            "--model",
            GPT,
            "--cluster",
            "dgx-a100-80g:nodes=16",
            "--global-batch",
            "512",
            "--pp",
            "8",
            "--schedules",
            "interleaved-1f1b",
            "--budget",
            "1",
            "--top",
            "5",
            "-o",
            str(path),
        ],
    )
    assert result.exit_code == 0, result.output
    _check_fits(result.output)
    assert "best plans (rank 1 is chosen)" in result.output
    assert "per pipeline rank" in result.output
    return path


@pytest.mark.parametrize(
    "args",
    [
        ["explain", "{plan}", "--model", GPT, "--budget", "1"],
        [
            *("estimate", "--model", GPT, "--cluster", "dgx-a100-80g:nodes=16"),
            *("--global-batch", "512", "--tp", "8", "--pp", "8", "--virtual-stages", "3"),
            *("--recompute", "selective", "--zero", "1"),
        ],
        [
            *("whatif", "--model", GPT, "--cluster", "dgx-a100-40g,dgx2-v100-32g"),
            *("--num-devices", "1,16,128", "--global-batch", "512", "--budget", "1"),
            *("--tokens", "3e11", "--price-per-device-hour", "2.5", "--currency", "EUR"),
        ],
        ["trace", "--model", "gpt2-small", "--all"],
        ["trace", "--model", "llama3-405b"],
        ["trace", "--model", "deepseek-moe-16b"],  # its experts' line
        ["models"],
        ["cluster", "list"],
        ["cluster", "show", "dgx2-v100-32g"],
    ],
    ids=lambda args: " ".join(args[:3]),
)
def test_command_output_fits_100_columns(args: list[str], plan_file: Path) -> None:
    result = CliRunner().invoke(cli, [a.replace("{plan}", str(plan_file)) for a in args])
    assert result.exit_code == 0, result.output
    _check_fits(result.output)


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
