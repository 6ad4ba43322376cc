"""Bounded search inputs (issue 37): peak memory and time of `autoplan plan` for the largest
models the zoo builds (4,096 layers, `autoplan.models._common.MAX_SIZE`) on 1,024 GPUs.

Each case runs the real command line in a fresh process (``python -m autoplan plan ...
--json``: model build on meta, trace, search with the default 10 s budget, the plan read back)
and reports its wall time and peak resident memory (the child's ``ru_maxrss``). The bound
docs/guide.md states ("Limits") is checked: every case within `PEAK_BOUND_BYTES`.

Cases: the GPT of issue 37 (hidden 2304, 24 heads, sequence 2048, vocabulary 51200) at 1,024,
2,048 and 4,096 layers on 128 DGX A100 nodes, global batch 1024; the same at 4,096 layers with
hidden 512 (small layers: more of the space fits, more schedules are simulated); Llama 3 8B
and DeepSeekMoE 16B (a mixture of experts whose dense first layer makes the units uneven: the
runs formulation) stretched to 4,096 layers. The mixture of experts searches for ~7 minutes
(no first guess fits, and the search goes on past its budget until one does); ``--quick``
leaves it out.

Before this work (the tree at 6cc0e20, same machine: 2 cores shared with other jobs):
1,024 layers 17.7 s / 535 MB; 4,096 layers 57 s / 1.69 GB; hidden 512 130 s / 3.37 GB;
llama3-8b:num_layers=4096 crashed after 167 s (a partition 60% over memory); the mixture of
experts passed 5 GB in 66 s. Time is the machine's (other jobs share it); memory is the
bound.

Run: .venv/bin/python bench/limits.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
# The documented bound (docs/guide.md, "Limits"): peak resident memory of a plan search for
# any zoo model of up to 4,096 layers on 1,024 devices.
PEAK_BOUND_BYTES = 2 * 2**30
GPT = "gpt:num_layers={},hidden_size=2304,num_heads=24,seq_len=2048,vocab_size=51200"
CLUSTER = "dgx-a100-80g:nodes=128"
CASES: tuple[tuple[str, bool], ...] = (  # (model, slow)
    (GPT.format(1024), False),
    (GPT.format(2048), False),
    (GPT.format(4096), False),
    ("gpt:num_layers=4096,hidden_size=512,num_heads=8,seq_len=1024,vocab_size=50304", False),
    ("llama3-8b:num_layers=4096", False),
    ("deepseek-moe-16b:num_layers=4096", True),
)


# Runs the command line in the child and, at its exit, prints the child's own peak RSS.
_CHILD = (
    "import atexit, resource, runpy, sys\n"
    "atexit.register(lambda: print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF)"
    ".ru_maxrss, file=sys.stderr))\n"
    "sys.argv = ['autoplan', *sys.argv[1:]]\n"
    "runpy.run_module('autoplan', run_name='__main__')\n"
)


def run_case(model: str) -> tuple[float, int, dict[str, object]]:
    """(wall seconds, peak RSS bytes, the command's JSON) of one plan search."""
    command = [sys.executable, "-c", _CHILD, "plan", "--model", model, "--cluster", CLUSTER]
    command += ["--global-batch", "1024", "--json"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{model}: exit {done.returncode}: {done.stderr[-2000:]}")
    marks = [line for line in done.stderr.splitlines() if line.startswith("peak_rss_kib ")]
    peak = int(marks[-1].split()[1]) * 1024  # kilobytes on Linux
    data: dict[str, object] = json.loads(done.stdout)
    return wall, peak, data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="leave out the mixture of experts")
    args = parser.parse_args()
    console = Console(width=140)
    table = Table(title=f"autoplan plan on {CLUSTER} (1,024 A100), global batch 1024")
    for column in ("model", "units", "candidates", "step", "gap", "time s", "peak RSS"):
        table.add_column(column, justify="left" if column == "model" else "right")
    ok = True
    for model, slow in CASES:
        if slow and args.quick:
            continue
        wall, peak, data = run_case(model)
        plans = data["plans"]
        stats = data["stats"]
        assert isinstance(plans, list) and isinstance(stats, dict)
        best = plans[0]
        ok &= peak <= PEAK_BOUND_BYTES
        table.add_row(
            model,
            f"{best['model']['num_units']:,}",
            f"{stats['candidates']:,}",
            f"{best['estimate']['step_time_s']:.3g} s",
            f"{stats['optimality_gap']:.1%}",
            f"{wall:.1f}",
            f"{peak / 2**30:.2f} GiB",
        )
        console.print(f"{model}: {wall:.1f} s, peak {peak / 2**30:.2f} GiB", highlight=False)
    console.print(table)
    console.print(
        f"bound: peak RSS <= {PEAK_BOUND_BYTES / 2**30:.0f} GiB for every case: "
        + ("met" if ok else "NOT MET")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
