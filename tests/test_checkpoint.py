"""`autoplan.Checkpointer`: a job that stops and resumes from its latest complete checkpoint
trains on exactly as the uninterrupted job does (loss, RNG draws and data position, step for
step), under the same plan or another; incomplete checkpoints are skipped; bad folders (a file,
unwritable, another job's), intervals and another model's checkpoints fail before the first
step, on every rank alike. Damaged checkpoints, failed saves, pruning and the folder's lock:
tests/test_checkpoint_integrity.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from autoplan.contract.plan import Plan
from tests.dist_utils import run_distributed
from tests.numerics import batch, build_model, loss_fn, make_plan, optimizer_factory

STEPS = 9  # the resumed job saves at 9 again, over the folder the crash cut short
EVERY = 3


class CountingBatches:
    """A data source with a position: batch k is `batch(global_batch, k)`."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch
        self.drawn = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.drawn += 1
        return batch(self.global_batch, self.drawn)

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = int(state["drawn"])


def _train(job: Any, data: CountingBatches, checkpointer: Any, upto: int) -> list[list[float]]:
    """Steps until ``job.step == upto``: per step the loss and a draw from torch's RNG (what a
    dropout would consume), so a lost RNG state shows."""
    records = []
    while job.step < upto:
        loss = float(job.train_step(*next(data)))
        records.append([loss, float(torch.rand(()))])
        if checkpointer is not None:
            checkpointer.after_step()
    return records


def _parameters(job: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters by name, whole (a collective over each DTensor's mesh)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in job.named_parameters()
    }


def resume_worker(
    rank: int,
    world_size: int,
    first: dict[str, Any],
    second: dict[str, Any],
    folder: str,
    model_name: str = "gpt",
) -> dict[str, Any]:
    """Train ``first`` for `STEPS` steps; train it again, saving every `EVERY` steps, and stop
    at step 7 (a cut-short step 9 folder is left behind); resume under ``second`` and train to
    `STEPS`. Returns per step the loss and an RNG draw of both runs (from the resumed step on),
    and both runs' final parameters."""
    from autoplan import Checkpointer
    from autoplan.runtime.parallelizer import parallelize

    def build(plan_data: dict[str, Any], perturb: bool = False) -> Any:
        model = build_model(model_name)
        if perturb:  # the restored weights must replace these
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5).add_(0.1)
        plan = Plan.from_data(plan_data)
        job = parallelize(model, plan=plan, loss_fn=loss_fn, optimizer=optimizer_factory())
        return job, CountingBatches(plan.global_batch_size)

    torch.manual_seed(100 + rank)
    job, data = build(first)
    uninterrupted = _train(job, data, None, STEPS)
    uninterrupted_parameters = _parameters(job)

    torch.manual_seed(100 + rank)
    job, data = build(first)
    checkpointer = Checkpointer(folder, job, every=EVERY, data=data)
    assert checkpointer.restore() == 0
    _train(job, data, checkpointer, 7)  # saves at 3 and 6; then the job "dies"
    checkpointer.wait()
    if rank == 0:  # a save that was cut short: newer, but without its completion marker
        (Path(folder) / "step_00000009").mkdir()
        (Path(folder) / "step_00000009" / "__0_0.distcp").write_bytes(b"partial")
    torch.distributed.barrier()

    torch.manual_seed(999)  # the RNG state must come from the checkpoint
    job, data = build(second, perturb=True)
    checkpointer = Checkpointer(folder, job, every=EVERY, data=data)
    resumed_at = checkpointer.restore()
    resumed = _train(job, data, checkpointer, STEPS)
    checkpointer.close()
    resumed_parameters = _parameters(job)
    kept = sorted(p for p in Path(folder).iterdir() if p.name.startswith("step_"))
    return {
        "uninterrupted": uninterrupted[resumed_at:],
        "resumed": resumed,
        "resumed_at": resumed_at,
        "uninterrupted_parameters": uninterrupted_parameters,
        "resumed_parameters": resumed_parameters,
        "kept": [p.name for p in kept],
        "complete": [(p / "autoplan.json").is_file() for p in kept],
        "aside": [
            (p.name, (p / "__0_0.distcp").read_bytes())
            for p in Path(folder).glob(".replaced.step_00000009.*")
        ],
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"pp": 2}, {"pp": 2}),
        ({"dp": 2, "zero": 3}, {"dp": 2, "zero": 3}),
        ({"dp": 2, "zero": 2}, {"pp": 2, "num_micro_batches": 4}),
    ],
    ids=["pp2", "dp2-zero3", "zero2-to-pp2"],
)
def test_a_stopped_job_resumes_as_if_it_never_stopped(
    first: dict[str, Any], second: dict[str, Any], tmp_path: Path, caplog: Any
) -> None:
    plans = [make_plan(**first), make_plan(**second)]
    assert plans[0].global_batch_size == plans[1].global_batch_size
    results = run_distributed(
        resume_worker,
        plans[0].to_data(),
        plans[1].to_data(),
        str(tmp_path / "ckpt"),
        world_size=2,
        tmp_path=tmp_path,
        timeout_s=300,
    )
    for result in results:
        assert result["resumed_at"] == 6  # the incomplete step 9 was skipped
        if first == second:
            # same plan: the same numbers exactly (weights, Adam state, RNG, data position)
            assert result["resumed"] == result["uninterrupted"]
            assert_equal_parameters(result)
        else:
            # resharded to another plan: the same up to summation order
            torch.testing.assert_close(
                torch.tensor(result["resumed"]),
                torch.tensor(result["uninterrupted"]),
                rtol=1e-5,
                atol=1e-6,
            )
            assert_equal_parameters(result, rtol=1e-4, atol=1e-5)  # tests/numerics.py
        # keep=2: the two newest complete ones; 9 was saved whole where the cut-short one was,
        # which was moved aside, not deleted (nothing says this job wrote it)
        assert result["kept"] == ["step_00000006", "step_00000009"]
        assert result["complete"] == [True, True]
        assert [content for _, content in result["aside"]] == [b"partial"]


