"""`autoplan whatif`: the best plan, speed and cost of a model across cluster sizes and types.

Every input mistake (device counts that are not whole nodes, an unknown cluster type or
override, a token count or price that is not a positive number, an unwritable plot path) is
found before the model is traced and printed as one line; sizes without a feasible plan are rows
that say why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Group
from rich.table import Table

from autoplan._format import (
    WIDTH,
    Row,
    columns_help,
    fitted_table,
    fmt_bytes,
    fmt_range_percent,
    fmt_recompute,
    fmt_time,
    print_fitted,
)
from autoplan.analysis.whatif import (
    DEFAULT_TOTAL_BUDGET_S,
    WhatIfInputError,
    WhatIfProgress,
    WhatIfResult,
    WhatIfRow,
    check_search_count,
    cluster_type,
    parse_cost_inputs,
    split_cluster_specs,
    whatif,
)
from autoplan.analysis.whatif_results import PROVEN_FOR_SUPERLINEAR
from autoplan.cli.columns import COST_COLUMNS, COST_TABLE, WHATIF_COLUMNS, WHATIF_TABLE
from autoplan.cli.common import (
    budget_s,
    console,
    emit_json,
    finite_seconds,
    framework_option,
    json_option,
    search_constraints,
    search_options,
    trace_spec,
    wide_option,
)
from autoplan.cli.progress import progress_enabled, progress_option, status_reporter
from autoplan.contract.plan import Plan
from cost_model.errors import SchemaError
from cost_model.messages import shown as shown_value
from cost_model.schema import check_writable

PICTURE_SUFFIXES = (".png", ".pdf", ".svg")


@click.command("whatif", epilog=columns_help([WHATIF_TABLE, COST_TABLE]))
@click.option(
    "--model",
    "model_spec",
    required=True,
    help="Model NAME[:key=value,...], or hf:PATH (a Hugging Face config.json).",
)
@click.option(
    "--cluster",
    "cluster_specs",
    required=True,
    multiple=True,
    help="Cluster type(s): NAME[:k=v,...] or YAML, comma-separated or repeated, e.g. "
    "dgx-a100-80g,dgx-h100-80g.",
)
@click.option(
    "--num-devices",
    "num_devices_text",
    required=True,
    help="Device counts, e.g. 64,128,256 (whole nodes, or fewer than one node).",
)
@click.option(
    "--global-batch", type=click.IntRange(min=1), required=True, help="Sequences per step."
)
@click.option("--tokens", "tokens_text", default=None, help="Tokens to train on, e.g. 300e9.")
@click.option(
    "--price-per-device-hour",
    "price_text",
    default=None,
    help="Price of one device for one hour, in --currency (with --tokens: the cost to train).",
)
@click.option(
    "--price",
    "price_items",
    multiple=True,
    help="Price of one device-hour per cluster type, TYPE=P, comma-separated or repeated, e.g. "
    "dgx-h100-80g=2.5,dgx-b200-180g=5 (over --price-per-device-hour and a cluster file's "
    "price_per_device_hour).",
)
@click.option(
    "--currency",
    default="USD",
    show_default=True,
    help="Currency of --price-per-device-hour, shown with the cost.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Draw throughput and scaling efficiency against devices (.png, .pdf or .svg).",
)
@click.option(
    "--set",
    "set_items",
    multiple=True,
    help="Cluster override for every type, key=value, e.g. inter_node_bandwidth=100GB/s.",
)
@click.option(
    "--total-budget",
    type=click.FloatRange(min=0.0),
    callback=finite_seconds,
    default=DEFAULT_TOTAL_BUDGET_S,
    show_default=True,
    help="Wall seconds for all the searches together: none starts once they are spent (each "
    "started search keeps its --budget); sizes not reached are listed as not run (0: no cap).",
)
@search_options(with_dp=False)
@framework_option
@wide_option
@progress_option
@json_option
def whatif_cmd(
    model_spec: str,
    cluster_specs: tuple[str, ...],
    num_devices_text: str,
    global_batch: int,
    tokens_text: str | None,
    price_text: str | None,
    price_items: tuple[str, ...],
    currency: str,
    plot_path: str | None,
    set_items: tuple[str, ...],
    time_limit: float,
    total_budget: float,
    framework: str,
    wide: bool,
    progress: bool | None,
    as_json: bool,
    **options: Any,
) -> None:
    """For each device count and cluster type: the best plan, its speed, scaling and cost."""
    # Everything the user typed is checked before the (slower) model trace.
    sizes = parse_device_counts(num_devices_text)
    tokens, price = parse_cost_inputs(
        tokens_text, price_text, names=("--tokens", "--price-per-device-hour")
    )
    overrides = parse_overrides(set_items)
    specs = [spec for text in cluster_specs for spec in split_cluster_specs(text)]
    prices = parse_prices(price_items, specs)
    check_search_count(len(specs), len(set(sizes)))
    for spec in specs:
        cluster_type(spec, overrides).check_devices(sizes)
    if plot_path is not None:
        check_picture_path(plot_path, "--plot")
    constraints = search_constraints(options)

    out = console()
    cap = total_budget or None  # (0: no cap)
    # progress on stderr: a bar on a terminal, else a line a search (`autoplan.cli.progress`)
    # (its searches run in worker processes: the delay before the first line counts wall time)
    with status_reporter(
        "what-if", enabled=progress_enabled(progress, as_json), in_workers=True
    ) as status:
        status.update(f"tracing {shown_value(model_spec, quoted=False)}")
        profile = trace_spec(model_spec).profile

        def report(step: WhatIfProgress) -> None:
            left = step.completed < step.total
            status.update(
                f"{step.completed}/{step.total} searches done"
                + (f"; planning {step.cluster} x {step.num_devices} devices" if left else "")
                + (f" (total budget {cap:g} s)" if cap is not None and left else ""),
                completed=step.completed,
                total=step.total,
                phase=f"search {step.completed}",
            )

        result = whatif(
            profile,
            specs,
            num_devices=sizes,
            global_batch=global_batch,
            tokens=tokens,
            price_per_device_hour=price,
            prices=prices,
            cluster_overrides=overrides,
            time_limit_s=time_limit,
            budget_s=budget_s(options),
            total_budget_s=cap,
            progress=report,
            framework=framework,
            **constraints,
        )
    if not result.feasible_rows and result.not_run:
        raise WhatIfInputError(
            f"no plan for {result.model} in the {len(result.rows) - result.not_run} searches "
            f"run; {not_run_line(result)}"
        )
    if not result.feasible_rows:
        reasons = "; ".join(f"{r.cluster} x {r.num_devices}: {r.reason}" for r in result.rows)
        # the fix follows the reasons: memory wants more or bigger devices, a constraint (or
        # the stack's refusal of it) wants the constraint relaxed
        memory = [r for r in result.rows if (r.reason or "").startswith("does not fit")]
        fixes = []
        if len(memory) < len(result.rows):
            refused = any("runs none of the plans" in (r.reason or "") for r in result.rows)
            fixes.append(
                "change what the reasons name"
                + (", or price another --framework" if refused else "")
            )
        if memory:
            fixes.append("try more devices, devices with more memory or a smaller global batch")
        raise WhatIfInputError(
            f"no plan for {result.model} fits any of the sizes: {reasons}; {'; '.join(fixes)}"
        )
    if plot_path is not None:
        # matplotlib takes about a second to import: only when a picture is asked for.
        from autoplan.analysis.plots import save_figure, whatif_figure

        save_figure(whatif_figure(result), plot_path, what="--plot")
    if as_json:
        data = result.to_data()
        data["plot"] = plot_path
        data["currency"] = currency if result.priced else None
        emit_json(data)
        return
    header = f"[bold]{result.model}[/], global batch {global_batch}"
    if tokens is not None:
        header += f", {tokens:.3g} tokens"
    if price is not None:
        header += f", {price:g} {currency} per device-hour"
    elif result.priced:
        header += f", priced per type in {currency}"
    if overrides:
        header += ", with " + ", ".join(f"{k}={v}" for k, v in overrides.items())
    out.print(header)
    print_fitted(
        out, *whatif_table(result, currency=currency, width=out.width, wide=wide).renderables
    )
    out.print(
        f"{len(result.rows) - result.not_run} searches in {result.total_time_s:.1f} s; scaling "
        "efficiency = "
        "tokens/s per device relative to the smallest size with a plan" + scaling_note(result)
    )
    if result.not_run:
        out.print(not_run_line(result))
    if plot_path is not None:
        out.print(f"wrote {plot_path}")


def parse_prices(items: tuple[str, ...], specs: list[str]) -> dict[str, str]:
    """``--price`` entries (``TYPE=P``, comma-separated or repeated) as {type: price text};
    a type that is not among ``specs`` or an entry without ``=`` is a `WhatIfInputError`."""
    prices: dict[str, str] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            # the price follows the last '=' (a type's own overrides may hold '=' too)
            name, equals, value = part.rpartition("=")
            if not equals or not name:
                raise WhatIfInputError(
                    f"--price {part!r} must be TYPE=PRICE, e.g. {specs[0]}=2.5 (one price for "
                    "every type: --price-per-device-hour)"
                )
            if name not in specs:
                raise WhatIfInputError(
                    f"--price names {name!r}, which is not in --cluster; price the types given: "
                    f"{', '.join(specs)}"
                )
            prices[name] = value
    return prices


def not_run_line(result: WhatIfResult) -> str:
    """``12 of 50 searches not run: ...``: how many the total budget left out and the fix."""
    cap = result.total_budget_s or 0.0
    return (
        f"{result.not_run} of {len(result.rows)} searches not run: the --total-budget of "
        f"{cap:g} s ran out; raise it (e.g. --total-budget {max(2 * cap, 60.0):g}, or 0 for no "
        "cap) or ask for fewer cluster types and sizes"
    )


def parse_device_counts(text: str) -> list[int]:
    """``"64,128,256"`` to [64, 128, 256]; one-line `WhatIfInputError` otherwise."""
    counts: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise WhatIfInputError(
                f"--num-devices {text!r}: {part!r} is not a whole number; write e.g. 64,128,256"
            ) from None
        if value < 1:
            raise WhatIfInputError(f"--num-devices {text!r}: {value} must be >= 1")
        counts.append(value)
    if not counts:
        raise WhatIfInputError("--num-devices is empty; write e.g. 64,128,256")
    return counts


def parse_overrides(items: tuple[str, ...]) -> dict[str, str]:
    """``--set key=value`` (repeated, or comma-separated) to a dict of cluster overrides."""
    overrides: dict[str, str] = {}
    for item in (p.strip() for text in items for p in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise WhatIfInputError(
                f"--set {item!r}: write key=value, e.g. --set inter_node_bandwidth=100GB/s"
            )
        overrides[key.strip()] = value.strip()
    return overrides


def check_picture_path(path: str, option: str) -> None:
    """A picture can be written there: a known suffix and an existing folder."""
    target = Path(path)
    if target.suffix.lower() not in PICTURE_SUFFIXES:
        raise WhatIfInputError(
            f"{option} {path!r}: use a file ending in {', '.join(PICTURE_SUFFIXES)}"
        )
    if not target.parent.is_dir():
        raise WhatIfInputError(f"{option} {path!r}: folder {str(target.parent)!r} does not exist")
    try:
        check_writable(target, option)
    except SchemaError as error:
        raise WhatIfInputError(str(error)) from None


def _plan_cell(row: WhatIfRow) -> str:
    plan = row.plan
    if not row.searched:
        return "not run (the total budget ran out)"
    if plan is None:
        return f"no plan: {row.reason}"
    return plan_label(plan)


def plan_label(plan: Plan) -> str:
    """A plan in one phrase, as the table's plan column shows it: its degrees,
    micro-batching, schedule, ZeRO level, recompute and sequence parallelism."""
    schedule = plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    extra = (f" c{plan.cp_degree}" if plan.cp_degree > 1 else "") + (
        f" e{plan.ep_degree}" if plan.ep_degree > 1 else ""
    )
    return (
        f"t{plan.tp_degree} p{plan.pp_degree} d{plan.dp_degree}{extra} mb{plan.micro_batch_size}x"
        f"{plan.num_micro_batches} {schedule} Z{plan.zero_stage} "
        + fmt_recompute(s.recompute for s in plan.stages)
        + (" SP" if plan.sequence_parallel else "")
        + (" compiled" if plan.compile else "")
        # an fp8 recipe by name (a plain dtype is the what-if's own, in its title)
        + (f" {plan.dtype}" if "fp8" in plan.dtype else "")
    )


def _amount(value: float) -> str:
    """Whole numbers with separators from 100 up, three significant digits below."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _efficiency_cell(result: WhatIfResult, row: WhatIfRow) -> str:
    shown = result.shown_efficiency(row)
    if shown is None:
        return "-" if row.scaling_efficiency is None else ">100%?"
    return f"{shown:.0%}"


