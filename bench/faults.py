"""Faults during training (issue 18 item 6): a 200-step run of the example's small GPT on 4
processes (two torchrun agents of 2, an elastic ``--nnodes 1:2`` job with a c10d rendezvous on
localhost, ``--max-restarts``), broken from outside as a cluster breaks jobs:

- 9 faults at random steps: SIGKILL or SIGSTOP of a random rank (a crashed or a wedged process);
- then the loss of a whole node (agent 1 and its workers): the job comes back on 2 processes,
  rank 0 searches a plan for them, and the checkpoint is resharded into it.

For each fault it prints: recovered (the job trained on), steps lost (the steps it had done
minus the checkpoint it resumed from), time to recover (from the fault to the restarted job's
first step), and whether every loss the recovered job computed equals the uninterrupted run's
(the same 4-process plan: bit for bit; after the re-plan: the relative difference, as another
plan sums in another order). Targets: 10 of 10 recovered, 0 hangs, steps lost <= the checkpoint
interval, the final loss identical.

Then the torchft part (issue 18 item 7): two replica groups of 2 processes (`TorchFTReplicas`,
a real lighthouse) train 3000 steps; 4 faults (SIGKILL or SIGSTOP of a random rank of a random
group, each 20-60 steps after the previous group rejoined). For each: whether the group
rejoined by healing from its peer, the step it healed to, the time that took, and the steps the
other group lost (rolled back: the target is 0) or retried (the step whose all-reduce the fault
broke); at the end both groups must hold the same weights.

How recovery works: a killed worker's agent sees it exit and restarts its workers; the other
agent's workers fail at once ("connection closed by peer") and it restarts too; both
re-rendezvous and resume from the newest complete checkpoint. A stopped worker holds its
connections open: its peers wait for the process-group timeout (``--timeout``, 10 s here),
then fail naming it (`StalledRankError`); torchrun then stops it (SIGTERM, and SIGKILL 30 s
later: a stopped process cannot act on SIGTERM, and torch's agent waits a fixed 30 s).

Run: .venv/bin/python bench/faults.py [--steps 200] [--every 10] [--seed 0] [--part torchft]
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fault_cases import integrity_part  # noqa: E402
from tests.jobs import Agent, example_args, free_port, start_agent  # noqa: E402

NPROC = 2  # per agent ("node")
HANG_S = 180.0  # no recovery within this long after a fault counts as a hang


@dataclass(frozen=True, slots=True)
class Fault:
    step: int  # injected once the job has logged this step
    kind: str  # "SIGKILL", "SIGSTOP" or "node"
    rank: int  # the rank signalled (node: the first rank of the node)


@dataclass(slots=True)
class Outcome:
    fault: Fault
    at_step: int = 0  # the last step the job logged before it restarted
    resumed: int | None = None  # the checkpoint step it resumed from
    recover_s: float | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)  # logged after recovery

    @property
    def recovered(self) -> bool:
        return self.resumed is not None


class LossLog:
    """The example's ``step loss`` lines with the time each was first seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[tuple[float, int, float]] = []
        self._offset = 0
        self._partial = ""

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as log:
            log.seek(self._offset)
            text = log.read()
            self._offset = log.tell()
        now = time.monotonic()
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            step, loss = line.split()
            self.records.append((now, int(step), float(loss)))

    @property
    def last_step(self) -> int:
        return self.records[-1][1] if self.records else 0


