"""The integrity part of bench/faults.py (issue 37 item 10): what a job does with damaged
checkpoints, a diverging loss, a full disk, a scheduler's SIGTERM and a second job on its folder.

Every case runs the example's small GPT under a real ``torchrun`` (2 processes) and starts from
a copy of one base run's checkpoint folder (steps 2 to ``BASE`` saved every 2 steps; the two
newest kept). For each case it prints:

- detected: the job's own line that names the problem (none: NOT detected);
- resumed from: the checkpoint step the next start resumed from;
- steps lost: steps done before the fault minus the step resumed from (a damaged newest
  checkpoint costs its interval; a SIGTERM that saved costs 0);
- good checkpoints lost: checkpoints that were complete and intact before the fault and are
  gone afterwards with no newer intact one in their place (the target is 0);
- tracebacks: Python tracebacks in the job's output (the target is 0), torchrun's own excluded:
  its agent prints one whenever a worker exits non-zero or the agent itself is signalled.

A case passes when it was detected, lost no good checkpoint, printed no traceback and, where
the job resumed, its losses equal the uninterrupted run's bit for bit (same plan, same
batches). "Intact" is judged here from the files, independently of the product: a checkpoint
is intact when its folder has the marker and every file is byte-identical to the copy taken
when it was written (files this bench did not damage).

The full-disk case mounts a small tmpfs (root only; otherwise it is reported as not run).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tests.jobs import Agent, free_port, losses, start_agent

NPROC = 2
BASE = 8  # steps of the base run, checkpointed every EVERY steps
EVERY = 2
HANG_S = 300.0
MARKER = "autoplan.json"


@dataclass(slots=True)
class Case:
    name: str
    detected: str | None = None  # the job's line naming the problem
    resumed: int | None = None
    steps_lost: int | None = None
    good_lost: int = 0
    good_left: int = 0
    tracebacks: int = 0
    losses_match: bool | None = None  # None: nothing to compare
    note: str = ""
    ran: bool = True
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            self.ran
            and self.detected is not None
            and self.good_lost == 0
            and self.tracebacks == 0
            and self.losses_match is not False
            and not self.problems
        )


@dataclass(slots=True)
class Job:
    code: int
    output: str
    losses: list[tuple[int, float]]


def _args(folder: Path, ckpt: Path, steps: int, every: int, extra: tuple[str, ...]) -> list[str]:
    return [
        "--steps", str(steps), "--global-batch", "16", "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", str(every), "--loss-log", str(folder / "loss.log"),
        "--timeout", "60", *extra,
    ]  # fmt: skip


def _start(folder: Path, ckpt: Path, steps: int, *, every: int = EVERY,
           extra: tuple[str, ...] = ()) -> Agent:  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    return start_agent(folder, _args(folder, ckpt, steps, every, extra), nproc=NPROC,
                       port=free_port())  # fmt: skip


def _finish(agent: Agent, folder: Path) -> Job:
    try:
        code = agent.wait(HANG_S)
    except subprocess.TimeoutExpired:
        code = -1
    finally:
        agent.stop()
    return Job(code=code, output=agent.output(), losses=losses(folder / "loss.log"))


def _run(folder: Path, ckpt: Path, steps: int, **kwargs: object) -> Job:
    return _finish(_start(folder, ckpt, steps, **kwargs), folder)  # type: ignore[arg-type]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(ckpt: Path) -> dict[int, dict[str, str]]:
    """Each complete checkpoint's files and their digests, by step."""
    found: dict[int, dict[str, str]] = {}
    for folder in sorted(ckpt.glob("step_*")):
        if (folder / MARKER).is_file():
            found[int(folder.name[5:])] = {
                p.name: _digest(p) for p in sorted(folder.iterdir()) if p.is_file()
            }
    return found


def _intact(ckpt: Path, known: dict[int, dict[str, str]]) -> set[int]:
    """Steps whose folder still holds every file byte-identical to what was known good."""
    good = set()
    for step, files in known.items():
        folder = ckpt / f"step_{step:08d}"
        if all((folder / n).is_file() and _digest(folder / n) == d for n, d in files.items()):
            good.add(step)
    return good


