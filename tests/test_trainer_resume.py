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

import json
import os
import signal
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
from tests.numerics import build_model, loss_fn

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
