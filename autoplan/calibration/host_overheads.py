"""Fit the training stack's host overheads from real training steps on this machine.

Expects a cluster whose device rates and links `autoplan.calibration.machine` has just
measured. Runs a few short training jobs of a small zoo GPT through `autoplan.parallelize` on
``world_size`` local processes (gloo on CPU, NCCL with one GPU per process), one job per
reference plan, and fits the host-time constants of `cost_model.calibration.Calibration` that
the device and link measurements cannot see:

- ``kernel_overhead_s`` (per op, forward or backward) from a plain DDP plan: a training step
  records autograd and runs the backward engine for every op, which the bare tiny kernel that
  `autoplan.calibration.machine` times does not;
- ``dp_unit_overhead_s`` (per unit per micro-batch) and ``sharded_optimizer_unit_overhead_s``
  (per unit per step) from two ZeRO-3 plans with 1 and 2 micro-batches per step;
- ``tp_module_overhead_s`` (per sharded module per micro-batch) from a tensor-parallel plan;
- ``pp_message_overhead_s`` (per pipeline send of an activation or a gradient) from a
  two-stage pipeline plan.

The fit is non-negative least squares on the cost model's own predictions (Gauss-Newton on
finite differences, exact NNLS for each linearised step): the constants are what makes
`cost_model.estimate.estimate` reproduce the measured step times of the reference plans. The
reference model is deliberately not the one ``bench/runtime.py`` scores, so
the bench tests transfer, not the fit.

Guarantees: fitted values are finite and >= 0; the jobs take about 8 s on an idle 2-core
machine, and as long as they need on a loaded one: a job that fails, or reports no finished
step for ``stall_s`` seconds, raises a one-line `CalibrationError`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autoplan.api import manual_plan
from autoplan.calibration._workers import DEFAULT_STALL_S, beat, join_workers
from autoplan.contract.plan import Plan
from cost_model.calibration import Calibration
from cost_model.estimate import estimate
from cost_model.files import atomic_write_text
from cost_model.hardware import Cluster
from cost_model.workload import ModelProfile

__all__ = [
    "CALIBRATION_MODEL",
    "RuntimeMeasurement",
    "fit_host_overheads",
    "measure_runtime",
    "reference_plans",
]

# Small enough that host costs are a large share of a step (well-determined fit), with heads
# and vocabulary that TP 2 and 4 divide. bench/runtime.py scores a different, larger GPT.
CALIBRATION_MODEL: dict[str, int] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "seq_len": 32,
    "vocab_size": 128,
}
SAMPLES_PER_DEVICE = 2  # global batch = 2 x devices: 1 or 2 micro-batches under pure DP
_WARMUP_STEPS = 2
_TIMED_STEPS = 6

# Fitted from the training steps (kernel_overhead_s starts from the tiny-kernel measurement,
# the wrappers' from 0).
HOST_CONSTANTS = (
    "kernel_overhead_s",
    "tp_module_overhead_s",
    "dp_unit_overhead_s",
    "sharded_optimizer_unit_overhead_s",
    "pp_message_overhead_s",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeMeasurement:
    """Median step time of one reference plan (the slowest rank of each step)."""

    name: str
    plan: dict[str, Any]  # `Plan.to_data()`
    step_s: float
    fitted: tuple[str, ...]  # the constants this run helps determine (empty: a check)


def _reference_model() -> Any:
    """The reference GPT on the meta device (tied embedding and head)."""
    # Imports torch (seconds): here, so the CLI's other commands stay fast.
    from autoplan.models import gpt

    spec = CALIBRATION_MODEL
    return gpt(
        spec["num_layers"],
        spec["hidden_size"],
        spec["num_heads"],
        spec["seq_len"],
        spec["vocab_size"],
        device="meta",
        tie_embeddings=True,
    )


def calibration_profile() -> ModelProfile:
    """The traced profile of the reference model (meta device, no real memory)."""
    # Imports torch (seconds): here, so the CLI's other commands stay fast.
    from autoplan.tracing import trace

    return trace(_reference_model()).profile


def reference_plans(
    profile: ModelProfile, cluster: Cluster
) -> list[tuple[str, dict[str, Any], tuple[str, ...]]]:
    """(name, plan data, fitted constants) of the reference jobs on ``cluster``'s devices."""
    batch = SAMPLES_PER_DEVICE * cluster.num_devices
    zero3 = ("dp_unit_overhead_s", "sharded_optimizer_unit_overhead_s")
    specs: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
        ("ddp", {"micro_batch": 2}, ("kernel_overhead_s",)),
        ("zero3, 1 micro-batch", {"micro_batch": 2, "zero": 3}, zero3),
        ("zero3, 2 micro-batches", {"micro_batch": 1, "zero": 3}, zero3),
        ("tp2", {"tp": 2, "micro_batch": 1}, ("tp_module_overhead_s",)),
        ("pp2", {"pp": 2, "micro_batch": 1}, ("pp_message_overhead_s",)),
    ]
    plans = []
    for name, kwargs, fitted in specs:
        plan = manual_plan(profile, cluster, global_batch=batch, dtype="fp32", **kwargs)
        plans.append((name, plan.to_data(), fitted))
    return plans


