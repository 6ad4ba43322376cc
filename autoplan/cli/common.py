"""Helpers shared by the CLI commands: the ``--json`` flag, JSON output, the rich console."""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console

from autoplan._format import WIDTH, wrap_words
from cost_model.frameworks import DEFAULT_FRAMEWORK, FRAMEWORKS
from cost_model.schema import check_writable, shown

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def emit_json(data: object) -> None:
    """Print ``data`` as JSON on stdout (the ``--json`` output of every command): strict JSON,
    so a number too large for a float (a cost at absurd token counts) is null, not Infinity."""
    click.echo(json.dumps(_finite(data), indent=2, allow_nan=False))


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def console_width() -> int | None:
    """The columns output is laid out for: ``COLUMNS`` when set (a whole number >= 20), else
    the terminal's (None: rich asks it), else `WIDTH` when stdout is piped or redirected."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) >= 20:
        return int(columns)
    return None if sys.stdout.isatty() else WIDTH


def console() -> Console:
    """A rich console for tables and messages on stdout, `console_width` columns wide: the
    tables fit it (`autoplan._format.fitted_table`) and long messages wrap at its words."""
    return Console(highlight=False, soft_wrap=False, width=console_width())


def stderr_width() -> int | None:
    """The columns a message on stderr wraps to: the terminal's (or ``COLUMNS``) when stderr
    is a terminal, None when it is a file or a pipe (one line, for scripts and logs)."""
    return shutil.get_terminal_size((WIDTH, 24)).columns if sys.stderr.isatty() else None


def echo_err(text: str) -> None:
    """``text`` on stderr: one line piped, wrapped at word boundaries on a terminal (later
    lines indented)."""
    width = stderr_width()
    click.echo(text if width is None else wrap_words(text, max(width, 40), indent="  "), err=True)


# --wide: every column of the tables, whatever the console's width
wide_option = click.option(
    "--wide",
    is_flag=True,
    help="Show every table column, however wide (by default a table wider than the terminal "
    "leaves out some columns, and its caption names them).",
)


def load_model(spec: str) -> Any:
    """A model from a CLI ``--model`` spec (zoo preset or builder with overrides), on meta.

    Imported on use: torch takes seconds to import and the file commands do not need it.
    """
    build_model = importlib.import_module("autoplan.models.spec").build_model
    return build_model(spec)


def int_list(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[int, ...] | None:
    """Parse ``"2,4,8"`` into (2, 4, 8) for options that allow several values."""
    if value is None:
        return None
    parts = [part.strip() for part in value.split(",")]
    if not any(parts):
        raise click.BadParameter("give at least one value")
    if not all(parts):
        raise click.BadParameter(f"{shown(value)} has an empty item; write e.g. '2,4,8'")
    try:
        return tuple(int(part) for part in parts)
    except ValueError:
        raise click.BadParameter(
            f"{shown(value)} is not a comma-separated list of integers"
        ) from None


def positive_int_list(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[int, ...] | None:
    """`int_list` for degrees and sizes: every value >= 1."""
    values = int_list(ctx, param, value)
    if values is not None and (bad := [v for v in values if v < 1]):
        raise click.BadParameter(
            f"{shown(', '.join(map(shown, bad)), quoted=False)}: values must be whole numbers >= 1"
        )
    return values


def str_list(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[str, ...] | None:
    """Parse ``"none,selective"`` into ("none", "selective")."""
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


def trace_spec(spec: str) -> Any:
    """Build and trace the model of a ``--model`` spec; the profile is named after the spec."""
    trace = importlib.import_module("autoplan.tracing").trace
    return trace(load_model(spec), name=spec)


F = TypeVar("F", bound=Callable[..., Any])


# --framework: the training stack plans are priced for (cost_model.frameworks)
framework_option = click.option(
    "--framework",
    default=DEFAULT_FRAMEWORK,
    show_default=True,
    help=(
        f"Training stack to price the plan for: {', '.join(FRAMEWORKS)}; options as "
        "NAME:key=value (megatron-lm-2021:ddp=torch)."
    ),
)


# The plan dtypes: cost_model.degrees.DTYPE_NAMES (not imported: the CLI starts fast)
DTYPE_CHOICES = ("bf16", "fp16", "fp32", "fp8", "fp8-rowwise", "mxfp8")
# --dtype of one plan
dtype_option = click.option(
    "--dtype",
    type=click.Choice(DTYPE_CHOICES),
    default=None,
    help="Training dtype, or an fp8 recipe (fp8: tensor-wise, fp8-rowwise, mxfp8) "
    "[the device's fastest: bf16 on GPUs, fp32 on CPUs].",
)


def dtype_list(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[str, ...] | None:
    """Click callback: ``bf16,fp8`` -> ('bf16', 'fp8'), each a plan dtype."""
    if value is None:
        return None
    names = tuple(dict.fromkeys(part.strip() for part in value.split(",")))
    for name in names:
        if name not in DTYPE_CHOICES:
            raise click.BadParameter(
                f"{name!r} is not a dtype; use {', '.join(DTYPE_CHOICES)}, or a list such as "
                "bf16,fp8",
                ctx,
                param,
            )
    return names


# --dtype of a search: one or several to compare
dtypes_option = click.option(
    "--dtype",
    callback=dtype_list,
    default=None,
    help="Training dtype, an fp8 recipe (fp8: tensor-wise, fp8-rowwise, mxfp8), or a list "
    "of them to search over, e.g. bf16,fp8 [the device's fastest: bf16 on GPUs, fp32 on CPUs].",
)


# The precision policy (cost_model.precision; not imported: the CLI starts fast): plan fields
# master_dtype, grad_reduce_dtype, optimizer_state_dtype
_PRECISION_OPTIONS = [
    click.option(
        "--master-dtype",
        type=click.Choice(["fp32", "bf16"]),
        default=None,
        help="Master weights' dtype: bf16 keeps no fp32 copy [fp32].",
    ),
    click.option(
        "--grad-reduce-dtype",
        type=click.Choice(["fp32", "bf16", "fp16"]),
        default=None,
        help="Gradient accumulation and reduction dtype [fp32; fp16 under --dtype fp16].",
    ),
    click.option(
        "--optimizer-state-dtype",
        type=click.Choice(["fp32", "bf16"]),
        default=None,
        help="AdamW moments' dtype [fp32].",
    ),
]


def precision_options(command: F) -> F:
    """``--master-dtype``, ``--grad-reduce-dtype`` and ``--optimizer-state-dtype``: the plan's
    precision policy (None: not given)."""
    for option in reversed(_PRECISION_OPTIONS):
        command = option(command)
    return command


def precision_fields(options: dict[str, Any]) -> dict[str, str]:
    """The precision-policy fields given among a command's `precision_options`."""
    names = ("master_dtype", "grad_reduce_dtype", "optimizer_state_dtype")
    return {name: options[name] for name in names if options.get(name) is not None}


