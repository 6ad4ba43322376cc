"""`autoplan plan`: search the fastest plan for a model on a cluster and save it as YAML."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from autoplan._format import (
    WIDTH,
    Row,
    columns_help,
    fitted_table,
    fmt_memory_cell,
    fmt_range_percent,
    fmt_recompute,
    fmt_schedule,
    fmt_time,
    print_fitted,
    short_bytes,
)
from autoplan.analysis.coverage import coverage
from autoplan.api import estimate
from autoplan.cli.columns import RANKED_COLUMNS, RANKED_TABLE, STAGE_TABLE
from autoplan.cli.common import (
    budget_s,
    check_output_path,
    console,
    echo_err,
    emit_json,
    framework_option,
    json_option,
    policy_lines,
    search_constraints,
    search_options,
    trace_spec,
    wide_option,
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


@click.command("plan", epilog=columns_help([RANKED_TABLE, STAGE_TABLE]))
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
@wide_option
@progress_option
@json_option
def plan_cmd(
    model_spec: str,
    cluster_spec: str,
    global_batch: int,
    output: str | None,
    top_k: int,
    framework: str,
    wide: bool,
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
                echo_err(unbounded_hint(step, elapsed))

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
    print_fitted(out, ranked_table(result.plans, width=out.width, wide=wide))
    detail = estimate(profile, target, best)
    print_fitted(out, stage_table(detail, best, width=out.width, wide=wide))
    out.print(summary_line(detail))
    for line in policy_lines(best):
        out.print(line)
    for line in coverage(best, profile, target, detail).lines():
        out.print(f"[bold]coverage:[/] {line}")
    if output is not None:
        out.print(f"wrote {output}")
    if stats.interrupted:
        echo_err(
            f"autoplan: interrupted: the plans above are the best found so far (a faster one "
            f"may exist by up to {stats.optimality_gap:.2%})"
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


def ranked_table(plans: tuple[Plan, ...], *, width: int = WIDTH, wide: bool = False) -> Table:
    """The ranked plans, one line each, with their rank layouts (outermost axis first) when
    they differ (the chosen plan's split is in its stage table), fitted to ``width``."""
    headroom = plans[0].estimate.memory_headroom if plans[0].estimate else 0.0
    shown = {
        "cp": any(plan.cp_degree > 1 for plan in plans),
        "ep": any(plan.ep_degree > 1 for plan in plans),
        # the rank layout only when the plans differ in it: then it may be all that tells two
        # apart
        "layout": len({plan.rank_layout for plan in plans}) > 1,
        # the dtype when the plans differ in it or train with an fp8 recipe (its name says which)
        "dtype": len({plan.dtype for plan in plans}) > 1 or any("fp8" in p.dtype for p in plans),
    }
    columns = [c for c in RANKED_COLUMNS if shown.get(c.header, True)]
    # the plans share the device: its capacity is said once, in the caption
    capacity_bytes = plans[0].estimate.memory_capacity_bytes if plans[0].estimate else 0.0
    capacity = f"/{short_bytes(capacity_bytes)}" if capacity_bytes > 0 else ""
    rows = []
    for rank, plan in enumerate(plans, start=1):
        e = plan.estimate
        assert e is not None
        cells = {
            "#": str(rank),
            "tp": str(plan.tp_degree),
            "pp": str(plan.pp_degree),
            "dp": str(plan.dp_degree),
            "cp": str(plan.cp_degree),
            "ep": str(plan.ep_degree),
            "mb x n": f"{plan.micro_batch_size} x {plan.num_micro_batches}",
            "schedule": fmt_schedule(plan.schedule),
            "v": str(plan.virtual_stages),
            # under HSDP, the shard group's size too (`Plan.dp_shard_degree`)
            "ZeRO": str(plan.zero_stage)
            + ("" if plan.dp_shard_degree is None else f" HSDP {plan.dp_shard_degree}"),
            "SP": "yes" if plan.sequence_parallel else "no",
            "recompute": fmt_recompute(s.recompute for s in plan.stages),
            "layout": "/".join(plan.rank_layout),
            "dtype": plan.dtype,
            "step": fmt_time(e.step_time_s),
            "range": fmt_range_percent(e.step_time_s, e.step_time_range_s),
            "MFU": f"{e.mfu:.1%}",
            "memory": fmt_memory_cell(
                e.peak_memory_bytes, e.memory_reserve_bytes, e.memory_capacity_bytes
            ).removesuffix(capacity),
        }
        rows.append(Row([cells[c.header] for c in columns]))
    return fitted_table(
        "best plans (rank 1 is chosen)",
        columns,
        rows,
        width=width,
        wide=wide,
        caption="range: the step's 80% range around it; memory per device: predicted + reserve "
        f"and allocator margin{f' of {capacity[1:]}' if capacity else ''} (G = GiB, M = MiB)"
        + f"; each plan keeps {headroom:.0%} of the device free beyond the peak's 80% range "
        "(memory headroom)",
    )
