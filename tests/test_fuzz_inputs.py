"""Bad input never shows a traceback (issue 17): generated plan and cluster files, command lines
and API calls. Every CLI outcome is exit code 0, or exit code 2 with one line on stderr (with
``--json``, a JSON object on stdout too) and no traceback; every API mistake raises
`autoplan.InputError`.

The CLI runs in-process through `autoplan.cli.main` (the console script's entry point), so that
hundreds of inputs take seconds; tests/test_cli.py runs the real console script. Searches get a
small model and a one-second budget, so no input can run for long.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoplan
from autoplan.cli import main
from autoplan.contract.errors import InputError, PlanError
from autoplan.contract.plan import Plan

MODEL = "gpt:num_layers=2,hidden_size=64,num_heads=4,seq_len=32,vocab_size=128"
CLUSTER = "dgx-a100-80g"
FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Values a user might type where a number, a name or a path is expected.
WORDS = st.sampled_from(
    [
        "", " ", "0", "-1", "1", "2", "3", "7", "8", "1.5", "nan", "inf", "-inf", "1e30",
        "1e400", "999999999999", "abc", "80GiB", "5us", "x=1", ",", ":", "gpt", "llama",
        "gpt3-175b", "/", "/dev/null", "/no/such/file.yaml", "☃", "0x10", "true", "none",
        "fp8", "zigzag", "local", "dgx-a100-80g:nodes=0", "dgx-a100-80g:nodes=1e12",
        "megatron-lm", "torchtitan", "deepspeed",
    ]
)  # fmt: skip
JUNK: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | WORDS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _run(*args: str) -> tuple[int, str, str]:
    """The CLI on ``args``: (exit code, stdout, stderr). An exception that escapes `main` is
    what the console script would print as a traceback: it fails the test."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def _check_outcome(args: tuple[str, ...], code: int, out: str, err: str) -> None:
    assert "Traceback" not in out + err, (args, err)
    assert code in (0, 2), (args, code, err)
    if code == 2:
        # progress lines ("plan: tracing ... (2 s)": stderr is not a terminal) may come before
        # the error's line
        lines = [
            line
            for line in err.strip().splitlines()
            if not re.fullmatch(r"[\w-]+: .+ \(\d+ s\)", line)
        ]
        assert len(lines) == 1 and lines[0].startswith("autoplan: error: "), (args, err)
        if "--json" in args:
            data = json.loads(out.strip().splitlines()[-1])
            assert data["error"] and data["kind"], (args, out)


@pytest.fixture(scope="module")
def valid_plan() -> dict[str, Any]:
    graph = autoplan.trace(autoplan.models.gpt(2, 64, 4, 32, 128))
    plan = autoplan.manual_plan(graph, autoplan.Cluster.preset(CLUSTER), pp=2, global_batch=8)
    return plan.to_data()


def _mutate(data: dict[str, Any], draw: st.DrawFn) -> dict[str, Any]:
    """``data`` with one to three keys (top level or one below) replaced, dropped or added."""
    data = json.loads(json.dumps(data))
    for _ in range(draw(st.integers(1, 3))):
        target = data
        nested = [k for k, v in data.items() if isinstance(v, dict)]
        if nested and draw(st.booleans()):
            target = data[draw(st.sampled_from(nested))]
        action = draw(st.sampled_from(["replace", "drop", "add"]))
        if action == "add" or not target:
            target[draw(st.text(min_size=1, max_size=8))] = draw(JUNK)
        elif action == "drop":
            target.pop(draw(st.sampled_from(sorted(target))))
        else:
            target[draw(st.sampled_from(sorted(target)))] = draw(JUNK)
    return data


def _write(path: Path, data: object, draw: st.DrawFn) -> None:
    form = draw(st.sampled_from(["yaml", "json", "bytes", "text"]))
    if form == "bytes":
        path.write_bytes(draw(st.binary(max_size=40)))
    elif form == "text":
        path.write_text(draw(st.text(max_size=40)))
    elif form == "json":
        path.write_text(json.dumps(data, allow_nan=True))
    else:
        path.write_text(yaml.safe_dump(data, allow_unicode=True))