def _schedule(rng: random.Random, steps: int, every: int, count: int) -> list[Fault]:
    """``count - 1`` rank faults at distinct random steps, then the node loss after them."""
    last = steps - every  # leave the re-planned job some steps
    spots = sorted(rng.sample(range(every // 2 + 1, last - every), count - 1))
    faults = [
        Fault(step=s, kind=rng.choice(["SIGKILL", "SIGSTOP"]), rank=rng.randrange(2 * NPROC))
        for s in spots
    ]
    return [*faults, Fault(step=rng.randrange(spots[-1] + 2, last), kind="node", rank=NPROC)]


def _start(tmp: Path, log: Path, args: argparse.Namespace, nnodes: str) -> list[Agent]:
    port = free_port()
    options = example_args(tmp, log, steps=args.steps, every=args.every, timeout_s=args.timeout)
    return [
        start_agent(
            tmp,
            options,
            nproc=NPROC,
            port=port,
            nnodes=nnodes,
            node=node,
            max_restarts=50,
            rdzv_conf="last_call_timeout=5",
        )
        for node in (0, 1)
    ]


def _uninterrupted(tmp: Path, args: argparse.Namespace) -> dict[int, float]:
    folder = tmp / "uninterrupted"
    folder.mkdir()
    log = folder / "loss.log"
    agents = _start(folder, log, args, nnodes="2")
    try:
        codes = [agent.wait(1200) for agent in agents]
    finally:
        for agent in agents:
            agent.stop()
    if codes != [0, 0]:
        raise SystemExit(f"the uninterrupted run failed: {codes}\n{agents[0].output()[-3000:]}")
    reader = LossLog(log)
    reader.poll()
    return {step: loss for _, step, loss in reader.records}


def _inject(fault: Fault, agents: list[Agent]) -> None:
    if fault.kind == "node":
        agents[1].kill_node()
        return
    agent = agents[fault.rank // NPROC]
    agent.signal_rank(fault.rank, getattr(signal, fault.kind))


def _run_with_faults(
    tmp: Path, args: argparse.Namespace, faults: list[Fault], console: Console
) -> tuple[list[Outcome], bool, list[tuple[int, float]]]:
    """Returns each fault's outcome, whether the job finished, and every logged loss."""
    folder = tmp / "faulted"
    folder.mkdir()
    log = LossLog(folder / "loss.log")
    agents = _start(folder, log.path, args, nnodes=f"1:{2}")
    outcomes = [Outcome(fault) for fault in faults]
    finished = False
    try:
        for index, outcome in enumerate(outcomes):
            fault = outcome.fault
            while log.last_step < fault.step:
                if agents[0].process.poll() is not None:
                    raise RuntimeError("the job ended before all faults were made")
                log.poll()
                time.sleep(0.02)
            fired = time.monotonic()
            _inject(fault, agents)
            console.print(f"fault {index + 1}: {fault.kind} rank {fault.rank} at step {fault.step}")
            seen = len(log.records)
            while outcome.resumed is None and time.monotonic() - fired < HANG_S:
                log.poll()
                for when, step, _ in log.records[seen:]:
                    previous = log.records[seen - 1][1]
                    if step <= previous:  # the restarted job's first step
                        outcome.at_step, outcome.resumed = previous, step - 1
                        outcome.recover_s = when - fired
                        break
                    seen += 1
                time.sleep(0.02)
            if outcome.resumed is None:
                console.print(f"[red]fault {index + 1}: no recovery in {HANG_S:.0f} s (hang)")
                return outcomes, False, [(s, v) for _, s, v in log.records]
            outcome.losses = []  # filled below, once the next fault's restart is known
        finished = agents[0].wait(1200) == 0
    finally:
        for agent in agents:
            agent.stop()
    log.poll()
    # each recovery's losses: from its restart to the next restart (or the end)
    restarts = [i for i in range(1, len(log.records)) if log.records[i][1] <= log.records[i - 1][1]]
    for outcome, start, end in zip(
        outcomes, restarts, [*restarts[1:], len(log.records)], strict=False
    ):
        outcome.losses = [(step, loss) for _, step, loss in log.records[start:end]]
    return outcomes, finished, [(s, v) for _, s, v in log.records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="Steps between checkpoints.")
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0, help="Process-group timeout, s.")
    parser.add_argument("--torchft-steps", type=int, default=3000)
    parser.add_argument("--torchft-faults", type=int, default=4)
    parser.add_argument(
        "--part",
        choices=["all", "torchrun", "torchft", "integrity"],
        default="all",
        help="Which part to run.",
    )
    args = parser.parse_args()
    console = Console(width=110)
    if args.part == "torchft":
        raise SystemExit(0 if _torchft_part(args, console) else 1)
    if args.part == "integrity":
        raise SystemExit(0 if integrity_part(args, console) else 1)
    faults = _schedule(random.Random(args.seed), args.steps, args.every, args.faults)
    with tempfile.TemporaryDirectory(prefix="autoplan-faults-") as name:
        tmp = Path(name)
        started = time.monotonic()
        expected = _uninterrupted(tmp, args)
        console.print(
            f"uninterrupted: {args.steps} steps on {2 * NPROC} processes in "
            f"{time.monotonic() - started:.0f} s; final loss {expected[args.steps]:.6f}"
        )
        started = time.monotonic()
        outcomes, finished, records = _run_with_faults(tmp, args, faults, console)
        elapsed = time.monotonic() - started

    table = Table(title=f"{len(faults)} faults, checkpoint every {args.every} steps", box=None)
    for column in ("#", "fault", "at step", "recovered", "resumed", "steps lost", "recover s",
                   "losses vs uninterrupted"):  # fmt: skip
        table.add_column(column, justify="right" if column != "fault" else "left")
    lost_ok = True
    for number, outcome in enumerate(outcomes, 1):
        fault = outcome.fault
        what = "node 1 lost" if fault.kind == "node" else f"{fault.kind} rank {fault.rank}"
        lost = outcome.at_step - outcome.resumed if outcome.resumed is not None else None
        lost_ok &= lost is not None and lost <= args.every
        diffs = [abs(loss - expected[step]) / abs(expected[step]) for step, loss in outcome.losses]
        if not diffs:
            same = "-"
        elif max(diffs) == 0:
            same = f"identical ({len(diffs)} steps)"
        else:
            same = f"max rel diff {max(diffs):.1e} ({len(diffs)} steps)"
        table.add_row(
            str(number),
            what,
            str(outcome.at_step or fault.step),
            "yes" if outcome.recovered else "NO",
            "-" if outcome.resumed is None else str(outcome.resumed),
            "-" if lost is None else str(lost),
            "-" if outcome.recover_s is None else f"{outcome.recover_s:.1f}",
            same,
        )
    console.print(table)
    recovered = sum(outcome.recovered for outcome in outcomes)
    hangs = sum(not outcome.recovered for outcome in outcomes)
    final = records[-1] if records else (0, float("nan"))
    same_plan = [o for o in outcomes if o.fault.kind != "node" and o.losses]
    first_restart = next(
        (i for i in range(1, len(records)) if records[i][0] <= records[i - 1][0]), len(records)
    )
    compared = [*records[:first_restart], *(pair for o in same_plan for pair in o.losses)]
    exact = all(loss == expected[step] for step, loss in compared)
    console.print(
        f"recovered {recovered} of {len(outcomes)}; hangs {hangs}; steps lost "
        f"{'<=' if lost_ok else 'NOT all <='} the interval ({args.every}); job "
        f"{'finished' if finished else 'did NOT finish'} in {elapsed:.0f} s"
    )
    verdict = "identical to the uninterrupted run, bit for bit" if exact else "DIFFERENT"
    line = (
        f"losses of the {len(compared)} steps before the first fault and after the "
        f"{len(same_plan)} same-plan recoveries: {verdict}"
    )
    if finished and final[0] == args.steps:
        line += (
            f"; final loss (step {final[0]}) {final[1]:.6f} vs {expected[args.steps]:.6f} (rel "
            f"diff {abs(final[1] - expected[args.steps]) / expected[args.steps]:.1e}: after the "
            "re-plan for 2 processes, another summation order)"
        )
    console.print(line)
    failed = recovered != len(outcomes) or not finished
    if args.part == "all":
        failed |= not _torchft_part(args, console)
        failed |= not integrity_part(args, console)
    if failed:
        raise SystemExit(1)


# ----------------------------------------------------------------------------- torchft


@dataclass(slots=True)
class GroupFault:
    step: int  # injected once the target group has logged this step
    kind: str  # "SIGKILL" or "SIGSTOP"
    group: int
    rank: int  # within the group
    rejoin_s: float | None = None  # until the group healed and trained again
    healed_to: int | None = None  # the step it healed to
    survivor_rollback: int = 0  # steps the other group went back (0: none)
    survivor_retried: int = 0  # steps the other group did twice (an all-reduce the fault broke)


def _torchft_part(args: argparse.Namespace, console: Console) -> bool:
    """Two replica groups of 2 processes (torchft, `autoplan.TorchFTReplicas`): faults in one
    group, the other trains on; returns whether every group rejoined and the weights agree."""
    rng = random.Random(args.seed + 1)
    steps, count = args.torchft_steps, args.torchft_faults
    # Each fault comes a random 20-60 steps after the previous group rejoined (its step is set
    # then): a group must have a live peer to heal from, and a stopped one is away for about
    # 50 s (the process-group timeout, then torchrun's fixed 30 s before it kills it).
    faults = [
        GroupFault(step=0, kind=rng.choice(["SIGKILL", "SIGSTOP"]), group=rng.randrange(2),
                   rank=rng.randrange(NPROC))
        for _ in range(count)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="autoplan-torchft-") as name:
        tmp = Path(name)
        port = free_port()
        lighthouse = subprocess.Popen(
            [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1",
             "--quorum_tick_ms", "100", "--join_timeout_ms", "1000", "--bind",
             f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        env = {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
        logs = [LossLog(tmp / f"group{g}" / "loss.log") for g in (0, 1)]
        agents: list[Agent] = []
        started = time.monotonic()
        try:
            for group in (0, 1):
                folder = tmp / f"group{group}"
                folder.mkdir()
                options = [
                    "--steps",
                    str(steps),
                    "--global-batch",
                    "32",
                    "--timeout",
                    str(args.timeout),
                    "--loss-log",
                    str(logs[group].path),
                    "--replica-groups",
                    "2",
                    "--replica-group",
                    str(group),
                ]
                agent = start_agent(
                    folder, options, nproc=NPROC, port=free_port(), max_restarts=50, env=env
                )
                agents.append(agent)
            for number, fault in enumerate(faults, 1):
                target, other = logs[fault.group], logs[1 - fault.group]
                for log in logs:
                    log.poll()
                fault.step = max(log.last_step for log in logs) + rng.randint(20, 60)
                if fault.step > steps - 600:  # a stopped group is away for ~500 steps
                    raise RuntimeError(f"--torchft-steps {steps} leaves no room for fault {number}")
                while target.last_step < fault.step:
                    if any(agent.process.poll() is not None for agent in agents):
                        raise RuntimeError("a replica group ended before all faults were made")
                    target.poll()
                    time.sleep(0.02)
                seen_other = len(other.records)
                fired = time.monotonic()
                agents[fault.group].signal_rank(fault.rank, getattr(signal, fault.kind))
                console.print(
                    f"torchft fault {number}: {fault.kind} group {fault.group} rank "
                    f"{fault.rank} at step {fault.step}"
                )
                before = target.last_step
                heals_seen = agents[fault.group].output().count("healed from a peer")
                while time.monotonic() - fired < HANG_S:
                    target.poll()
                    other.poll()
                    text = agents[fault.group].output()
                    if text.count("healed from a peer") > heals_seen and target.last_step > before:
                        fault.rejoin_s = time.monotonic() - fired
                        found = re.findall(r"healed from a peer: step \d+ -> (\d+)", text)
                        fault.healed_to = int(found[-1])
                        break
                    time.sleep(0.05)
                if fault.rejoin_s is None:
                    console.print(f"[red]torchft fault {number}: no rejoin in {HANG_S:.0f} s")
                    break
                other.poll()
                survivor = [step for _, step, _ in other.records[seen_other - 1 :]]
                fault.survivor_rollback = max(
                    (a - b for a, b in itertools.pairwise(survivor) if b < a),
                    default=0,
                )
                fault.survivor_retried = sum(b == a for a, b in itertools.pairwise(survivor))
            codes = [agent.wait(1200) for agent in agents]
        finally:
            for agent in agents:
                agent.stop()
            lighthouse.kill()
        elapsed = time.monotonic() - started
        digests = [
            re.findall(rf"replica group {g}: step {steps}, weights (\w+)", agent.output())
            for g, agent in enumerate(agents)
        ]
    table = Table(title=f"torchft: 2 replica groups of {NPROC} processes, {steps} steps", box=None)
    for column in ("#", "fault", "at step", "rejoined", "healed to step", "rejoin s",
                   "other group: steps lost", "retried"):  # fmt: skip
        table.add_column(column, justify="left" if column == "fault" else "right")
    for number, fault in enumerate(faults, 1):
        table.add_row(
            str(number),
            f"{fault.kind} group {fault.group} rank {fault.rank}",
            str(fault.step),
            "yes" if fault.rejoin_s is not None else "NO",
            "-" if fault.healed_to is None else str(fault.healed_to),
            "-" if fault.rejoin_s is None else f"{fault.rejoin_s:.1f}",
            str(fault.survivor_rollback),
            str(fault.survivor_retried),
        )
    console.print(table)
    rejoined = sum(fault.rejoin_s is not None for fault in faults)
    same = bool(digests[0]) and digests[0] == digests[1]
    console.print(
        f"torchft: {rejoined} of {len(faults)} groups rejoined by healing from a peer; steps "
        f"lost by the group that kept training: {max(f.survivor_rollback for f in faults)}; "
        f"both groups finished ({codes}) in {elapsed:.0f} s with "
        f"{'the same weights' if same else 'DIFFERENT weights'} ({digests[0]} / {digests[1]})"
    )
    return rejoined == len(faults) and codes == [0, 0] and same


if __name__ == "__main__":
    main()
