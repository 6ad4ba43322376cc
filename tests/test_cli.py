"""The command line: exit codes, tables, JSON, one-line errors (in-process through the console
script's entry point; `test_version` and `test_the_console_script_runs` start the real
script)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from autoplan import __version__
from autoplan.contract.plan import Plan, even_stages
from tests.conftest import run_cli

SMALL_MODEL = "gpt:num_layers=2,hidden_size=64,num_heads=4,seq_len=32,vocab_size=128"
ESTIMATE = ("estimate", "--model", SMALL_MODEL, "--cluster", "dgx-a100-80g")


def _assert_user_error(result: object, fragment: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)  # type: ignore[attr-defined]
    stderr: str = result.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in stderr
    # (a progress line, "estimate: tracing ... (2 s)", may come first on a loaded machine)
    lines = [
        line
        for line in stderr.strip().splitlines()
        if not re.fullmatch(r"[\w-]+: .+ \(\d+ s\)", line)
    ]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("autoplan: error: ")
    assert fragment in lines[0], lines[0]


def test_version() -> None:
    result = run_cli("--version", real=True)
    assert result.returncode == 0
    assert __version__ in result.stdout


def test_the_console_script_runs() -> None:
    # the installed script, a user error: one line, exit code 2, no traceback
    result = run_cli("estimate", "--model", "nosuch", "--cluster", "dgx-a100-80g",
                     "--global-batch", "8", real=True)  # fmt: skip
    _assert_user_error(result, "nosuch")


def test_help_lists_only_working_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    section = result.stdout.split("Commands:")[1]
    commands = [line.split()[0] for line in section.splitlines() if line.strip()]
    assert {"cluster", "validate"} <= set(commands)
    for command in commands:
        sub = run_cli(command, "--help")
        assert sub.returncode == 0, (command, sub.stderr)
        assert "Usage:" in sub.stdout


def test_cluster_show_table_and_json() -> None:
    table = run_cli("cluster", "show", "dgx-a100-80g:nodes=4")
    assert table.returncode == 0, table.stderr
    assert "4 node(s) x 8 = 32 A100-SXM4-80GB" in table.stdout
    assert "80 GiB" in table.stdout and "312 TFLOP/s" in table.stdout
    data = json.loads(run_cli("cluster", "show", "dgx-a100-80g:nodes=4", "--json").stdout)
    assert data["num_devices"] == 32 and data["num_nodes"] == 4
    assert data["device"]["memory_bytes"] == 80 * 2**30


def test_a_cluster_may_be_renamed_by_an_override() -> None:
    data = json.loads(run_cli("cluster", "show", "dgx-a100-80g:name=mine", "--json").stdout)
    assert data["name"] == "mine" and data["num_devices"] == 8


def test_cluster_show_from_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    assert run_cli("cluster", "show", "dgx-h100-80g:nodes=2", "--json").returncode == 0
    data = json.loads(run_cli("cluster", "show", "dgx-h100-80g:nodes=2", "--json").stdout)
    del data["num_devices"]
    path.write_text(yaml.safe_dump(data))
    result = run_cli("cluster", "show", str(path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["num_devices"] == 16


def _write_plan(tmp_path: Path, **changes: object) -> Path:
    plan = Plan(
        dp_degree=2,
        tp_degree=2,
        pp_degree=2,
        stages=even_stages(6, 2),
        micro_batch_size=1,
        num_micro_batches=4,
        global_batch_size=8,
    )
    data = plan.to_data()
    data.update(changes)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_validate_accepts_and_reports(tmp_path: Path) -> None:
    path = _write_plan(tmp_path)
    result = run_cli("validate", str(path), "--cluster", "dgx-a100-80g")
    assert result.returncode == 0, result.stderr
    assert "valid for dgx-a100-80g (8 devices)" in " ".join(result.stdout.split())
    data = json.loads(run_cli("validate", str(path), "--cluster", "dgx-a100-80g", "--json").stdout)
    assert data["valid"] is True


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("cluster", "show", "nosuch"), "unknown cluster preset 'nosuch'"),
        (("cluster", "show", "dgx-a100-80g:nodes=-2"), "num_nodes = -2 must be at least 1"),
        (("cluster", "show", "/no/such/file.yaml"), "does not exist"),
        (
            ("validate", "/no/such/plan.yaml", "--cluster", "local"),
            "plan file '/no/such/plan.yaml' does not exist",
        ),
        (("validate", "/tmp", "--cluster", "local"), "plan file '/tmp' is a directory"),
        (("validate", "/dev/zero", "--cluster", "local"), "'/dev/zero' is not a regular file"),
        (("cluster", "show", "dgx-a100-80g:nodes=x"), "nodes='x': expected a whole number"),
        (("cluster", "show", "dgx-a100-80g:memory=nan"), "memory='nan': cannot read 'nan'"),
        (
            ("cluster", "show", "dgx-a100-80g:inter_node_bandwidth=1e-300"),
            "bandwidth_bytes_per_s = 1e-300 is outside [1000, 1e+15] bytes/s; check its unit",
        ),
        (
            ("cluster", "show", "dgx-a100-80g:intra_node_latency=3600"),
            "latency_s = 3600 s is over 60 s; check its unit",
        ),
        (
            (
                "plan",
                "--model",
                "gpt2-small",
                "--cluster",
                "dgx-a100-80g",
                "--global-batch",
                "8",
                "-o",
                "/proc/autoplan-plan.yaml",
            ),
            "-o/--output '/proc/autoplan-plan.yaml'",  # not writable (Linux), or no such folder
        ),
        (
            (*ESTIMATE, "--global-batch", "8", "--dp", "3"),
            "dp x tp x pp = 3 x 1 x 1 = 3, but cluster 'dgx-a100-80g' has 8 devices; with tp = 1 "
            "and pp = 1 use dp = 8",
        ),
        (
            (*ESTIMATE, "--global-batch", "12"),
            "global_batch = 12 is not a multiple of micro_batch x dp = 1 x 8 = 8; use a global "
            "batch of 8 or 16",
        ),
        (
            (*ESTIMATE, "--global-batch", "8", "--tp", "3"),
            "choose tp and pp whose product is one of 1, 2, 4, 8",
        ),
        (
            ("plan", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--global-batch", "8"),
            # (how many devices: test_plan_cli, from the memory headroom rule)
            "devices of this type (2,602 GiB); use more devices or devices with more memory",
        ),
    ],
)
def test_user_errors_are_one_line(args: tuple[str, ...], fragment: str) -> None:
    _assert_user_error(run_cli(*args), fragment)


def test_plan_errors_are_one_line(tmp_path: Path) -> None:
    _assert_user_error(
        run_cli("validate", str(_write_plan(tmp_path)), "--cluster", "dgx-a100-80g:nodes=2"),
        "devices, but cluster 'dgx-a100-80g' has 16",
    )
    _assert_user_error(
        run_cli(
            "validate", str(_write_plan(tmp_path, global_batch_size=7)), "--cluster", "dgx-a100-80g"
        ),
        "global_batch_size = 7 must equal",
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("dp_degree: [\n")
    _assert_user_error(run_cli("validate", str(bad), "--cluster", "local"), "not valid YAML")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "is empty"),
        (b"# only a comment\n", "is empty"),
        (b"\xff\xfe", "is not UTF-8"),
        (b"name: a\nname: b\n", "at line 2: key 'name' is given twice; keep one"),
    ],
)
def test_unreadable_files_say_why(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "file.yaml"
    path.write_bytes(content)
    _assert_user_error(run_cli("validate", str(path), "--cluster", "local"), fragment)
    _assert_user_error(run_cli("cluster", "show", str(path)), fragment)


def test_usage_errors_exit_2_without_traceback() -> None:
    result = run_cli("validate")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "Missing argument" in result.stderr
    result = run_cli("nosuchcommand")
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_every_option_has_help() -> None:
    import click

    from autoplan.cli import cli

    missing = []

    def walk(command: click.Command, path: str) -> None:
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}")
            return
        assert command.help, path
        missing.extend(
            f"{path} {param.opts[0]}"
            for param in command.params
            if isinstance(param, click.Option) and not param.help
        )

    walk(cli, "autoplan")
    assert not missing, missing


def test_models_lists_the_presets_with_their_sizes() -> None:
    from autoplan.models import list_presets

    done = run_cli("models", "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert list(rows) == list_presets()
    assert rows["gpt3-175b"]["num_params"] == pytest.approx(174.6e9, rel=1e-3)
    assert rows["llama3-8b"]["num_kv_heads"] == 8
    table = run_cli("models")
    assert "gpt3-175b" in table.stdout and "174.62 B" in table.stdout


def test_a_plan_estimate_prints_as_a_sentence() -> None:
    from autoplan.contract.plan import PlanEstimate

    estimate = PlanEstimate(
        cluster="dgx-a100-80g",
        num_devices=64,
        step_time_s=3.99,
        tokens_per_s=131539.2,
        model_tflops_per_device=179.2,
        mfu=0.574,
        peak_memory_bytes=80 * 2**30,
        memory_reserve_bytes=6 * 2**30,
        memory_capacity_bytes=80 * 2**30,
    )
    assert str(estimate) == (
        "on 64 dgx-a100-80g devices: a step takes 3.99 s (131,539 tokens/s, MFU 57.4%); peak "
        "memory predicted 74 GiB + 6 GiB reserve/margin of 80 GiB (fits)"
    )


def test_validate_names_the_capacity_a_plan_was_made_for(tmp_path: Path) -> None:
    """A plan made with a memory override, validated against the plain preset its file
    names: the refusal says which capacity the plan was made for."""
    from autoplan import manual_plan
    from autoplan.models.spec import build_model
    from autoplan.tracing import trace

    graph = trace(build_model("llama3-8b"))
    big = "dgx-h100-80g:nodes=2,memory=160GiB"
    plan = manual_plan(graph, big, dp=16, global_batch=128, recompute="none", zero=1)
    assert plan.estimate is not None
    assert 80 * 2**30 < plan.estimate.peak_memory_bytes < 160 * 2**30
    path = tmp_path / "big.yaml"
    plan.to_yaml(path)
    _assert_user_error(
        run_cli("validate", str(path)),
        "the plan was made for devices of 160 GiB, its estimate.memory_capacity_bytes",
    )
