"""Checkpoints never lose good state (issue 37): verified files, damaged checkpoints skipped for
the previous intact one, failed saves reported on every rank, pruning that keeps what a
diverged or damaged run still needs, and one job per folder.

The rules are tested in this process on real files (markers, checksums, pruning choices, the
lock and its stale-lock rules); two 2-process jobs check the whole path on real DCP shards:
damage of each kind (bits flipped in the middle of a model tensor, a truncated shard, 4 KB
zeroed, ``.metadata`` or a shard deleted, the marker garbled or deleted, a shard that hashes
right but does not load) is skipped with one line and the job resumes with exactly the previous
checkpoint's state; a save that hits a file size limit on one rank is reported on both at the
same step, and pruning keeps a checkpoint from before a non-finite step and other runs' folders.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from autoplan.runtime.checkpoint import CheckpointError, _doomed
from autoplan.runtime.checkpoint_files import (
    _file_digest,
    _model_changes,
    check_files,
    marker_bytes,
    read_marker,
    reason,
)
from autoplan.runtime.checkpoint_lock import FolderLock
from tests.dist_utils import run_distributed
from tests.numerics import build_model, loss_fn, make_plan, optimizer_factory
from tests.test_checkpoint import CountingBatches, _parameters

# ----------------------------------------------------------------------------- markers, files


def _folder_with_marker(tmp_path: Path, step: int = 30) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path / f"step_{step:08d}"
    folder.mkdir()
    files = {}
    for name, size in (("__0_0.distcp", 20_000), ("__1_0.distcp", 9_000), (".metadata", 700)):
        (folder / name).write_bytes(os.urandom(size))
        length, digest = _file_digest(folder / name)
        files[name] = {"size": length, "sha256": digest, "rank": 0}
    marker = {"format": 2, "step": step, "files": files, "model_state": {"w": [4, 2]}}
    (folder / "autoplan.json").write_bytes(marker_bytes(marker))
    return folder, marker


def test_a_marker_reads_back_whole_or_says_what_is_wrong(tmp_path: Path) -> None:
    folder, marker = _folder_with_marker(tmp_path)
    read, problem = read_marker(folder)
    assert problem is None and read == marker
    path = folder / "autoplan.json"
    text = path.read_text()

    path.write_text(text.replace('"step": 30', '"step": 31'))  # one digit changed
    assert read_marker(folder) == (
        None,
        "autoplan.json is damaged (its checksum does not match its content)",
    )
    path.write_text(text[: len(text) // 2])  # cut short
    assert str(read_marker(folder)[1]).startswith("autoplan.json is damaged (not JSON: ")
    path.write_bytes(b"\0" * 100)
    assert str(read_marker(folder)[1]).startswith("autoplan.json is damaged (not JSON: ")
    path.unlink()
    assert read_marker(folder) == (
        None,
        "autoplan.json is missing (the job stopped while saving it)",
    )
    # a marker moved to another step's folder
    other = tmp_path / "step_00000040"
    other.mkdir()
    (other / "autoplan.json").write_text(text)
    assert read_marker(other) == (None, "autoplan.json is damaged (it names step 30)")
    # an older autoplan's marker (no checksums) still reads
    legacy = {"step": 30, "model_fingerprint": "abc", "world_size": 2}
    path.write_text(json.dumps(legacy))
    assert read_marker(folder) == (legacy, None)


def test_each_kind_of_file_damage_is_named(tmp_path: Path) -> None:
    folder, marker = _folder_with_marker(tmp_path)
    files = marker["files"]
    names = sorted(files)
    assert check_files(folder, files, names) == []

    shard = folder / "__0_0.distcp"
    original = shard.read_bytes()
    flipped = bytearray(original)
    flipped[10_000] ^= 0x01  # one bit
    shard.write_bytes(bytes(flipped))
    assert check_files(folder, files, names) == [
        ("__0_0.distcp", "is damaged (fails its SHA-256 checksum)")
    ]
    zeroed = bytearray(original)
    zeroed[8192:12288] = b"\0" * 4096
    shard.write_bytes(bytes(zeroed))
    assert check_files(folder, files, names) == [
        ("__0_0.distcp", "is damaged (fails its SHA-256 checksum)")
    ]
    shard.write_bytes(original[:12_345])
    assert check_files(folder, files, names) == [
        ("__0_0.distcp", "is damaged (truncated: 12345 bytes of 20000 written)")
    ]
    shard.write_bytes(original + b"x")
    assert check_files(folder, files, names) == [
        ("__0_0.distcp", "is damaged (resized: 20001 bytes of 20000 written)")
    ]
    shard.write_bytes(original)
    (folder / ".metadata").unlink()
    (folder / "__1_0.distcp").unlink()
    assert check_files(folder, files, names) == [
        (".metadata", "is missing"),
        ("__1_0.distcp", "is missing"),
    ]
    # a rank checks only its share
    assert check_files(folder, files, ["__0_0.distcp"]) == []


def test_a_changed_model_is_named_tensor_by_tensor() -> None:
    saved = {"tok.weight": [64, 32], "h.0.q.weight": [32, 32], "h.0.ln.bias": [32], "h.1.w": [4]}
    now = {"tok.weight": [96, 32], "h.0.q.weight": [32, 32], "h.0.ln.bias": [48], "h.2.w": [4]}
    assert _model_changes(saved, now) == [
        "tok.weight (64, 32) now (96, 32)",
        "h.0.ln.bias (32,) now (48,)",
        "h.1.w (4,) gone",
        "h.2.w (4,) new",
    ]
    assert _model_changes(saved, saved) == []


def test_reasons_are_one_line_with_the_os_error() -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert reason(full) == "No space left on device (ENOSPC)"
    big = OSError(errno.EFBIG, os.strerror(errno.EFBIG), "/ck/.step_4/__1_0.distcp")
    wrapped = CheckpointException("save", {1: (big, traceback.StackSummary())})
    assert reason(wrapped) == "File too large (EFBIG) (__1_0.distcp) on rank 1"
    assert reason(RuntimeError("a\nb   c")) == "RuntimeError: a b c"
    long = reason(ValueError("x" * 5000))  # torch's paragraph-long messages: the start
    assert long.startswith("ValueError: xxx") and long.endswith("(5,012 characters)"), long
    try:
        try:
            raise full
        except OSError as error:
            raise RuntimeError("unexpected pos 4096") from error
    except RuntimeError as error:
        assert reason(error) == "No space left on device (ENOSPC)"


# ----------------------------------------------------------------------------- pruning


@pytest.mark.parametrize(
    ("ours", "good", "keep", "nonfinite", "doomed"),
    [
        # the keep newest verified ones stay
        ([2, 4, 6, 8], [2, 4, 6, 8], 2, None, [2, 4]),
        # unverified ones of this run older than the newest verified go too; newer never
        ([2, 4, 6, 8, 10], [6, 8], 1, None, [2, 4, 6]),
        # the newest verified one is never deleted, nor anything newer than it
        ([6, 8, 10], [6], 1, None, []),
        # a non-finite loss at 7: the newest verified step before it stays
        ([2, 4, 6, 8, 10, 12], [2, 4, 6, 8, 10, 12], 2, 7, [2, 4, 8]),
        # ...and every one before it when this job verified none of them (a restart)
        ([2, 4, 6, 8, 10, 12], [10, 12], 1, 7, [8, 10]),
        ([2, 4], [2, 4], None, None, []),  # keep=None keeps all
        ([2, 4], [], 1, None, []),  # nothing verified: nothing deleted
    ],
)
def test_pruning_keeps_what_the_run_may_need(
    ours: list[int], good: list[int], keep: int | None, nonfinite: int | None, doomed: list[int]
) -> None:
    assert _doomed(ours, good, keep, nonfinite) == doomed


# ----------------------------------------------------------------------------- the lock


def _holder(folder: Path) -> dict[str, Any]:
    data = json.loads((folder / "autoplan.lock").read_text())
    assert isinstance(data, dict)
    return data


def test_a_second_job_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = FolderLock(tmp_path, "torchrun:job-a")
    first.acquire()
    holder = _holder(tmp_path)
    assert holder["job"] == "torchrun:job-a"
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(CheckpointError) as refused:
        FolderLock(tmp_path, "torchrun:job-b").acquire()
    assert str(refused.value) == (
        f"checkpoint folder {tmp_path} is in use by job torchrun:job-a (pid {os.getpid()} on "
        f"{socket.gethostname()}, since {holder['since']}; lock file {tmp_path}/autoplan.lock): "
        "wait for it to end or pass another --checkpoint-dir; if that job is gone, delete the "
        "lock file"
    )
    assert _holder(tmp_path)["token"] == first.token  # untouched
    # a restart of the same job (the same TORCHELASTIC_RUN_ID) takes it over
    again = FolderLock(tmp_path, "torchrun:job-a")
    again.acquire()
    assert _holder(tmp_path)["token"] == again.token
    first.release()  # no longer the first's: left alone
    assert (tmp_path / "autoplan.lock").is_file()
    again.release()
    assert not (tmp_path / "autoplan.lock").exists()
    again.release()  # idempotent


def _write_lock(folder: Path, **fields: Any) -> None:
    record = {
        "job": "torchrun:gone",
        "host": socket.gethostname(),
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "pid": os.getpid(),
        "process_start": None,
        "since": "2026-01-01T00:00:00+00:00",
        "token": "theirs",
        **fields,
    }
    (folder / "autoplan.lock").write_text(json.dumps(record))


def test_stale_locks_are_taken_over_and_live_ones_are_not(tmp_path: Path) -> None:
    lock = tmp_path / "autoplan.lock"
    # a process of this host that has ended
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    _write_lock(tmp_path, pid=ended.pid)
    mine = FolderLock(tmp_path, "torchrun:new")
    mine.acquire()
    assert _holder(tmp_path)["token"] == mine.token
    mine.release()
    # a pid that lives again as another process (its start time differs)
    _write_lock(tmp_path, pid=os.getpid(), process_start=12.0)
    mine = FolderLock(tmp_path, "torchrun:new")
    mine.acquire()
    mine.release()
    # another host: held while its heartbeat is fresh ...
    _write_lock(tmp_path, host="elsewhere", boot_id="x", pid=1)
    with pytest.raises(CheckpointError, match=r"is in use by job torchrun:gone \(pid 1 on elsewh"):
        FolderLock(tmp_path, "torchrun:new").acquire()
    # ... and stale once untouched for more than STALE_S (by the file system's clock)
    past = time.time() - 3600
    os.utime(lock, (past, past))
    mine = FolderLock(tmp_path, "torchrun:new")
    mine.acquire()
    mine.release()
    # an unreadable lock is not guessed at
    lock.write_text("{")
    os.utime(lock, (past, past))
    with pytest.raises(CheckpointError, match=r"autoplan\.lock is unreadable: if no job uses"):
        FolderLock(tmp_path, "torchrun:new").acquire()


def test_the_holder_keeps_its_lock_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autoplan.runtime.checkpoint_lock as checkpoint_lock

    monkeypatch.setattr(checkpoint_lock, "HEARTBEAT_S", 0.02)
    lock = FolderLock(tmp_path, "torchrun:beating")
    lock.acquire()
    past = time.time() - 3600
    os.utime(tmp_path / "autoplan.lock", (past, past))
    while (tmp_path / "autoplan.lock").stat().st_mtime < past + 10:  # pytest-timeout: a hang
        time.sleep(0.01)
    lock.release()


def test_the_lock_goes_when_the_process_ends(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from autoplan.runtime.checkpoint_lock import FolderLock; "
        "FolderLock(Path(sys.argv[1]), 'torchrun:short').acquire(); "
        "print((Path(sys.argv[1]) / 'autoplan.lock').is_file())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "True"
    assert not (tmp_path / "autoplan.lock").exists()


# ----------------------------------------------------------------------------- real jobs

EVERY = 2
SHARD = "__1_0.distcp"  # rank 1's shard of the model and optimizer (FSDP2 shards them)


def _flip_mid_tensor(folder: Path, tensor: torch.Tensor) -> None:
    """Flip bits in the middle of ``tensor``'s bytes inside rank 1's shard (found by value)."""
    path = folder / SHARD
    data = bytearray(path.read_bytes())
    raw = tensor.detach().contiguous().numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and len(raw) >= 64, "the tensor's bytes are not in the shard"
    for offset in range(at + len(raw) // 2, at + len(raw) // 2 + 16):
        data[offset] ^= 0x55
    path.write_bytes(bytes(data))


def _truncate(folder: Path) -> None:
    path = folder / "__0_0.distcp"
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def _zero_4k(folder: Path) -> None:
    path = folder / SHARD
    with path.open("r+b") as handle:
        handle.seek(path.stat().st_size // 2 - 2048)
        handle.write(b"\0" * 4096)


def _garble_marker(folder: Path) -> None:
    path = folder / "autoplan.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 3] + "\x00garbage")


def _loads_badly(folder: Path) -> None:
    """Rank 1's shard replaced by other bytes of its size, and the marker rewritten to match:
    the checks pass, DCP's load fails (a damaged file hashed after the damage)."""
    path = folder / SHARD
    path.write_bytes(os.urandom(path.stat().st_size))
    marker = json.loads((folder / "autoplan.json").read_text())
    marker["files"][SHARD]["sha256"] = _file_digest(path)[1]
    (folder / "autoplan.json").write_bytes(marker_bytes(marker))


