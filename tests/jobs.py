"""torchrun jobs of examples/train_gpt.py, and faults made from outside as a cluster makes them.

`start_agent` starts one torchrun agent (a "node") in a session of its own, its output in a
file; `Agent.workers` finds its worker processes by the ``RANK`` torchrun gave them, so a test
or bench/faults.py can SIGKILL or SIGSTOP a given rank, or kill the whole node (agent and
workers). `losses` reads the ``step loss`` lines the example's rank 0 appends (``--loss-log``;
repeated steps after a restart included), `wait_for_step` polls it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
BATCH = 16  # the example's default global batch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job_env(tmp: Path) -> dict[str, str]:
    """The example's environment: this checkout importable, no calibration file (the local
    cluster's defaults, so every search here sees the same cluster), one thread a process."""
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        AUTOPLAN_LOCAL_CLUSTER=str(tmp / "no-calibration.yaml"),
        OMP_NUM_THREADS="1",
        COLUMNS="200",
    )


@dataclass
class Agent:
    """One torchrun agent and its workers."""

    process: subprocess.Popen[bytes]
    node: int
    log: Path

    def workers(self) -> dict[int, psutil.Process]:
        """This agent's live workers by global rank."""
        found: dict[int, psutil.Process] = {}
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return found
        for child in children:
            try:
                rank = child.environ().get("RANK")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if rank is not None and child.status() != psutil.STATUS_ZOMBIE:
                found[int(rank)] = child
        return found

    def signal_rank(self, rank: int, sig: signal.Signals, *, timeout_s: float = 60) -> int:
        """Send ``sig`` to the worker of ``rank`` (waiting until it is up); returns its pid."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            worker = self.workers().get(rank)
            if worker is not None:
                worker.send_signal(sig)
                return int(worker.pid)
            time.sleep(0.05)
        raise TimeoutError(f"no worker of rank {rank} under agent {self.process.pid}")

    def kill_node(self) -> None:
        """The node dies: its agent and every worker, at once (torchrun starts each worker in
        a session of its own, so the agent's process group does not hold them)."""
        for process in self._tree():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

    def _tree(self) -> list[psutil.Process]:
        try:
            agent = psutil.Process(self.process.pid)
            return [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout=timeout_s)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """Kill whatever is left of this agent's job (a test's clean-up)."""
        self.kill_node()
        self.process.wait()


def start_agent(
    tmp: Path,
    example_args: list[str],
    *,
    nproc: int,
    port: int,
    nnodes: str = "1",
    node: int = 0,
    max_restarts: int = 0,
    rdzv_conf: str = "",
    script: Path = EXAMPLE,
    env: dict[str, str] | None = None,
) -> Agent:
    """A torchrun agent with a c10d rendezvous on 127.0.0.1:``port``; node 0 hosts its store."""
    conf = f"is_host={1 if node == 0 else 0}" + (f",{rdzv_conf}" if rdzv_conf else "")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"autoplan-{port}",
        "--rdzv-conf",
        conf,
        "--max-restarts",
        str(max_restarts),
        str(script),
        *example_args,
    ]
    log = tmp / f"agent{node}-{port}.log"
    env = {**job_env(tmp), **(env or {})}
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    agent = Agent(process=process, node=node, log=log)
    if node == 0:
        _wait_listening(port, agent)
    return agent


def _wait_listening(port: int, agent: Agent, timeout_s: float = 60) -> None:
    """Until the rendezvous store listens on ``port``: a port picked by `free_port` is free only
    until someone binds it, so the next job's ports are picked after this one holds its own."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and agent.process.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


def losses(path: Path) -> list[tuple[int, float]]:
    """The (step, loss) lines in the order written; a restarted job repeats steps."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            step, loss = line.split()
            records.append((int(step), float(loss)))
        except ValueError:  # the line being written
            continue
    return records


def wait_for_step(path: Path, step: int, agents: list[Agent], timeout_s: float = 300) -> int:
    """Poll the loss log until it records ``step`` or later; returns the step it saw."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = losses(path)
        if records and records[-1][0] >= step:
            return records[-1][0]
        if all(agent.process.poll() is not None for agent in agents):
            tails = "\n".join(agent.output()[-3000:] for agent in agents)
            raise RuntimeError(f"the job ended before step {step}:\n{tails}")
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached in {timeout_s} s")


def example_args(
    tmp: Path,
    log: Path,
    *,
    steps: int,
    every: int,
    extra: tuple[str, ...] = (),
    timeout_s: float = 60,
) -> list[str]:
    """The example's options: checkpoints in ``tmp/ckpt`` every ``every`` steps, losses to
    ``log``, the process-group timeout."""
    return [
        "--steps",
        str(steps),
        "--global-batch",
        str(BATCH),
        "--checkpoint-dir",
        str(tmp / "ckpt"),
        "--checkpoint-every",
        str(every),
        "--loss-log",
        str(log),
        "--timeout",
        str(timeout_s),
        *extra,
    ]


def fixed_plan(tmp: Path, processes: int, global_batch: int = BATCH) -> Path:
    """A pipeline plan for the example's model (p2p between every pair of neighbours), written
    to ``tmp/plan.yaml``: runs given it compare bit for bit, whatever a search would pick."""
    import autoplan

    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import small_gpt

    plan = autoplan.manual_plan(
        autoplan.trace(small_gpt()),
        autoplan.Cluster.local(num_devices=processes),
        pp=processes,
        global_batch=global_batch,
        micro_batch=4,
        schedule="1f1b",
        dtype="fp32",
    )
    path = tmp / "plan.yaml"
    plan.to_yaml(path)
    return path


def run_uninterrupted(
    tmp: Path,
    nproc: int,
    *,
    steps: int,
    every: int,
    extra: tuple[str, ...] = (),
    nodes: int = 1,
) -> dict[int, float]:
    """The example run to the end without a fault (in ``tmp/uninterrupted``), on ``nodes``
    agents of ``nproc`` processes (the same topology searches the same plan): step -> loss."""
    folder = tmp / "uninterrupted"
    folder.mkdir(exist_ok=True)
    log = folder / "loss.log"
    args = example_args(folder, log, steps=steps, every=every, extra=extra)
    port = free_port()
    agents = [
        start_agent(folder, args, nproc=nproc, port=port, nnodes=str(nodes), node=node)
        for node in range(nodes)
    ]
    try:
        codes = [agent.wait(600) for agent in agents]
    finally:
        for agent in agents:
            agent.stop()
    records = losses(log)
    if codes != [0] * nodes or [step for step, _ in records] != list(range(1, steps + 1)):
        raise RuntimeError(f"the uninterrupted run failed ({codes}):\n{agents[0].output()[-3000:]}")
    return dict(records)
