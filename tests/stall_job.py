"""A torchrun job in which rank 1 stops itself (SIGSTOP) before step 3
(tests/test_parallelize_runtime.py): its peers wait in step 3's first collective with it for the
process-group timeout, then fail with a `StalledRankError` naming rank 1.

Usage: stall_job.py {dp,pp,dp2pp2} TIMEOUT_S (dp, pp: 2 processes; dp2pp2: 4, whose groups are
sub-groups of the world)
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn.functional as F

import autoplan
from autoplan.models import gpt
from autoplan.runtime.parallelizer import parallelize

if __name__ == "__main__":
    layout, timeout_s = sys.argv[1], float(sys.argv[2])
    torch.manual_seed(0)
    model = gpt(2, 64, 4, 32, 128)
    cluster = autoplan.Cluster.local(num_devices=int(os.environ["WORLD_SIZE"]))
    degrees = {"dp": {"dp": 2}, "pp": {"pp": 2}, "dp2pp2": {"dp": 2, "pp": 2}}[layout]
    plan = autoplan.manual_plan(
        autoplan.trace(model), cluster, global_batch=4, dtype="fp32", **degrees
    )
    job = parallelize(
        model,
        plan=plan,
        loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()),
        timeout_s=timeout_s,
    )
    tokens = torch.randint(0, 128, (4, 33))
    for step in range(1, 6):
        if step == 3 and int(os.environ["RANK"]) == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        job.train_step(tokens[:, :-1], tokens[:, 1:])
