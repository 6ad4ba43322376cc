"""`autoplan export`: the launch config of a plan on Megatron-LM, torchtitan or DeepSpeed.

Prints the files (or writes them to ``-o DIR``), the launch line and what the user still
supplies. The model comes from the plan's ``model.name`` (or ``--model``), the cluster from
``--cluster``, else the cluster the plan records (as `autoplan validate` and `explain` resolve
them; one line naming what to pass when they cannot be). The plan is first checked as
`autoplan validate` checks it: its devices are the cluster's whole nodes, it was made for the
model (fingerprint), and its predicted peak memory fits (``--allow-over-memory`` warns instead,
as validate's). A plan the framework cannot express fails with one line naming every such
field, the option the framework lacks and the nearest plan it can run
(`autoplan.export.ExportError`). A plan priced for another stack than the target exports with a
note saying so (printed first, as a comment line). The launch line carries its rendezvous
(torchrun's c10d, or DeepSpeed's launcher without ssh) and the environment the stack needs;
the variables it names (``$MASTER_ADDR`` ...) are listed above it, with what to set.

With ``-o DIR`` the files are written atomically, never through a symbolic link, and a file
export did not write (or that was edited since) is replaced only with ``--force``
(`autoplan.export.writing`); the same export twice succeeds.
"""

from __future__ import annotations

import click

from autoplan._format import comment_lines, shell_lines
from autoplan.analysis.explain import plan_cluster, plan_model_spec
from autoplan.cli.common import console, echo_err, emit_json, json_option, trace_spec
from autoplan.cli.progress import progress_enabled, progress_option, status_reporter
from autoplan.contract.plan import Plan
from autoplan.export import FRAMEWORKS, check_devices, export_plan
from autoplan.export.writing import ExportWrite, write_export
from cost_model.hardware import load_cluster
from cost_model.messages import shown


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
    help="Cluster NAME[:k=v,...] or YAML the plan runs on: its nodes and memory "
    "[the plan's estimate.cluster, its device count].",
)
@click.option(
    "--allow-over-memory",
    is_flag=True,
    help="Warn instead of failing when the predicted peak memory exceeds the device's.",
)
@click.option(
    "--allow-cross-node-tp", is_flag=True, help="Accept tensor-parallel groups that span nodes."
)
@click.option(
    "--force",
    is_flag=True,
    help="With -o: replace files in the folder that autoplan export did not write (or that "
    "were edited since); symbolic links are refused even so.",
)
@progress_option
@json_option
def export_cmd(
    plan_path: str,
    framework: str,
    output_dir: str | None,
    model_spec: str | None,
    cluster_spec: str | None,
    allow_over_memory: bool,
    allow_cross_node_tp: bool,
    force: bool,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Write what launches a plan on Megatron-LM, torchtitan or DeepSpeed."""
    plan = Plan.from_yaml(plan_path)
    cluster_note = ""
    if cluster_spec is not None:
        target = load_cluster(cluster_spec)
    else:
        target, cluster_note = plan_cluster(plan, plan_path)
    if model_spec is None:
        model_spec, _ = plan_model_spec(plan, plan_path)
    check_devices(plan, target)  # whole nodes of the cluster: fail before the (slower) trace
    # progress on stderr (`autoplan.cli.progress`): torch's import and a trace take seconds
    with status_reporter("export", enabled=progress_enabled(progress, as_json)) as status:
        status.update(f"tracing {shown(model_spec, quoted=False)}")
        graph = trace_spec(model_spec)
    result = export_plan(
        plan,
        framework,
        model=model_spec,
        cluster=target,
        graph=graph,
        allow_over_memory=allow_over_memory,
        allow_cross_node_tp=allow_cross_node_tp,
    )
    memory = result.memory
    if memory is not None and not memory.fits:
        echo_err(f"WARNING (--allow-over-memory): {memory.problem}")
    wrote: ExportWrite | None = None
    if output_dir is not None:
        wrote = write_export(output_dir, result.files, force=force)
    if as_json:
        emit_json(
            {
                "framework": result.framework,
                "files": dict(result.files),
                "written": None if wrote is None else [str(p) for p in wrote.paths],
                "unchanged": None if wrote is None else [str(p) for p in wrote.unchanged],
                "command": list(result.command),
                "command_line": result.command_line,
                "variables": {v.name: v.meaning for v in result.variables},
                "notes": list(result.notes),
                "stack_note": result.stack_note,
                "memory": None if memory is None else str(memory),
                "peak_memory_bytes": None if memory is None else memory.peak_memory_bytes,
                "cluster_note": cluster_note or None,
            }
        )
        return
    out = console()
    if result.stack_note is not None:
        out.print(
            comment_lines(f"note: {result.stack_note}", out.width), style="bold", markup=False
        )
    if cluster_note:
        out.print(comment_lines(f"using {cluster_note}", out.width), style="dim", markup=False)
    if memory is not None and memory.fits:
        out.print(comment_lines(f"checked: {memory}", out.width), style="dim", markup=False)
    if wrote is not None:
        for path in wrote.paths:
            verb = "unchanged" if path in wrote.unchanged else "wrote"
            out.print(f"{verb} {path}", markup=False, soft_wrap=True)
    else:
        for name, text in result.files.items():
            out.print(f"# ---- {name} ----", style="bold", markup=False)
            out.print(text.rstrip("\n"), markup=False, soft_wrap=True, highlight=False)
    out.print("# launch (the same line on every node):", style="bold", markup=False)
    for variable in result.variables:
        out.print(
            comment_lines(f"set {variable}", out.width, prefix="#   "), style="bold", markup=False
        )
    # wrapped with the shell's line continuations: it still pastes as one command
    out.print(shell_lines(result.command_line_words, out.width), markup=False, soft_wrap=True)
    for note in result.notes:
        out.print(comment_lines(f"note: {note}", out.width), style="dim", markup=False)