def _damage_cases(tensor: torch.Tensor) -> dict[str, Any]:
    return {
        "bits flipped": lambda f: _flip_mid_tensor(f, tensor),
        "truncated": _truncate,
        "4 KB zeroed": _zero_4k,
        ".metadata deleted": lambda f: (f / ".metadata").unlink(),
        "shard deleted": lambda f: (f / SHARD).unlink(),
        "marker garbled": _garble_marker,
        "marker deleted": lambda f: (f / "autoplan.json").unlink(),
        "does not load": _loads_badly,
    }


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _job() -> Any:
    from autoplan.runtime.parallelizer import parallelize

    return parallelize(
        build_model("gpt"),
        plan=make_plan(dp=2, zero=3),
        loss_fn=loss_fn,
        optimizer=optimizer_factory(),
    )


def _train(job: Any, data: CountingBatches, checkpointer: Any, upto: int) -> None:
    while job.step < upto:
        job.train_step(*next(data))
        checkpointer.after_step()


def damage_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save steps 2 and 4; for each kind of damage to step 4 (in a copy of the folder), a new
    job restores and reports what it resumed, its parameters and the lines it logged."""
    import torch.distributed as dist

    from autoplan import Checkpointer
    from autoplan.runtime.checkpoint import CheckpointError

    lines = _Lines()
    logging.getLogger("autoplan.runtime.checkpoint").addHandler(lines)
    base = Path(root) / "base"
    job = _job()
    data = CountingBatches(job.plan.global_batch_size)
    checkpointer = Checkpointer(base, job, every=EVERY, data=data)
    _train(job, data, checkpointer, 2)
    checkpointer.wait()
    at_2 = _parameters(job)
    _train(job, data, checkpointer, 4)
    checkpointer.close()
    # a tensor of this rank's shard as saved at step 4: its part of the first FSDP-sharded
    # weight
    name, param = next((n, p) for n, p in job.named_parameters() if p.ndim == 2)
    victim = param.to_local().detach().clone()
    damage = _damage_cases(victim)
    assert all("skipping" not in line for line in lines.lines)

    results: dict[str, Any] = {"victim": name}
    for index, (case, hurt) in enumerate(damage.items()):
        folder = Path(root) / f"case{index}"
        if rank == 0:
            shutil.copytree(base, folder)
        dist.barrier()
        if rank == (1 if case == "bits flipped" else 0):  # rank 1 knows its tensor's bytes
            hurt(folder / "step_00000004")
        dist.barrier()
        lines.lines.clear()
        job = _job()
        data = CountingBatches(job.plan.global_batch_size)
        restorer = Checkpointer(folder, job, every=EVERY, data=data)
        resumed = restorer.restore()
        equal = all(torch.equal(at_2[k], v) for k, v in _parameters(job).items())
        results[case] = {
            "resumed": resumed,
            "drawn": data.drawn,
            "equal": equal,
            "lines": list(lines.lines),
        }
        if case == "bits flipped":
            # the resumed job saves step 4 again: over the damaged folder of its own run
            _train(job, data, restorer, 4)
            restorer.wait()
            again = Checkpointer(folder, _job(), every=EVERY)
            results[case]["again"] = again.restore()
            results[case]["replaced_lines"] = list(lines.lines)
            again.close(save=False)
        restorer.close(save=False)
        dist.barrier()

    # every checkpoint damaged: nothing was loaded, the job starts afresh
    folder = Path(root) / "all-damaged"
    if rank == 0:
        shutil.copytree(base, folder)
        _zero_4k(folder / "step_00000002")
        _zero_4k(folder / "step_00000004")
    dist.barrier()
    lines.lines.clear()
    fresh = Checkpointer(folder, _job(), every=EVERY)
    results["all damaged"] = {"resumed": fresh.restore(), "lines": list(lines.lines)}
    fresh.close(save=False)
    # the only checkpoint passes its checks but fails to load: the model holds part of it
    folder = Path(root) / "load-fails"
    if rank == 0:
        shutil.copytree(base, folder)
        shutil.rmtree(folder / "step_00000002")
        _loads_badly(folder / "step_00000004")
    dist.barrier()
    try:
        Checkpointer(folder, _job(), every=EVERY).restore()
        results["load fails"] = None
    except CheckpointError as error:
        results["load fails"] = str(error)
    return results


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    results = run_distributed(
        damage_worker, str(tmp_path / "ck"), world_size=2, tmp_path=tmp_path, timeout_s=400
    )
    root, other = results
    reasons = {
        "bits flipped": f"{SHARD} is damaged (fails its SHA-256 checksum)",
        "truncated": "__0_0.distcp is damaged (truncated: ",
        "4 KB zeroed": f"{SHARD} is damaged (fails its SHA-256 checksum)",
        ".metadata deleted": ".metadata is missing",
        "shard deleted": f"{SHARD} is missing",
        "marker garbled": "autoplan.json is damaged (not JSON: ",
        "marker deleted": "autoplan.json is missing (the job stopped while saving it)",
        "does not load": "it does not load: ",
    }
    for index, (case, why) in enumerate(reasons.items()):
        for result in results:
            # the previous checkpoint's state exactly: weights, step, data position
            assert result[case]["resumed"] == 2, (case, result[case])
            assert result[case]["equal"], case
            assert result[case]["drawn"] == 2, case
        folder = tmp_path / "ck" / f"case{index}" / "step_00000004"
        skipped = [line for line in root[case]["lines"] if line.startswith("skipping")]
        # one line, on rank 0 only, naming the folder, the file and the reason
        assert len(skipped) == 1, (case, root[case]["lines"])
        assert skipped[0].startswith(f"skipping checkpoint {folder}: {why}"), skipped
        assert skipped[0].endswith("; trying the previous one"), skipped
        assert not any(line.startswith("skipping") for line in other[case]["lines"]), case
    # the damaged step 4 of its own run was replaced by the resumed job's new save
    assert root["bits flipped"]["again"] == 4
    assert any("replacing checkpoint" in line for line in root["bits flipped"]["replaced_lines"])
    assert root["all damaged"]["resumed"] == 0
    assert root["all damaged"]["lines"][-1].startswith(
        f"no intact checkpoint in {tmp_path / 'ck' / 'all-damaged'} (2 skipped): starting from "
        "step 0"
    )
    assert root["load fails"] == other["load fails"]
    assert root["load fails"].startswith(
        f"no checkpoint in {tmp_path / 'ck' / 'load-fails'} loads (the newest that passed its "
        "checks, step_00000004 ("
    ), root["load fails"]


def full_disk_worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """A file size limit on rank 1 fails the save of step 4; the job goes on; a non-finite
    step 5 keeps step 2 through later saves and a restart of the job; a job started anew
    prunes only its own checkpoints; another job's folder stays throughout."""
    import resource
    import signal

    import torch.distributed as dist

    from autoplan import Checkpointer
    from autoplan.runtime.checkpoint import CheckpointError, CheckpointSaveError

    root = Path(folder)
    run = {"optimizer": "AdamW", "lr": 0.01, "global_batch": 8}
    job = _job()
    data = CountingBatches(job.plan.global_batch_size)
    checkpointer = Checkpointer(root, job, every=EVERY, data=data, keep=1, run=run)
    _train(job, data, checkpointer, 2)
    checkpointer.wait()
    result: dict[str, Any] = {"first_save_s": checkpointer.last_save_s}
    if rank == 0:  # another job's checkpoint in the folder (an older step)
        shutil.copytree(root / "step_00000002", root / "step_00000001")
        marker = json.loads((root / "step_00000001" / "autoplan.json").read_text())
        marker.update(step=1, job="torchrun:another-job")
        (root / "step_00000001" / "autoplan.json").write_bytes(marker_bytes(marker))
    dist.barrier()

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # writes past 4 KB fail with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        _train(job, data, checkpointer, 4)  # starts the save of step 4
        pending = checkpointer._pending
        assert pending is not None
        while not pending.done():  # its writes fail: the save ends on each rank
            time.sleep(0.01)
        while job.step < 10:  # the next step's poll reports it, on every rank
            job.train_step(*next(data))
            checkpointer.after_step()
    except CheckpointSaveError as error:
        result["raised_at"] = job.step
        result["message"] = str(error)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    dist.barrier()
    result["after_failure"] = sorted(p.name for p in root.iterdir())
    checkpointer.note_nonfinite(5)  # say the loss was not finite at step 5 (skipped)
    _train(job, data, checkpointer, 12)
    checkpointer.wait()
    result["after_nonfinite"] = sorted(p.name for p in root.glob("step_*"))
    result["last_complete_step"] = checkpointer.last_complete_step

    # a restart of the same job: the lock passes to it, the non-finite step is in the marker
    restarted = _job()
    data = CountingBatches(restarted.plan.global_batch_size)
    checkpointer = Checkpointer(root, restarted, every=EVERY, data=data, keep=1, run=run)
    fresh = _parameters(restarted)

    def refuse(info: Any) -> None:
        raise CheckpointError(f"refused {info.path.name}")

    try:  # the caller refuses the checkpoint before it loads: nothing changes
        checkpointer.restore(before_load=refuse)
    except CheckpointError as error:
        result["refused"] = str(error)
    result["untouched"] = restarted.step == 0 and all(
        torch.equal(fresh[k], v) for k, v in _parameters(restarted).items()
    )
    seen: list[Any] = []
    result["resumed"] = checkpointer.restore(before_load=seen.append)
    result["seen"] = [(info.step, info.run) for info in seen]
    assert checkpointer.restored is not None
    result["run"] = checkpointer.restored.run
    _train(restarted, data, checkpointer, 16)
    checkpointer.close()
    result["after_restart"] = sorted(p.name for p in root.iterdir())

    # a job started anew (another TORCHELASTIC_RUN_ID) resumes, and deletes only its own
    os.environ["TORCHELASTIC_RUN_ID"] = "a-new-job"
    anew = _job()
    data = CountingBatches(anew.plan.global_batch_size)
    checkpointer = Checkpointer(root, anew, every=EVERY, data=data, keep=1, run=run)
    result["resumed_anew"] = checkpointer.restore()
    _train(anew, data, checkpointer, 20)
    checkpointer.close()
    del os.environ["TORCHELASTIC_RUN_ID"]
    result["after_anew"] = sorted(p.name for p in root.iterdir())
    return result