def assert_equal_parameters(result: dict[str, Any], **tolerances: float) -> None:
    """The resumed job ends with the uninterrupted one's parameters (bit for bit unless
    tolerances are given); every parameter the rank holds in both runs is compared."""
    expected, got = result["uninterrupted_parameters"], result["resumed_parameters"]
    common = sorted(expected.keys() & got.keys())
    assert common, (sorted(expected), sorted(got))
    for name in common:
        if tolerances:
            torch.testing.assert_close(got[name], expected[name], **tolerances, msg=name)
        else:
            assert torch.equal(got[name], expected[name]), name


def _bad_input_worker(rank: int, world_size: int, folder: str, blocker: str) -> list[str]:
    import os

    from autoplan import Checkpointer
    from autoplan.contract.errors import PlanError
    from autoplan.models import gpt
    from autoplan.runtime.checkpoint import CheckpointError
    from autoplan.runtime.parallelizer import parallelize
    from tests.numerics import HEADS, HIDDEN, NUM_BLOCKS, SEQ

    messages = []
    job = parallelize(
        build_model("gpt"), plan=make_plan(dp=2), loss_fn=loss_fn, optimizer=optimizer_factory()
    )
    for every in (0, -3, 2.5):
        try:
            Checkpointer(folder, job, every=every)  # type: ignore[arg-type]
        except CheckpointError as error:
            messages.append(str(error))
    for bad in (f"{blocker}/ckpt", blocker):
        try:
            Checkpointer(bad, job, every=2)
        except CheckpointError as error:
            messages.append(str(error))
    saver = Checkpointer(folder, job, every=1)
    os.environ["TORCHELASTIC_RUN_ID"] = "another-job"  # a second job on the folder
    try:
        Checkpointer(folder, job, every=1)
    except CheckpointError as error:
        messages.append(str(error))
    del os.environ["TORCHELASTIC_RUN_ID"]
    # the checkpoint group waits on a lost peer as long as the training's group, not 30 min
    group_timeout = saver._group._get_backend(torch.device("cpu")).options._timeout
    messages.append(f"checkpoint group timeout {group_timeout.total_seconds():.0f} s")
    job.train_step(*batch(job.plan.global_batch_size, 0))
    saver.after_step()
    saver.close()
    for other in (build_model("llama"), gpt(NUM_BLOCKS, HIDDEN, HEADS, SEQ, 96, device="cpu")):
        try:
            Checkpointer(
                folder,
                parallelize(
                    other, plan=make_plan(dp=2), loss_fn=loss_fn, optimizer=optimizer_factory()
                ),
                every=2,
            ).restore()
        except CheckpointError as error:
            messages.append(str(error))
    zero1 = parallelize(
        build_model("gpt"),
        plan=make_plan(dp=2, zero=1),
        loss_fn=loss_fn,
        optimizer=optimizer_factory(),
    )
    try:
        Checkpointer(folder, zero1, every=2)
    except PlanError as error:
        messages.append(str(error))
    return messages


