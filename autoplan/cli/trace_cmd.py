"""`autoplan trace`: the pipeline units of a model, their sizes and costs, as a table or JSON.

Figures are for the whole batch (``--batch-size`` sequences of ``--seq-len`` tokens) at the
model's dtype; parameters are counted per unit (a head tied to the embedding shows the shared
matrix) and once in the total. ``--json`` gives the same figures in base units (FLOP, bytes).
A unit with mixture-of-experts layers also lists them (``moe``: experts, top-k, parameters and
FLOPs per expert, expected tokens per expert and all-to-all bytes for the traced batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from autoplan._format import WIDTH, Row, columns_help, fitted_table, fmt_count, print_fitted
from autoplan.cli.columns import TRACE_COLUMNS, TRACE_TABLE
from autoplan.cli.common import console, emit_json, json_option, wide_option
from autoplan.cli.progress import progress_enabled, progress_option, status_reporter
from cost_model.messages import shown

if TYPE_CHECKING:
    from autoplan.contract.graph import ModelGraph, MoELayerProfile

_MIB = 2.0**20


@click.command("trace", epilog=columns_help([TRACE_TABLE]))
@click.option(
    "--model",
    "model_spec",
    required=True,
    metavar="NAME[:k=v,...]",
    help="Preset (gpt3-175b, llama3-8b, ...) or builder with overrides "
    "(gpt:num_layers=24,hidden_size=2304,num_heads=24,seq_len=2048,vocab_size=51200), or "
    "hf:PATH[:k=v,...], a Hugging Face causal LM's config.json (no weights).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Sequences per batch.",
)
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens per sequence (default: the model's seq_len).",
)
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    help="One row per unit (by default a run of identical blocks is one row).",
)
@wide_option
@progress_option
@json_option
def trace(
    model_spec: str,
    batch_size: int,
    seq_len: int | None,
    show_all: bool,
    wide: bool,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Trace a model on the meta device and show its pipeline units (identical blocks as one
    row, figures per unit; --all lists every unit)."""
    # progress on stderr (`autoplan.cli.progress`): torch's import and a first trace take seconds
    with status_reporter("trace", enabled=progress_enabled(progress, as_json)) as status:
        status.update(f"tracing {shown(model_spec, quoted=False)}")
        # Imported here: torch takes seconds to import, and other commands do not need it.
        from autoplan.models.spec import build_model
        from autoplan.tracing import trace as trace_model

        model = build_model(model_spec)
        graph = trace_model(model, batch_size=batch_size, seq_len=seq_len, name=model_spec)
    data = trace_data(graph)
    if as_json:
        emit_json(data)
        return
    out = console()
    out.print(
        f"{data['model']}: {data['num_units']} pipeline units, batch {data['batch_size']} x "
        f"seq {data['seq_len']}, torch.{data['front_end']}, "
        f"fingerprint {data['fingerprint']}",
        markup=False,  # wrapped at words; a model spec longer than a line is folded
    )
    print_fitted(out, trace_table(data, collapse=not show_all, width=out.width, wide=wide))
    out.print(LEGEND, markup=False)
    for line in moe_lines(data):
        out.print(line, markup=False)  # wrapped at the console's width, as the legend
    shared = [u for u in data["units"] if u["num_params_shared"]]
    for unit in shared:
        out.print(
            f"{unit['name']} shares {fmt_count(unit['num_params_shared'])} parameters with an "
            "earlier unit (tied weights; counted once in the total)",
            markup=False,
        )


def trace_data(graph: ModelGraph) -> dict[str, Any]:
    """The ``--json`` output: per-unit figures for the traced batch, and totals."""
    profile = graph.profile
    batch = graph.batch_size
    units = []
    for idx, unit in enumerate(profile.units):
        row: dict[str, Any] = {
            "index": idx,
            "name": unit.name,
            "kind": unit.kind,
            "num_params": unit.num_params,
            "num_params_shared": unit.num_params_shared,
            "num_params_tp_sharded": unit.num_params_tp_sharded,
            "param_bytes": unit.param_bytes,
            "forward_flops": unit.forward_flops * batch,
            "backward_flops": unit.backward_flops * batch,
            "saved_activation_bytes": unit.saved_bytes * batch,
            "input_bytes": unit.input_bytes * batch,
            "cut_bytes": unit.output_bytes * batch,
            "tp": {
                "linears": [
                    {"path": t.path, "style": t.style, "fused": t.fused} for t in unit.tp.linears
                ],
                **unit.tp.divisible_counts(),
            },
        }
        layers = graph.unit_moe_layers(idx)
        if layers:  # dense units keep exactly the keys above
            row["moe"] = [_moe_data(layer, batch) for layer in layers]
        units.append(row)
    return {
        "model": profile.name,
        "front_end": graph.front_end,
        "fingerprint": profile.fingerprint,
        "batch_size": batch,
        "seq_len": profile.seq_len,
        "hidden_size": profile.hidden_size,
        "vocab_size": profile.vocab_size,
        "num_heads": profile.num_heads,
        "num_kv_heads": profile.num_kv_heads,
        "dtype_bytes": profile.traced_dtype_bytes,
        "num_units": profile.num_units,
        "units": units,
        "totals": {
            "num_params": profile.num_params,
            "forward_flops": profile.forward_flops_per_sample * batch,
            "backward_flops": sum(u.backward_flops for u in profile.units) * batch,
            "saved_activation_bytes": sum(u.saved_bytes for u in profile.units) * batch,
        },
    }


