"""`autoplan cluster show` (a cluster description as a table, JSON or YAML; both load back as
a cluster file) and `autoplan cluster list` (the presets)."""

from __future__ import annotations

import click
import yaml
from rich.table import Table

from autoplan._format import (
    Row,
    columns_help,
    fitted_table,
    fmt_bandwidth,
    fmt_bytes,
    fmt_flops,
    fmt_time,
    print_fitted,
)
from autoplan.cli.columns import CLUSTER_COLUMNS, CLUSTER_TABLE
from autoplan.cli.common import console, emit_json, json_option, wide_option
from cost_model.hardware import Cluster, load_cluster, preset_names


@click.group()
def cluster() -> None:
    """Inspect cluster descriptions (presets or YAML files)."""


@cluster.command("show")
@click.argument("spec", metavar="NAME|PATH")
@click.option(
    "--yaml",
    "as_yaml",
    is_flag=True,
    help="Print the cluster file (YAML) to edit and pass as --cluster PATH.",
)
@json_option
def cluster_show(spec: str, as_yaml: bool, as_json: bool) -> None:
    """Show a cluster: NAME[:key=value,...] of a preset, or a cluster YAML file. The --json and
    --yaml outputs are cluster files: save one, edit it, pass it as --cluster PATH."""
    described = load_cluster(spec)
    if as_json:
        data = described.to_data()
        data["num_devices"] = described.num_devices  # derived; checked when loaded
        emit_json(data)
        return
    if as_yaml:
        click.echo(f"# autoplan cluster: {described.name}")
        click.echo(yaml.safe_dump(described.to_data(), sort_keys=False), nl=False)
        return
    console().print(cluster_table(described))


@cluster.command("list", epilog=columns_help([CLUSTER_TABLE]))
@wide_option
@json_option
def cluster_list(wide: bool, as_json: bool) -> None:
    """List the cluster presets (pass a NAME to --cluster, or NAME:key=value,... to override)."""
    presets = [Cluster.preset(name) for name in preset_names()]
    if as_json:
        emit_json(
            [
                {
                    "name": c.name,
                    "devices_per_node": c.devices_per_node,
                    "device": c.device.name,
                    "memory_bytes": c.device.memory_bytes,
                    "scale_up_devices": c.scale_up_devices,
                    "description": c.description,
                }
                for c in presets
            ]
        )
        return
    rows = [
        Row(
            [
                c.name,
                f"{c.devices_per_node} x {c.device.name}",
                fmt_bytes(c.device.memory_bytes),
                c.description,
            ]
        )
        for c in presets
    ]
    out = console()
    title = "cluster presets (one node each; --num-devices or nodes=N scales them)"
    print_fitted(out, fitted_table(title, CLUSTER_COLUMNS, rows, width=out.width, wide=wide))


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
    if c.scale_up_devices is not None:  # a scale-up fabric wider than a node (GB200 NVL72)
        table.add_row(
            "scale-up domain",
            f"{c.scale_up_devices} devices on the intra-node link ({c.scale_up_domain} in this "
            "cluster); the inter-node link between domains",
        )
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