def _account(case: Case, ckpt: Path, good_before: dict[int, dict[str, str]],
             after: dict[int, dict[str, str]]) -> None:  # fmt: skip
    """Good checkpoints lost: intact before, gone now, and no newer intact one (old or new)."""
    still = _intact(ckpt, good_before)
    newest = max([*still, *after], default=-1)
    case.good_lost = sum(1 for step in good_before if step not in still and step > newest)
    case.good_left = len(still | set(after))


TRACEBACKS: list[str] = []  # the counted tracebacks' text, shown after the table


def _tracebacks(text: str) -> int:
    """Tracebacks the job's processes printed. torchrun's agent prints its own traceback when a
    worker exited non-zero (``ChildFailedError``) and when the agent itself gets SIGTERM
    (``SignalException``), whatever the workers did: those are the launcher's, not autoplan's,
    and are not counted."""
    blocks = text.split("Traceback (most recent call last)")[1:]
    launcher = ("ChildFailedError", "SignalException")
    counted = [b for b in blocks if not any(n in b.split("\n\n")[0] for n in launcher)]
    TRACEBACKS.extend("\n".join(block.splitlines()[:25]) for block in counted)
    return len(counted)


def _find(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text, re.MULTILINE)
    return None if match is None else match.group(0).strip()[:400]


def _resumed(text: str) -> int | None:
    match = re.search(r"resumed step (\d+)", text)
    return None if match is None else int(match.group(1))


def _compare(case: Case, job: Job, expected: dict[int, float]) -> None:
    if job.losses:
        case.losses_match = all(loss == expected.get(step) for step, loss in job.losses)


# ----------------------------------------------------------------------------- damage