def _moe_data(layer: MoELayerProfile, batch: int) -> dict[str, Any]:
    return {
        "path": layer.path,
        "num_experts": layer.num_experts,
        "top_k": layer.top_k,
        "expert_ffn_hidden_size": layer.expert_ffn_hidden_size,
        "num_params_per_expert": layer.num_params_per_expert,
        "num_shared_expert_params": layer.num_shared_expert_params,
        "forward_flops_per_token_per_expert": layer.forward_flops_per_token_per_expert,
        "tokens_per_expert": layer.tokens_per_expert(batch),
        "dispatch_bytes": layer.dispatch_bytes(batch),
        "combine_bytes": layer.dispatch_bytes(batch),
    }


def moe_lines(data: dict[str, Any]) -> list[str]:
    """One line per distinct mixture-of-experts layer shape, naming the units that have it."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for unit in data["units"]:
        for layer in unit.get("moe", ()):
            key = tuple(v for k, v in layer.items() if k != "path")
            groups.setdefault(key, []).append(unit["name"])
    lines = []
    for names in groups.values():
        unit = next(u for u in data["units"] if u["name"] == names[0])
        layer = unit["moe"][0]
        where = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} (x{len(names)})"
        shared = (
            f", shared expert {fmt_count(layer['num_shared_expert_params'])} params"
            if layer["num_shared_expert_params"]
            else ""
        )
        lines.append(
            f"experts in {where}: {layer['num_experts']} experts, top-{layer['top_k']}, "
            f"{fmt_count(layer['num_params_per_expert'])} params and "
            f"{_number(layer['forward_flops_per_token_per_expert'] / 1e6)} MFLOP per routed token "
            f"each{shared}; per batch (balanced routing) {layer['tokens_per_expert']:,.1f} "
            f"tokens per expert, all-to-all dispatch and combine "
            f"{_number(layer['dispatch_bytes'] / _MIB)} MiB each"
        )
    return lines


LEGEND = (
    "params: the unit's parameters; fwd GFLOP: its forward for the whole batch (the backward is "
    "about twice that); saved act MiB: what its forward keeps for the backward without "
    "recompute; cut MiB: what a pipeline stage ending after it sends to the next (its output). "
    "Rows 'a-b (xN)' stand for N identical units; --all lists each."
)

_SAME = ("kind", "num_params", "forward_flops", "saved_activation_bytes", "cut_bytes")


def _runs(units: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Consecutive blocks with identical figures, grouped (other units alone)."""
    runs: list[list[dict[str, Any]]] = []
    for unit in units:
        last = runs[-1][-1] if runs else None
        if last is not None and unit["kind"] == "block" and all(unit[k] == last[k] for k in _SAME):
            runs[-1].append(unit)
        else:
            runs.append([unit])
    return runs


def trace_table(
    data: dict[str, Any], *, collapse: bool = True, width: int = WIDTH, wide: bool = False
) -> Table:
    """A row per pipeline unit (a run of identical blocks as one with ``collapse``) and the
    totals, fitted to ``width``."""
    rows: list[Row] = []
    groups = _runs(data["units"]) if collapse else [[u] for u in data["units"]]
    for group in groups:
        unit, end = group[0], group[-1]
        index, name = str(unit["index"]), unit["name"]
        if len(group) > 1:
            index = f"{unit['index']}-{end['index']}"
            name = f"{unit['name']} .. {end['name']} (x{len(group)})"
        rows.append(
            Row(
                [
                    index,
                    name,
                    unit["kind"],
                    fmt_count(unit["num_params"]),
                    _number(unit["forward_flops"] / 1e9),
                    _number(unit["saved_activation_bytes"] / _MIB),
                    _number(unit["cut_bytes"] / _MIB),
                ]
            )
        )
    totals = data["totals"]
    total = [
        "",
        "total",
        "",
        fmt_count(totals["num_params"]),
        _number(totals["forward_flops"] / 1e9),
        _number(totals["saved_activation_bytes"] / _MIB),
        "",
    ]
    rows.append(Row(total, style="bold", section=True))
    return fitted_table(None, TRACE_COLUMNS, rows, width=width, wide=wide)


def _number(value: float) -> str:
    """Thousands separators for large figures, three significant digits for small ones."""
    if value >= 100:
        return f"{value:,.0f}"
    if value == 0:
        return "0"
    return f"{value:.3g}"
