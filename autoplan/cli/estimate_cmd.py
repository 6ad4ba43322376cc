"""`autoplan estimate`: the cost model's step time, throughput and memory for a hand-made plan."""

from __future__ import annotations

import click
from rich.table import Table

from autoplan._format import fmt_bytes, fmt_memory, fmt_time
from autoplan.api import default_dp, estimate, manual_plan
from autoplan.cli.common import console, dtype_option, emit_json, json_option, trace_spec
from autoplan.plan import DTypeName, Recompute, Schedule
from cost_model.estimate import Estimate
from cost_model.hardware import load_cluster


@click.command("estimate")
@click.option("--model", "model_spec", required=True, help="Model NAME[:key=value,...].")
@click.option("--cluster", "cluster_spec", required=True, help="Cluster NAME[:k=v,...] or YAML.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel degree.")
@click.option("--dp", type=int, default=None, help="Data-parallel degree [devices / (tp x pp)].")
@click.option("--micro-batch", type=int, default=1, show_default=True, help="Micro-batch size.")
@click.option("--global-batch", type=int, required=True, help="Sequences per optimizer step.")
@click.option(
    "--recompute",
    type=click.Choice(["none", "selective", "full"]),
    default="none",
    show_default=True,
    help="Activation recompute on every stage.",
)
@click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True, help="ZeRO level.")
@click.option(
    "--schedule",
    type=click.Choice(["gpipe", "1f1b", "interleaved-1f1b"]),
    default=None,
    help="Pipeline schedule [1f1b, or interleaved-1f1b with --virtual-stages > 1].",
)
@click.option(
    "--virtual-stages",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Pipeline stages per pipeline rank (> 1 with --schedule interleaved-1f1b).",
)
@click.option("--sequence-parallel", is_flag=True, help="Split TP-replicated work by sequence.")
@dtype_option
@json_option
def estimate_cmd(
    model_spec: str,
    cluster_spec: str,
    tp: int,
    pp: int,
    dp: int | None,
    micro_batch: int,
    global_batch: int,
    recompute: Recompute,
    zero: int,
    schedule: Schedule | None,
    virtual_stages: int,
    sequence_parallel: bool,
    dtype: DTypeName | None,
    as_json: bool,
) -> None:
    """Predict step time, tokens/s, MFU and per-stage memory of a plan with an even split."""
    target = load_cluster(cluster_spec)
    if dp is None:
        dp = default_dp(target, tp, pp)  # fail before the (slower) model trace
    profile = trace_spec(model_spec).profile
    if schedule is None:
        schedule = "interleaved-1f1b" if virtual_stages > 1 else "1f1b"
    plan = manual_plan(
        profile,
        target,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=micro_batch,
        global_batch=global_batch,
        recompute=recompute,
        zero=zero,
        schedule=schedule,
        virtual_stages=virtual_stages,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
    )
    result = estimate(profile, target, plan)
    if as_json:
        data = result.to_data()
        data["model"] = profile.name
        data["plan"] = plan.to_data()
        emit_json(data)
        return
    out = console()
    out.print(
        f"[bold]{profile.name}[/] on {target.name} ({target.num_devices} devices): "
        f"dp={plan.dp_degree} tp={plan.tp_degree} pp={plan.pp_degree} "
        f"v={plan.virtual_stages} micro-batch={plan.micro_batch_size} x "
        f"{plan.num_micro_batches}, {plan.schedule}, ZeRO-{plan.zero_stage}, {plan.dtype}"
        + (", sequence parallel" if plan.sequence_parallel else "")
    )
    out.print(stage_table(result))
    out.print(summary_line(result))
    if not result.fits:
        out.print(f"[bold red]does not fit:[/] {result.memory_report()}")


def summary_line(result: Estimate) -> str:
    fits = "fits" if result.fits else "DOES NOT FIT"
    return (
        f"step {fmt_time(result.step_time_s)} (pipeline {fmt_time(result.pipeline_time_s)}, "
        f"bubble {result.bubble_fraction:.1%}, tail {fmt_time(result.tail_s)}) | "
        f"{result.tokens_per_s:,.0f} tokens/s | {result.model_tflops_per_device:.1f} "
        f"TFLOP/s per device | MFU {result.mfu:.1%} | peak memory "
        + fmt_memory(
            result.peak_memory_bytes,
            result.peak_rank.memory.reserve_bytes,
            result.memory_capacity_bytes,
        )
        + f": {fits}"
    )


def stage_table(result: Estimate) -> Table:
    """Per-stage breakdown: seconds within one step, bytes per device."""
    table = Table(title="per stage (times per step, memory per device)", title_justify="left")
    for name in (
        "stage",
        "rank",
        "units",
        "recompute",
        "fwd/mb",
        "bwd/mb",
        "compute",
        "TP comm",
        "PP comm",
        "DP comm",
        "bubble",
        "weights+grads+opt",
        "activations",
    ):
        table.add_column(name, justify="left" if name in ("units", "recompute") else "right")
    for s in result.stages:
        table.add_row(
            str(s.stage_idx),
            str(s.pp_rank),
            f"{s.first_unit}-{s.last_unit}",
            s.recompute,
            fmt_time(s.forward_s),
            fmt_time(s.backward_s),
            fmt_time(s.compute_s),
            fmt_time(s.tp_comm_s),
            fmt_time(s.pp_comm_s),
            fmt_time(s.dp_comm_s),
            fmt_time(s.bubble_s),
            fmt_bytes(s.param_bytes + s.grad_bytes + s.optimizer_bytes),
            fmt_bytes(s.activation_bytes),
        )
    return table
