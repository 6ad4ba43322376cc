"""Train a small GPT on Python's own documentation with a plan autoplan picks for the job.

    torchrun --nproc-per-node 4 examples/train_gpt.py [--steps 400] [--plan plan.yaml]
        [--checkpoint-dir ckpt --checkpoint-every 50]
    python examples/train_gpt.py --ray 4 --checkpoint-dir /shared/ckpt [--max-failures 3]

Every rank builds the model on the meta device (no memory), and `autoplan.Trainer` finds a plan
for the running job (rank 0 searches and broadcasts it; or uses ``--plan``), materialises each
rank's shard and trains. The corpus is CPython's bundled language reference (``pydoc_data``): no
downloads. Rank 0 prints the plan, shows a progress bar, prints the first and last loss, and the
predicted step time against the measured one (the median after warm-up).

With ``--checkpoint-dir`` the job saves every ``--checkpoint-every`` steps (in the background)
and, started again, resumes from the latest complete checkpoint: the same batches, the same
losses as a run that never stopped. Under ``torchrun --max-restarts N`` a worker that dies is
restarted and resumes by itself; under an elastic ``--nnodes MIN:MAX`` a job that comes back
on fewer or more workers searches a plan for them and reshards the checkpoint into it (it
prints how long both took). ``--ray N`` runs the same `train` function on N Ray Train workers
(a local Ray cluster; ``pip install 'torch-autoplan[ray]'``), restarted by Ray's
``FailureConfig`` and resuming from the same checkpoints. ``--replica-groups N --replica-group
R`` makes this torchrun job one of N torchft replica groups (``pip install
'torch-autoplan[torchft]'``, a ``torchft_lighthouse`` at ``$TORCHFT_LIGHTHOUSE``): the groups
average gradients every step, and one that dies drops out while the others go on; restarted,
it heals from a peer and rejoins.

A non-finite loss or gradient stops the job with one line naming the step, the rank and the
newest good checkpoint (exit 1; ``--on-nan skip`` skips such steps instead). SIGTERM or SIGINT
(``--save-on-signal``, on under torchrun) stops it after the current step, saves that step when
the save fits the launcher's grace period, prints the step saved and the steps lost, and exits
128 + the signal's number (143 for SIGTERM): non-zero, because the job did not finish. Resumed
with another ``--lr`` or ``--global-batch``, it says so and applies them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

import autoplan
from autoplan._format import wrap_phrases
from autoplan.cli.common import console as cli_console
from autoplan.data import Batches, load_corpus
from autoplan.models import gpt
from autoplan.runtime.checkpoint import CheckpointSaveError


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def small_gpt(seq_len: int = 64) -> torch.nn.Module:
    """The example's model, on the meta device: no rank ever holds the whole model;
    `parallelize` materialises each rank's shards. The vocabulary (the corpus has 97 symbols)
    is padded to 128 so that any tensor-parallel degree up to 128 divides it."""
    return gpt(num_layers=4, hidden_size=64, num_heads=4, seq_len=seq_len, vocab_size=128)


def train(config: dict[str, Any], on_step: Callable[[int, float], None] | None = None) -> None:
    """The training function: one call per rank, under torchrun or Ray Train (the process
    group may exist already). ``config`` holds the command line's options by name."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("autoplan.runtime.replicas").setLevel(logging.INFO)
    # the end-of-run predicted-vs-measured line is printed below, not logged a second time
    logging.getLogger("autoplan.runtime.step_timing").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    corpus = load_corpus()
    data = Batches(corpus, config["global_batch"], config["seq_len"], seed=0)  # same on all ranks
    # No plan given: rank 0 runs autoplan.search for this job (Cluster.local, the running world)
    # and broadcasts the plan; on CPU the search is limited to fp32 plans.
    trainer = autoplan.Trainer(
        small_gpt(config["seq_len"]),
        loss_fn=loss_fn,
        data=data,
        optimizer=functools.partial(torch.optim.AdamW, lr=config["lr"], weight_decay=0.0),
        plan=autoplan.Plan.from_yaml(config["plan"]) if config.get("plan") else None,
        global_batch_size=config["global_batch"],
        checkpoint_dir=config.get("checkpoint_dir"),
        checkpoint_every=config.get("checkpoint_every", 50),
        timeout_s=config.get("timeout"),
        on_nan=config.get("on_nan", "stop"),
        save_on_signal=config.get("save_on_signal"),
        replicas=(
            autoplan.TorchFTReplicas(
                replica_group=config["replica_group"],
                num_replica_groups=config["replica_groups"],
            )
            if config.get("replica_groups")
            else None
        ),
    )
    rank0 = dist.get_rank() == 0
    console = cli_console()  # the CLI's: COLUMNS, the terminal's, or 100 when piped
    if rank0:
        plan = trainer.plan
        group = (
            f" (replica group {config['replica_group']} of {config['replica_groups']})"
            if config.get("replica_groups")
            else ""
        )
        # wrapped between its phrases only, never inside one ("8 micro-batches of 1")
        phrases = [
            f"plan for {dist.get_world_size()} processes{group}: "
            f"dp {plan.dp_degree} x tp {plan.tp_degree} x pp {plan.pp_degree}",
            f"schedule {plan.schedule}",
            f"{plan.num_micro_batches} micro-batches of {plan.micro_batch_size}",
            f"ZeRO-{plan.zero_stage}",
            f"recompute {'/'.join(sorted({s.recompute for s in plan.stages}))}",
            plan.dtype,
        ]
        console.print(wrap_phrases(phrases, console.width), markup=False, highlight=False)
        console.print(f"corpus: {len(corpus.tokens):,} characters of CPython's documentation")
        # one line, as validate's verdict: it names the checkpoint's path, which logs grep
        console.print(trainer.setup.describe(), soft_wrap=True, highlight=False)
    first_step, losses = trainer.step, []
    start = time.perf_counter()
    with Progress(
        TextColumn("[bold]training"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TimeRemainingColumn(),
        console=console,
        disable=not rank0 or bool(config.get("ray")),
    ) as progress:
        task = progress.add_task(
            "train", total=config["steps"], completed=first_step, loss=float("nan")
        )
        for loss in trainer.steps(config["steps"]):
            losses.append(loss)
            if rank0 and config.get("loss_log"):
                with open(config["loss_log"], "a") as log:
                    log.write(f"{trainer.step} {loss!r}\n")
            if on_step is not None:
                on_step(trainer.step, loss)
            progress.update(task, advance=1, loss=loss)
    elapsed = time.perf_counter() - start
    if rank0 and losses:
        first = sum(losses[:10]) / min(10, len(losses))
        last = sum(losses[-10:]) / min(10, len(losses))
        console.print(
            f"loss: start {losses[0]:.3f} (mean of first 10: {first:.3f}), end {losses[-1]:.3f} "
            f"(mean of last 10: {last:.3f}); {len(losses)} steps in {elapsed:.0f} s"
        )
        timing = trainer.step_timing()
        if timing is not None:
            # wrapped at words: past the range it adds what to do
            console.print(timing.line(), highlight=False, markup=False)
    if trainer.replicas is not None:
        # Replica groups hold the same weights at the same step: each prints their digest.
        digest = _weights_digest(trainer.model)
        if rank0:
            console.print(
                f"replica group {config['replica_group']}: step {trainer.step}, weights {digest}"
            )


def _weights_digest(model: Any) -> str:
    """A hash of every rank's parameters, the same on every rank (a collective)."""
    local = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        local.update(name.encode())
        local.update(param.detach().cpu().contiguous().numpy().tobytes())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local.hexdigest())
    return hashlib.sha256("".join(gathered).encode()).hexdigest()[:16]


