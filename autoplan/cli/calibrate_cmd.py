"""`autoplan calibrate`: measure this machine and save a cluster file `Cluster.local()` loads."""

from __future__ import annotations

import click
from rich.table import Table

from autoplan._format import fmt_bandwidth, fmt_flops, fmt_time
from autoplan.calibration._workers import DEFAULT_STALL_S
from autoplan.calibration.machine import calibrate
from autoplan.cli.common import console, emit_json, json_option
from autoplan.cli.progress import progress_enabled, progress_option, status_reporter


@click.command("calibrate")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where to write the cluster YAML [the local calibration cache].",
)
@click.option(
    "--processes",
    type=click.IntRange(2, 4),
    default=None,
    help="Local processes for the collective measurements (2-4) [cores, 2-4].",
)
@click.option(
    "--quick",
    is_flag=True,
    help="Fewer shapes and repetitions: ~7 s of measurements instead of ~14 s on 2 idle cores.",
)
@click.option(
    "--training/--no-training",
    default=True,
    show_default=True,
    help="Fit the training stack's host overheads to real training steps (~8 s).",
)
@click.option(
    "--stall-timeout",
    type=click.FloatRange(min=1.0),
    default=DEFAULT_STALL_S,
    show_default=True,
    help="Seconds without progress after which a measurement job counts as hung "
    "(a loaded machine is slower, and is waited for).",
)
@progress_option
@json_option
def calibrate_cmd(
    output: str | None,
    processes: int | None,
    quick: bool,
    training: bool,
    stall_timeout: float,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Measure matmul FLOP/s, memory bandwidth, collectives and training-step overheads; write
    a cluster YAML."""
    out = console()
    # progress on stderr (`autoplan.cli.progress`): the measurements take seconds, in worker
    # processes
    with status_reporter(
        "calibrate", enabled=progress_enabled(progress, as_json), in_workers=True
    ) as status:
        status.update("starting the measurements")

        def report(what: str, fraction: float) -> None:
            status.update(f"measuring {what}", round(100 * fraction), 100)

        cluster, path, measured = calibrate(
            output,
            world_size=processes,
            quick=quick,
            training=training,
            progress=report,
            stall_s=stall_timeout,
        )
    if as_json:
        data = cluster.to_data()
        data["path"] = str(path)
        data["measurements"] = {
            "matmul": [
                {"dtype": m.dtype, "size": m.size, "flops_per_s": m.flops_per_s}
                for m in measured.matmul
            ],
            "comm": [
                {
                    "op": c.op,
                    "world_size": c.world_size,
                    "size_bytes": c.size_bytes,
                    "time_s": c.time_s,
                }
                for c in measured.comm
            ],
            "backend": measured.backend,
            "training_steps": [
                {"name": r.name, "plan": r.plan, "step_s": r.step_s, "fitted": list(r.fitted)}
                for r in measured.runtime
            ],
        }
        emit_json(data)
        return
    table = Table(title=f"calibrated {cluster.name}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for m in measured.matmul:
        table.add_row(f"matmul {m.dtype} {m.size}^3", fmt_flops(m.flops_per_s))
    table.add_row("memory bandwidth", fmt_bandwidth(cluster.device.memory_bandwidth_bytes_per_s))
    table.add_row("kernel overhead", fmt_time(cluster.calibration.kernel_overhead_s))
    for c in measured.comm:
        table.add_row(
            f"{c.op} {c.size_bytes} B x {c.world_size} ({measured.backend})", fmt_time(c.time_s)
        )
    table.add_row(
        "link (fitted)",
        f"{fmt_bandwidth(cluster.intra_node.bandwidth_bytes_per_s)}, latency "
        f"{fmt_time(cluster.intra_node.latency_s)}",
    )
    table.add_row(
        "GEMM half-efficiency size", f"{cluster.calibration.gemm_half_efficiency_flops:.3g} FLOP"
    )
    for r in measured.runtime:
        table.add_row(f"training step: {r.name}", fmt_time(r.step_s))
    cal = cluster.calibration
    if measured.runtime:
        table.add_row(
            "host overheads (fitted)",
            f"TP {fmt_time(cal.tp_module_overhead_s)}/module, FSDP "
            f"{fmt_time(cal.dp_unit_overhead_s)}/unit, sharded optimizer "
            f"{fmt_time(cal.sharded_optimizer_unit_overhead_s)}/unit, pipeline "
            f"{fmt_time(cal.pp_message_overhead_s)}/message, op dispatch "
            f"{fmt_time(cal.kernel_overhead_s)}",
        )
    out.print(table)
    out.print(f"wrote {path}")
