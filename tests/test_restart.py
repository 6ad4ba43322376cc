"""Lose a worker, keep training (issue 18): examples/train_gpt.py under torchrun with a c10d
rendezvous, faults made from outside (tests/jobs.py).

- ``--max-restarts``: a SIGKILLed worker is restarted by torchrun, the job resumes from its
  latest complete checkpoint by itself, and every step's loss (repeated steps included) equals
  the uninterrupted run's, bit for bit.
- elastic ``--nnodes 1:2``: one of two agents (nodes) dies; the other comes back alone, rank 0
  searches a plan for the 2 processes left, and training resumes from the checkpoint resharded
  into it, the losses equal to the uninterrupted 4-process run's up to summation order.
- a node joins a running elastic job: the job grows from 2 to 4 processes, re-plans and
  reshards (with torch's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: under the shared store a
  node that joins after the first round waits for a key the first node never writes, and the
  whole job ends; docs/guide.md).
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import PipelineReference
from tests.jobs import (
    Agent,
    example_args,
    free_port,
    losses,
    run_uninterrupted,
    start_agent,
    wait_for_step,
)

STEPS = 24  # the kill comes at step 10 or so: well before the end
EVERY = 4
# The rendezvous drops a node whose agent missed keep_alive_max_attempt heartbeats (torch's
# default 3 x 5 s): 1 s x 5 here, so the lost node is given up in seconds.
FAST_RDZV = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"


def _args(tmp_path: Path, log: Path, *extra: str) -> list[str]:
    return example_args(tmp_path, log, steps=STEPS, every=EVERY, extra=extra)


def _run_uninterrupted(tmp_path: Path, nproc: int, nodes: int = 1) -> dict[int, float]:
    return run_uninterrupted(tmp_path, nproc, steps=STEPS, every=EVERY, nodes=nodes)


def _resumed_step(output: str) -> int:
    found = re.findall(r"resumed step (\d+) from ", output)
    assert found, output[-3000:]
    return int(found[-1])


@pytest.mark.slow
def test_a_killed_worker_restarts_and_resumes_by_itself(
    tmp_path: Path, pipeline_reference: PipelineReference
) -> None:
    plan, expected = pipeline_reference.plan, pipeline_reference.losses
    assert (pipeline_reference.steps, pipeline_reference.every) == (STEPS, EVERY)

    log = tmp_path / "loss.log"
    agent = start_agent(
        tmp_path, _args(tmp_path, log, "--plan", str(plan)), nproc=2, port=free_port(),
        max_restarts=1,
    )  # fmt: skip
    try:
        killed_at = wait_for_step(log, 2 * EVERY + 2, [agent])
        agent.signal_rank(1, signal.SIGKILL)
        assert agent.wait(300) == 0, agent.output()[-4000:]
    finally:
        agent.stop()
    output = agent.output()
    resumed = _resumed_step(output)
    # the newest complete checkpoint: a save completes a few steps after it starts
    assert resumed % EVERY == 0 and EVERY <= resumed <= killed_at, output[-3000:]
    assert "(same plan)" in output
    records = losses(log)
    # every step up to the kill, then again from the checkpoint on: each loss bit for bit
    steps = [step for step, _ in records]
    assert steps[-1] == STEPS and set(steps) == set(range(1, STEPS + 1))
    assert resumed + 1 in steps[killed_at:], steps
    for step, loss in records:
        assert loss == expected[step], (step, loss, expected[step])


@pytest.mark.slow
def test_a_job_that_loses_a_node_replans_and_reshards(tmp_path: Path) -> None:
    expected = _run_uninterrupted(tmp_path, 2, nodes=2)  # the topology the job starts on

    log = tmp_path / "loss.log"
    port = free_port()
    args = _args(tmp_path, log)
    # Two agents ("nodes") of 2 processes; the job may go on with one. Node 1 starts first
    # (it waits for node 0's store), so both reach the first round together: one that came
    # more than last_call_timeout after node 0 would join a later round, which torch's shared
    # rendezvous store does not survive (test_a_job_that_gains_a_node_...).
    agents = [
        start_agent(
            tmp_path, args, nproc=2, port=port, nnodes="1:2", node=node, max_restarts=3,
            rdzv_conf=FAST_RDZV,
        )
        for node in (1, 0)
    ][::-1]  # fmt: skip
    try:
        killed_at = wait_for_step(log, 2 * EVERY + 2, agents)
        agents[1].kill_node()  # node 1 (not the rendezvous host) is lost
        assert agents[0].wait(300) == 0, agents[0].output()[-4000:]
    finally:
        for agent in agents:
            agent.stop()
    output = agents[0].output()
    # the 4-process job's rank 0 is on whichever node joined first
    before = agents[0].output() + agents[1].output()
    assert "plan for 4 processes" in before and "plan for 2 processes" in output, before[-3000:]
    match = re.search(
        r"2 processes: searched a plan in ([0-9.]+) s, built in [0-9.]+ s; re-planned: resumed "
        r"step (\d+) from \S+, saved by 4 processes under plan \w+, resharded to plan \w+ in "
        r"([0-9.]+) s",
        output,
    )
    assert match, output[-3000:]
    resumed = int(match.group(2))
    assert resumed % EVERY == 0 and EVERY <= resumed <= killed_at
    _assert_resharded_losses(losses(log), expected, resumed, STEPS)


@pytest.mark.slow
def test_a_job_that_gains_a_node_replans_and_reshards(tmp_path: Path) -> None:
    steps = 16  # the join comes at step 9: held there until node 1 is in
    expected = run_uninterrupted(tmp_path, 2, steps=steps, every=EVERY)

    log = tmp_path / "loss.log"
    port = free_port()
    args = example_args(tmp_path, log, steps=steps, every=EVERY)
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def agent(node: int) -> Agent:
        return start_agent(
            tmp_path, args, nproc=2, port=port, nnodes="1:2", node=node, max_restarts=3,
            rdzv_conf=FAST_RDZV, env=env,
        )  # fmt: skip

    agents = [agent(0)]
    try:
        # The first round is node 0's alone. Its workers are held (SIGSTOP) once a checkpoint
        # is saved, so the job cannot finish before node 1 has started (its steps take a second)
        # and go on once node 0's agent stops them for the new round.
        wait_for_step(log, 2 * EVERY + 1, agents)  # checkpoint 4 complete
        workers = list(agents[0].workers().values())
        for worker in workers:
            worker.suspend()
        agents.append(agent(1))
        deadline = time.monotonic() + 300
        while "closing signal" not in agents[0].output() and time.monotonic() < deadline:
            time.sleep(0.1)
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.resume()
        assert agents[0].wait(300) == 0, agents[0].output()[-4000:]
        assert agents[1].wait(300) == 0, agents[1].output()[-4000:]
    finally:
        for each in agents:
            each.stop()
    # the 4-process job's rank 0 is on whichever node joined its round first
    output = agents[0].output() + agents[1].output()
    assert "plan for 2 processes" in output and "plan for 4 processes" in output, output[-3000:]
    match = re.search(
        r"4 processes: searched a plan in [0-9.]+ s, built in [0-9.]+ s; re-planned: resumed "
        r"step (\d+) from \S+, saved by 2 processes under plan \w+, resharded to plan \w+",
        output,
    )
    assert match, output[-3000:]
    resumed = int(match.group(1))
    assert resumed < steps, resumed  # joined while it trained
    # node 0's agent stops its workers with SIGTERM for the new round: they save the step they
    # are on (save_on_signal is on under torchrun), and the new round resumes from it
    assert f"stopped by SIGTERM after step {resumed}: saved step {resumed} " in output, output
    _assert_resharded_losses(losses(log), expected, resumed, steps)


def _assert_resharded_losses(
    records: list[tuple[int, float]], expected: dict[int, float], resumed: int, steps: int
) -> None:
    """Every step's loss of a job re-planned after step ``resumed``: the records up to the
    re-plan equal the uninterrupted run's (the same plan), the later ones agree with them up to
    summation order."""
    assert records[-1][0] == steps
    # the records from the resumed run on (a step is repeated unless the first run stopped
    # right at its last checkpoint)
    restart = max(i for i, (step, _) in enumerate(records) if step == resumed + 1)
    for step, loss in records[:restart]:
        assert loss == expected[step], (step, loss, expected[step])
    for step, loss in records[restart:]:
        # The new plan sums in another order than the old one (a pipeline instead of
        # data-parallel gradient sums, or the reverse): the first steps after the reshard agree
        # to fp32 rounding (measured: <= 1e-7), then the difference grows step by step through
        # Adam (measured: up to 1e-4 by step 40 of a longer run). A wrong resume (weights, Adam moments, data
        # position) differs by 1e-2 or more at once.
        tolerance = 1e-6 if step <= resumed + 4 else 1e-3
        assert loss == pytest.approx(expected[step], rel=tolerance), (step, loss, expected[step])
