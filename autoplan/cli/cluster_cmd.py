"""`autoplan cluster show`: a cluster description as a table or JSON."""

from __future__ import annotations

import click
from rich.table import Table

from autoplan._format import fmt_bandwidth, fmt_bytes, fmt_flops, fmt_time
from autoplan.cli.common import console, emit_json, json_option
from cost_model.hardware import Cluster, load_cluster


@click.group()
def cluster() -> None:
    """Inspect cluster descriptions (presets or YAML files)."""


@cluster.command("show")
@click.argument("spec", metavar="NAME|PATH")
@json_option
def cluster_show(spec: str, as_json: bool) -> None:
    """Show a cluster: NAME[:key=value,...] of a preset, or a cluster YAML file."""
    described = load_cluster(spec)
    if as_json:
        data = described.to_data()
        data["num_devices"] = described.num_devices
        emit_json(data)
        return
    console().print(cluster_table(described))


def cluster_table(c: Cluster) -> Table:
    table = Table(title=f"cluster {c.name}", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    if c.description:
        table.add_row("description", c.description)
    table.add_row(
        "devices", f"{c.num_nodes} node(s) x {c.devices_per_node} = {c.num_devices} {c.device.name}"
    )
    table.add_row("device memory", fmt_bytes(c.device.memory_bytes))
    for dtype, flops in c.device.peak_flops.items():
        table.add_row(f"peak {dtype}", fmt_flops(flops))
    table.add_row("memory bandwidth", fmt_bandwidth(c.device.memory_bandwidth_bytes_per_s))
    for label, link in (("intra-node", c.intra_node), ("inter-node", c.inter_node)):
        table.add_row(
            f"{label} link",
            f"{fmt_bandwidth(link.bandwidth_bytes_per_s)} per device per direction, "
            f"latency {fmt_time(link.latency_s)}",
        )
    cal = c.calibration
    table.add_row(
        "efficiency",
        f"GEMM {cal.gemm_efficiency:.0%} (half at {cal.gemm_half_efficiency_flops:.3g} FLOP), "
        f"memory {cal.memory_efficiency:.0%}, links {cal.intra_node_comm_efficiency:.0%} / "
        f"{cal.inter_node_comm_efficiency:.0%}",
    )
    return table
