"""`autoplan estimate`: the cost model's step time, throughput and memory for a hand-made plan."""

from __future__ import annotations

import click
from rich.table import Table

from autoplan._format import (
    WIDTH,
    Row,
    collapse_runs,
    columns_help,
    fitted_table,
    fmt_bytes,
    fmt_headroom,
    fmt_memory,
    fmt_recompute,
    fmt_time,
    fmt_time_range,
    print_fitted,
)
from autoplan.api import default_dp, estimate, manual_plan
from autoplan.cli.columns import STAGE_COLUMNS, STAGE_TABLE
from autoplan.cli.common import (
    compile_option,
    console,
    dtype_option,
    emit_json,
    framework_option,
    json_option,
    memory_headroom_option,
    policy_lines,
    precision_fields,
    precision_options,
    range_level,
    tp_comm_overlap_option,
    trace_spec,
    wide_option,
)
from autoplan.cli.progress import progress_enabled, progress_option, status_reporter
from autoplan.contract.plan import RECOMPUTE_MODES, DTypeName, Plan, Recompute, Schedule
from cost_model.estimate import Estimate
from cost_model.frameworks import DEFAULT_FRAMEWORK
from cost_model.hardware import load_cluster
from cost_model.messages import shown as shown_value


@click.command("estimate", epilog=columns_help([STAGE_TABLE]))
@click.option(
    "--model",
    "model_spec",
    required=True,
    help="Model NAME[:key=value,...], or hf:PATH (a Hugging Face config.json).",
)
@click.option("--cluster", "cluster_spec", required=True, help="Cluster NAME[:k=v,...] or YAML.")
@click.option(
    "--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel degree."
)
@click.option(
    "--pp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Pipeline-parallel degree.",
)
@click.option(
    "--dp",
    type=click.IntRange(min=1),
    default=None,
    help="Data-parallel degree [devices / (tp x pp x cp)].",
)
@click.option(
    "--cp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Context-parallel degree.",
)
@click.option(
    "--ep",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Expert-parallel degree (within dp).",
)
@click.option(
    "--etp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Expert-tensor-parallel degree: each routed expert split over etp ranks of the TP "
    "group (a divisor of tp; Megatron-LM's --expert-tensor-parallel-size).",
)
@click.option(
    "--micro-batch",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Micro-batch size.",
)
@click.option(
    "--global-batch",
    type=click.IntRange(min=1),
    required=True,
    help="Sequences per optimizer step.",
)
@click.option(
    "--recompute",
    type=click.Choice(list(RECOMPUTE_MODES)),
    default="none",
    show_default=True,
    help="Activation recompute on every stage.",
)
@click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True, help="ZeRO level.")
@click.option(
    "--dp-shard",
    type=click.IntRange(min=1),
    default=None,
    help="HSDP: shard the weights within groups of this many consecutive dp ranks and "
    "replicate across the groups (needs --zero 1-3; a divisor of dp) [all of dp].",
)
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
@tp_comm_overlap_option
@click.option(
    "--range-level",
    type=float,
    default=0.8,
    show_default=True,
    callback=range_level,
    help="Share of outcomes the step's and the peak's ranges hold (0.8: an 80% range).",
)
@memory_headroom_option
@dtype_option
@precision_options
@compile_option
@click.option(
    "--optimizer-offload",
    type=click.FloatRange(0.0, 1.0),
    default=0.0,
    show_default=True,
    help="Share of the optimizer step (master weights, moments, Adam) kept and run on the host "
    "(Megatron-LM --optimizer-offload-fraction; DeepSpeed offload_optimizer).",
)
@click.option(
    "--activation-offload",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Blocks of each stage (the first its recompute does not cover) whose saved "
    "activations wait on the host (Megatron-LM --cpu-offloading-num-layers; torch save_on_cpu).",
)
@framework_option
@wide_option
@progress_option
@json_option
def estimate_cmd(
    model_spec: str,
    cluster_spec: str,
    tp: int,
    pp: int,
    dp: int | None,
    cp: int,
    ep: int,
    etp: int,
    micro_batch: int,
    global_batch: int,
    recompute: Recompute,
    zero: int,
    dp_shard: int | None,
    schedule: Schedule | None,
    virtual_stages: int,
    sequence_parallel: bool,
    tp_comm_overlap: bool,
    range_level: float,
    memory_headroom: float | None,
    dtype: DTypeName | None,
    master_dtype: str | None,
    grad_reduce_dtype: str | None,
    optimizer_state_dtype: str | None,
    compile: bool,
    optimizer_offload: float,
    activation_offload: int,
    framework: str,
    wide: bool,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Predict step time, tokens/s, MFU and per-stage memory of a plan with an even split."""
    policy = precision_fields(
        {
            "master_dtype": master_dtype,
            "grad_reduce_dtype": grad_reduce_dtype,
            "optimizer_state_dtype": optimizer_state_dtype,
        }
    )
    target = load_cluster(cluster_spec)
    if dp is None:
        dp = default_dp(target, tp, pp, cp)  # fail before the (slower) model trace
    # progress on stderr (`autoplan.cli.progress`): torch's import and a trace take seconds
    with status_reporter("estimate", enabled=progress_enabled(progress, as_json)) as status:
        status.update(f"tracing {shown_value(model_spec, quoted=False)}")
        profile = trace_spec(model_spec).profile
    if schedule is None:
        schedule = "interleaved-1f1b" if virtual_stages > 1 else "1f1b"
    plan = manual_plan(
        profile,
        target,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=ep,
        etp=etp,
        micro_batch=micro_batch,
        global_batch=global_batch,
        recompute=recompute,
        zero=zero,
        dp_shard=dp_shard,
        schedule=schedule,
        virtual_stages=virtual_stages,
        sequence_parallel=sequence_parallel,
        tp_comm_overlap=tp_comm_overlap,
        dtype=dtype,
        framework=framework,
        compile=compile,
        optimizer_offload=optimizer_offload,
        activation_offload=activation_offload,
        **policy,  # type: ignore[arg-type]
    )
    result = estimate(
        profile, target, plan, range_level=range_level, memory_headroom=memory_headroom
    )
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
        + (f"cp={plan.cp_degree} " if plan.cp_degree > 1 else "")
        + (f"ep={plan.ep_degree} " if plan.ep_degree > 1 else "")
        + (f"etp={plan.etp_degree} " if plan.etp_degree > 1 else "")
        + f"v={plan.virtual_stages} micro-batch={plan.micro_batch_size} x "
        f"{plan.num_micro_batches}, {plan.schedule}, {plan.zero_text}, {plan.dtype}"
        + (", sequence parallel" if plan.sequence_parallel else "")
        + (", compiled" if plan.compile else "")
        + (f", priced for {plan.framework}" if plan.framework != DEFAULT_FRAMEWORK else "")
    )
    print_fitted(out, stage_table(result, plan, width=out.width, wide=wide))
    out.print(summary_line(result))
    for line in policy_lines(plan):
        out.print(line)
    if plan.optimizer_offload > 0:
        out.print(
            f"[bold]optimizer offload:[/] {plan.optimizer_offload:g} of the optimizer step on the "
            "host (gradients out and weights back over the host link each step)"
        )
    if activation_offload:
        out.print(
            f"[bold]activation offload:[/] {activation_offload} block(s) a stage keep their saved "
            "activations on the host (out after the forward, back before the backward)"
        )
    if not result.fits:
        out.print(f"[bold red]does not fit:[/] {result.memory_report()}")
        out.print(result.memory_problem(), markup=False)


def summary_line(result: Estimate) -> str:
    """Two lines: the step and its throughput, then the peak memory and whether it fits."""
    fits = "fits" if result.fits else "DOES NOT FIT"
    return (
        f"step {fmt_time_range(result.step_time_s, result.step_time_range_s, result.range_level)} "
        f"(pipeline {fmt_time(result.pipeline_time_s)}, "
        f"bubble {result.bubble_fraction:.1%}, tail {fmt_time(result.tail_s)}) | "
        f"{result.tokens_per_s:,.0f} tokens/s | MFU {result.mfu:.1%}\n"
        f"{result.model_tflops_per_device:.1f} TFLOP/s per device | peak memory "
        + fmt_memory(
            result.peak_memory_bytes,
            result.peak_rank.memory.reserve_bytes,
            result.memory_capacity_bytes,
        )
        + ", "
        + fmt_headroom(
            result.peak_memory_bytes,
            result.memory_capacity_bytes,
            result.memory_headroom,
            result.usable_memory_bytes,
        )
        + f": {fits}"
    )


def stage_table(
    result: Estimate, plan: Plan | None = None, *, width: int = WIDTH, wide: bool = False
) -> Table:
    """One row per pipeline rank (a rank's stages summed; ranks whose cells agree share a row):
    seconds within one step and bytes per device, fitted to ``width`` (`fitted_table`). A
    communication column is shown where the plan has that parallelism (``plan``'s cp and ep
    degrees, more than one pipeline rank) or the estimate prices some."""
    stages = {s.stage_idx: s for s in result.stages}
    interleaved = any(len(r.stages) > 1 for r in result.ranks)
    shown = {
        "TP comm": any(s.tp_comm_s > 0 for s in result.stages),
        "CP comm": (plan is not None and plan.cp_degree > 1)
        or any(s.cp_comm_s > 0 for s in result.stages),
        "EP comm": (plan is not None and plan.ep_degree > 1)
        or any(s.ep_comm_s > 0 for s in result.stages),
        "PP comm": len(result.ranks) > 1,
        "bubble": len(result.ranks) > 1 or any(r.bubble_s > 0 for r in result.ranks),
        "DP comm": any(s.dp_comm_s > 0 for s in result.stages),
        # the host's share where a stack's host work shows at all
        "host": any(s.host_s > 0 for s in result.stages),
        "offload": any(s.offload_s > 0 for s in result.stages),
    }
    columns = [c for c in STAGE_COLUMNS if shown.get(c.header, True)]
    rows: list[tuple[int, list[str]]] = []
    for rank in result.ranks:
        held = [stages[i] for i in rank.stages]
        units = sum(s.last_unit - s.first_unit + 1 for s in held)
        if interleaved:
            unit_cell = f"{units} ({len(held)})"
        else:
            first, last = held[0].first_unit, held[-1].last_unit
            unit_cell = str(first) if first == last else f"{first}-{last}"
        memory = rank.memory
        cells = {
            "units": unit_cell,
            "recompute": fmt_recompute(s.recompute for s in held),
            "compute": fmt_time(sum(s.compute_s for s in held)),
            "TP comm": fmt_time(sum(s.tp_comm_s for s in held)),
            "CP comm": fmt_time(sum(s.cp_comm_s for s in held)),
            "EP comm": fmt_time(sum(s.ep_comm_s for s in held)),
            "PP comm": fmt_time(sum(s.pp_comm_s for s in held)),
            "DP comm": fmt_time(sum(s.dp_comm_s for s in held)),
            "host": fmt_time(sum(s.host_s for s in held)),
            "offload": fmt_time(sum(s.offload_s for s in held)),
            "bubble": fmt_time(rank.bubble_s),
            "state": fmt_bytes(memory.param_bytes + memory.grad_bytes + memory.optimizer_bytes),
            "activations": fmt_bytes(memory.activation_bytes),
        }
        rows.append((rank.pp_rank, [cells[c.header] for c in columns[1:]]))
    return fitted_table(
        "per pipeline rank (times per step, memory per device)",
        columns,
        [Row([label, *cells]) for label, cells in collapse_runs(rows)],
        width=width,
        wide=wide,
        caption="state: weights + grads + optimizer; activations: held at the peak"
        + ("; units (stages): pipeline units over the rank's model chunks" if interleaved else ""),
        # said of the columns shown
        notes={
            "PP comm": "PP comm: the host's time posting sends and receives (their link time "
            "is the receiver's bubble)",
            "CP comm": "CP comm: the ring exchanges not hidden under attention",
        },
    )
