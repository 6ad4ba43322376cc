"""`autoplan explain`: a plan's per-stage breakdown, critical path and "why not" alternatives.

Without ``--model``/``--cluster`` the model and cluster the plan file records are used
(``model.name``, ``estimate.cluster`` with the plan's device count) and the output says so;
when they cannot be resolved the command says what to pass (one line, exit 2).
"""

from __future__ import annotations

from typing import Any

import click
from rich.padding import Padding
from rich.table import Table

from autoplan._format import (
    WIDTH,
    Row,
    collapse_runs,
    columns_help,
    fitted_table,
    fmt_gib,
    fmt_time,
    print_fitted,
)
from autoplan.analysis.explain import (
    Explanation,
    describe_plan,
    explain,
    plan_cluster,
    plan_model_spec,
)
from autoplan.analysis.timeline import timeline_of
from autoplan.cli.columns import MEMORY_COLUMNS, MEMORY_TABLE, STAGE_TABLE
from autoplan.cli.common import (
    ZERO_RUNS_AS,
    console,
    emit_json,
    finite_seconds,
    json_option,
    memory_headroom_option,
    policy_lines,
    trace_spec,
    wide_option,
    zero_note,
)
from autoplan.cli.estimate_cmd import stage_table, summary_line
from autoplan.cli.progress import progress_enabled, progress_option, status_reporter
from autoplan.cli.whatif_cmd import check_picture_path
from autoplan.contract.plan import Plan
from cost_model.frameworks import FRAMEWORKS
from cost_model.hardware import load_cluster
from cost_model.messages import shown