@FUZZ
@given(data=st.data())
def test_generated_plan_files(
    tmp_path: Path, valid_plan: dict[str, Any], data: st.DataObject
) -> None:
    path = tmp_path / "plan.yaml"
    _write(path, _mutate(valid_plan, data.draw), data.draw)
    json_flag = data.draw(st.sampled_from([(), ("--json",)]))
    args = ("validate", str(path), "--cluster", CLUSTER, "--model", MODEL, *json_flag)
    _check_outcome(args, *_run(*args))


@FUZZ
@given(data=st.data())
def test_generated_cluster_files(tmp_path: Path, data: st.DataObject) -> None:
    path = tmp_path / "cluster.yaml"
    base = autoplan.Cluster.preset(data.draw(st.sampled_from(["dgx-a100-80g", "local"])))
    _write(path, _mutate(base.to_data(), data.draw), data.draw)
    json_flag = data.draw(st.sampled_from([(), ("--json",)]))
    args = ("cluster", "show", str(path), *json_flag)
    _check_outcome(args, *_run(*args))


# command -> options that take a value, and the arguments that make it a valid call
COMMANDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "plan": (
        ("--model", "--cluster", "--global-batch", "--tp", "--pp", "--dp", "--micro-batch",
         "--max-tp", "--max-pp", "--zero", "--recompute", "--schedules", "--dtype",
         "--time-limit", "--top", "-o", "--framework", "--memory-headroom"),
        ("--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8", "--budget", "1"),
    ),
    "estimate": (
        ("--model", "--cluster", "--global-batch", "--tp", "--pp", "--dp", "--micro-batch",
         "--recompute", "--zero", "--schedule", "--virtual-stages", "--dtype", "--framework",
         "--memory-headroom"),
        ("--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8"),
    ),
    "whatif": (
        ("--model", "--cluster", "--num-devices", "--global-batch", "--tokens",
         "--price-per-device-hour", "--currency", "--set", "--plot", "--max-tp", "--zero",
         "--framework", "--memory-headroom"),
        ("--model", MODEL, "--cluster", CLUSTER, "--num-devices", "8", "--global-batch", "8",
         "--budget", "1"),
    ),
    "trace": (("--model", "--batch-size", "--seq-len"), ("--model", MODEL)),
    "cluster show": ((), (CLUSTER,)),
    "validate": (("--cluster", "--model", "--memory-headroom"), ("/no/such/plan.yaml",)),
}  # fmt: skip


@pytest.fixture
def in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Generated ``-o``/``--plot`` values are relative paths: they land in a scratch folder,
    never in the checkout."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@FUZZ
@given(data=st.data())
def test_generated_command_lines(in_tmp_dir: Path, data: st.DataObject) -> None:
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    options, valid = COMMANDS[command]
    args = list(valid)
    for _ in range(data.draw(st.integers(1, 3))):
        if options and data.draw(st.integers(0, 4)):
            # replace (or add) one option's value
            option = data.draw(st.sampled_from(options))
            value = data.draw(WORDS | st.text(max_size=10))
            if option in args and args.index(option) + 1 < len(args):
                args[args.index(option) + 1] = value
            else:
                args += [option, value]
        else:
            args.append(data.draw(WORDS | st.sampled_from(["--bogus", "--json", "-x", "--"])))
    if data.draw(st.booleans()):
        args.append("--json")
    full = (*command.split(), *args)
    _check_outcome(full, *_run(*full))


def test_a_nul_byte_in_a_path_option_is_one_line(in_tmp_dir: Path) -> None:
    # found by test_generated_command_lines: click's path check raised ValueError on it
    full = ("whatif", "--plot", "\x00")
    _check_outcome(full, *_run(*full))


@pytest.mark.parametrize(
    ("command", "option", "value"),
    [
        ("estimate", "--micro-batch", "-1"),
        ("estimate", "--dp", "-8"),
        ("estimate", "--tp", "0"),
        ("plan", "--micro-batch", "0"),
        ("plan", "--dp", "2,-8"),
        ("plan", "--tp", "1,,2"),  # an empty item: not read as "1,2"
    ],
)
def test_a_degree_or_batch_below_one_names_its_flag(command: str, option: str, value: str) -> None:
    """The error names the flag the user typed (not the API's parameter name), in one line."""
    full = (command, "--model", MODEL, "--cluster", "local:devices=2", "--global-batch", "8")
    code, out, err = _run(*full, option, value)
    assert code == 2, (out, err)
    assert f"Invalid value for '{option}'" in err and err.count("\n") <= 1, err


