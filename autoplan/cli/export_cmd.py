"""`autoplan export`: the launch config of a plan on Megatron-LM, torchtitan or DeepSpeed.

Prints the files (or writes them to ``-o DIR``), the launch line and what the user still
supplies. The model's sizes come from the plan's ``model.name`` (or ``--model``); the launch
line's node count from ``--cluster``, else the cluster the plan records, else placeholders. A
plan the framework cannot express fails with one line naming every such field, the option the
framework lacks and the nearest plan it can run (`autoplan.export.ExportError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import click

from autoplan.analysis.explain import ExplainInputError, plan_cluster
from autoplan.cli.common import console, emit_json, json_option
from autoplan.contract.errors import InputError
from autoplan.contract.plan import Plan
from autoplan.export import FRAMEWORKS, export_plan
from cost_model.hardware import load_cluster


@click.command("export")
@click.argument("plan_path", metavar="PLAN.yaml")
@click.option(
    "--to",
    "framework",
    type=click.Choice(FRAMEWORKS),
    required=True,
    help="The training stack to launch the plan on.",
)
@click.option(
    "-o",
    "--output",
    "output_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write the files into this directory [print them].",
)
@click.option(
    "--model", "model_spec", default=None, help="Model NAME[:key=value,...] [the plan's model]."
)
@click.option(
    "--cluster",
    "cluster_spec",
    default=None,
    help="Cluster NAME[:k=v,...] or YAML, for the launch line's nodes [the plan's cluster].",
)
@json_option
def export_cmd(
    plan_path: str,
    framework: str,
    output_dir: str | None,
    model_spec: str | None,
    cluster_spec: str | None,
    as_json: bool,
) -> None:
    """Write what launches a plan on Megatron-LM, torchtitan or DeepSpeed."""
    plan = Plan.from_yaml(plan_path)
    devices_per_node = None
    if cluster_spec is not None:
        devices_per_node = load_cluster(cluster_spec).devices_per_node
    else:
        # a plan recording no resolvable cluster keeps $NNODES and $NPROC_PER_NODE
        with contextlib.suppress(ExplainInputError):
            devices_per_node = plan_cluster(plan, plan_path)[0].devices_per_node
    result = export_plan(plan, framework, model=model_spec, devices_per_node=devices_per_node)
    written: list[str] = []
    if output_dir is not None:
        written = _write(Path(output_dir), result.files)
    if as_json:
        emit_json(
            {
                "framework": result.framework,
                "files": dict(result.files),
                "written": written or None,
                "command": list(result.command),
                "command_line": result.command_line,
                "notes": list(result.notes),
            }
        )
        return
    out = console()
    if written:
        for path in written:
            out.print(f"wrote {path}", markup=False, soft_wrap=True)
    else:
        for name, text in result.files.items():
            out.print(f"# ---- {name} ----", style="bold", markup=False)
            out.print(text.rstrip("\n"), markup=False, soft_wrap=True, highlight=False)
    out.print("# launch (on every node):", style="bold", markup=False)
    out.print(result.command_line, markup=False, soft_wrap=True)
    for note in result.notes:
        out.print(f"# note: {note}", style="dim", markup=False, soft_wrap=True)


def _write(directory: Path, files: Mapping[str, str]) -> list[str]:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, text in files.items():
            path = directory / name
            path.write_text(text)
            paths.append(str(path))
    except OSError as error:
        raise InputError(f"-o/--output {str(directory)!r}: cannot write ({error})") from None
    return paths
