"""Helpers shared by the CLI commands: the ``--json`` flag, JSON output, the rich console."""

from __future__ import annotations

import json

import click
from rich.console import Console

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def emit_json(data: object) -> None:
    """Print ``data`` as JSON on stdout (the ``--json`` output of every command)."""
    click.echo(json.dumps(data, indent=2))


def console() -> Console:
    """A rich console for tables and progress bars on stdout."""
    return Console(highlight=False, soft_wrap=False)