# ------------------------------------------------------------------------------------- API


@pytest.fixture(scope="module")
def graph() -> Any:
    return autoplan.trace(autoplan.models.gpt(2, 64, 4, 32, 128))


@pytest.mark.parametrize("layout", [3, "dp", None, 1.5])
def test_a_rank_layout_that_is_not_a_list_is_a_plan_error(graph: Any, layout: Any) -> None:
    # Found by test_generated_api_calls: an int layout raised TypeError from manual_plan.
    with pytest.raises(PlanError, match=r"rank_layout = .* must be a list of the axes"):
        autoplan.manual_plan(graph, CLUSTER, global_batch=8, rank_layout=layout)


def test_an_absurd_global_batch_is_a_plan_error_not_out_of_memory(graph: Any) -> None:
    # Found by test_generated_api_calls: global_batch 2^40 built 2^37 micro-batches' actions
    # and died with MemoryError.
    with pytest.raises(PlanError, match=r"num_micro_batches = 137,438,953,472: .* at most"):
        autoplan.manual_plan(graph, CLUSTER, global_batch=2**40)


API_VALUES = WORDS | JUNK | st.sampled_from([0, -1, 3, 2**40, math.nan, math.inf, 1.5, None])


@FUZZ
@given(data=st.data())
def test_generated_api_calls(graph: Any, data: st.DataObject) -> None:
    cluster = autoplan.Cluster.preset(CLUSTER)
    call = data.draw(st.sampled_from(["manual_plan", "search", "Plan", "estimate"]))
    keys = {
        "manual_plan": ["tp", "pp", "dp", "micro_batch", "global_batch", "recompute", "zero",
                        "schedule", "virtual_stages", "sequence_parallel", "dtype", "rank_layout",
                        "framework"],
        "search": ["global_batch", "tp", "pp", "dp", "micro_batch", "zero", "recompute",
                   "schedules", "dtype", "max_tp", "max_pp", "top_k", "time_limit_s",
                   "framework", "memory_headroom"],
        "Plan": ["dp_degree", "tp_degree", "pp_degree", "micro_batch_size", "num_micro_batches",
                 "global_batch_size", "schedule", "zero_stage", "dtype", "virtual_stages",
                 "sequence_parallel", "rank_layout", "framework", "memory_headroom"],
        "estimate": [],
    }[call]  # fmt: skip
    bad = {key: data.draw(API_VALUES) for key in data.draw(st.sets(st.sampled_from(keys or ["_"])))}
    bad.pop("_", None)
    target: Any = data.draw(st.sampled_from([cluster, "dgx-a100-80g", None, 8]))
    try:
        if call == "manual_plan":
            autoplan.manual_plan(graph, target, **{"global_batch": 8, **bad})
        elif call == "search":
            autoplan.search(graph, target, **{"global_batch": 8, "budget_s": 1.0, **bad})
        elif call == "Plan":
            base = autoplan.manual_plan(graph, cluster, global_batch=8)
            if data.draw(st.booleans()):  # built directly, not from a file
                fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
                plan = Plan(**{**fields, **bad})
            else:
                plan = Plan.from_data({**base.to_data(), **bad})
            plan.validate(graph.profile, target)
        else:
            plan = Plan.from_data(_mutate(autoplan.manual_plan(graph, cluster, global_batch=8)
                                          .to_data(), data.draw))  # fmt: skip
            autoplan.estimate(graph, target, plan)
    except InputError:
        pass


# ------------------------------------------------------------ bounded input files (issue 37)
#
# A hostile plan or cluster file can neither exhaust memory nor give a traceback: `read_yaml`
# refuses YAML aliases (a 1 KB "billion laughs" file expands into billions of values when a
# message prints it), nesting over MAX_DEPTH, files over MAX_FILE_BYTES and numbers over
# MAX_NUMBER_CHARS; messages show at most about 80 characters of any value (`shown`).

PLAN_FIELDS = ["dp_degree", "model.name", "stages.0.recompute", "estimate.cluster", "framework"]
CLUSTER_FIELDS = ["name", "device.peak_flops.fp32", "intra_node.bandwidth_bytes_per_s",
                  "calibration.gemm_efficiency", "device.name"]  # fmt: skip