def scaling_note(result: WhatIfResult) -> str:
    """Why a scaling efficiency exceeds 100%, when one does ("" otherwise): against an
    unproven baseline it is not shown (">100%?"); against a proven one, the plan shape that
    gains."""
    notes = []
    for row in result.rows:
        if (row.scaling_efficiency or 0.0) <= 1.0 or row.plan is None:
            continue
        baseline = result.baseline_of(row)
        if baseline is None or baseline.plan is None:
            continue
        if result.shown_efficiency(row) is None:
            notes.append(
                f"{row.num_devices:,} {row.cluster}: {row.scaling_efficiency:.0%} against the "
                f"{baseline.num_devices:,}-device plan, which is not proven within "
                f"{PROVEN_FOR_SUPERLINEAR:.0%} (gap {baseline.optimality_gap:.1%}): shown as "
                "'>100%?'; a larger --budget proves more"
            )
        else:
            notes.append(
                f"{row.num_devices:,} {row.cluster}: {row.scaling_efficiency:.0%}, its plan "
                f"({plan_label(row.plan)}) beside the {baseline.num_devices:,}-device one "
                f"({plan_label(baseline.plan)}): more memory per device buys a faster shape"
            )
    return "".join(f"\n{note}" for note in notes)


def whatif_table(
    result: WhatIfResult, *, currency: str = "USD", width: int = WIDTH, wide: bool = False
) -> Group:
    """A table per cluster type, a row per device count: the best plan, its speed, memory,
    scaling and the search's unproven gap; with ``tokens``, a table of the time and cost to
    train; each fitted to ``width``."""
    tables: list[Table] = []
    clusters = list(dict.fromkeys(row.cluster for row in result.rows))
    headroom = f"{float(dict(result.constraints).get('memory_headroom', 0.1)):.0%}"
    for index, cluster in enumerate(clusters):
        rows = [row for row in result.rows if row.cluster == cluster]
        last = index == len(clusters) - 1
        cells: list[Row] = []
        for row in rows:
            head = [f"{row.num_devices:,}", _plan_cell(row)]
            if row.plan is None:
                cells.append(Row([*head, *["-"] * 7], style="dim"))
                continue
            assert row.step_time_s is not None and row.tokens_per_s is not None
            assert row.mfu is not None and row.peak_memory_bytes is not None
            cells.append(
                Row(
                    [
                        *head,
                        fmt_time(row.step_time_s),
                        fmt_range_percent(row.step_time_s, row.step_time_range_s or (0.0, 0.0)),
                        f"{row.tokens_per_s:,.0f}",
                        f"{row.mfu:.1%}",
                        f"{row.peak_memory_bytes / row.memory_capacity_bytes:.0%}",
                        _efficiency_cell(result, row),
                        f"{row.optimality_gap:.1%}" if row.optimality_gap > 0 else "0",
                    ]
                )
            )
        tables.append(
            fitted_table(
                # a size below a node is priced on part of one: the largest row's is the node's
                f"best plan per size: {cluster} ({max(r.devices_per_node for r in rows)} "
                f"devices per node, {fmt_bytes(rows[0].memory_capacity_bytes)} each)",
                WHATIF_COLUMNS,
                cells,
                width=width,
                wide=wide,
                caption=(
                    "plan: t/p/d = tensor/pipeline/data-parallel degrees (c/e: context and "
                    "expert parallel, when used), mb = micro-batch size x count, Z = ZeRO level; "
                    "memory: the peak device's predicted tensors, framework reserve and "
                    "allocator margin, as a share of its capacity (the rest is free; plans "
                    f"keep {headroom} of it free beyond the peak's 80% range)"
                )
                if last
                else None,
                # said of the columns shown, under the last table
                notes={
                    "range": "range: the step's 80% range around it",
                    "gap": "gap: a plan up to this much faster may exist (the search's budget "
                    "ended before it proved otherwise)",
                }
                if last
                else None,
            )
        )
    if result.tokens is not None:
        tables.append(_cost_table(result, currency, width=width, wide=wide))
    parts: list[Table | str] = []
    for table in tables:
        parts += [table, ""] if table is not tables[-1] else [table]
    return Group(*parts)


def _cost_table(result: WhatIfResult, currency: str, *, width: int, wide: bool) -> Table:
    assert result.tokens is not None
    columns = list(COST_COLUMNS if result.priced else COST_COLUMNS[:4])
    rows: list[Row] = []
    for row in result.rows:
        cells = [row.cluster, f"{row.num_devices:,}"]
        if row.training is None:
            rows.append(Row([*cells, *["-"] * (len(columns) - 2)], style="dim"))
            continue
        cells += [_amount(row.training.days), _amount(row.training.device_hours)]
        if result.priced:
            training = row.training
            price, cost = training.price_per_device_hour, training.cost
            per_million = training.cost_per_million_tokens
            cells += [
                f"{price:g}" if price is not None else "-",
                _amount(cost) if cost is not None else "-",
                f"{per_million:.3g}" if per_million is not None else "-",
            ]
        rows.append(Row(cells))
    return fitted_table(
        f"to train on {result.tokens:.3g} tokens",
        columns,
        rows,
        width=width,
        wide=wide,
        caption=(
            f"price and cost: {currency} per device-hour and {currency} (a type without a "
            "price has no cost); per 1M tokens: the cost of a million tokens at the row's "
            "throughput"
        )
        if result.priced
        else None,
    )