def memory_headroom(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """Click callback: a memory headroom is a fraction of device memory in [0, 0.9) (None:
    not given, the plan's recorded one or the default)."""
    if value is None:
        return None
    from cost_model.headroom import MemoryHeadroomError, parse_memory_headroom

    try:
        return parse_memory_headroom(value)
    except MemoryHeadroomError as error:
        raise click.BadParameter(str(error), ctx, param) from None


memory_headroom_option = click.option(
    "--memory-headroom",
    callback=memory_headroom,
    default=None,
    metavar="FRACTION",
    # cost_model.headroom.DEFAULT_MEMORY_HEADROOM (not imported: the CLI starts fast)
    help="Share of each device's memory to keep free beyond the upper end of the predicted "
    "peak's range, in [0, 0.9) [0.1, or the plan file's memory_headroom].",
)


# --compile: torch.compile of every plan's blocks (`Plan.compile`), a policy, not searched
compile_option = click.option(
    "--compile",
    is_flag=True,
    help="torch.compile each transformer block (priced as inductor's fusion of the "
    "element-wise and normalisation ops; refused by stacks that do not compile).",
)


# --tp-comm-overlap (estimate): the plan's sequence-parallel TP collectives overlapped with the
# GEMMs (`Plan.tp_comm_overlap`)
tp_comm_overlap_option = click.option(
    "--tp-comm-overlap",
    is_flag=True,
    help="Overlap the sequence-parallel TP all-gathers and reduce-scatters with the GEMMs "
    "(Megatron-LM's --tp-comm-overlap, torch's async TP; needs --sequence-parallel).",
)


def overlap_choice(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[bool, ...] | None:
    """``--tp-comm-overlap on|off`` as the search's constraint (None: as the stack runs it)."""
    return None if value is None else (value == "on",)


def _tp_overlap_text(framework: str) -> str:
    """How the plan's stack overlaps its TP communication, for a plan with ``tp_comm_overlap``."""
    overlap = FRAMEWORKS[framework.partition(":")[0]].tp_comm_overlap
    how = f": {overlap.name}" if overlap is not None else ""
    return f"sequence-parallel all-gathers and reduce-scatters overlapped with the GEMMs{how}"


def policy_lines(plan: Any) -> list[str]:
    """The lines `plan`, `estimate` and `explain` print under a plan's tables: its precision,
    what it compiles, how its stack overlaps TP communication and why its ZeRO level runs as
    another (each only where it says something)."""
    from autoplan._format import fmt_compile
    from cost_model.precision import precision_text

    lines = []
    precision = precision_text(plan.dtype, plan.fp8_exclude, plan.fp8_all_gather, plan.precision)
    if precision is not None:
        lines.append(f"[bold]precision:[/] {precision}")
    if compiled := fmt_compile([plan.stage_compiled(s) for s in range(plan.num_stages)]):
        lines.append(f"[bold]compile:[/] {compiled}")
    if plan.tp_comm_overlap:
        lines.append(f"[bold]TP communication:[/] {_tp_overlap_text(plan.framework)}")
    if (zero := zero_note(plan)) is not None:
        lines.append(f"[bold]ZeRO:[/] {zero}")
    return lines


# Why "ZeRO-1 (runs as ZeRO-2)" (`Plan.zero_text`; `cost_model.strategy.decide`)
ZERO_RUNS_AS = (
    "ZeRO-1 runs as ZeRO-2 on autoplan's runtime: outside plain DDP (fp32, no tensor or "
    "pipeline parallelism) the data-parallel wrapper is FSDP2, which shards the gradients with "
    "the optimizer state, and the plan is priced as it runs"
)


def zero_note(plan: Any) -> str | None:
    """Why a plan's ZeRO level runs as another (`Plan.zero_text` says "ZeRO-1 (runs as
    ZeRO-2)"), or None when it runs as named."""
    return ZERO_RUNS_AS if "runs as" in plan.zero_text else None


def search_options(*, with_dp: bool = True) -> Callable[[F], F]:
    """The planner's constraint options (``--tp 4,8``, ``--max-pp``, ``--zero 0,1``, ...) and
    ``--time-limit`` and ``--budget``; a command receives them as keyword arguments named like
    `autoplan.search`'s constraints (collect them with `search_constraints`)."""
    options = [
        click.option("--tp", callback=positive_int_list, help="Allowed TP degrees, e.g. 4,8."),
        click.option("--pp", callback=positive_int_list, help="Allowed pipeline degrees."),
        *(
            [
                click.option(
                    "--dp", callback=positive_int_list, help="Allowed data-parallel degrees."
                )
            ]
            if with_dp
            else []
        ),
        click.option(
            "--cp",
            callback=positive_int_list,
            help="Allowed context-parallel degrees [1 below 16K tokens, else those leaving "
            ">= 2048 tokens per rank].",
        ),
        click.option(
            "--ep",
            callback=positive_int_list,
            help="Allowed expert-parallel degrees [divisors of dp and of the experts].",
        ),
        click.option(
            "--etp",
            callback=positive_int_list,
            help="Allowed expert-tensor-parallel degrees (each routed expert split over etp "
            "ranks of the TP group; divisors of tp) [1, and tp where the stack splits experts: "
            "megatron-lm].",
        ),
        click.option(
            "--micro-batch", callback=positive_int_list, help="Allowed micro-batch sizes."
        ),
        click.option(
            "--max-tp",
            type=click.IntRange(min=1),
            default=None,
            help="Largest tensor-parallel degree to try [devices per node].",
        ),
        click.option(
            "--max-pp",
            type=click.IntRange(min=1),
            default=None,
            help="Largest number of pipeline ranks to try [the model's pipeline units].",
        ),
        click.option("--zero", callback=int_list, help="Allowed ZeRO levels, e.g. 0,1."),
        click.option(
            "--recompute", callback=str_list, help="Allowed recompute modes, e.g. none,selective."
        ),
        click.option(
            "--schedules", callback=str_list, help="Allowed schedules, e.g. 1f1b,interleaved-1f1b."
        ),
        dtypes_option,
        *_PRECISION_OPTIONS,
        compile_option,
        click.option(
            "--tp-comm-overlap",
            type=click.Choice(["on", "off"]),
            default=None,
            callback=overlap_choice,
            help="Overlap sequence-parallel TP communication with the GEMMs [on where the "
            "stack runs it: Megatron-LM; torchtitan and autoplan with --compile].",
        ),
        click.option(
            "--allow-cross-node-tp", is_flag=True, help="Let tensor-parallel groups span nodes."
        ),
        click.option(
            "--objective",
            # cost_model.uncertainty.OBJECTIVES (not imported: the CLI starts fast)
            type=click.Choice(["pessimistic", "expected"]),
            default="pessimistic",
            show_default=True,
            help="What the search minimises: the upper end of the step's 80% range "
            "(pessimistic) or the predicted step (expected).",
        ),
        memory_headroom_option,
        click.option(
            "--time-limit",
            type=click.FloatRange(min=0.01),
            callback=finite_seconds,
            default=10.0,
            show_default=True,
            help="Reference seconds of work per solver call (deterministic, like --budget).",
        ),
        click.option(
            "--budget",
            type=click.FloatRange(min=0.0),
            callback=finite_seconds,
            default=10.0,  # planner.search.DEFAULT_BUDGET_S (not imported: OR-tools loads slowly)
            show_default=True,
            help="Reference seconds of work the search may spend before it returns its best plan "
            "with its proven gap (0: until every candidate is proven). Work is counted, not "
            "timed, so the same question gets the same plan on any machine; a reference second "
            "is about a wall second on a 2-core machine, and a search stops at 10x its budget "
            "in wall time whatever its count (then it says so).",
        ),
    ]

    def decorate(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def search_constraints(options: dict[str, Any]) -> dict[str, Any]:
    """The constraints the user set among a command's `search_options` (not the limits)."""
    return {
        key: value
        for key, value in options.items()
        # (identity: a headroom of 0.0 equals False)
        if key not in ("time_limit", "budget") and value is not None and value is not False
    }


def range_level(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """Click callback: a range level is a fraction in (0, 1)."""
    from cost_model.uncertainty import RangeLevelError, check_range_level

    try:
        return check_range_level(value)
    except RangeLevelError as error:
        raise click.BadParameter(str(error), ctx, param) from None


def finite_seconds(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """Click callback: a number of seconds must be finite (``inf``/``nan`` parse as floats)."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{shown(value)} is not a finite number of seconds", ctx, param)
    return value


def check_output_path(path: str, option: str) -> None:
    """Fail before the work when ``path`` cannot be written."""
    check_writable(path, option)


def budget_s(options: dict[str, Any]) -> float | None:
    """The search's visit budget from ``--budget`` (0 means none)."""
    value = float(options.get("budget", 10.0))
    return value if value > 0 else None