def _alias_bomb(levels: int = 10, width: int = 9) -> str:
    """One flow-style YAML value of ~1 KB that PyYAML's safe loader expands into width**levels
    strings (10 levels of 9: 3.5 billion): each level lists the previous one `width` times."""
    value = "&a0 [" + ", ".join(["lol"] * width) + "]"
    for level in range(1, levels):
        value = f"&a{level} [{value}, " + ", ".join([f"*a{level - 1}"] * (width - 1)) + "]"
    return value


def _with(data: dict[str, Any], field: str, text: str) -> str:
    """``data`` as YAML with the value at dotted path ``field`` replaced by YAML ``text``."""
    data = json.loads(json.dumps(data))
    *parents, last = field.split(".")
    target: Any = data
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    target[last] = "PLACEHOLDER"
    return yaml.safe_dump(data, sort_keys=False).replace("PLACEHOLDER", text, 1)


def _cluster_data() -> dict[str, Any]:
    return autoplan.Cluster.preset(CLUSTER).to_data()


def _refused(args: tuple[str, ...], fragment: str) -> str:
    """Run the CLI on ``args``: exit 2, one line naming ``fragment``, no value shown whole."""
    code, out, err = _run(*args)
    _check_outcome(args, code, out, err)
    assert code == 2 and fragment in err, (args, err[:2000])
    assert len(err) < 600, err[:2000]  # the line names a value, it does not print it
    return err


def _plan_commands(path: Path) -> list[tuple[str, ...]]:
    return [
        ("validate", str(path), "--cluster", CLUSTER),
        ("explain", str(path), "--cluster", CLUSTER, "--model", MODEL),
        ("export", str(path), "--to", "megatron-lm", "--cluster", CLUSTER, "--model", MODEL),
    ]


def _cluster_commands(path: Path) -> list[tuple[str, ...]]:
    return [
        ("cluster", "show", str(path)),
        ("estimate", "--model", MODEL, "--cluster", str(path), "--global-batch", "8"),
    ]


@pytest.mark.parametrize("field", PLAN_FIELDS)
def test_an_alias_bomb_in_a_plan_field_is_refused(
    tmp_path: Path, valid_plan: dict[str, Any], field: str
) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_with(valid_plan, field, _alias_bomb()))
    assert path.stat().st_size < 4096
    for args in _plan_commands(path):
        _refused(args, "uses a YAML alias (*a0) at line")
    with pytest.raises(PlanError, match=r"uses a YAML alias .*; write the value out"):
        Plan.from_yaml(path)


@pytest.mark.parametrize("field", CLUSTER_FIELDS)
def test_an_alias_bomb_in_a_cluster_field_is_refused(tmp_path: Path, field: str) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_with(_cluster_data(), field, _alias_bomb()))
    for args in _cluster_commands(path):
        _refused(args, "uses a YAML alias (*a0) at line")
    with pytest.raises(autoplan.ClusterError, match="uses a YAML alias"):
        autoplan.Cluster.from_yaml(path)


def test_anchors_defined_elsewhere_and_a_merge_key_are_refused(
    tmp_path: Path, valid_plan: dict[str, Any]
) -> None:
    """The bomb in a key of its own, used by a field; and ``<<: *a`` (a merge is an alias)."""
    path = tmp_path / "plan.yaml"
    path.write_text(f"x: {_alias_bomb()}\n" + _with(valid_plan, "dp_degree", "*a9"))
    _refused(("validate", str(path), "--cluster", CLUSTER), "uses a YAML alias (*a0)")
    path.write_text("base: &b {num_nodes: 2}\n" + _with(_cluster_data(), "name", "x") + "<<: *b\n")
    _refused(("cluster", "show", str(path)), "uses a YAML alias (*b) at line")


@pytest.mark.parametrize(
    "nest", [("[" * 500, "]" * 500), ("{a: " * 500, "}" * 500), ("[" * 21, "]" * 21)]
)
def test_deep_nesting_is_refused_not_a_recursion_error(
    tmp_path: Path, valid_plan: dict[str, Any], nest: tuple[str, str]
) -> None:
    opening, closing = nest
    plan, cluster = tmp_path / "plan.yaml", tmp_path / "cluster.yaml"
    plan.write_text(_with(valid_plan, "stages.0.recompute", f"{opening}1{closing}"))
    cluster.write_text(_with(_cluster_data(), "device.peak_flops.fp32", f"{opening}1{closing}"))
    fragment = "nests lists or mappings more than 20 deep at line"
    for args in [*_plan_commands(plan), *_cluster_commands(cluster)]:
        _refused(args, fragment)
    with pytest.raises(PlanError, match=fragment):
        Plan.from_yaml(plan)
    with pytest.raises(autoplan.ClusterError, match=fragment):
        autoplan.Cluster.from_yaml(cluster)


