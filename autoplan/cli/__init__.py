"""The ``autoplan`` command line.

Every command takes ``--json`` for machine-readable output on stdout. A user mistake (bad flag,
file, model or cluster spec, impossible plan) prints one message ``autoplan: error: ...`` on
stderr and exits 2, never a traceback: one line when stderr is a file or a pipe (for scripts and
logs), wrapped at word boundaries to the terminal's width when it is a terminal. One module per
command; each is registered below.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import NoReturn

import click

from autoplan import __version__
from autoplan._format import wrap_words
from autoplan.cli.calibrate_cmd import calibrate_cmd
from autoplan.cli.cluster_cmd import cluster
from autoplan.cli.common import stderr_width
from autoplan.cli.estimate_cmd import estimate_cmd
from autoplan.cli.explain_cmd import explain_cmd
from autoplan.cli.export_cmd import export_cmd
from autoplan.cli.models_cmd import models_cmd
from autoplan.cli.plan_cmd import plan_cmd
from autoplan.cli.trace_cmd import trace
from autoplan.cli.validate_cmd import validate
from autoplan.cli.whatif_cmd import whatif_cmd
from autoplan.contract.errors import InputError
from cost_model.schema import shown


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autoplan")
def cli() -> None:
    """autoplan: search and compile parallel training plans for Transformers."""


cli.add_command(cluster)
cli.add_command(models_cmd)
cli.add_command(validate)
cli.add_command(trace)
cli.add_command(estimate_cmd)
cli.add_command(plan_cmd)
cli.add_command(calibrate_cmd)
cli.add_command(whatif_cmd)
cli.add_command(explain_cmd)
cli.add_command(export_cmd)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: user mistakes become one line on stderr and exit code 2
    (with ``--json``, also a JSON object ``{"error": ..., "kind": ...}`` on stdout)."""
    args = list(argv) if argv is not None else sys.argv[1:]
    for arg in args:
        if "\x00" in arg:
            # no shell passes one; click's path checks would raise ValueError on it
            _fail(f"argument {shown(arg)} contains a NUL byte; remove it", "UsageError", args, 2)
    try:
        # (a command that raises click's Exit returns its code here: e.g. 130 after an
        # interrupted search printed its best plan)
        code = cli.main(args=args, prog_name="autoplan", standalone_mode=False)
        if isinstance(code, int) and code != 0:
            sys.exit(code)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.UsageError as error:
        where = error.ctx.command_path if error.ctx is not None else "autoplan"
        _fail(f"{error.format_message()} (see '{where} --help')", "UsageError", args, 2)
    except click.ClickException as error:
        _fail(error.format_message(), type(error).__name__, args, error.exit_code)
    except click.exceptions.Abort:
        click.echo("autoplan: aborted", err=True)
        sys.exit(130)
    except InputError as error:
        # a file that could not be written on a full disk (cost_model.files.OutputFileError)
        # is a failure of the run: exit 1
        _fail(str(error), type(error).__name__, args, getattr(error, "exit_code", 2))


# The longest error line printed. Messages show values through `shown` (about 80 characters
# each); this is the last resort for a message that embeds one whole (click's own, a library's).
MAX_ERROR_CHARS = 1000


def _fail(message: str, kind: str, args: Sequence[str], code: int) -> NoReturn:
    line = " ".join(message.split())  # one line, whatever the message held
    if len(line) > MAX_ERROR_CHARS:  # keep the start (what) and the end (the fix)
        cut = len(line) - MAX_ERROR_CHARS + 40
        line = f"{line[:700]} ...[{cut:,} characters cut]... {line[700 + cut :]}"
    if "--json" in args:
        click.echo(json.dumps({"error": line, "kind": kind}))
    click.echo(error_text(line, stderr_width()), err=True)
    sys.exit(code)


def error_text(line: str, width: int | None) -> str:
    """``autoplan: error: LINE``: one line for scripts and logs (``width`` None: stderr is
    not a terminal), else wrapped at word boundaries to ``width`` columns for a person, later
    lines indented (the message stays one message either way)."""
    text = f"autoplan: error: {line}"
    return text if width is None else wrap_words(text, max(width, 40), indent="  ")
