"""A torchrun job of 2 processes in which rank 1 alone fails (tests/test_rank_failures.py).

Usage: rank_failure_job.py {input,data} TIMEOUT_S OUT_DIR

- ``input``: rank 1 gives `autoplan.parallelize` a cluster that does not exist: a
  `ClusterError` (an `InputError`) on rank 1 alone, after the process group exists, while rank
  0 goes on building;
- ``data``: an `autoplan.Trainer` trains the example's model (a checkpoint every step, in
  OUT_DIR/ckpt) and rank 1's data iterator raises a ValueError when asked for step 3's batch:
  outside `train_step`, while rank 0 waits in step 3's first collective for it.

Rank 0 writes the exception that ended it (type and message) to OUT_DIR/rank0.txt, so the test
can tell a crash report from a timeout; the exception then propagates as it would in any job.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import autoplan
from autoplan.data import Batches, load_corpus
from autoplan.models import gpt


class _FailingBatches(Batches):
    """The corpus's batches; on rank 1, the third draw raises (a corrupt shard, say)."""

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.drawn == 2 and os.environ["RANK"] == "1":
            raise ValueError("shard 7 of the training data is corrupt (rank 1's data loader)")
        return super().__next__()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _run(mode: str, timeout_s: float, out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=128)
    plan = autoplan.manual_plan(
        autoplan.trace(model), autoplan.Cluster.local(num_devices=2), pp=2, global_batch=4
    )
    if mode == "input":
        cluster: Any = "no-such-cluster" if os.environ["RANK"] == "1" else None
        job = autoplan.parallelize(model, cluster, plan=plan, loss_fn=_loss, timeout_s=timeout_s)
        tokens = torch.randint(0, 128, (4, 33))
        job.train_step(tokens[:, :-1], tokens[:, 1:])
        return
    trainer = autoplan.Trainer(
        model,
        loss_fn=_loss,
        data=_FailingBatches(load_corpus(max_chars=20_000), 4, 32),
        plan=plan,
        checkpoint_dir=out / "ckpt",
        checkpoint_every=1,
        timeout_s=timeout_s,
    )
    for _ in trainer.steps(6):
        pass


if __name__ == "__main__":
    mode, timeout, folder = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
    try:
        _run(mode, timeout, folder)
    except BaseException as error:
        if os.environ["RANK"] == "0":
            (folder / "rank0.txt").write_text(f"{type(error).__name__}: {error}")
        raise