def test_twenty_levels_of_nesting_still_load(tmp_path: Path, valid_plan: dict[str, Any]) -> None:
    """The bound refuses the 21st level, not a file that nests as deep as the bound allows: the
    value itself is then refused by the schema (a list is no recompute mode)."""
    path = tmp_path / "plan.yaml"
    path.write_text(_with(valid_plan, "stages.0.recompute", "[" * 16 + "1" + "]" * 16))
    with pytest.raises(PlanError, match=r"stages\[0\]\.recompute: \[\[\[\[.* is not one of"):
        Plan.from_yaml(path)


def test_too_many_values_are_refused(tmp_path: Path, valid_plan: dict[str, Any]) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(_with(valid_plan, "dp_degree", "[" + "0," * 100_001 + "]"))
    _refused(("validate", str(path), "--cluster", CLUSTER), "has more than 100,000 values")


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    """Over 1 MiB: refused from its size (stat) before a byte is read, so a 200 MB file costs
    nothing (a sparse file here: no disk and no time to write it)."""
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as file:
        file.truncate(200 * 2**20)
    fragment = "is 209,715,200 bytes; plan files are at most 1,048,576 bytes"
    for args in _plan_commands(huge):
        _refused(args, fragment)
    for args in _cluster_commands(huge):
        _refused(args, "is 209,715,200 bytes; cluster files are at most 1,048,576 bytes")
    with pytest.raises(PlanError, match=fragment):
        Plan.from_yaml(huge)


def test_a_twenty_megabyte_name_is_refused_by_size(
    tmp_path: Path, valid_plan: dict[str, Any]
) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(_with(valid_plan, "model.name", "a" * 20_000_000))
    err = _refused(("validate", str(path), "--cluster", CLUSTER), "plan files are at most")
    assert "aaaa" not in err


STRING_FIELDS = ["model.name", "framework", "estimate.cluster", "dtype", "stages.0.recompute"]


@pytest.mark.parametrize("field", STRING_FIELDS)
def test_a_long_string_is_refused_and_shown_shortened(
    tmp_path: Path, valid_plan: dict[str, Any], field: str
) -> None:
    """900 KB in a string field (under the file limit): refused, showing ~40 characters of it
    and its length."""
    path = tmp_path / "plan.yaml"
    path.write_text(_with(valid_plan, field, "x" * 900_000))
    for args in _plan_commands(path):
        err = _refused(args, "(900,000 characters)")
        assert "x" * 80 not in err


@pytest.mark.parametrize("field", STRING_FIELDS)
def test_a_string_at_the_limit_is_shown_shortened(
    tmp_path: Path, valid_plan: dict[str, Any], field: str
) -> None:
    """1,000 characters (the most a name takes) in a field: every message shows ~80 of them."""
    path = tmp_path / "plan.yaml"
    path.write_text(_with(valid_plan, field, "x" * 1000))
    for args in [*_plan_commands(path), ("explain", str(path)), ("export", str(path), "--to",
                 "torchtitan")]:  # fmt: skip
        code, out, err = _run(*args)
        _check_outcome(args, code, out, err)
        assert "x" * 80 not in err, err


