"""Measure this machine and write a calibrated cluster file that `Cluster.local()` loads.

Measures (each a few tenths of a second): matmul FLOP/s over square shapes per dtype, memory
bandwidth (a large copy), the cost of a tiny kernel, and, over 2-4 local processes (gloo on
CPU, NCCL on CUDA; file:// rendezvous in a temporary directory), all-reduce, all-gather and
send/recv time for small and large messages. From them it fits the cluster's constants:

- ``peak_flops[dtype]``: the best matmul rate seen (so ``gemm_efficiency`` is 1.0 on CPU; on a
  GPU the datasheet peak is kept and the efficiency is measured against it);
- ``gemm_half_efficiency_flops``: the median over the smaller shapes of ``W (1/e - 1)``, which
  inverts ``e(W) = W / (W + W_half)`` (`cost_model.compute.saturating_efficiency`);
- memory bandwidth and ``kernel_overhead_s`` directly;
- intra-node link latency and bandwidth from the ring all-reduce model
  ``t(N) = 2 (G-1) alpha + 2 (G-1)/G N / B`` at a small and a large N
  (`cost_model.communication.all_reduce_time_s`).

- host overheads of the training stack (DTensor, FSDP2 wrappers) from a few real training jobs
  (`autoplan.calibration.host_overheads`).

Compute rates are measured in every worker process at once, as a training job loads the
machine. On CPU, ``dp_overlap_fraction`` is 0: gloo moves the bytes with the worker's only core.

Guarantees: the written YAML loads with `Cluster.from_yaml`; values are positive; the whole run
takes well under a minute on a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
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

from autoplan.calibration._workers import DEFAULT_STALL_S, beat, join_workers
from autoplan.calibration.host_overheads import (
    RuntimeMeasurement,
    calibration_profile,
    fit_host_overheads,
    measure_runtime,
)
from cost_model import local_machine
from cost_model.communication import ring_half_collective_time_s
from cost_model.files import atomic_write_text
from cost_model.hardware import Cluster, LinkSpec
from cost_model.local_machine import calibrated_path
from cost_model.local_rates import AlphaBeta, fit_half_efficiency_flops
from cost_model.local_rates import fit_alpha_beta as _fit_alpha_beta
from cost_model.local_rates import timeit as _timeit
from cost_model.schema import check_writable
from cost_model.strategy import GroupPlacement

logger = logging.getLogger(__name__)

__all__ = [
    "CommMeasurement",
    "Measurements",
    "calibrate",
    "fit_alpha_beta",
    "fit_half_efficiency_flops",
    "measure_comm",
]

Progress = Callable[[str, float], None]  # (what is being measured, fraction done)


@dataclass(frozen=True, kw_only=True, slots=True)
class MatmulMeasurement:
    dtype: str
    size: int  # square n x n x n
    flops_per_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class CommMeasurement:
    """Mean time of one collective of ``size_bytes`` (per rank) over ``world_size`` ranks."""

    op: str  # all_reduce | all_gather | reduce_scatter | send_recv
    world_size: int
    size_bytes: int
    time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurements:
    matmul: tuple[MatmulMeasurement, ...]
    memory_bandwidth_bytes_per_s: float
    kernel_overhead_s: float
    comm: tuple[CommMeasurement, ...]
    backend: str
    # Step times of real training jobs (`autoplan.calibration.host_overheads`); empty when skipped.
    runtime: tuple[RuntimeMeasurement, ...] = ()


def fit_alpha_beta(world_size: int, small: CommMeasurement, large: CommMeasurement) -> AlphaBeta:
    """Latency and bandwidth of the ring all-reduce model from a small and a large message
    (`cost_model.local_rates.fit_alpha_beta`, from the measurements' sizes and times)."""
    return _fit_alpha_beta(
        world_size, (small.size_bytes, small.time_s), (large.size_bytes, large.time_s)
    )


def measure_compute(
    *,
    quick: bool = False,
    progress: Progress | None = None,
    barrier: Callable[[], None] = lambda: None,
) -> tuple[tuple[MatmulMeasurement, ...], float, float]:
    """Matmul rates per dtype and size, memory bandwidth and tiny-kernel overhead.

    ``barrier`` runs before each measurement: with several workers measuring at once it keeps
    them on the same shape, so none runs alone (and faster) while the others still work.
    """
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    budget = 0.05 if quick else 0.25
    # Small shapes pin down the fixed cost per call (W_half / peak), large ones the peak.
    sizes = (64, 128, 512, 1024) if quick else (32, 64, 128, 256, 512, 1024, 2048)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    results: list[MatmulMeasurement] = []
    total = len(sizes) * len(dtypes) + 2
    done = 0
    for name, dtype in dtypes.items():
        for n in sizes:
            if progress:
                progress(f"matmul {name} {n}^3", done / total)
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            barrier()
            seconds = _timeit(functools.partial(torch.matmul, a, b), budget, sync)
            results.append(MatmulMeasurement(dtype=name, size=n, flops_per_s=2.0 * n**3 / seconds))
            done += 1
    if progress:
        progress("memory bandwidth", done / total)
    numel = (16 if quick else 64) * 2**20 // 4
    src = torch.empty(numel, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    barrier()
    copy_s = _timeit(lambda: dst.copy_(src), budget, sync)
    bandwidth = 2.0 * numel * 4 / copy_s  # read + write
    done += 1
    if progress:
        progress("kernel overhead", done / total)
    tiny = torch.ones(1, device=device)
    overhead = _timeit(lambda: tiny.add_(1.0), budget / 2, sync)
    return tuple(results), bandwidth, overhead


def _comm_worker(
    rank: int,
    world_size: int,
    init_file: str,
    out_file: str,
    sizes: Sequence[int],
    repeats: int,
    quick: bool,
    heartbeat: str,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    # torch 2.13 renamed reduce_scatter_tensor (still there, deprecated); older torch lacks the new
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    # Warm-up: the first collectives of a new group open connections and allocate buffers.
    warm = torch.ones(1024, device=device)
    for _ in range(5):
        dist.all_reduce(warm)
        dist.all_gather([torch.empty_like(warm) for _ in range(world_size)], warm)
    sync()
    records = []
    for size in sizes:
        numel = max(size // 4, 1)
        x = torch.ones(numel, device=device)
        out = [torch.empty_like(x) for _ in range(world_size)]
        full = torch.ones(numel * world_size, device=device)

        def all_reduce(x: torch.Tensor = x) -> None:
            dist.all_reduce(x)

        def all_gather(x: torch.Tensor = x, out: list[torch.Tensor] = out) -> None:
            dist.all_gather(out, x)

        def reduce_scatter(x: torch.Tensor = x, full: torch.Tensor = full) -> None:
            scatter(x, full)

        def send_recv(x: torch.Tensor = x) -> None:
            if rank == 0:
                dist.send(x, 1)
            elif rank == 1:
                dist.recv(x, 0)

        for name, fn in (
            ("all_reduce", all_reduce),
            ("all_gather", all_gather),
            ("reduce_scatter", reduce_scatter),
            ("send_recv", send_recv),
        ):
            fn()
            sync()
            # Each call starts together on every rank (a barrier before it) and is timed alone.
            # The mean, not the median: on CPU workers small collectives are bimodal (~0.3 ms,
            # or ~4 ms when a waiting rank sleeps through a scheduler tick), a training step
            # pays the mix, and a median flips between the modes from run to run. Small
            # messages get more calls, since their mean converges slowest.
            calls = repeats * 4 if numel * 4 <= 2**18 else repeats
            times = []
            for _ in range(calls):
                dist.barrier()
                start = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - start)
            elapsed = statistics.fmean(times)
            records.append(
                {"op": name, "world_size": world_size, "size_bytes": numel * 4, "time_s": elapsed}
            )
            dist.barrier()
            if rank == 0:
                beat(heartbeat)
    # Compute rates with every worker busy at once, as in a training job: workers share
    # caches, memory bandwidth and (on a VM) physical cores, so one worker alone runs faster.
    dist.barrier()

    def step() -> None:
        dist.barrier()
        if rank == 0:
            beat(heartbeat)

    matmul, bandwidth, overhead = measure_compute(quick=quick, barrier=step)
    dist.barrier()
    if rank == 0:
        compute = {
            "matmul": [dataclasses.asdict(m) for m in matmul],
            "memory_bandwidth_bytes_per_s": bandwidth,
            "kernel_overhead_s": overhead,
        }
        # the parent reads it whole or not at all
        atomic_write_text(
            out_file, json.dumps({"backend": backend, "records": records, "compute": compute})
        )
    dist.destroy_process_group()


def measure_comm(
    world_size: int = 2, *, quick: bool = False, stall_s: float = DEFAULT_STALL_S
) -> tuple[tuple[CommMeasurement, ...], str, dict[str, Any]]:
    """Collective timings over ``world_size`` local processes (spawned; file:// rendezvous),
    the backend's name, and rank 0's `measure_compute` results taken while every rank ran it.
    Waits as long as the workers make progress; `CalibrationError` if none for ``stall_s``."""
    # torch.multiprocessing re-exports a *function* named spawn over the submodule.
    start_processes: Any = importlib.import_module("torch.multiprocessing.spawn").start_processes

    sizes = (4096, 4 * 2**20) if quick else (4096, 256 * 2**10, 4 * 2**20, 16 * 2**20)
    repeats = 7 if quick else 21
    with tempfile.TemporaryDirectory(prefix="autoplan-calibrate-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        out_file = os.path.join(tmp, "result.json")
        heartbeat = os.path.join(tmp, "heartbeat")
        context = start_processes(
            _comm_worker,
            args=(world_size, init_file, out_file, sizes, repeats, quick, heartbeat),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        join_workers(
            context,
            heartbeat,
            stall_s=stall_s,
            what=f"measuring collectives and compute over {world_size} processes",
            hint=STALL_HINT,
        )
        data = json.loads(Path(out_file).read_text())
    records = tuple(CommMeasurement(**r) for r in data["records"])
    return records, str(data["backend"]), data["compute"]


def measure(
    *,
    world_size: int = 2,
    quick: bool = False,
    progress: Progress | None = None,
    stall_s: float = DEFAULT_STALL_S,
) -> Measurements:
    """Run every measurement (collectives first, in fresh processes)."""
    if progress:
        progress(f"collectives over {world_size} processes", 0.0)
    comm, backend, compute = measure_comm(world_size, quick=quick, stall_s=stall_s)
    return Measurements(
        matmul=tuple(MatmulMeasurement(**m) for m in compute["matmul"]),
        memory_bandwidth_bytes_per_s=float(compute["memory_bandwidth_bytes_per_s"]),
        kernel_overhead_s=float(compute["kernel_overhead_s"]),
        comm=comm,
        backend=backend,
    )


# ------------------------------------------------------------------------------- fitting


_CALIBRATED_STAMP = "; calibrated "


def calibrated_cluster(base: Cluster, measured: Measurements) -> Cluster:
    """``base`` with the measured rates and the fitted calibration constants."""
    is_gpu = base.device.kind == "gpu"
    peak_flops = dict(base.device.peak_flops)
    points: list[tuple[float, float]] = []
    gemm_efficiency = 1.0
    # One W_half serves every dtype: take it from the dtype jobs train in on this device
    # (CPU workers: fp32, as `parallelize` plans them; GPUs: bf16). On CPU the bf16 curve
    # (AMX tiles) is far steeper and would make fp32 GEMMs look slow.
    train_dtype = "bf16" if is_gpu else "fp32"
    if not any(m.dtype == train_dtype for m in measured.matmul):
        train_dtype = measured.matmul[0].dtype if measured.matmul else train_dtype
    for dtype in sorted({m.dtype for m in measured.matmul}):
        rows = [m for m in measured.matmul if m.dtype == dtype]
        best = max(m.flops_per_s for m in rows)
        if not is_gpu:
            peak_flops[dtype] = best  # no datasheet for a CPU core: the best rate is the peak
        elif dtype == "bf16" and "bf16" in peak_flops:
            gemm_efficiency = min(1.0, best / peak_flops["bf16"])
        if dtype == train_dtype:
            points.extend((2.0 * m.size**3, m.flops_per_s / best) for m in rows)
    device = dataclasses.replace(
        base.device,
        peak_flops=peak_flops,
        memory_bandwidth_bytes_per_s=(
            base.device.memory_bandwidth_bytes_per_s
            if is_gpu
            else measured.memory_bandwidth_bytes_per_s
        ),
    )
    memory_efficiency = (
        min(1.0, measured.memory_bandwidth_bytes_per_s / base.device.memory_bandwidth_bytes_per_s)
        if is_gpu
        else 1.0
    )
    intra = base.intra_node
    all_reduce = sorted(
        (c for c in measured.comm if c.op == "all_reduce"), key=lambda c: c.size_bytes
    )
    if len(all_reduce) >= 2:
        fit = fit_alpha_beta(all_reduce[0].world_size, all_reduce[0], all_reduce[-1])
        intra = LinkSpec(bandwidth_bytes_per_s=fit.bandwidth_bytes_per_s, latency_s=fit.latency_s)
    probe = dataclasses.replace(
        base,
        intra_node=intra,
        calibration=dataclasses.replace(base.calibration, intra_node_comm_efficiency=1.0),
    )
    calibration = dataclasses.replace(
        base.calibration,
        all_gather_efficiency=_half_collective_efficiency(measured, probe, "all_gather"),
        reduce_scatter_efficiency=_half_collective_efficiency(measured, probe, "reduce_scatter"),
        gemm_efficiency=gemm_efficiency,
        gemm_half_efficiency_flops=fit_half_efficiency_flops(points),
        memory_efficiency=memory_efficiency,
        intra_node_comm_efficiency=1.0,
        kernel_overhead_s=measured.kernel_overhead_s,
        # gloo on single-threaded CPU workers moves bytes with the core that computes: nothing
        # overlaps. GPUs keep the preset's value (NCCL kernels on their own streams).
        dp_overlap_fraction=base.calibration.dp_overlap_fraction if is_gpu else 0.0,
    )
    # Re-calibrating starts from the last calibrated file: replace its stamp, do not append.
    origin = base.description.split(_CALIBRATED_STAMP)[0]
    description = (
        f"{origin}{_CALIBRATED_STAMP}{time.strftime('%Y-%m-%d %H:%M')} "
        f"({measured.backend}, {len(measured.matmul)} matmul shapes)"
    )
    return dataclasses.replace(
        base,
        name="local",
        device=device,
        intra_node=intra,
        calibration=calibration,
        description=description,
    )


def _half_collective_efficiency(measured: Measurements, probe: Cluster, op: str) -> float:
    """How much of the ring model's bandwidth ``op`` reached at the largest measured size,
    given the link fitted from the all-reduce (1.0 when it is as fast or no data)."""
    rows = [c for c in measured.comm if c.op == op]
    if not rows:
        return 1.0
    largest = max(rows, key=lambda c: c.size_bytes)
    g = largest.world_size
    # all_gather: each rank sends its size_bytes and receives the g-fold result;
    # reduce_scatter: the input buffer is g x size_bytes. Either way the full buffer is g x.
    full = largest.size_bytes * g
    placement = GroupPlacement(size=g, num_nodes=1, ranks_per_node=g)
    ideal = ring_half_collective_time_s(full, placement, probe, 1.0)
    latency = (g - 1) * probe.intra_node.latency_s
    if largest.time_s <= latency:
        return 1.0
    return max(0.01, min(1.0, (ideal - latency) / (largest.time_s - latency)))


def one_worker_rates(cluster: Cluster, workers_per_core: float) -> Cluster:
    """The compute rates of one CPU worker alone on its core, from rates measured while
    ``workers_per_core`` workers shared each core (all of them busy, as `measure` runs them).

    The file stores what one worker gets on its own; `Cluster.local` records the sharing and
    the estimate stretches concurrent work by it (processor sharing), so rates measured under
    sharing would count it twice. Compute and memory bandwidth scale up by the sharing. The
    links stay as measured: gloo's per-rank rate over 4 workers on 2 cores came out within 5%
    of 2 workers' (it is not bound by the core share), and its latency is bimodal either way.
    """
    if workers_per_core <= 1.0:
        return cluster
    device = dataclasses.replace(
        cluster.device,
        peak_flops={k: v * workers_per_core for k, v in cluster.device.peak_flops.items()},
        memory_bandwidth_bytes_per_s=cluster.device.memory_bandwidth_bytes_per_s * workers_per_core,
    )
    return dataclasses.replace(cluster, device=device)


STALL_HINT = (
    "the machine may be overloaded or a worker hung: retry with --quick or fewer --processes, "
    "or allow longer silences with --stall-timeout"
)


def calibrate(
    output: str | Path | None = None,
    *,
    world_size: int | None = None,
    quick: bool = False,
    training: bool = True,
    progress: Progress | None = None,
    stall_s: float = DEFAULT_STALL_S,
) -> tuple[Cluster, Path, Measurements]:
    """Measure this machine, write the calibrated cluster YAML and return it with its path.

    ``output`` defaults to `cost_model.local_machine.calibrated_path()`, which `Cluster.local()`
    reads. ``world_size`` (2-4) defaults to the number of cores, at least 2 and at most 4.
    With ``training``, the host overheads of the training stack are then fitted to real
    training steps through `autoplan.parallelize` (`autoplan.calibration.host_overheads`, ~8 s). The
    measurements take as long as the machine needs; a job that reports no progress for
    ``stall_s`` seconds is stopped with a `CalibrationError`.
    """
    if world_size is None:
        world_size = min(4, max(2, len(os.sched_getaffinity(0))))
    base = local_machine.detect()
    path = Path(output) if output is not None else calibrated_path()
    check_writable(path, "output (-o)", create_folder=True)
    measured = measure(world_size=world_size, quick=quick, progress=progress, stall_s=stall_s)
    cluster = calibrated_cluster(base, measured)
    cores = len(os.sched_getaffinity(0))
    shared = base.device.kind == "cpu" and world_size > cores
    if shared:
        cluster = one_worker_rates(cluster, world_size / cores)
    if training:
        if progress:
            progress(f"training steps over {world_size} processes", 0.9)
        job = dataclasses.replace(
            cluster, devices_per_node=world_size, shared_cores_per_node=cores if shared else None
        )
        profile = calibration_profile()
        runs = measure_runtime(profile, job, stall_s=stall_s)
        cluster = dataclasses.replace(cluster, calibration=fit_host_overheads(profile, job, runs))
        measured = dataclasses.replace(measured, runtime=runs)
    # Store the one-node template; Cluster.local() sets the device count and memory again.
    # atomic: a failed write (OutputFileError, one line) leaves the old calibration whole
    cluster.to_yaml(path)
    logger.info("wrote calibrated cluster to %s", path)
    return cluster, path, measured
