"""`autoplan plan`: search the fastest plan for a model on a cluster and save it as YAML."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autoplan._format import fmt_bytes, fmt_time
from autoplan.api import estimate
from autoplan.cli.common import console, emit_json, int_list, json_option, str_list, trace_spec
from autoplan.cli.estimate_cmd import stage_table, summary_line
from autoplan.plan import Plan
from cost_model.hardware import load_cluster


@click.command("plan")
@click.option("--model", "model_spec", required=True, help="Model NAME[:key=value,...].")
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
@click.option("--tp", callback=int_list, help="Allowed TP degrees, e.g. 4,8.")
@click.option("--pp", callback=int_list, help="Allowed pipeline degrees.")
@click.option("--dp", callback=int_list, help="Allowed data-parallel degrees.")
@click.option("--micro-batch", callback=int_list, help="Allowed micro-batch sizes.")
@click.option("--max-tp", type=click.IntRange(min=1), default=None)
@click.option("--max-pp", type=click.IntRange(min=1), default=None)
@click.option("--zero", callback=int_list, help="Allowed ZeRO levels, e.g. 0,1.")
@click.option(
    "--recompute", callback=str_list, help="Allowed recompute modes, e.g. none,selective."
)
@click.option(
    "--schedules", callback=str_list, help="Allowed schedules, e.g. 1f1b,interleaved-1f1b."
)
@click.option(
    "--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True
)
@click.option("--allow-cross-node-tp", is_flag=True, help="Let tensor-parallel groups span nodes.")
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0.01),
    default=10.0,
    show_default=True,
    help="Seconds per solver call.",
)
@json_option
def plan_cmd(
    model_spec: str,
    cluster_spec: str,
    global_batch: int,
    output: str | None,
    top_k: int,
    as_json: bool,
    time_limit: float,
    **options: Any,
) -> None:
    """Search the fastest plan that fits and show it with its ranked alternatives."""
    from autoplan.planner.search import SearchProgress, search_plans

    constraints = {key: value for key, value in options.items() if value not in (None, False)}
    target = load_cluster(cluster_spec)
    out = console()
    profile = trace_spec(model_spec).profile
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=True,
        disable=as_json,
    ) as progress:
        task = progress.add_task(f"searching plans for {profile.name} on {target.name}", total=None)

        def report(step: SearchProgress) -> None:
            progress.update(task, completed=step.visited, total=step.total)

        result = search_plans(
            profile,
            target,
            global_batch=global_batch,
            top_k=top_k,
            time_limit_s=time_limit,
            progress=report,
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
        return
    out.print(
        f"[bold]{profile.name}[/] on {target.name} ({target.num_devices} devices), global batch "
        f"{global_batch}: {stats.candidates:,} candidate plans, {stats.solver_calls} solver "
        f"calls, {stats.total_s:.2f} s"
        + (f" (unproven gap {stats.optimality_gap:.2%})" if stats.optimality_gap > 0 else "")
    )
    out.print(ranked_table(result.plans))
    detail = estimate(profile, target, best)
    out.print(stage_table(detail))
    out.print(summary_line(detail))
    if output is not None:
        out.print(f"wrote {output}")


def ranked_table(plans: tuple[Plan, ...]) -> Table:
    table = Table(title="best plans (rank 1 is chosen)", title_justify="left")
    for name in (
        "rank",
        "tp",
        "pp",
        "dp",
        "micro-batch",
        "schedule",
        "ZeRO",
        "SP",
        "recompute",
        "layout",
        "stages (units)",
        "step",
        "tokens/s",
        "MFU",
        "peak memory",
    ):
        table.add_column(name, justify="left" if name in ("schedule", "recompute") else "right")
    for rank, plan in enumerate(plans, start=1):
        e = plan.estimate
        assert e is not None
        sizes = [s.num_units for s in plan.stages]
        schedule = plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
        table.add_row(
            str(rank),
            str(plan.tp_degree),
            str(plan.pp_degree),
            str(plan.dp_degree),
            f"{plan.micro_batch_size} x {plan.num_micro_batches}",
            schedule,
            str(plan.zero_stage),
            "yes" if plan.sequence_parallel else "no",
            "+".join(sorted({s.recompute for s in plan.stages})),
            "/".join(plan.rank_layout),
            f"{min(sizes)}-{max(sizes)}" if min(sizes) != max(sizes) else str(sizes[0]),
            fmt_time(e.step_time_s),
            f"{e.tokens_per_s:,.0f}",
            f"{e.mfu:.1%}",
            fmt_bytes(e.peak_memory_bytes),
        )
    return table