@pytest.mark.parametrize("field", ["name", "description", "device.name"])
def test_a_long_cluster_string_is_refused_and_shown_shortened(tmp_path: Path, field: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(_with(_cluster_data(), field, "y" * 900_000))
    for args in _cluster_commands(path):
        err = _refused(args, "is too long; a name or a description has at most 1,000 characters")
        assert "y" * 80 not in err and "(900,000 characters)" in err


def test_a_cluster_name_at_the_limit_is_shown_shortened(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(_with(_cluster_data(), "name", "y" * 1000))
    plan = tmp_path / "plan.yaml"  # for 16 devices: the cluster has 8
    graph = autoplan.trace(autoplan.models.gpt(2, 64, 4, 32, 128))
    sixteen = autoplan.Cluster.preset(CLUSTER, nodes=2)
    autoplan.manual_plan(graph, sixteen, global_batch=16).to_yaml(plan)
    err = _refused(("validate", str(plan), "--cluster", str(path)), "(1,000 characters) has 8")
    assert "y" * 80 not in err


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("9" * 5000, "has a number of 5,000 characters (99999999999999999999...) at line"),
        ("9" * 101, "has a number of 101 characters"),
        ("9" * 100, "dp_degree = an integer of 100 digits is over 9,007,199,254,740,992"),
        ("1.0e-400", "has 1.0e-400, which is too small for a number (it would read as 0)"),
        ("1.0e+400", "has 1.0e+400, which is too large for a number"),
    ],
)
def test_huge_and_tiny_numbers_in_a_plan(
    tmp_path: Path, valid_plan: dict[str, Any], text: str, fragment: str
) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(_with(valid_plan, "dp_degree", text))
    _refused(("validate", str(path), "--cluster", CLUSTER), fragment)
    with pytest.raises(PlanError, match=re.escape(fragment)):
        Plan.from_yaml(path)


@pytest.mark.parametrize(
    ("field", "text", "fragment"),
    [
        # issue 37 item 14: 1e-400 underflowed to 0.0, which reads as "not stated"
        ("device.host_link_bandwidth_bytes_per_s", "1e-400GB/s", "'1e-400GB/s' is too small"),
        ("device.host_link_bandwidth_bytes_per_s", "1.0e-400", "has 1.0e-400, which is too small"),
        ("device.host_link_bandwidth_bytes_per_s", "1e-300", "= 1e-300 is outside [1000, 1e+15]"),
        ("device.peak_flops.fp32", "1e400", "'1e400' is too large for a number"),
        ("device.peak_flops.fp32", "1e30", "peak_flops.fp32 = 1e+30 is outside [1e+06, 1e+18]"),
        ("device.memory_bandwidth_bytes_per_s", "1e-5", "is outside [1000, 1e+15] bytes/s"),
        ("inter_node.bandwidth_bytes_per_s", "1e-400GB/s", "'1e-400GB/s' is too small"),
    ],
)
def test_a_cluster_number_that_underflows_or_overflows_is_refused(
    tmp_path: Path, field: str, text: str, fragment: str
) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(_with(_cluster_data(), field, text))
    for args in _cluster_commands(path):
        _refused(args, fragment)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("host_link_bandwidth=1e-400GB/s", "host_link_bandwidth takes 0 (not stated) or 1000 to"),
        ("host_link_bandwidth=1e-300GB/s", "outside [1000, 1e+15] bytes/s (or 0: not stated)"),
        ("inter_node_bandwidth=1e400GB/s", "'1e400GB/s' is too large for a number"),
        ("peak_flops_bf16=1e-400TFLOPS", "peak_flops_bf16 takes 1e+06 to 1e+18 FLOP/s"),
        ("memory_bandwidth=1e308TB/s", "is too large for a number"),
    ],
)
def test_a_cluster_override_that_underflows_or_overflows_is_refused(
    override: str, fragment: str
) -> None:
    _refused(("cluster", "show", f"{CLUSTER}:{override}"), fragment)
    # 0 stays "not stated", as documented
    assert (
        autoplan.Cluster.preset(
            CLUSTER, host_link_bandwidth="0"
        ).device.host_link_bandwidth_bytes_per_s
        == 0
    )


