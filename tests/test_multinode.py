"""Multi-node for real: two torchrun agents on localhost act as two nodes of two processes
each (c10d rendezvous on 127.0.0.1), and a plan whose data-parallel groups span both nodes
trains to the same losses as the single-process reference."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.numerics import make_plan, reference

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_two_torchrun_nodes_train_like_one_process(tmp_path: Path) -> None:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"autoplan-test-{port}",
                # Both agents run on this machine: say which one hosts the rendezvous store.
                "--rdzv-conf",
                f"is_host={1 if node == 0 else 0}",
                "--max-restarts",
                "0",
                str(ROOT / "tests" / "multinode_job.py"),
                str(tmp_path),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=240)
            outputs.append(out)
    finally:
        for agent in agents:
            agent.kill()
    for node, (agent, out) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"node {node} agent failed:\n{out[-4000:]}"

    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    nodes = {r["rank"]: r["node"] for r in records}
    assert sorted(nodes.values()) == [0, 0, 1, 1]
    for record in records:
        # Data-parallel groups cross the nodes; tensor-parallel groups stay inside one.
        assert len({nodes[r] for r in record["dp_group"]}) == 2
        assert len({nodes[r] for r in record["tp_group"]}) == 1
    expected = reference("gpt", make_plan(dp=2, tp=2, zero=3).global_batch_size)
    for record in records:
        torch.testing.assert_close(
            torch.tensor(record["losses"]),
            torch.tensor([loss for loss, _ in expected.records]),
            rtol=1e-5,
            atol=1e-6,
        )
