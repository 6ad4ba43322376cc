"""The README's main job: autoplan end to end on this machine (`make demo`).

1. trace a small GPT on the meta device and show its pipeline units;
2. search a plan for a 4-process job on this machine (`Cluster.local`), save it as YAML;
3. train the GPT with that plan under `torchrun --nproc-per-node 4` (the loss falls);
4. ask a what-if question about a large model on a cluster you do not own: GPT-3 175B on
   64 to 1024 A100s, as a table and a plot (whatif.png), and draw one step of a Megatron-style
   pipeline plan's schedule (timeline.png). Files go to ``demo-output/`` (or $AUTOPLAN_DEMO_DIR).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

import autoplan
from autoplan._format import shell_lines
from autoplan.analysis.plots import save_figure, timeline_figure, whatif_figure
from autoplan.analysis.timeline import timeline_of
from autoplan.cli.common import console as cli_console
from autoplan.cli.plan_cmd import ranked_table
from autoplan.cli.trace_cmd import trace_data, trace_table
from autoplan.cli.whatif_cmd import scaling_note, whatif_table

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("AUTOPLAN_DEMO_DIR", "demo-output"))
sys.path.insert(0, str(HERE))

from train_gpt import small_gpt  # noqa: E402

# the training job's processes (`python examples/demo.py --processes 2` for another count)
NUM_PROCESSES = 4
GLOBAL_BATCH = 16


def main(num_processes: int = NUM_PROCESSES) -> None:
    console = cli_console()  # the CLI's: COLUMNS, the terminal's, or 100 when piped
    OUT.mkdir(exist_ok=True)

    console.rule("1. Trace a small GPT on the meta device")
    graph = autoplan.trace(small_gpt(), name="small-gpt")
    console.print(trace_table(trace_data(graph), width=console.width))

    console.rule(f"2. Search a plan for {num_processes} processes on this machine")
    cluster = autoplan.Cluster.local(num_devices=num_processes)
    source = (
        "calibrated"
        if "calibrated" in cluster.description
        else "measured on first use; `autoplan calibrate` refines them"
        if "measured on first use" in cluster.description
        else "defaults; `autoplan calibrate`"
    )
    console.print(
        f"{cluster.name}: {cluster.num_devices} worker processes on {os.cpu_count()} CPU cores, "
        f"{cluster.device.peak_flops_for('fp32') / 1e9:.0f} GFLOP/s each ({source})"
    )
    # CPU training runs in fp32; the search gets the same constraint as parallelize's.
    plans = autoplan.search(graph, cluster, global_batch=GLOBAL_BATCH, top_k=3, dtype="fp32")
    console.print(ranked_table(tuple(plans), width=console.width))
    plan_path = OUT / "plan.yaml"
    plans[0].to_yaml(plan_path)
    console.print(f"saved the best plan to {plan_path}")

    console.rule(f"3. Train it: torchrun --nproc-per-node {num_processes}")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={num_processes}",
        str(HERE / "train_gpt.py"),
        "--plan",
        str(plan_path),
        "--steps",
        "150",
        "--global-batch",
        str(GLOBAL_BATCH),
    ]
    # wrapped with the shell's continuations: it still pastes as one command
    words = [shlex.quote(word) for word in command]
    console.print(shell_lines(words, console.width), soft_wrap=True, markup=False)
    subprocess.run(command, check=True)

    console.rule("4. What if: GPT-3 175B on 64 to 1024 A100s (DGX A100 nodes), 300B tokens")
    # on the meta device: a few seconds, no memory
    gpt3 = autoplan.trace(autoplan.models.preset("gpt3-175b"), name="gpt3-175b")
    result = autoplan.whatif(
        gpt3,
        "dgx-a100-80g",
        num_devices=[64, 128, 256, 512, 1024],
        global_batch=1536,
        tokens=300e9,
        price_per_device_hour=2.0,
        # each size's search returns its best after this many reference seconds of work (the
        # same plan on any machine), with its proven gap
        budget_s=5.0,
    )
    console.print(whatif_table(result, width=console.width))
    note = scaling_note(result)
    if note:
        console.print("scaling efficiency above 100%:" + note)
    plot = save_figure(whatif_figure(result), OUT / "whatif.png")
    console.print(f"throughput and scaling plot: {plot}")
    # A Megatron-style layout for comparison, and a picture of one step of its pipeline.
    nodes = autoplan.Cluster.preset("dgx-a100-80g", nodes=128)
    megatron = autoplan.manual_plan(
        gpt3,
        nodes,
        tp=8,
        pp=8,
        micro_batch=1,
        global_batch=1536,
        recompute="full",
        schedule="interleaved-1f1b",
        virtual_stages=2,
    )
    baseline = autoplan.estimate(gpt3, nodes, megatron)
    console.print(
        f"Megatron-style t8 p8 d16 interleaved (v=2), full recompute on 1024 GPUs: step "
        f"{baseline.step_time_s:.1f} s, MFU {baseline.mfu:.1%}, "
        f"bubble {baseline.bubble_fraction:.1%}"
    )
    # autoplan's own plan for the same 1024 GPUs, and one step of its pipeline schedule
    best = next(row.plan for row in result.rows if row.num_devices == 1024 and row.plan)
    estimate = autoplan.estimate(gpt3, nodes, best)
    console.print(
        f"autoplan's plan on 1024 GPUs: step {estimate.step_time_s:.1f} s, MFU "
        f"{estimate.mfu:.1%}, bubble {estimate.bubble_fraction:.1%} "
        f"({baseline.step_time_s / estimate.step_time_s:.2f}x the Megatron-style layout's speed)"
    )
    picture = save_figure(timeline_figure(timeline_of(estimate, best)), OUT / "timeline.png")
    console.print(f"one step of autoplan's pipeline schedule: {picture}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--processes",
        type=int,
        choices=range(1, 65),
        metavar="N",
        default=NUM_PROCESSES,
        help=f"processes of the training job [{NUM_PROCESSES}]",
    )
    main(parser.parse_args().processes)