def _loss(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _runtime_worker(
    rank: int,
    world_size: int,
    init_file: str,
    out_file: str,
    plans: list[dict[str, Any]],
    heartbeat: str,
) -> None:
    # A worker process: torch and the runtime load here, not in the process that fits.
    import torch
    import torch.distributed as dist

    from autoplan.runtime.parallelizer import parallelize

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        # parallelize's memory check describes the job's cluster: not measured again here
        AUTOPLAN_MEASURE_LOCAL="0",
    )
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
    )
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    seq, vocab = CALIBRATION_MODEL["seq_len"], CALIBRATION_MODEL["vocab_size"]
    results = []
    for data in plans:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(
            0, vocab, (int(data["global_batch_size"]), seq + 1), generator=generator
        )
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        torch.manual_seed(0)
        model = _reference_model()
        # (the plan is calibrate's own: parallelize's one-line announcement of it is noise here)
        logging.getLogger("autoplan.runtime.parallelizer").setLevel(logging.WARNING)
        trainer = parallelize(
            model,
            plan=Plan.from_data(data),
            loss_fn=_loss,
            optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        )
        times = []
        for step in range(_WARMUP_STEPS + _TIMED_STEPS):
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step(inputs, targets)
            sync()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= _WARMUP_STEPS:
                times.append(float(elapsed))
            if rank == 0:
                beat(heartbeat)
        results.append(statistics.median(times))
        del trainer, model
    if rank == 0:
        atomic_write_text(out_file, json.dumps(results))  # the parent reads it whole or not
    dist.destroy_process_group()


