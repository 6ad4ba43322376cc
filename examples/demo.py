"""The README's main job: autoplan end to end on this machine (`make demo`).

1. trace a small GPT on the meta device and show its pipeline units;
2. search a plan for a 4-process job on this machine (`Cluster.local`), save it as YAML;
3. train the GPT with that plan under `torchrun --nproc-per-node 4` (the loss falls);
4. ask a what-if question about a large model on a cluster you do not own: GPT-3 175B on
   64 to 1024 A100s, as a table and a plot (whatif.png).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

import autoplan
from autoplan.cli.plan_cmd import ranked_table
from autoplan.cli.trace_cmd import trace_data, trace_table

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("AUTOPLAN_DEMO_DIR", "demo-output"))
sys.path.insert(0, str(HERE))

from train_gpt import small_gpt  # noqa: E402

NUM_PROCESSES = 4
GLOBAL_BATCH = 16


def main() -> None:
    console = Console(highlight=False, width=140)
    OUT.mkdir(exist_ok=True)

    console.rule("1. Trace a small GPT on the meta device")
    graph = autoplan.trace(small_gpt(), name="small-gpt")
    console.print(trace_table(trace_data(graph)))

    console.rule(f"2. Search a plan for {NUM_PROCESSES} processes on this machine")
    cluster = autoplan.Cluster.local(num_devices=NUM_PROCESSES)
    source = "measured" if "calibrated" in cluster.description else "defaults; `autoplan calibrate`"
    console.print(
        f"{cluster.name}: {cluster.num_devices} worker processes on {os.cpu_count()} CPU cores, "
        f"{cluster.device.peak_flops_for('fp32') / 1e9:.0f} GFLOP/s each ({source})"
    )
    # CPU training runs in fp32; the search gets the same constraint as parallelize's.
    plans = autoplan.search(graph, cluster, global_batch=GLOBAL_BATCH, top_k=3, dtype="fp32")
    console.print(ranked_table(tuple(plans)))
    plan_path = OUT / "plan.yaml"
    plans[0].to_yaml(plan_path)
    console.print(f"saved the best plan to {plan_path}")

    console.rule(f"3. Train it: torchrun --nproc-per-node {NUM_PROCESSES}")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={NUM_PROCESSES}",
        str(HERE / "train_gpt.py"),
        "--plan",
        str(plan_path),
        "--steps",
        "150",
        "--global-batch",
        str(GLOBAL_BATCH),
    ]
    console.print(" ".join(command[1:]))
    subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
