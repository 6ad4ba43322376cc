"""`autoplan models`: the model presets with their sizes (any of them is a --model spec)."""

from __future__ import annotations

from typing import Any

import click

from autoplan._format import Row, columns_help, fitted_table, print_fitted
from autoplan.cli.columns import MODEL_COLUMNS, MODEL_TABLE
from autoplan.cli.common import console, emit_json, json_option, wide_option
from autoplan.cli.progress import progress_enabled, progress_option, status_reporter


def _row(name: str) -> dict[str, Any]:
    # The zoo imports torch (seconds): here, so the CLI's other commands stay fast.
    from autoplan.models import MoEConfig, preset, preset_config

    config = preset_config(name)
    model = preset(name)  # on meta: no memory
    params = sum(p.numel() for p in model.parameters())  # a tied embedding counts once
    family = type(config).__name__.removesuffix("Config").lower()  # gpt, llama, moe
    row: dict[str, Any] = {
        "name": name,
        "family": family,
        "num_params": params,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "num_kv_heads": getattr(config, "num_kv_heads", config.num_heads),
        "ffn_hidden_size": config.ffn_hidden_size,
        "seq_len": config.seq_len,
        "vocab_size": config.vocab_size,
    }
    if isinstance(config, MoEConfig):
        row["num_experts"] = config.num_experts
        row["top_k"] = config.top_k
        row["moe_ffn_hidden_size"] = config.moe_ffn_hidden_size
        row["num_shared_experts"] = config.num_shared_experts
    return row


@click.command("models", epilog=columns_help([MODEL_TABLE]))
@progress_option
@wide_option
@json_option
def models_cmd(progress: bool | None, wide: bool, as_json: bool) -> None:
    """List the model presets and their sizes. Pass a name to --model, with overrides as
    NAME:key=value,... (e.g. llama3-8b:seq_len=4096), or use the builders gpt:..., llama:... and
    moe:... (ffn shows a MoE's experts as experts x top-k x expert size)."""
    # progress on stderr (`autoplan.cli.progress`): torch's import and the presets take seconds
    with status_reporter("models", enabled=progress_enabled(progress, as_json)) as status:
        status.update("importing the model zoo")
        from autoplan.models import list_presets  # imports torch, as in _row

        names = list_presets()
        presets: list[dict[str, Any]] = []
        for done, name in enumerate(names):
            status.update(f"building {name} on meta", done, len(names), phase="build")
            presets.append(_row(name))
    if as_json:
        emit_json(presets)
        return
    rows = [
        Row(
            [
                r["name"],
                f"{r['num_params'] / 1e9:,.2f} B",
                str(r["num_layers"]),
                str(r["hidden_size"]),
                f"{r['num_heads']} ({r['num_kv_heads']})",
                (
                    f"{r['num_experts']}x{r['top_k']}x{r['moe_ffn_hidden_size']}"
                    if r["family"] == "moe"
                    else str(r["ffn_hidden_size"])
                ),
                str(r["seq_len"]),
                str(r["vocab_size"]),
            ]
        )
        for r in presets
    ]
    out = console()
    table = fitted_table(
        "model presets (--model NAME[:key=value,...])",
        MODEL_COLUMNS,
        rows,
        width=out.width,
        wide=wide,
    )
    print_fitted(out, table)