@pytest.mark.slow
def test_a_failed_save_is_reported_on_every_rank_and_pruning_keeps_good_state(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ck"
    results = run_distributed(
        full_disk_worker, str(folder), world_size=2, tmp_path=tmp_path, timeout_s=400
    )
    first, second = results
    # reported on both ranks, at the same step, in one line
    assert first["raised_at"] == second["raised_at"] == 5  # the step after, not the next save
    assert first["message"] == second["message"]
    assert first["message"].startswith("checkpoint of step 4 failed: "), first["message"]
    assert "File too large (EFBIG)" in first["message"] and "on rank 1" in first["message"]
    assert first["message"].endswith(
        f"; the newest good checkpoint is {folder / 'step_00000002'}"
    ), first["message"]
    # the failed save's staging folder is gone; the good checkpoint and the lock are there
    assert first["after_failure"] == ["autoplan.lock", "step_00000001", "step_00000002"]
    assert first["first_save_s"] is not None and first["first_save_s"] > 0
    # keep=1, a non-finite step 5: step 2 (older than it) stays, with the newest; another
    # job's step 1 is never pruned
    assert first["after_nonfinite"] == ["step_00000001", "step_00000002", "step_00000012"]
    assert first["last_complete_step"] == 12
    # the restart resumed 12, read the run facts back, and still kept step 2 through its
    # own saves (the non-finite step came with the marker)
    assert first["resumed"] == 12
    assert first["refused"] == "refused step_00000012" and first["untouched"]
    assert first["seen"] == [(12, first["run"])]
    assert first["run"] == {"optimizer": "AdamW", "lr": 0.01, "global_batch": 8}
    # close released the lock
    assert first["after_restart"] == ["step_00000001", "step_00000002", "step_00000016"]
    # the new job resumed 16, saved 18 and 20 (keep=1: 18 went) and left the earlier jobs'
    assert first["resumed_anew"] == 16
    assert first["after_anew"] == [
        "step_00000001",
        "step_00000002",
        "step_00000016",
        "step_00000020",
    ]