def test_bad_checkpoint_arguments_fail_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    messages, same = run_distributed(
        _bad_input_worker,
        str(tmp_path / "ckpt"),
        str(blocker),
        world_size=2,
        tmp_path=tmp_path,
        timeout_s=200,
    )
    assert messages == same  # every rank fails alike
    assert all("\n" not in message for message in messages)
    assert len(messages) == 10, messages
    assert messages.pop(6) == "checkpoint group timeout 60 s"  # the default group's (dist_utils)
    assert messages[0] == (
        "checkpoint interval every=0: must be a whole number of steps >= 1 (e.g. 100)"
    )
    assert messages[1].startswith("checkpoint interval every=-3:")
    assert messages[2].startswith("checkpoint interval every=2.5:")
    assert messages[3].startswith(f"checkpoint folder '{blocker}/ckpt' is not writable (")
    assert messages[3].endswith("pass a folder this job can write to")
    assert messages[4] == (
        f"checkpoint folder '{blocker}' is a file, not a folder: pass a folder (it is created "
        "if missing), or move the file away"
    )
    ckpt = tmp_path / "ckpt"
    # the lock names its holder: this test's rank 0 process
    assert messages[5].startswith(f"checkpoint folder {ckpt} is in use by job process:"), messages
    assert f"lock file {ckpt / 'autoplan.lock'}): wait for it to end" in messages[5]
    model_error = f"checkpoint {ckpt / 'step_00000001'} is of another model: "
    fix = (
        "; point --checkpoint-dir at this model's checkpoints or at an empty folder, or build "
        "the model the checkpoint was saved from"
    )
    # llama: changed shapes first (grouped-query k/v, its MLP), the rest counted
    assert messages[6] == (
        model_error + "blocks.0.attn.k_proj.weight (32, 32) now (16, 32), "
        "blocks.0.attn.v_proj.weight (32, 32) now (16, 32), blocks.0.mlp.up_proj.weight "
        "(128, 32) now (64, 32), and 36 more" + fix
    )
    # one dimension changed (the vocabulary): named with both shapes (the head is tied to it)
    assert messages[7] == model_error + "tok_emb.weight (64, 32) now (96, 32)" + fix
    assert messages[8].startswith("state_dict() is not supported with zero_stage 1")


def test_plans_that_cannot_be_checkpointed_are_refused_before_they_run(tmp_path: Path) -> None:
    import autoplan
    from autoplan.contract.errors import PlanError
    from tests.conftest import run_cli

    graph = autoplan.trace(build_model("gpt"))
    cluster = autoplan.Cluster.local(num_devices=2)
    zero1 = autoplan.manual_plan(graph, cluster, dp=2, zero=1, global_batch=8, dtype="fp32")
    zero2 = autoplan.manual_plan(graph, cluster, dp=2, zero=2, global_batch=8, dtype="fp32")
    problem = zero1.checkpoint_problem()
    assert problem is not None and problem.startswith("state_dict() is not supported with ")
    assert zero2.checkpoint_problem() is None
    # ZeRO-1 outside DDP runs as FSDP2's ZeRO-2, which saves
    piped = autoplan.manual_plan(graph, cluster, pp=2, zero=1, global_batch=8, dtype="fp32")
    assert piped.checkpoint_problem() is None
    path = tmp_path / "zero1.yaml"
    zero1.to_yaml(path)
    assert run_cli("validate", str(path)).returncode == 0  # fine for a job without checkpoints
    done = run_cli("validate", str(path), "--checkpoint")
    assert done.returncode == 2 and done.stderr.startswith("autoplan: error: --checkpoint: state")
    # the Trainer refuses it before parallelize runs (no process group is needed to say so)
    with pytest.raises(PlanError, match="checkpoint_dir is set, but state_dict"):
        autoplan.Trainer(
            build_model("gpt"),
            loss_fn=loss_fn,
            data=CountingBatches(8),
            plan=zero1,
            checkpoint_dir=tmp_path / "ckpt",
        )