def _ray_worker(config: dict[str, Any]) -> None:
    """`train` on one Ray Train worker (Ray made the process group). At every checkpoint and at
    the end it reports the step and loss to Ray with a pointer to autoplan's newest complete
    checkpoint, so ``result.checkpoint`` and ``result.metrics`` name it."""
    import tempfile

    import ray.train

    def report(step: int, loss: float, folder: str | None) -> None:
        if dist.get_rank() != 0 or folder is None:
            ray.train.report({"step": step, "loss": loss})  # every worker calls it: a barrier
            return
        with tempfile.TemporaryDirectory() as pointer:
            Path(pointer, "autoplan_checkpoint.json").write_text(json.dumps({"path": folder}))
            ray.train.report(
                {"step": step, "loss": loss},
                checkpoint=ray.train.Checkpoint.from_directory(pointer),
                # unique: a restarted group reports its steps again
                checkpoint_dir_name=f"pointer_{step:08d}_{uuid.uuid4().hex[:8]}",
            )

    def latest() -> str | None:
        found = _latest_checkpoint(config["checkpoint_dir"])
        return None if found is None else str(found)

    last: list[tuple[int, float]] = []

    def on_step(step: int, loss: float) -> None:
        last[:] = [(step, loss)]
        if step % config["checkpoint_every"] == 0 and step < config["steps"]:
            report(step, loss, latest())

    train(config, on_step=on_step)
    if last:  # the job saved its last step before train returned
        report(*last[0], latest())


