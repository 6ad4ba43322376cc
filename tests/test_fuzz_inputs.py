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
import re
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
        # what-if progress lines (stdout is not a terminal) may come before the error's line
        lines = [
            line
            for line in err.strip().splitlines()
            if not re.fullmatch(r"what-if: \d+/\d+ searches done", line)
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
         "--time-limit", "--top", "-o", "--framework"),
        ("--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8", "--budget", "1"),
    ),
    "estimate": (
        ("--model", "--cluster", "--global-batch", "--tp", "--pp", "--dp", "--micro-batch",
         "--recompute", "--zero", "--schedule", "--virtual-stages", "--dtype", "--framework"),
        ("--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8"),
    ),
    "whatif": (
        ("--model", "--cluster", "--num-devices", "--global-batch", "--tokens",
         "--price-per-device-hour", "--currency", "--set", "--plot", "--max-tp", "--zero",
         "--framework"),
        ("--model", MODEL, "--cluster", CLUSTER, "--num-devices", "8", "--global-batch", "8",
         "--budget", "1"),
    ),
    "trace": (("--model", "--batch-size", "--seq-len"), ("--model", MODEL)),
    "cluster show": ((), (CLUSTER,)),
    "validate": (("--cluster", "--model"), ("/no/such/plan.yaml",)),
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
                   "framework"],
        "Plan": ["dp_degree", "tp_degree", "pp_degree", "micro_batch_size", "num_micro_batches",
                 "global_batch_size", "schedule", "zero_stage", "dtype", "virtual_stages",
                 "sequence_parallel", "rank_layout", "framework"],
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
