"""One rank's failure speaks (issue 37, Must show 9; problems 11 and 12).

The store-backed records and the one-line summary are checked against a real in-memory store
(`torch.distributed.HashStore`, the same interface as torchrun's TCPStore). Two real torchrun
jobs of 2 processes (tests/rank_failure_job.py, a 120 s process-group timeout) check the whole
path: an `InputError` on rank 1 alone, and rank 1's data loader raising mid-training outside
`train_step` while rank 0 waits for it in a collective. Each prints its one line exactly once,
from rank 1, and rank 0 ends because it learnt that rank 1 crashed (`CrashedRankError`), not by
the process-group timeout and not blaming a stall.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed import HashStore  # type: ignore[attr-defined]

from autoplan.runtime.rank_failures import summary_line
from passes.progress import (
    CrashedRankError,
    RankFailure,
    RankFailures,
    StalledRankError,
    looks_like_peer_failure,
)
from tests.jobs import ROOT, job_env

# gloo's words when a peer's process is gone (torch 2.13, tcp/pair.cc)
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:36041. This is typically caused by a remote worker crashing."
)


def _ranks(world: int) -> list[RankFailures]:
    store = HashStore()
    return [RankFailures(rank, world, store) for rank in range(world)]


def test_a_collective_that_failed_after_a_peer_recorded_its_crash_names_the_peer() -> None:
    rank0, rank1, rank2 = _ranks(3)
    lost = RuntimeError(GLOO_CLOSED)
    # nobody recorded anything: not a crash (a peer killed outright leaves no record)
    assert rank0.crashed(lost, wait_s=0) is None
    rank1.record(ValueError("shard 7 is corrupt\nsecond line"), primary=True)
    crashed = rank0.crashed(lost, wait_s=0)
    assert isinstance(crashed, CrashedRankError)
    assert str(crashed) == (
        "rank 1 crashed: ValueError: shard 7 is corrupt; rank 0's collective with it failed: "
        + GLOO_CLOSED
    )
    # rank 0's own error is not a collective's: it is its own, whatever rank 1 did
    assert rank0.crashed(KeyError("x"), wait_s=0) is None
    # the first record wins; the peer's own record is not its own crash
    rank1.record(RuntimeError("later"), primary=False)
    assert rank2.read()[1] == RankFailure(
        rank=1,
        primary=True,
        error_type="ValueError",
        message="shard 7 is corrupt",
        input_error=False,
    )
    assert rank1.crashed(lost, wait_s=0) is None


def test_a_peer_that_reported_a_stall_is_not_a_crashed_peer() -> None:
    rank0, rank1 = _ranks(2)
    rank1.record(StalledRankError("rank 2 stopped making progress"), primary=True)
    assert rank0.crashed(RuntimeError("Timed out waiting 120000ms"), wait_s=0) is None


def test_exactly_one_rank_reports_and_the_others_see_it() -> None:
    ranks = _ranks(4)
    assert [failures.claim_report() for failures in ranks[2:] + ranks[:2]] == [
        True,
        False,
        False,
        False,
    ]
    assert not ranks[0].wait_reported(0)
    ranks[2].reported()
    assert all(failures.wait_reported(0) for failures in ranks)


def test_errors_of_peers_read_like_peers_down_the_chain_of_causes() -> None:
    wrapped = RuntimeError("[Stage 0] failed to run forward:")
    wrapped.__cause__ = RuntimeError(GLOO_CLOSED)
    assert looks_like_peer_failure(wrapped)
    assert looks_like_peer_failure(RuntimeError("Timed out waiting 300000ms for recv"))
    assert not looks_like_peer_failure(ValueError("Connection closed"))  # not a RuntimeError
    assert not looks_like_peer_failure(RuntimeError("shape mismatch"))


def _failure(rank: int, message: str, *, input_error: bool = True) -> RankFailure:
    return RankFailure(
        rank=rank,
        primary=True,
        error_type="PlanError" if input_error else "ValueError",
        message=message,
        input_error=input_error,
    )


def test_the_summary_line_names_the_failing_ranks() -> None:
    one = _failure(1, "bad cluster")
    secondary = RankFailure(
        rank=0, primary=False, error_type="CrashedRankError", message="x", input_error=False
    )
    assert (
        summary_line(one, {0: secondary, 1: one}, 2)
        == "autoplan: error: bad cluster (rank 1; 2 ranks stopped)"
    )
    every = {rank: _failure(rank, "bad plan") for rank in range(2)}
    assert (
        summary_line(every[0], every, 2)
        == "autoplan: error: bad plan (every one of the 2 ranks stopped)"
    )
    mixed = {
        1: _failure(1, "bad"),
        3: _failure(3, "bad"),
        2: _failure(2, "y" * 300, input_error=False),
    }
    line = summary_line(mixed[1], mixed, 4)
    assert line.startswith("autoplan: error: bad (ranks 1, 3; rank 2: ValueError: yyy")
    assert line.endswith("(312 characters); 4 ranks stopped)") and len(line) < 200, line
    alone = _failure(0, "boom", input_error=False)
    assert (
        summary_line(alone, {}, 1) == "autoplan: error: ValueError: boom (rank 0; 1 rank stopped)"
    )


def _torchrun(mode: str, tmp_path: Path) -> tuple[str, str]:
    """Run tests/rank_failure_job.py ``mode`` on 2 processes; (the job's output, what rank 0
    raised). The process-group timeout is 120 s: a job that waited for it is not what a test
    of a crash report should see (the assertions say why it ended, not how long it took)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(Path(__file__).parent / "rank_failure_job.py"),
            mode,
            "120",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=job_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    rank0 = tmp_path / "rank0.txt"
    return done.stdout + done.stderr, rank0.read_text() if rank0.exists() else ""