def _newest(ckpt: Path) -> Path:
    return sorted(p for p in ckpt.glob("step_*") if (p / MARKER).is_file())[-1]


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for offset in range(middle, middle + 64):
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def _zero_4k(path: Path) -> None:
    with path.open("r+b") as handle:
        handle.seek(max(0, path.stat().st_size // 2 - 2048))
        handle.write(b"\0" * 4096)


def _shard(folder: Path) -> Path:
    shards = sorted(folder.glob("*.distcp"))
    return shards[-1]  # __1_0.distcp: rank 1's


DAMAGE: dict[str, Callable[[Path], None]] = {
    "bits flipped in a shard": lambda f: _flip(_shard(f)),
    "shard truncated": lambda f: _truncate(_shard(f)),
    "4 KB of a shard zeroed": lambda f: _zero_4k(_shard(f)),
    ".metadata deleted": lambda f: (f / ".metadata").unlink(),
    "a shard deleted": lambda f: _shard(f).unlink(),
}


def _damaged(base: Path, work: Path, name: str, expected: dict[int, float]) -> Case:
    case = Case(f"damaged: {name}")
    ckpt = work / "ckpt"
    shutil.copytree(base, ckpt)
    good_before = _snapshot(ckpt)
    newest = _newest(ckpt)
    DAMAGE[name](newest)
    good_before.pop(int(newest.name[5:]))
    job = _run(work, ckpt, BASE + 4)
    case.detected = _find(rf"^.*{re.escape(newest.name)}.*(damaged|corrupt|checksum|incomplete|"
                          r"missing|skipp).*$", job.output)  # fmt: skip
    case.resumed = _resumed(job.output)
    case.steps_lost = None if case.resumed is None else BASE - case.resumed
    case.tracebacks = _tracebacks(job.output)
    if job.code != 0:
        case.problems.append(f"exit {job.code}")
    _compare(case, job, expected)
    _account(case, ckpt, good_before, _snapshot(ckpt))
    return case


# ----------------------------------------------------------------------------- NaN


def _nan(base: Path, work: Path, mode: str) -> Case:
    """Resumed with a learning rate that diverges at once: the loss turns non-finite a step
    or two later."""
    case = Case(f"NaN, --on-nan {mode}")
    ckpt = work / "ckpt"
    shutil.copytree(base, ckpt)
    good_before = _snapshot(ckpt)
    job = _run(work, ckpt, BASE + 6, extra=("--lr", "1e10", "--on-nan", mode))
    case.detected = _find(
        r"^.*(non-finite .* at step \d+|skipped step \d+: non-finite).*$", job.output
    )
    case.resumed = _resumed(job.output)
    case.tracebacks = _tracebacks(job.output)
    after = _snapshot(ckpt)
    bad = [step for step, loss in job.losses if loss != loss or abs(loss) == float("inf")]
    first_bad = min(bad, default=None)
    said = re.search(r"at step (\d+)|skipped step (\d+)", case.detected or "")
    if first_bad is None and said is not None:  # a stopped step logs no loss: its line says it
        first_bad = int(said.group(1) or said.group(2))
    if mode == "stop":
        if job.code != 1:
            case.problems.append(f"exit {job.code}, not 1")
        if first_bad is not None and any(step >= first_bad for step in after):
            case.problems.append(f"saved a checkpoint at or after the bad step {first_bad}")
    else:
        if job.code != 0:
            case.problems.append(f"exit {job.code}")
        if first_bad is not None and not any(step < first_bad for step in after):
            case.problems.append(f"no checkpoint older than the first bad step {first_bad} left")
    case.note = f"first non-finite step {first_bad}" if first_bad else "no non-finite step"
    # what the product still holds from before the divergence counts: newer checkpoints
    # saved after it (skip mode) hold diverged weights and replace nothing good
    _account(case, ckpt, good_before, {s: f for s, f in after.items() if s < (first_bad or 0)})
    return case


# ----------------------------------------------------------------------------- full disk


@contextlib.contextmanager
def _tmpfs(path: Path, size_kb: int) -> Iterator[bool]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _full_disk(base: Path, work: Path) -> Case:
    """The checkpoint folder on a small file system that fills up mid-run (a filler file
    written once the job has saved twice more)."""
    case = Case("disk full")
    size_kb = sum(p.stat().st_size for p in base.rglob("*") if p.is_file()) // 1024 * 4
    with _tmpfs(work / "fs", size_kb) as mounted:
        if not mounted:
            case.ran, case.note = False, "not run: mounting a tmpfs needs root"
            return case
        ckpt = work / "fs" / "ckpt"
        shutil.copytree(base, ckpt)
        good_before = _snapshot(ckpt)
        agent = _start(work, ckpt, BASE + 20)
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and agent.process.poll() is None:
            done = losses(work / "loss.log")
            if done and done[-1][0] >= BASE + 4:
                free = shutil.disk_usage(work / "fs").free
                with contextlib.suppress(OSError):
                    (work / "fs" / "filler").write_bytes(b"\0" * max(0, free - 64 * 1024))
                break
            time.sleep(0.05)
        job = _finish(agent, work)
        case.detected = _find(r"^.*(No space left|disk full|ENOSPC|File too large).*$", job.output)
        case.tracebacks = _tracebacks(job.output)
        if job.code == 0:
            case.problems.append("exit 0 after a failed save")
        after = _snapshot(ckpt)
        (work / "fs" / "filler").unlink(missing_ok=True)
        _account(case, ckpt, good_before, after)
        newest = max(after, default=None)
        case.note = f"newest good checkpoint left: step {newest}"
        # room again: the next start resumes from the newest good one
        again = _run(work / "again", ckpt, (newest or 0) + 2)
        case.resumed = _resumed(again.output)
        case.tracebacks += _tracebacks(again.output)
        last_done = max((s for s, _ in job.losses), default=0)
        case.steps_lost = None if case.resumed is None else last_done - case.resumed
    return case


# ----------------------------------------------------------------------------- signals, locks


def _sigterm(work: Path, expected: dict[int, float]) -> Case:
    """A scheduler's SIGTERM to the whole job (agent and workers, as Slurm signals a step)."""
    case = Case("SIGTERM (scheduler)")
    ckpt = work / "ckpt"
    agent = _start(work, ckpt, 40, every=10)
    stop_at = 0
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        done = losses(work / "loss.log")
        if done and done[-1][0] >= 14:
            stop_at = done[-1][0]
            for process in agent._tree():  # the agent and its workers
                with contextlib.suppress(Exception):
                    process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    job = _finish(agent, work)
    case.detected = _find(r"^.*stopped by SIG\w+ after step \d+.*$", job.output)
    done_steps = max((s for s, _ in job.losses), default=stop_at)
    good_before = _snapshot(ckpt)
    again = _run(work / "again", ckpt, done_steps + 4, every=10)
    case.resumed = _resumed(again.output)
    case.steps_lost = None if case.resumed is None else done_steps - case.resumed
    case.tracebacks = _tracebacks(job.output) + _tracebacks(again.output)
    _compare(case, again, expected)
    _account(case, ckpt, good_before, _snapshot(ckpt))
    case.note = f"signalled after step {stop_at}; steps done {done_steps}"
    return case


def _two_jobs(work: Path) -> Case:
    """A second job started on the folder of a running one."""
    case = Case("two jobs, one folder")
    ckpt = work / "ckpt"
    first = _start(work / "first", ckpt, 300, every=10)  # still running when the second starts
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline and not losses(work / "first" / "loss.log"):
        time.sleep(0.05)
    second = _run(work / "second", ckpt, 300, every=10)
    overlapped = first.process.poll() is None
    job = _finish(first, work / "first")
    if not overlapped:
        case.problems.append("the first job ended before the second did: not a test of the lock")
    case.detected = _find(r"^.*(lock|held by|in use).*$", second.output)
    case.tracebacks = _tracebacks(second.output) + _tracebacks(job.output)
    if second.code == 0:
        case.problems.append("the second job ran")
    if job.code != 0:
        case.problems.append(f"the first job failed ({job.code})")
    after = _snapshot(ckpt)
    if max(after, default=0) != 300:
        case.problems.append(f"the first job's last checkpoint is {max(after, default=None)}")
    case.good_left = len(after)
    case.note = f"first job exit {job.code}, second exit {second.code}"
    return case


# ----------------------------------------------------------------------------- the part


def integrity_part(args: argparse.Namespace, console: Console) -> bool:
    """Runs every case; prints the table; returns whether every case passed."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autoplan-integrity-") as name:
        tmp = Path(name)
        reference = _run(tmp / "reference", tmp / "reference" / "ckpt", 40, every=10)
        expected = dict(reference.losses)
        if reference.code != 0 or len(expected) != 40:
            raise SystemExit(f"the reference run failed:\n{reference.output[-3000:]}")
        base_job = _run(tmp / "base", tmp / "base" / "ckpt", BASE)
        if base_job.code != 0:
            raise SystemExit(f"the base run failed:\n{base_job.output[-3000:]}")
        base = tmp / "base" / "ckpt"
        cases = [_damaged(base, tmp / f"damage{i}", name, expected)
                 for i, name in enumerate(DAMAGE)]  # fmt: skip
        cases += [_nan(base, tmp / "nan-stop", "stop"), _nan(base, tmp / "nan-skip", "skip")]
        cases.append(_full_disk(base, tmp / "disk"))
        cases.append(_sigterm(tmp / "sigterm", expected))
        cases.append(_two_jobs(tmp / "two"))
    table = Table(
        title=f"checkpoint integrity: {NPROC} processes, base run of {BASE} steps saved every "
        f"{EVERY}",
        box=None,
    )
    for column in ("case", "detected", "resumed from", "steps lost", "good lost", "good left",
                   "tracebacks", "losses", "ok"):  # fmt: skip
        table.add_column(column, justify="left" if column == "case" else "right")
    for case in cases:
        table.add_row(
            case.name,
            ("yes" if case.detected else "NO") if case.ran else "not run",
            "-" if case.resumed is None else str(case.resumed),
            "-" if case.steps_lost is None else str(case.steps_lost),
            str(case.good_lost),
            str(case.good_left),
            str(case.tracebacks),
            {None: "-", True: "identical", False: "DIFFERENT"}[case.losses_match],
            "yes" if case.passed else ("-" if not case.ran else "NO"),
        )
    console.print(table)
    console.print("what each job said (its own line, paths shortened to the folder's name):")
    for case in cases:
        line = re.sub(r"/\S*/(step_\d+|ckpt)", r"\1", case.detected or case.note)
        console.print(f"  {case.name}: {line}", soft_wrap=True, highlight=False)
        if case.note and case.ran and case.detected:
            console.print(f"    ({case.note})", highlight=False)
        for problem in case.problems:
            console.print(f"    [red]{problem}")
    for text in TRACEBACKS:
        console.print(f"[red]a traceback:[/red]\n{text}", highlight=False)
    ran = [case for case in cases if case.ran]
    passed = sum(case.passed for case in ran)
    console.print(
        f"integrity: {passed} of {len(ran)} cases passed ({len(cases) - len(ran)} not run); "
        f"detected {sum(c.detected is not None for c in ran)}, good checkpoints lost "
        f"{sum(c.good_lost for c in ran)}, tracebacks {sum(c.tracebacks for c in ran)}; "
        f"{time.monotonic() - started:.0f} s"
    )
    return passed == len(ran)
