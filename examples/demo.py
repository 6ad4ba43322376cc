"""The README's main job: what autoplan does, end to end, on this machine.

Run with `make demo`. Each stage prints what it shows; later stages are added as autoplan grows.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.console import Console

from autoplan import Cluster, Plan
from autoplan.cli.cluster_cmd import cluster_table
from autoplan.plan import even_stages


def main() -> None:
    console = Console(highlight=False)
    console.rule("1. This machine as a cluster")
    local = Cluster.local()
    console.print(cluster_table(local))

    console.rule("2. A named cluster you do not own: 4 DGX A100 nodes")
    console.print(cluster_table(Cluster.preset("dgx-a100-80g", nodes=4)))

    console.rule("3. A hand-written plan, saved as YAML and validated against the cluster")
    big = Cluster.preset("dgx-a100-80g", nodes=4)
    plan = Plan(
        dp_degree=2,
        tp_degree=8,
        pp_degree=2,
        stages=even_stages(26, 2),
        micro_batch_size=1,
        num_micro_batches=16,
        global_batch_size=32,
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.yaml"
        plan.to_yaml(path)
        console.print(path.read_text())
        Plan.from_yaml(path).validate(None, big)
    console.print(
        f"plan valid for {big.name}: {plan.num_devices} devices, "
        f"tp groups {plan.group_ranks('tp')} stay inside one node"
    )


if __name__ == "__main__":
    main()
