"""Helpers shared by the CLI commands: the ``--json`` flag, JSON output, the rich console."""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import click
from rich.console import Console

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def emit_json(data: object) -> None:
    """Print ``data`` as JSON on stdout (the ``--json`` output of every command)."""
    click.echo(json.dumps(data, indent=2))


def console() -> Console:
    """A rich console for tables and progress bars on stdout (160 columns when not a terminal,
    so piped and captured output keeps whole table cells)."""
    return Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def load_model(spec: str) -> Any:
    """A model from a CLI ``--model`` spec (zoo preset or builder with overrides), on meta.

    Imported on use: torch takes seconds to import and the file commands do not need it.
    """
    build_model = importlib.import_module("autoplan.model_spec").build_model
    return build_model(spec)


def int_list(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[int, ...] | None:
    """Parse ``"2,4,8"`` into (2, 4, 8) for options that allow several values."""
    if value is None:
        return None
    try:
        values = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if not values:
        raise click.BadParameter("give at least one value")
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
