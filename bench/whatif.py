"""What-if for GPT-3 175B on 64 to 8192 A100 80GB GPUs (global batch 1536, 300B tokens), and
published hybrid layouts estimated by autoplan next to autoplan's best plan for the same cluster.

Target (issues 7, 15, 40): with the CLI's default settings the what-if over the 8 sizes
finishes in <= 10 s on this machine, no size over 3 s, each size's proven optimality gap
<= 2% (printed). The model is traced once before
(a few seconds, see bench/trace.py) and timed separately, as is the one-time import of torch's
pipelining package (bench/search.py does the same; the what-if's worker processes load it when
they start, inside the total). Exits non-zero when the target is missed.

Published layouts (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21, arXiv:2104.04473; transcribed in bench/data/):

1. PP 64 x DP 6 x TP 8 on 3072 A100s, Table 1's last row. The paper used it for its 1T-parameter
   GPT (128 layers, hidden 25600, batch 3072); here it is applied to GPT-3 175B (96 layers,
   batch 1536), as issue 7 asks. 98 pipeline units (embedding, 96 blocks, head) over 64 stages
   split 2 or 1 per stage; 64 x 2 chunks would exceed the units, so the schedule is 1F1B.
   Micro-batch 1 and full recompute as the paper's Table 1 runs (bench/data/
   validation_assumptions.yaml, row megatron-sc21-t1-1t).
2. GPT-3 175B's own PTD-P layout, Table 2: 1536 A100s, batch 1536, micro-batch 1, model-parallel
   size 96 = TP 8 (section 5.1: "a tensor-model-parallel size of 8") x PP 12, so DP 16;
   interleaved schedule with 4 chunks per rank (the authors' examples/sc21/run_figure_12.sh for
   the same (8, 12) configuration) and full recompute (the paper's eq. 3 counts it).

GPT-3's own paper (Brown et al. 2020, section 2.3) states no layout ("a mixture of model
parallelism within each matrix multiply and model parallelism across the layers of the
network" on V100s), so the Megatron-LM runs above are the published hybrid layouts for it.

Run: .venv/bin/python bench/whatif.py [--plot whatif.png]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

import autoplan
from autoplan._format import fmt_bytes, fmt_time
from autoplan.analysis.explain import describe_plan
from autoplan.analysis.whatif import whatif
from autoplan.cli.whatif_cmd import whatif_table
from autoplan.contract.plan import Plan
from autoplan.planner.search import DEFAULT_BUDGET_S, search_plans
from cost_model.hardware import Cluster

MODEL = "gpt3-175b"
CLUSTER = "dgx-a100-80g"
SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
GLOBAL_BATCH = 1536
TOKENS = 300e9  # GPT-3's training tokens (Brown et al. 2020, section 2.2)
TARGET_S = 10.0
TARGET_SIZE_S = 3.0
TARGET_GAP = 0.02
# Each size's search budget: the CLI's default (issue 40: the target holds at the defaults a
# user gets), reference seconds of deterministic work; then it returns its best with the gap.
BUDGET_PER_SIZE_S = DEFAULT_BUDGET_S


@dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    """A published layout and where it comes from."""

    name: str
    source: str
    num_devices: int
    layout: dict[str, Any]


PUBLISHED = (
    Published(
        name="PP 64 x DP 6 x TP 8 (1T model's layout)",
        source="Narayanan et al. 2021, Table 1 (used for the 1T, 128-layer GPT)",
        num_devices=3072,
        layout=dict(tp=8, pp=64, dp=6, micro_batch=1, recompute="full", schedule="1f1b"),
    ),
    Published(
        name="PP 12 x DP 16 x TP 8 (GPT-3 175B, PTD-P)",
        source="Narayanan et al. 2021, Table 2 (t = 8 per sec. 5.1; v = 4 per run_figure_12.sh)",
        num_devices=1536,
        layout=dict(
            tp=8,
            pp=12,
            dp=16,
            micro_batch=1,
            recompute="full",
            schedule="interleaved-1f1b",
            virtual_stages=4,
        ),
    ),
)


# The training-stack constants of Megatron-LM, which ran the published layouts, as
# bench/validate_published.py applies them to those rows (bench/data/
# validation_assumptions.yaml, megatron-sc21-*): it frees each pipeline output once sent and
# waits for its sends as it goes (pipeline_boundary_retention 0), where torch's multi-stage
# runtime keeps them until the step ends.
MEGATRON_STACK = {"pipeline_boundary_retention": 0.0}


def _row(table: Table, label: str, plan: Plan, fits: bool, note: str = "") -> None:
    e = plan.estimate
    assert e is not None
    days = TOKENS / e.tokens_per_s / 86400
    table.add_row(
        label,
        describe_plan(plan),
        fmt_time(e.step_time_s),
        f"{e.tokens_per_s:,.0f}",
        f"{e.mfu:.1%}",
        fmt_bytes(e.peak_memory_bytes) + ("" if fits else " (does not fit)") + note,
        f"{days:.1f}",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--plot", default=None, help="also draw the what-if picture here")
    args = parser.parse_args()
    console = Console(width=200, highlight=False)

    start = time.perf_counter()
    profile = autoplan.trace(autoplan.models.preset(MODEL), name=MODEL).profile
    console.print(
        f"traced {MODEL} ({profile.num_units} pipeline units) in "
        f"{time.perf_counter() - start:.1f} s"
    )

    # torch's pipelining package loads on the first schedule the cost model reads (once per
    # process): timed apart, as the trace is.
    start = time.perf_counter()
    import torch.distributed.pipelining.schedules  # noqa: F401

    console.print(f"import torch.distributed.pipelining: {time.perf_counter() - start:.1f} s")

    start = time.perf_counter()
    result = whatif(
        profile,
        CLUSTER,
        num_devices=SIZES,
        global_batch=GLOBAL_BATCH,
        tokens=TOKENS,
        budget_s=BUDGET_PER_SIZE_S,
    )
    elapsed = time.perf_counter() - start
    console.print(whatif_table(result))
    per_size = ", ".join(
        f"{r.num_devices}: {r.search_time_s:.1f} s (gap {r.optimality_gap:.1%})"
        for r in result.rows
    )
    slowest = max(r.search_time_s for r in result.rows)
    widest = max(r.optimality_gap for r in result.rows)
    ok = elapsed <= TARGET_S and slowest <= TARGET_SIZE_S and widest <= TARGET_GAP
    console.print(
        f"what-if over {len(SIZES)} sizes: {elapsed:.1f} s, slowest size {slowest:.1f} s, widest "
        f"gap {widest:.1%} (targets <= {TARGET_S:.0f} s, <= {TARGET_SIZE_S:.0f} s, <= "
        f"{TARGET_GAP:.0%}: {'met' if ok else 'MISSED'}); per size {per_size}"
    )
    if args.plot:
        from autoplan.analysis.plots import save_figure, whatif_figure

        save_figure(whatif_figure(result), args.plot)
        console.print(f"wrote {args.plot}")

    table = Table(
        title=f"published layouts vs autoplan ({MODEL}, batch {GLOBAL_BATCH}, "
        f"days for {TOKENS:.0e} tokens)"
    )
    for column in ("plan", "layout", "step", "tokens/s", "MFU", "peak memory", "days"):
        table.add_column(column, justify="left" if column in ("plan", "layout") else "right")
    for published in PUBLISHED:
        cluster = Cluster.preset(CLUSTER, nodes=published.num_devices // 8)
        plan = autoplan.manual_plan(profile, cluster, global_batch=GLOBAL_BATCH, **published.layout)
        fits = autoplan.estimate(profile, cluster, plan).fits
        note = ""
        if not fits:
            # as it ran: under Megatron-LM's runtime
            megatron = cluster.with_overrides(**MEGATRON_STACK)
            ran = autoplan.estimate(profile, megatron, plan)
            note = (
                f"; under Megatron-LM's runtime {fmt_bytes(ran.peak_memory_bytes)}"
                f" ({'fits' if ran.fits else 'does not fit'}): torch's keeps the"
                " pipeline's sends until the step ends"
            )
        t0 = time.perf_counter()
        best = search_plans(
            profile, cluster, global_batch=GLOBAL_BATCH, budget_s=BUDGET_PER_SIZE_S
        ).plans[0]
        search_s = time.perf_counter() - t0
        _row(
            table,
            f"{published.name}, {published.num_devices} GPUs [{published.source}]",
            plan,
            fits,
            note,
        )
        _row(
            table,
            f"autoplan's best on the same {published.num_devices} GPUs (search {search_s:.1f} s)",
            best,
            True,
        )
        assert plan.estimate is not None and best.estimate is not None
        table.add_row(
            "",
            f"autoplan / published: "
            f"{best.estimate.tokens_per_s / plan.estimate.tokens_per_s:.2f}x tokens/s",
            "",
            "",
            "",
            "",
            "",
            end_section=True,
        )
    console.print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