@click.command("explain", epilog=columns_help([STAGE_TABLE, MEMORY_TABLE]))
@click.argument("plan_path", metavar="PLAN.yaml")
@click.option(
    "--cluster",
    "cluster_spec",
    default=None,
    help="Cluster NAME[:k=v,...] or YAML [the plan's estimate.cluster, its device count].",
)
@click.option(
    "--model", "model_spec", default=None, help="Model NAME[:key=value,...] [the plan's model]."
)
@click.option(
    "--timeline",
    "timeline_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Draw one step of the pipeline schedule (.png, .pdf or .svg).",
)
@click.option(
    "--top",
    "top_k",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="How many of the search's best plans to compare with.",
)
@click.option(
    "--no-alternatives", is_flag=True, help="Skip the searches (breakdown and critical path only)."
)
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0.01),
    callback=finite_seconds,
    default=10.0,
    show_default=True,
    help="Seconds per solver call.",
)
@click.option(
    "--budget",
    type=click.FloatRange(min=0.0),
    callback=finite_seconds,
    default=10.0,
    show_default=True,
    help="Seconds each comparison search may visit candidates (0: until every one is proven).",
)
@click.option(
    "--framework",
    default=None,
    help=f"Training stack to price the plan for ({', '.join(FRAMEWORKS)}) [the plan's].",
)
@memory_headroom_option
@wide_option
@progress_option
@json_option
def explain_cmd(
    plan_path: str,
    cluster_spec: str | None,
    model_spec: str | None,
    timeline_path: str | None,
    top_k: int,
    no_alternatives: bool,
    time_limit: float,
    budget: float,
    framework: str | None,
    memory_headroom: float | None,
    wide: bool,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Explain a plan: where its step time goes and what the alternatives would cost."""
    plan = Plan.from_yaml(plan_path)
    notes: list[str] = []
    if cluster_spec is not None:
        target = load_cluster(cluster_spec)
    else:
        target, note = plan_cluster(plan, plan_path)
        notes.append(note)
    if model_spec is None:
        model_spec, note = plan_model_spec(plan, plan_path)
        notes.append(note)
    plan.validate(None, target)  # fail before the (slower) model trace
    if timeline_path is not None:
        check_picture_path(timeline_path, "--timeline")
    out = console()
    timeline: dict[str, Any] | None = None
    # progress on stderr: a bar on a terminal, else a line a phase (`autoplan.cli.progress`)
    with status_reporter("explain", enabled=progress_enabled(progress, as_json)) as status:
        status.update(f"tracing {shown(model_spec, quoted=False)}")
        profile = trace_spec(model_spec).profile
        status.update("pricing the plan")
        result = explain(
            plan,
            profile,
            target,
            top_k=top_k,
            alternatives=not no_alternatives,
            time_limit_s=time_limit,
            budget_s=budget if budget > 0 else None,
            progress=status.update,
            framework=framework,
            memory_headroom=memory_headroom,
        )
        if timeline_path is not None:
            status.update(f"drawing the timeline to {shown(timeline_path, quoted=False)}")
            # matplotlib takes about a second to import: only when a picture is asked for.
            from autoplan.analysis.plots import save_figure, timeline_figure, timeline_view

            simulated = timeline_of(result.estimate, plan)
            save_figure(timeline_figure(simulated), timeline_path, what="--timeline")
            view = timeline_view(simulated)
            timeline = {
                "path": timeline_path,
                "schedule": simulated.schedule,
                "pp_degree": simulated.pp_degree,
                "pipeline_time_s": simulated.pipeline_time_s,
                "step_time_s": simulated.step_time_s,
                # bars narrower than MIN_BAR_PX: each rank's time shares, and a zoom
                "aggregated": view.aggregated,
                "zoom_rank": view.zoom_rank,
                "zoom_window_s": list(view.window_s) if view.window_s else None,
            }
    if as_json:
        data = result.to_data()
        data["resolved"] = notes
        data["timeline"] = timeline
        emit_json(data)
        return
    _print(out, result, notes, plan, wide)
    if timeline is not None:
        out.print(
            f"wrote {timeline_path}: one step of {fmt_time(timeline['step_time_s'])} (the "
            "estimate's own simulation of the schedule)" + _zoom_note(timeline)
        )


def _print(out: Any, result: Explanation, notes: list[str], plan: Plan, wide: bool) -> None:
    for note in notes:
        out.print(f"[dim]using {note}[/]")
    out.print(
        f"[bold]{result.model}[/] on {result.cluster} ({result.num_devices} devices): "
        f"{describe_plan(result.plan)}, {plan.dtype}"
    )
    print_fitted(out, stage_table(result.estimate, plan, width=out.width, wide=wide))
    print_fitted(out, memory_table(result, width=out.width, wide=wide))
    out.print(summary_line(result.estimate))
    for line in policy_lines(plan):
        out.print(line)
    out.print(f"[bold]critical path:[/] {result.critical_path.summary()}")
    for note in result.notes:
        out.print(f"note: {note}")
    for line in result.coverage.lines() if result.coverage else ():
        out.print(f"[bold]coverage:[/] {line}")
    if result.alternatives:
        out.print("[bold]why not ...[/]")
        for alternative in result.alternatives:
            out.print(Padding(alternative.line, (0, 0, 0, 2)))
        # an alternative's "ZeRO-1 (runs as ZeRO-2)", explained where the plan's was not
        said = zero_note(plan) is not None
        if not said and any("(runs as ZeRO-" in a.line for a in result.alternatives):
            out.print(f"[bold]ZeRO:[/] {ZERO_RUNS_AS}")


def memory_table(result: Explanation, *, width: int = WIDTH, wide: bool = False) -> Table:
    """Each pipeline rank's peak memory per device against the capacity, in GiB (ranks whose
    cells agree share a row), fitted to ``width``."""
    e = result.estimate
    rows = [
        (
            m.pp_rank,
            [
                fmt_gib(m.param_bytes),
                fmt_gib(m.grad_bytes),
                fmt_gib(m.optimizer_bytes),
                fmt_gib(m.activation_bytes),
                fmt_gib(m.working_bytes),
                fmt_gib(m.loss_bytes),
                fmt_gib(m.reserve_bytes),
                fmt_gib(m.total_bytes),
                fmt_gib(m.capacity_bytes),
                f"{m.fraction:.0%}",
                "yes" if m.fits else "[bold red]NO[/]",
            ],
        )
        for m in result.memory
    ]
    return fitted_table(
        "memory per device at the peak (GiB)",
        MEMORY_COLUMNS,
        [Row([label, *cells]) for label, cells in collapse_runs(rows)],
        width=width,
        wide=wide,
        caption="activations: held micro-batches",
        # said of the columns shown (the capacity, when left out, still)
        notes={
            "working": "working: one backward's working set, p2p and DP buffers",
            "loss": "loss: fp32 log-probabilities",
            "reserve": "reserve: framework reserve + allocator margin",
            "fits": f"capacity {fmt_gib(e.memory_capacity_bytes)}; fits: total at most "
            f"{fmt_gib(e.usable_memory_bytes)} (the capacity less the {e.memory_headroom:.0%} "
            "memory headroom and the peak's 80% range)",
        },
    )


def _zoom_note(timeline: dict[str, Any]) -> str:
    """How an aggregated timeline is drawn: "" for a bar per action."""
    if not timeline["aggregated"]:
        return ""
    start, end = timeline["zoom_window_s"]
    return (
        "; too many actions for a bar each: each rank's time shares, and a zoom on pp rank "
        f"{timeline['zoom_rank']} over {fmt_time(start)}-{fmt_time(end)}"
    )