def _latest_checkpoint(folder: str) -> Path | None:
    complete = sorted(Path(folder).glob("step_*/autoplan.json"))
    return complete[-1].parent if complete else None


def run_with_ray(config: dict[str, Any]) -> None:
    """`train` on ``config["ray"]`` CPU workers of a local Ray cluster, gloo between them; a
    worker that fails restarts the group (``FailureConfig(max_failures)``), which resumes from
    the checkpoint folder (it must be storage every worker sees)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not config.get("checkpoint_dir"):
        raise SystemExit("--ray needs --checkpoint-dir: a restarted worker group resumes from it")
    checkpoints = os.path.abspath(config["checkpoint_dir"])
    config = {**config, "checkpoint_dir": checkpoints}
    if config.get("loss_log"):
        config["loss_log"] = os.path.abspath(config["loss_log"])
    ray.init(num_cpus=config["ray"])
    trainer = TorchTrainer(
        _ray_worker,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo", timeout_s=int(config.get("timeout") or 300)),
        scaling_config=ScalingConfig(num_workers=config["ray"], use_gpu=False),
        run_config=RunConfig(
            name="train_gpt",
            storage_path=os.path.join(checkpoints, "ray"),
            failure_config=FailureConfig(max_failures=config["max_failures"]),
            # the newest pointer only: older autoplan checkpoints are pruned (keep=2)
            checkpoint_config=CheckpointConfig(num_to_keep=1),
        ),
    )
    result = trainer.fit()
    pointer = Path(result.checkpoint.path, "autoplan_checkpoint.json")
    print(
        f"ray: finished at step {result.metrics['step']}, loss {result.metrics['loss']:.3f}; "
        f"checkpoint {json.loads(pointer.read_text())['path']}"
    )
    ray.shutdown()


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
    parser.add_argument(
        "--timeout", type=float, default=None, help="Process-group timeout in seconds."
    )
    parser.add_argument(
        "--ray", type=int, default=0, metavar="N", help="Run on N local Ray Train workers."
    )
    parser.add_argument(
        "--max-failures", type=int, default=3, help="With --ray: worker-group restarts allowed."
    )
    parser.add_argument(
        "--replica-groups",
        type=int,
        default=0,
        metavar="N",
        help="This job is one of N torchft replica groups (lighthouse: $TORCHFT_LIGHTHOUSE).",
    )
    parser.add_argument(
        "--replica-group", type=int, default=0, metavar="R", help="This job's group: 0..N-1."
    )
    parser.add_argument(
        "--on-nan",
        choices=("stop", "skip"),
        default="stop",
        help="A non-finite loss or gradient stops the job (default) or skips the step.",
    )
    parser.add_argument(
        "--save-on-signal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SIGTERM/SIGINT save the current step before the job stops (default: under torchrun).",
    )
    config = vars(parser.parse_args())
    if config["ray"]:
        run_with_ray(config)
        return
    try:
        train(config)
    except autoplan.TrainingStopped as stopped:  # a signal: the job did not finish
        _end_job(str(stopped), sys.stdout)
        sys.exit(stopped.exit_code)
    except (autoplan.NonFiniteError, CheckpointSaveError) as error:  # a failure of the run
        _end_job(f"train_gpt: error: {error}", sys.stderr)
        sys.exit(1)
    dist.destroy_process_group()


def _end_job(line: str, file: Any) -> None:
    """Every rank raised the same one line: rank 0 prints it, and the others wait for that at
    a barrier (torchrun's agent stops every worker as soon as one exits)."""
    joined = dist.is_initialized()
    if (dist.get_rank() if joined else int(os.environ.get("RANK", "0"))) == 0:
        print(line, file=file, flush=True)
    if joined:
        with contextlib.suppress(Exception):  # a peer gone: nobody left to wait for
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
