"""`autoplan plan`: search the fastest plan for a model on a cluster and save it as YAML."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from autoplan._format import (
    MEMORY_CELL_CAPTION,
    compact_table,
    fmt_memory_cell,
    fmt_range_percent,
    fmt_recompute,
    fmt_schedule,
    fmt_time,
)
from autoplan.analysis.coverage import coverage
from autoplan.api import estimate
from autoplan.cli.common import (
    budget_s,
    check_output_path,
    console,
    emit_json,
    framework_option,
    json_option,
    policy_lines,
    search_constraints,
    search_options,
    trace_spec,
)
from autoplan.cli.estimate_cmd import stage_table, summary_line
from autoplan.cli.progress import (
    progress_enabled,
    progress_option,
    search_status,
    status_reporter,
)
from autoplan.contract.plan import Plan
from autoplan.planner.search import SearchProgress, SearchStats, search_plans
from cost_model.hardware import load_cluster
from cost_model.messages import shown


@click.command("plan")
@click.option(
    "--model",
    "model_spec",
    required=True,
    help="Model NAME[:key=value,...], or hf:PATH (a Hugging Face config.json).",
)
@click.option("--cluster", "cluster_spec", required=True, help="Cluster NAME[:k=v,...] or YAML.")
@click.option(
    "--global-batch",
    type=click.IntRange(min=1),
    required=True,
    help="Sequences per optimizer step.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the best plan (with its estimate) to this YAML file.",
)
@click.option(
    "--top",
    "top_k",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="How many ranked plans to show.",
)
@search_options()
@framework_option
@progress_option
@json_option
def plan_cmd(
    model_spec: str,
    cluster_spec: str,
    global_batch: int,
    output: str | None,
    top_k: int,
    framework: str,
    progress: bool | None,
    as_json: bool,
    time_limit: float,
    **options: Any,
) -> None:
    """Search the fastest plan that fits and show it with its ranked alternatives."""
    constraints = search_constraints(options)
    target = load_cluster(cluster_spec)
    if output is not None:
        check_output_path(output, "-o/--output")
    out = console()
    # progress on stderr: a bar on a terminal, else a line a phase (`autoplan.cli.progress`)
    with status_reporter("plan", enabled=progress_enabled(progress, as_json)) as status:
        status.update(f"tracing {shown(model_spec, quoted=False)}")
        profile = trace_spec(model_spec).profile
        status.update(f"searching plans for {profile.name} on {target.name}")
        unbounded = budget_s(options) is None
        hinted = False

        def report(step: SearchProgress) -> None:
            nonlocal hinted
            status.update(
                search_status(step.phase, step.visited, step.total, step.best_step_time_s),
                completed=step.visited,
                total=step.total or None,
                phase=step.phase,
            )
            elapsed = time.monotonic() - status.started
            if unbounded and not hinted and step.phase == "visit" and elapsed > UNBOUNDED_HINT_S:
                hinted = True
                click.echo(unbounded_hint(step, elapsed), err=True)

        result = search_plans(
            profile,
            target,
            global_batch=global_batch,
            top_k=top_k,
            time_limit_s=time_limit,
            budget_s=budget_s(options),
            progress=report,
            framework=framework,
            **constraints,
        )
    best = result.plans[0]
    if output is not None:
        best.to_yaml(Path(output))
    stats = result.stats
    if as_json:
        emit_json(
            {
                "model": profile.name,
                "cluster": target.name,
                "num_devices": target.num_devices,
                "plans": [plan.to_data() for plan in result.plans],
                "output": output,
                "stats": dataclasses.asdict(stats),
            }
        )
        _exit_if_interrupted(stats)
        return
    out.print(
        f"[bold]{profile.name}[/] on {target.name} ({target.num_devices} devices), global batch "
        f"{global_batch}: {stats.candidates:,} candidate plans, {stats.solver_calls} solver "
        f"calls, {stats.total_s:.2f} s"
        + (f" (unproven gap {stats.optimality_gap:.2%})" if stats.optimality_gap > 0 else "")
    )
    if stats.wall_capped:
        out.print(
            f"[yellow]the wall-clock cap stopped the search after {stats.work_s:.1f} of its "
            "reference seconds: this machine ran it far slower than the reference, so another "
            "run may answer differently; raise --budget or ask when the machine is idle[/]"
        )
    out.print(ranked_table(result.plans))
    detail = estimate(profile, target, best)
    out.print(stage_table(detail))
    out.print(summary_line(detail))
    for line in policy_lines(best):
        out.print(line)
    for line in coverage(best, profile, target, detail).lines():
        out.print(f"[bold]coverage:[/] {line}")
    if output is not None:
        out.print(f"wrote {output}")
    if stats.interrupted:
        click.echo(
            f"autoplan: interrupted: the plans above are the best found so far (a faster one "
            f"may exist by up to {stats.optimality_gap:.2%})",
            err=True,
        )
    _exit_if_interrupted(stats)


# Seconds a search without a budget (--budget 0) runs before it says how much is left.
UNBOUNDED_HINT_S = 60.0


def unbounded_hint(step: SearchProgress, elapsed_s: float) -> str:
    """What a search without a budget has left, and the ways out."""
    left = step.total - step.visited
    return (
        f"autoplan: --budget 0 proves every candidate: {left:,} of {step.total:,} remain after "
        f"{elapsed_s:.0f} s, which may take hours; press Ctrl-C for the best plan so far with "
        "its gap, give a budget (--budget 10), or narrow the space (e.g. --tp 8, --max-pp 16, "
        "--schedules interleaved-1f1b, --zero 1, --recompute selective)"
    )


def _exit_if_interrupted(stats: SearchStats) -> None:
    """Exit 130 (as for Ctrl-C) after the best plan so far was shown."""
    if stats.interrupted:
        raise click.exceptions.Exit(130)


def ranked_table(plans: tuple[Plan, ...]) -> Table:
    """The ranked plans, one line each, with their rank layouts (outermost axis first) when
    they differ (the chosen plan's split is in its stage table)."""
    headroom = plans[0].estimate.memory_headroom if plans[0].estimate else 0.0
    table = compact_table(
        "best plans (rank 1 is chosen)",
        caption="range: the step's 80% range around it; "
        + MEMORY_CELL_CAPTION
        + f"; each plan keeps {headroom:.0%} of the device free beyond the peak's 80% range "
        "(memory headroom)",
    )
    # The rank layout only when the plans differ in it: then it may be all that tells two apart.
    layouts = len({plan.rank_layout for plan in plans}) > 1
    # cp and ep columns only when a plan uses them
    cp = any(plan.cp_degree > 1 for plan in plans)
    ep = any(plan.ep_degree > 1 for plan in plans)
    # the dtype when the plans differ in it or train with an fp8 recipe (its name says which)
    dtypes = len({plan.dtype for plan in plans}) > 1 or any("fp8" in plan.dtype for plan in plans)
    narrow = layouts or dtypes
    for name in (
        "#",
        "tp",
        "pp",
        "dp",
        *(("cp",) if cp else ()),
        *(("ep",) if ep else ()),
        "mb x n",
        "schedule",
        "v",
        "ZeRO",
        "SP",
        "recompute",
        *(("layout",) if layouts else ()),
        *(("dtype",) if dtypes else ()),
        "step",
        # the step's 80% range, where the width allows (the chosen plan's is printed below)
        *(() if narrow else ("range",)),
        "MFU",
        "memory",
    ):
        left = name in ("schedule", "recompute", "layout", "dtype")
        table.add_column(name, justify="left" if left else "right")
    for rank, plan in enumerate(plans, start=1):
        e = plan.estimate
        assert e is not None
        table.add_row(
            str(rank),
            str(plan.tp_degree),
            str(plan.pp_degree),
            str(plan.dp_degree),
            *((str(plan.cp_degree),) if cp else ()),
            *((str(plan.ep_degree),) if ep else ()),
            f"{plan.micro_batch_size} x {plan.num_micro_batches}",
            fmt_schedule(plan.schedule),
            str(plan.virtual_stages),
            # under HSDP, the shard group's size too (`Plan.dp_shard_degree`)
            str(plan.zero_stage)
            + ("" if plan.dp_shard_degree is None else f" HSDP {plan.dp_shard_degree}"),
            "yes" if plan.sequence_parallel else "no",
            fmt_recompute(s.recompute for s in plan.stages),
            *(("/".join(plan.rank_layout),) if layouts else ()),
            *((plan.dtype,) if dtypes else ()),
            fmt_time(e.step_time_s),
            *(() if narrow else (fmt_range_percent(e.step_time_s, e.step_time_range_s),)),
            f"{e.mfu:.1%}",
            fmt_memory_cell(e.peak_memory_bytes, e.memory_reserve_bytes, e.memory_capacity_bytes),
        )
    return table
