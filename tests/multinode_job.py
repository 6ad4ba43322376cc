"""One rank of the two-node job that tests/test_multinode.py starts with two torchrun agents.

Trains the tiny GPT for a few steps under a plan whose data-parallel groups span both nodes and
whose tensor-parallel groups stay inside each node, with the cluster autoplan derives from the
torchrun environment (2 nodes x LOCAL_WORLD_SIZE), and writes this rank's losses to
``<out>/rank<N>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.runtime.parallelizer import parallelize
from tests.numerics import STEPS, batch, build_model, loss_fn, make_plan, optimizer_factory


def main(out: Path) -> None:
    torch.set_num_threads(1)
    plan = make_plan(dp=2, tp=2, zero=3)  # rank layout pp/dp/tp: tp = {0,1},{2,3}; dp = {0,2},{1,3}
    model = parallelize(
        build_model("gpt"), plan=plan, loss_fn=loss_fn, optimizer=optimizer_factory()
    )
    rank = dist.get_rank()
    losses = [float(model.train_step(*batch(plan.global_batch_size, s))) for s in range(STEPS)]
    record = {
        "rank": rank,
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "dp_group": list(plan.group_ranks("dp", rank)),
        "tp_group": list(plan.group_ranks("tp", rank)),
        "losses": losses,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
