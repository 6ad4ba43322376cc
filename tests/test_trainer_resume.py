"""`autoplan.Trainer` when a run ends early or resumes changed (issue 37 items 2, 5, 6, 7).

Single-process: what a checkpoint records about its run and what a resumed run says about it
(another optimizer or other data refused in one line; a new lr or global batch applied and
named), the signal handlers (a relayed repeat is the same request, a later one goes to the
previous handlers, ignored signals stay ignored, the caller's handlers come back), the grace
period read from the launcher's environment and the options' checks.

Two processes (slow, one job): an uninterrupted run; a SIGTERM to one rank stops both after
the step that carried the stop bit, saves that step and the resumed run's losses equal the
uninterrupted run's bit for bit; a resumed run with lr 1e10 applies it and says so, diverges,
stops at the non-finite step with one line, saves nothing from it and leaves every good
checkpoint; ``on_nan="skip"`` trains past it and keeps a checkpoint older than the first
skipped step. And the example: ``--lr 1e10`` stops in one line with exit 1, no traceback.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autoplan.contract.errors import InputError
from autoplan.data import Batches, load_corpus
from autoplan.runtime import trainer as trainer_module
from autoplan.runtime.trainer import (
    TrainingStopped,
    default_signal_grace_s,
    run_changes,
    run_facts,
    run_refusal,
)
from tests.conftest import PipelineReference
from tests.dist_utils import run_distributed
from tests.jobs import example_args, free_port, losses, start_agent, wait_for_step
from tests.numerics import batch, build_model, loss_fn, make_plan

ROOT = Path(__file__).resolve().parents[1]
CKPT = Path("ckpt/step_00000030")


def _adamw(lr: float = 3e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=lr, weight_decay=0.0)


def _data(batch_size: int = 16, seed: int = 0, seq_len: int = 64) -> Batches:
    return Batches(load_corpus(max_chars=5000), batch_size, seq_len, seed=seed)


def test_a_checkpoint_records_the_optimizer_the_batch_and_the_data() -> None:
    facts = run_facts([_adamw()], 16, _data())
    assert json.loads(json.dumps(facts)) == facts  # the marker holds it as JSON
    assert facts["optimizer"] == "torch.optim.adamw.AdamW"
    group = facts["param_groups"][0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-3,
        [0.9, 0.999],
        1e-8,
        0.0,
    )
    assert "params" not in group
    assert facts["global_batch"] == 16
    assert facts["data"]["class"] == "autoplan.data.Batches"
    assert (facts["data"]["batch_size"], facts["data"]["seq_len"], facts["data"]["seed"]) == (
        16,
        64,
        0,
    )
    assert facts["data"]["corpus"].startswith("5,000 characters, sha256 ")
    # a data source without config() is recorded by its class
    assert run_facts([_adamw()], 16, iter([]))["data"] == {"class": "builtins.list_iterator"}


def test_another_optimizer_is_refused_in_one_line() -> None:
    saved = run_facts([_adamw()], 16, _data())
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    message = run_refusal(saved, run_facts([sgd], 16, _data()), step=30, path=CKPT)
    assert message == (
        "cannot resume step 30 from ckpt/step_00000030: it holds the state of optimizer AdamW, "
        "and this run builds SGD, whose state it cannot load; resume with AdamW, or start the "
        "SGD run in an empty checkpoint folder"
    )


def test_other_data_is_refused_and_another_batch_is_applied() -> None:
    saved = run_facts([_adamw()], 16, _data())
    message = run_refusal(saved, run_facts([_adamw()], 16, _data(seed=1, seq_len=32)), step=30,
                          path=CKPT)  # fmt: skip
    assert message is not None and "\n" not in message
    assert message.startswith(
        "cannot resume step 30 from ckpt/step_00000030: the data changed (seed 0 -> 1, "
        "seq_len 64 -> 32), and the data position it saved belongs to the old data;"
    )
    # a new global batch changes the data's batch size with it: applied, not refused
    bigger = run_facts([_adamw()], 32, _data(batch_size=32))
    assert run_refusal(saved, bigger, step=30, path=CKPT) is None
    groups = trainer_module._hyperparameters(_adamw())
    assert run_changes(saved, bigger, step=30, saved_groups=groups, groups=groups) == (
        "resumed step 30: global batch 16 -> 32 (applied; the data goes on from its position "
        "in batches of 32)",
    )


def test_a_new_learning_rate_is_named_and_an_unchanged_run_says_nothing() -> None:
    saved = run_facts([_adamw()], 16, _data())
    old, new = (
        trainer_module._hyperparameters(_adamw()),
        trainer_module._hyperparameters(_adamw(1e10)),
    )
    lines = run_changes(saved, saved, step=30, saved_groups=old, groups=new)
    assert lines == (
        "resumed step 30: lr 0.003 -> 1e+10 (applied: this run's values, not the checkpoint's)",
    )
    assert all(len(line) <= 100 for line in lines)
    assert run_changes(saved, saved, step=30, saved_groups=old, groups=old) == ()
    # a checkpoint of an older version records no run: nothing to refuse or name but what its
    # optimizer state held
    assert run_refusal({}, saved, step=30, path=CKPT) is None
    assert run_changes({}, saved, step=30, saved_groups=old, groups=old) == ()


@pytest.fixture
def restore_handlers() -> Iterator[None]:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


class _StopFlag:
    """What the handler calls: `DistributedModel.request_stop` sets a flag, nothing more."""

    def __init__(self) -> None:
        self.requests = 0

    def request_stop(self) -> None:
        self.requests += 1


def test_a_signal_asks_for_a_stop_once_and_a_later_one_goes_to_the_previous_handler(
    restore_handlers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    earlier: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: earlier.append(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # e.g. a background job: stays ignored
    flag = _StopFlag()
    handler = trainer_module._StopOnSignal(flag)  # type: ignore[arg-type]
    assert handler.install()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGTERM)
    assert (flag.requests, handler.signum, earlier) == (1, signal.SIGTERM, [])
    os.kill(os.getpid(), signal.SIGTERM)  # the same request relayed (torchrun's agent)
    assert (flag.requests, earlier) == (1, [])
    monkeypatch.setattr(trainer_module, "_RELAYED_S", 0.0)
    os.kill(os.getpid(), signal.SIGTERM)  # a second request: to the handler that was there
    assert (flag.requests, earlier) == (1, [signal.SIGTERM])
    assert signal.getsignal(signal.SIGTERM) is not handler._handle  # restored by the repeat
    handler.uninstall()


def test_the_grace_period_is_the_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert default_signal_grace_s() == 30.0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert default_signal_grace_s() == 45.0
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "nonsense")
    assert default_signal_grace_s() == 45.0
    stopped = TrainingStopped("x", signal=signal.SIGTERM, step=4, saved_step=4, steps_lost=0)
    assert stopped.exit_code == 143
    assert TrainingStopped("x", signal=None, step=4, saved_step=4, steps_lost=0).exit_code == 1


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ({"on_nan": "ignore"}, "on_nan='ignore': use 'stop' (the default) or 'skip'"),
        ({"save_on_signal": "yes"}, "save_on_signal='yes': use True, False or None"),
        ({"signal_grace_s": -1.0}, "signal_grace_s=-1.0: give the seconds between"),
    ],
)
def test_bad_options_fail_before_anything_runs(option: dict[str, Any], expected: str) -> None:
    from autoplan import Trainer

    with pytest.raises(InputError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        Trainer(
            build_model("gpt"),
            loss_fn=loss_fn,
            data=iter([]),  # type: ignore[arg-type]
            global_batch_size=4,
            **option,
        )


# ----------------------------------------------------------------------------- two processes

LR = 1e-2
BATCH = 4  # pp2: 2 micro-batches of 2


class _Counted:
    """Batch k is `tests.numerics.batch(BATCH, k)`: a position a checkpoint saves."""

    def __init__(self) -> None:
        self.drawn = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.drawn += 1
        return batch(BATCH, self.drawn)

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = int(state["drawn"])

    def config(self) -> dict[str, Any]:
        return {"batch_size": BATCH, "source": "tests.numerics.batch"}


def _trainer(folder: Path | None, lr: float, **options: Any) -> Any:
    from autoplan import Trainer

    return Trainer(
        build_model("gpt"),
        loss_fn=loss_fn,
        data=_Counted(),
        optimizer=functools.partial(torch.optim.AdamW, lr=lr, eps=1e-6),
        plan=make_plan(pp=2, micro_batch=2),
        checkpoint_dir=folder,
        **options,
    )


def _complete(folder: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in folder.glob("step_*") if (p / "autoplan.json").is_file())


def lifecycle_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """One job, five runs in turn (each a new Trainer on the same process group); returns what
    each saw. See the module doc."""
    from autoplan import NonFiniteError

    folder = Path(root) / "ckpt"
    out: dict[str, Any] = {"reference": list(_trainer(None, LR).steps(8))}

    # a SIGTERM to rank 1 after step 3: the stop bit rides on step 4's all-reduce
    trainer = _trainer(folder, LR, checkpoint_every=100, save_on_signal=True)
    before = signal.getsignal(signal.SIGTERM)
    out["signalled"] = []
    try:
        for loss in trainer.steps(8):
            out["signalled"].append(loss)
            if trainer.step == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
    except TrainingStopped as stopped:
        out["stopped"] = [str(stopped), stopped.step, stopped.saved_step, stopped.steps_lost,
                          stopped.exit_code, trainer.stopped_by]  # fmt: skip
    out["handler_back"] = signal.getsignal(signal.SIGTERM) is before
    out["after_stop"] = _complete(folder)

    trainer = _trainer(folder, LR, checkpoint_every=2)
    out["resumed_at"], out["resume_changes"] = trainer.setup.resumed.step, trainer.setup.changes
    out["resumed"] = list(trainer.steps(8))
    out["before_divergence"] = _complete(folder)

    # resumed with lr 1e10: applied and said; the run diverges and stops
    trainer = _trainer(folder, 1e10, checkpoint_every=2)
    out["lr_changes"] = trainer.setup.changes
    out["lrs"] = sorted({g["lr"] for o in trainer.model.optimizers for g in o.param_groups})
    out["diverging"] = []
    try:
        for loss in trainer.steps(30):
            out["diverging"].append((trainer.step, loss))
    except NonFiniteError as error:
        out["nan_stop"] = (str(error), trainer.step)
    out["after_nan_stop"] = _complete(folder)

    # the same with on_nan="skip": trains on, skipping; an older checkpoint stays
    trainer = _trainer(folder, 1e10, checkpoint_every=2, on_nan="skip")
    start = trainer.step
    out["skip_losses"] = list(trainer.steps(start + 8))
    out["skip_start"], out["skipped"] = start, list(trainer.model.skipped_steps)
    out["after_skip"] = _complete(folder)
    return out


@pytest.mark.slow
def test_stop_on_signal_resume_changed_and_non_finite_steps(tmp_path: Path) -> None:
    ranks = run_distributed(
        lifecycle_worker, str(tmp_path), world_size=2, tmp_path=tmp_path, timeout_s=400
    )
    folder = tmp_path / "ckpt"
    zero, one = ranks
    reference = zero["reference"]
    # the signal (to rank 1 only) stopped both ranks after step 4, which was saved
    message = f"stopped by SIGTERM after step 4: saved step 4 to {folder / 'step_00000004'} in "
    for rank in ranks:
        text, step, saved, lost, code, name = rank["stopped"]
        assert text.startswith(message) and text.endswith(" s; 0 steps lost"), text
        assert (step, saved, lost, code, name) == (4, 4, 0, 143, "SIGTERM")
        assert rank["handler_back"] and rank["after_stop"] == [4]
    assert zero["signalled"] == reference[:4]
    # ... and the resumed run goes on as if it never stopped: bit for bit
    assert (zero["resumed_at"], zero["resume_changes"]) == (4, ())
    assert zero["resumed"] == reference[4:]
    assert zero["before_divergence"] == [6, 8]

    # lr 1e10 on resume: applied (the checkpoint's optimizer state held 0.01) and said once
    assert zero["lr_changes"] == (
        "resumed step 8: lr 0.01 -> 1e+10 (applied: this run's values, not the checkpoint's)",
    )
    assert zero["lrs"] == one["lrs"] == [1e10]
    text, last_good_step = zero["nan_stop"]
    bad = last_good_step + 1
    assert "\n" not in text and f"step {bad}" in text and "rank" in text, text
    left = zero["after_nan_stop"]
    assert left and max(left) < bad, (left, bad)  # nothing saved from the bad step or later
    assert text.endswith(
        f"; the newest good checkpoint is step {max(left)} "
        f"({folder / f'step_{max(left):08d}'}), nothing saved after it"
    ), text
    assert set(zero["before_divergence"]) <= set(left) or min(left) > 8, left
    assert all(loss == loss for _, loss in zero["diverging"])  # every yielded loss is finite

    # on_nan="skip": trains on to its last step, and keeps a checkpoint older than the first
    # skipped step although keep=2 (the two newest are after it)
    assert zero["skipped"] and zero["skipped"] == one["skipped"]
    first = min(zero["skipped"])
    after = zero["after_skip"]
    assert max(after) == zero["skip_start"] + 8
    assert any(step < first for step in after), (after, first)
    assert [s for s in after if s >= first][-2:] == [max(after) - 2, max(after)]


@pytest.mark.slow
def test_the_example_stops_a_diverging_run_in_one_line(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        AUTOPLAN_LOCAL_CLUSTER=str(tmp_path / "no-calibration.yaml"),
        COLUMNS="200",
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "6", "--lr", "1e10",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("train_gpt: error:")]
    assert len(errors) == 1, result.stderr
    assert "non-finite" in errors[0] and "the newest good checkpoint is step " in errors[0]
    bad = int(errors[0].split("the newest good checkpoint is step ")[1].split()[0]) + 1
    assert _complete(tmp_path / "ckpt") and max(_complete(tmp_path / "ckpt")) < bad


@pytest.mark.slow
def test_a_schedulers_sigterm_saves_the_step_and_the_job_resumes_from_it(
    tmp_path: Path, pipeline_reference: PipelineReference
) -> None:
    """The example under torchrun; SIGTERM to the agent and to every worker at once, as Slurm
    signals a job step (each worker then gets it twice: the agent forwards its own)."""
    plan, expected = pipeline_reference.plan, pipeline_reference.losses
    log = tmp_path / "loss.log"

    def args(steps: int) -> list[str]:
        return example_args(tmp_path, log, steps=steps, every=100, extra=("--plan", str(plan)))

    agent = start_agent(tmp_path, args(24), nproc=2, port=free_port())
    try:
        wait_for_step(log, 4, [agent])
        workers = list(agent.workers().values())
        agent.process.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        agent.wait(300)
    finally:
        agent.stop()
    output = agent.output()
    found = re.findall(r"stopped by SIGTERM after step (\d+): saved step (\d+) to (\S+) in "
                       r"[0-9.]+ s; 0 steps lost", output)  # fmt: skip
    assert len(found) == 1, output[-4000:]  # one line, from rank 0
    stop, saved, path = int(found[0][0]), int(found[0][1]), Path(found[0][2])
    assert saved == stop and path == tmp_path / "ckpt" / f"step_{stop:08d}"
    assert _complete(tmp_path / "ckpt") == [stop]
    records = losses(log)
    assert [step for step, _ in records] == list(range(1, stop + 1))

    again = start_agent(tmp_path, args(stop + 4), nproc=2, port=free_port())
    try:
        assert again.wait(300) == 0, again.output()[-4000:]
    finally:
        again.stop()
    assert f"resumed step {stop} from {path} in " in again.output()
    records = losses(log)
    assert [step for step, _ in records] == list(range(1, stop + 5))
    for step, loss in records:  # 0 steps lost, and the same run: bit for bit
        assert loss == expected[step], (step, loss, expected[step])
