"""A torchrun job whose plan is for 8 processes, launched on 2 (tests/test_parallelize_runtime.py):
every rank raises the same `PlanError` from `autoplan.parallelize`."""

from __future__ import annotations

import torch.nn.functional as F

import autoplan
from autoplan.models import gpt
from autoplan.runtime.parallelizer import parallelize

if __name__ == "__main__":
    model = gpt(2, 64, 4, 32, 128)
    plan = autoplan.manual_plan(autoplan.trace(model), "dgx-a100-80g", global_batch=8)
    parallelize(
        model, plan=plan, loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())
    )