@pytest.mark.parametrize("version", ["true", "1.0", "'1'", "[1]"])
def test_a_schema_version_that_is_not_the_integer_1_is_refused(
    tmp_path: Path, valid_plan: dict[str, Any], version: str
) -> None:
    """``schema_version: true`` was read as 1 (``True == 1`` in Python)."""
    plan, cluster = tmp_path / "plan.yaml", tmp_path / "cluster.yaml"
    plan.write_text(_with(valid_plan, "schema_version", version))
    cluster.write_text(_with(_cluster_data(), "schema_version", version))
    _refused(("validate", str(plan), "--cluster", CLUSTER), "this autoplan reads version 1")
    _refused(("cluster", "show", str(cluster)), "this autoplan reads version 1")
    with pytest.raises(PlanError, match="schema_version = True"):
        Plan(**{**{f: getattr(Plan.from_data(valid_plan), f) for f in Plan.__dataclass_fields__},
                "schema_version": True})  # fmt: skip


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("estimate", "--model", "g" * 100_000, "--cluster", CLUSTER, "--global-batch", "8"),
         "(100,000 characters)"),
        (("estimate", "--model", MODEL, "--cluster", "c" * 100_000, "--global-batch", "8"),
         "(100,000 characters)"),
        (("estimate", "--model", MODEL.replace("=2,", "=" + "9" * 4000 + ","), "--cluster",
          CLUSTER, "--global-batch", "8"), "num_layers = an integer of 4,000 digits is more"),
        (("estimate", "--model", MODEL + ",dropout=" + "d" * 100_000, "--cluster", CLUSTER,
          "--global-batch", "8"), "dropout=ddddd"),
        (("cluster", "show", f"{CLUSTER}:memory=" + "8" * 100_000), "(100,000 characters)"),
        (("plan", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8",
          "--tp", "1," * 50_000 + "x"), "(100,001 characters)"),
    ],
)  # fmt: skip
def test_a_huge_command_line_value_is_shown_shortened(args: tuple[str, ...], fragment: str) -> None:
    """A value near the kernel's 128 KB limit on one argument; `shown` shortens it."""
    err = _refused(args, fragment)
    assert re.search(r"(.)\1{80}", err) is None, err


def test_the_error_line_is_capped_as_a_last_resort() -> None:
    """A message that embeds a value whole (click's own, for one) is cut to 1,000 characters,
    keeping its start and its end."""
    code, out, err = _run("plan", "--model", MODEL, "--cluster", CLUSTER, "--global-batch",
                          "z" * 100_000)  # fmt: skip
    _check_outcome(("plan",), code, out, err)
    assert code == 2 and len(err) < 1100 and "characters cut" in err, err[:2000]


# Through the real command line, in a separate process whose address space is capped: before
# issue 37 the bomb's message took 4 GB, here it would die with MemoryError (a traceback).
_MEMORY_CAP_BYTES = 3 * 2**30  # torch's import maps ~1 GB of address space


def _capped_cli(*args: str) -> subprocess.CompletedProcess[str]:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_CAP_BYTES, _MEMORY_CAP_BYTES))

    return subprocess.run(
        [sys.executable, "-m", "autoplan", *args],
        capture_output=True,
        text=True,
        preexec_fn=cap,
        timeout=300,
        check=False,
        env=dict(os.environ, NO_COLOR="1"),
    )


def test_bombs_through_the_real_command_line_in_bounded_memory(
    tmp_path: Path, valid_plan: dict[str, Any]
) -> None:
    plan, cluster, deep = tmp_path / "plan.yaml", tmp_path / "cluster.yaml", tmp_path / "deep.yaml"
    plan.write_text(_with(valid_plan, "model.name", _alias_bomb()))
    cluster.write_text(_with(_cluster_data(), "device.peak_flops.fp32", _alias_bomb()))
    deep.write_text(_with(valid_plan, "dp_degree", "[" * 5000 + "]" * 5000))
    for args, fragment in [
        (("validate", str(plan), "--cluster", CLUSTER), "uses a YAML alias (*a0) at line"),
        (("cluster", "show", str(cluster)), "uses a YAML alias (*a0) at line"),
        (("validate", str(deep), "--cluster", CLUSTER), "more than 20 deep at line"),
    ]:
        done = _capped_cli(*args)
        assert done.returncode == 2, (args, done.returncode, done.stderr[-3000:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("autoplan: error: "), done.stderr[-3000:]
        assert fragment in lines[0] and len(lines[0]) < 400, lines[0]


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("p" * 100_000 + ".yaml", "(100,005 characters): File name too long"),
        ("plan\x00.yaml", "contains a NUL byte"),
        ("/dev/zero", "is not a regular file"),
    ],
)
def test_an_unusable_path_is_an_input_error(path: str, fragment: str) -> None:
    """Too long a name for the OS (ENAMETOOLONG from stat was a traceback), a NUL byte."""
    with pytest.raises(PlanError, match=re.escape(fragment)):
        Plan.from_yaml(path)
    with pytest.raises(autoplan.ClusterError, match=re.escape(fragment)):
        autoplan.Cluster.from_yaml(path)
    if "\x00" not in path:  # the CLI refuses a NUL in any argument before this
        _refused(("validate", path, "--cluster", CLUSTER), fragment)
    if path.endswith(".yaml"):  # else a --cluster spec is a preset's name
        _refused(("cluster", "show", path), fragment)