def measure_runtime(
    profile: ModelProfile, cluster: Cluster, *, stall_s: float = DEFAULT_STALL_S
) -> tuple[RuntimeMeasurement, ...]:
    """Step times of the reference plans, on ``cluster.num_devices`` local processes
    (`CalibrationError` if a job fails or finishes no step for ``stall_s`` seconds)."""
    start_processes: Any = importlib.import_module("torch.multiprocessing.spawn").start_processes
    plans = reference_plans(profile, cluster)
    world = cluster.num_devices
    with tempfile.TemporaryDirectory(prefix="autoplan-calibrate-runtime-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        out_file = os.path.join(tmp, "result.json")
        heartbeat = os.path.join(tmp, "heartbeat")
        context = start_processes(
            _runtime_worker,
            args=(world, init_file, out_file, [data for _, data, _ in plans], heartbeat),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        join_workers(
            context,
            heartbeat,
            stall_s=stall_s,
            what=f"measuring training steps over {world} processes",
            hint=(
                "the machine may be overloaded or a worker hung: retry, allow longer silences "
                "with --stall-timeout, or skip this part with --no-training"
            ),
        )
        step_s = json.loads(Path(out_file).read_text())
    return tuple(
        RuntimeMeasurement(name=name, plan=data, step_s=t, fitted=fitted)
        for (name, data, fitted), t in zip(plans, step_s, strict=True)
    )


def predicted_step_s(
    profile: ModelProfile, cluster: Cluster, calibration: Calibration, plan: dict[str, Any]
) -> float:
    """The cost model's step time for ``plan`` with ``calibration`` in place of the cluster's."""
    probe = dataclasses.replace(cluster, calibration=calibration)
    return estimate(profile, probe, Plan.from_data(plan)).step_time_s


def _least_squares(
    profile: ModelProfile,
    cluster: Cluster,
    calibration: Calibration,
    names: Sequence[str],
    runs: Sequence[RuntimeMeasurement],
) -> Calibration:
    """``calibration`` with ``names`` fitted (>= 0) to the runs' step times."""
    # The model is piecewise linear in each constant. On a GPU the wrappers' time is a floor
    # under each unit's (`cost_model.parts.host`): below the device's time it has no slope,
    # so the search starts above it (1 ms, far above these small units' device time) and
    # walks down; a small finite-difference step straddles the floors' kinks less often.
    calibration = dataclasses.replace(
        calibration, **{name: getattr(calibration, name) or 1e-3 for name in names}
    )
    step = 1e-5  # s
    for _ in range(12):
        base = np.array([predicted_step_s(profile, cluster, calibration, r.plan) for r in runs])
        jacobian = np.empty((len(runs), len(names)))
        for j, name in enumerate(names):
            moved = dataclasses.replace(calibration, **{name: getattr(calibration, name) + step})
            for i, run in enumerate(runs):
                moved_s = predicted_step_s(profile, cluster, moved, run.plan)
                jacobian[i, j] = (moved_s - base[i]) / step
        current = np.array([getattr(calibration, name) for name in names])
        # Linearised: measured ~ base + J (x - current); solve for x >= 0.
        target = np.array([r.step_s for r in runs]) - base + jacobian @ current
        solution = _nonnegative_least_squares(jacobian, target)
        calibration = dataclasses.replace(
            calibration, **{name: float(v) for name, v in zip(names, solution, strict=True)}
        )
        if float(np.max(np.abs(solution - current))) < 1e-9:
            break
    return calibration


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin |a x - b|`` over ``x >= 0``, exactly, by trying every set of free variables
    (a handful of unknowns here: at most 2^3 small solves)."""
    n = a.shape[1]
    best, best_cost = np.zeros(n), float(np.sum(b**2))
    for free in itertools.chain.from_iterable(
        itertools.combinations(range(n), k) for k in range(1, n + 1)
    ):
        cols = list(free)
        x_free, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if np.any(x_free < 0):
            continue
        x = np.zeros(n)
        x[cols] = x_free
        cost = float(np.sum((a @ x - b) ** 2))
        if cost < best_cost - 1e-30:
            best, best_cost = x, cost
    return best


def fit_host_overheads(
    profile: ModelProfile, cluster: Cluster, runs: Sequence[RuntimeMeasurement]
) -> Calibration:
    """``cluster.calibration`` with the host constants fitted to ``runs``.

    First the per-op dispatch cost (``kernel_overhead_s``) from the DDP run, which has no
    wrapper of autoplan's own: in a training step each op also records autograd and runs
    through the backward engine, which a bare tiny kernel does not. Then the data-parallel
    constants (their runs have no TP), then the TP constant given them (a TP plan's
    optimizer also steps distributed tensors), then the pipeline's.
    """
    wrappers = [name for name in HOST_CONSTANTS if name != "kernel_overhead_s"]
    calibration = dataclasses.replace(cluster.calibration, **dict.fromkeys(wrappers, 0.0))
    for names in (
        ("kernel_overhead_s",),
        ("dp_unit_overhead_s", "sharded_optimizer_unit_overhead_s"),
        ("tp_module_overhead_s",),
        ("pp_message_overhead_s",),
    ):
        subset = [r for r in runs if set(r.fitted) & set(names)]
        if subset:
            calibration = _least_squares(profile, cluster, calibration, names, subset)
    return calibration