def _our_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("autoplan: error:")]


@pytest.mark.slow
def test_an_input_error_on_one_rank_is_one_line_from_that_rank(tmp_path: Path) -> None:
    output, rank0 = _torchrun("input", tmp_path)
    assert _our_lines(output) == [
        "autoplan: error: unknown cluster preset 'no-such-cluster'; valid presets: "
        "dgx-a100-40g, dgx-a100-80g, dgx-b200-180g, dgx-h100-80g, dgx-h200-141g, dgx2-v100-32g, "
        "gb200-nvl72, local, mi300x-192g, p3.16xlarge (or give a path to a cluster YAML file) "
        "(rank 1; 2 ranks stopped)"
    ], output[-4000:]
    # no traceback of the user's mistake, no stall blamed, no timeout waited for
    for absent in ('rank_failure_job.py", line', "ClusterError", "StalledRankError", "Timed out"):
        assert absent not in output, (absent, output[-4000:])
    # rank 0 either learnt of the crash or was stopped by the launcher before its next error
    assert rank0 == "" or rank0.startswith("CrashedRankError: rank 1 crashed: unknown cluster")


@pytest.mark.slow
def test_a_data_loader_error_on_one_rank_is_reported_once_and_its_peer_names_it(
    tmp_path: Path,
) -> None:
    output, rank0 = _torchrun("data", tmp_path)
    error = "shard 7 of the training data is corrupt (rank 1's data loader)"
    assert _our_lines(output) == [
        f"autoplan: error: ValueError: {error} (rank 1; 2 ranks stopped)"
    ], output[-4000:]
    # the traceback of a failure that is not a user's mistake, once, from rank 1
    assert output.count(f"[rank1]: ValueError: {error}") == 1, output[-4000:]
    assert "[rank0]: Traceback" not in output, output[-4000:]
    # rank 0, blocked in step 3 with rank 1, was told at once that rank 1 crashed
    assert rank0.startswith(
        f"CrashedRankError: rank 1 crashed: ValueError: {error}; rank 0's collective with it "
        "failed: "
    ), rank0
    assert "Connection closed by peer" in rank0, rank0
    for absent in ("StalledRankError", "Timed out"):
        assert absent not in output + rank0, (absent, output[-4000:])
