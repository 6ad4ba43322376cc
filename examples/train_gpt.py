"""Train a small GPT on Python's own documentation with a plan autoplan picks for the job.

    torchrun --nproc-per-node 4 examples/train_gpt.py [--steps 400] [--plan plan.yaml]
        [--checkpoint-dir ckpt --checkpoint-every 50]

Every rank builds the model on the meta device (no memory), `autoplan.parallelize` finds a plan
for the running job (rank 0 searches and broadcasts it; or uses ``--plan``), materialises each
rank's shard and trains. The corpus is CPython's bundled language reference (``pydoc_data``):
no downloads. Rank 0 prints the plan, shows a progress bar and prints the first and last loss.
With ``--checkpoint-dir`` the job saves every ``--checkpoint-every`` steps (in the background)
and, started again, resumes from the latest complete checkpoint: the same batches, the same
losses as a run that never stopped (under another plan or world size too, resharded).
"""

from __future__ import annotations

import argparse
import functools
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

import autoplan
from autoplan.data import Batches, load_corpus
from autoplan.models import gpt


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def small_gpt(seq_len: int = 64) -> torch.nn.Module:
    """The example's model, on the meta device: no rank ever holds the whole model;
    `parallelize` materialises each rank's shards. The vocabulary (the corpus has 97 symbols)
    is padded to 128 so that any tensor-parallel degree up to 128 divides it."""
    return gpt(num_layers=4, hidden_size=64, num_heads=4, seq_len=seq_len, vocab_size=128)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1 (steps between checkpoints)")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--plan", default=None, help="A plan YAML to run instead of searching.")
    parser.add_argument(
        "--checkpoint-dir", default=None, help="Save checkpoints here and resume from them."
    )
    parser.add_argument(
        "--checkpoint-every", type=_positive, default=50, help="Steps between checkpoints."
    )
    parser.add_argument(
        "--loss-log", default=None, help="Append 'step loss' lines to this file (rank 0)."
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    corpus = load_corpus()
    model = small_gpt(args.seq_len)
    # No plan given: rank 0 runs autoplan.search for this job (Cluster.local, the torchrun world)
    # and broadcasts the plan; on CPU the search is limited to fp32 plans.
    trainer = autoplan.parallelize(
        model,
        plan=autoplan.Plan.from_yaml(args.plan) if args.plan else None,
        loss_fn=loss_fn,
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0),
        global_batch_size=args.global_batch,
    )
    rank0 = dist.get_rank() == 0
    console = Console()
    if rank0:
        plan = trainer.plan
        console.print(
            f"[bold]plan[/bold] for {dist.get_world_size()} processes: dp {plan.dp_degree} x "
            f"tp {plan.tp_degree} x pp {plan.pp_degree}, schedule {plan.schedule}, "
            f"{plan.num_micro_batches} micro-batches of {plan.micro_batch_size}, "
            f"ZeRO-{plan.zero_stage}, recompute "
            f"{'/'.join(sorted({s.recompute for s in plan.stages}))}, {plan.dtype}"
        )
        console.print(f"corpus: {len(corpus.tokens):,} characters of CPython's documentation")

    data = Batches(corpus, args.global_batch, args.seq_len, seed=0)  # same batches on every rank
    checkpointer = None
    first_step = 0
    if args.checkpoint_dir:
        checkpointer = autoplan.Checkpointer(
            args.checkpoint_dir, trainer, every=args.checkpoint_every, data=data
        )
        first_step = checkpointer.restore()
        if rank0 and first_step:
            console.print(f"resumed from {checkpointer.latest()} at step {first_step}")
    losses: list[float] = []
    start = time.perf_counter()
    with Progress(
        TextColumn("[bold]training"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TimeRemainingColumn(),
        console=console,
        disable=not rank0,
    ) as progress:
        task = progress.add_task("train", total=args.steps, completed=first_step, loss=float("nan"))
        for _ in range(first_step, args.steps):
            inputs, targets = next(data)
            losses.append(float(trainer.train_step(inputs, targets)))
            if rank0 and args.loss_log:
                with open(args.loss_log, "a") as log:
                    log.write(f"{trainer.step} {losses[-1]!r}\n")
            if checkpointer is not None:
                checkpointer.after_step()
            progress.update(task, advance=1, loss=losses[-1])
    if checkpointer is not None:
        checkpointer.close()
    elapsed = time.perf_counter() - start
    if rank0 and losses:
        first = sum(losses[:10]) / min(10, len(losses))
        last = sum(losses[-10:]) / min(10, len(losses))
        console.print(
            f"loss: start {losses[0]:.3f} (mean of first 10: {first:.3f}), end {losses[-1]:.3f} "
            f"(mean of last 10: {last:.3f}); {len(losses)} steps in {elapsed:.0f} s"
        )
        sample = corpus.decode(inputs[0][:48])
        console.print(f"a training window: {sample!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
