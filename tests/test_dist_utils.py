"""The multi-process test launcher: a rank's native crash is retried once, and only that."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.dist_utils import DistributedTestError, run_distributed


def _crash_first_time(rank: int, world_size: int, marker: str, crash_signal: int) -> int:
    """Rank 1 kills itself with ``crash_signal`` on the first run only (the marker file)."""
    if rank == 1 and not Path(marker).exists():
        Path(marker).touch()
        os.kill(os.getpid(), crash_signal)
    return rank * 10


@pytest.mark.slow
def test_a_native_crash_runs_the_job_once_more(tmp_path: Path) -> None:
    marker = str(tmp_path / "crashed")
    with pytest.warns(UserWarning, match="crashed in native code; the job ran again"):
        values = run_distributed(
            _crash_first_time,
            marker,
            int(signal.SIGSEGV),
            world_size=2,
            tmp_path=tmp_path,
            timeout_s=60,
        )
    assert values == [0, 10]


@pytest.mark.slow
def test_a_killed_rank_is_not_retried(tmp_path: Path) -> None:
    """SIGKILL is what tests send on purpose (and the OOM killer): it fails at once."""
    with pytest.raises(DistributedTestError, match="exited with code -9"):
        run_distributed(
            _crash_first_time,
            str(tmp_path / "crashed"),
            int(signal.SIGKILL),
            world_size=2,
            tmp_path=tmp_path,
            timeout_s=60,
        )


def _return_rank(rank: int, world_size: int) -> int:
    return rank


@pytest.mark.slow
def test_a_failed_rendezvous_runs_the_job_once_more_and_only_once(tmp_path: Path) -> None:
    """An interface that does not exist fails gloo's rendezvous every time: one retry, then
    the error names the harness's init_process_group and the rank's own message."""
    with (
        pytest.warns(UserWarning, match="the gloo rendezvous failed; the job ran again"),
        pytest.raises(DistributedTestError, match="failed in init_process_group") as raised,
    ):
        run_distributed(
            _return_rank,
            world_size=2,
            tmp_path=tmp_path,
            timeout_s=60,
            env={"GLOO_SOCKET_IFNAME": "autoplan-no-such-if0"},
        )
    assert "autoplan-no-such-if0" in str(raised.value)
