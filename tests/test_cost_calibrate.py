"""`autoplan calibrate`: the fits (hand-worked), the cluster file it writes, and a short real run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from autoplan.calibration.machine import (
    CommMeasurement,
    MatmulMeasurement,
    Measurements,
    calibrated_cluster,
    fit_alpha_beta,
    fit_half_efficiency_flops,
)
from cost_model.hardware import Cluster
from tests.conftest import run_cli


def test_fit_alpha_beta_recovers_the_ring_model() -> None:
    # 2 ranks, alpha = 100 us, B = 1 GB/s: t(N) = 2 (G-1) alpha + 2 (G-1)/G N / B
    # = 2e-4 + N / 1e9. At 4096 B: 2.04096e-4 s; at 4 MiB: 2e-4 + 4.194304e-3 s.
    small = CommMeasurement(op="all_reduce", world_size=2, size_bytes=4096, time_s=2.04096e-4)
    large = CommMeasurement(
        op="all_reduce", world_size=2, size_bytes=4 * 2**20, time_s=2e-4 + 4.194304e-3
    )
    fit = fit_alpha_beta(2, small, large)
    assert fit.latency_s == pytest.approx(1e-4, rel=1e-9)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-9)


def test_fit_half_efficiency_inverts_the_saturation_curve() -> None:
    # e(W) = W / (W + 1e9): W = 1e9 -> 0.5, W = 3e9 -> 0.75, W = 1e11 -> 0.990...
    points = [(w, w / (w + 1e9)) for w in (1e9, 3e9, 1e11)]
    assert fit_half_efficiency_flops(points) == pytest.approx(1e9, rel=1e-9)
    assert fit_half_efficiency_flops([(1e12, 1.0)]) == 0.0


def _measurements() -> Measurements:
    return Measurements(
        matmul=(
            MatmulMeasurement(dtype="fp32", size=256, flops_per_s=20e9),
            MatmulMeasurement(dtype="fp32", size=1024, flops_per_s=80e9),
            MatmulMeasurement(dtype="bf16", size=1024, flops_per_s=200e9),
        ),
        memory_bandwidth_bytes_per_s=12e9,
        kernel_overhead_s=7e-6,
        comm=(
            CommMeasurement(op="all_reduce", world_size=2, size_bytes=4096, time_s=2.04096e-4),
            CommMeasurement(
                op="all_reduce", world_size=2, size_bytes=4 * 2**20, time_s=2e-4 + 4.194304e-3
            ),
            # Against the fitted link (1e-4 s, 1e9 B/s), the ring all-gather of the 8 MiB result
            # takes 1e-4 + 1/2 * 8 MiB / 1e9 = 1e-4 + 4.194304e-3 s: measured at twice the
            # bandwidth time it is 50% efficient; the reduce-scatter at four times, 25%.
            CommMeasurement(
                op="all_gather", world_size=2, size_bytes=4 * 2**20, time_s=1e-4 + 2 * 4.194304e-3
            ),
            CommMeasurement(
                op="reduce_scatter",
                world_size=2,
                size_bytes=4 * 2**20,
                time_s=1e-4 + 4 * 4.194304e-3,
            ),
        ),
        backend="gloo",
    )


def test_calibrated_cluster_round_trips_and_cluster_local_loads_it(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = Cluster.preset_file("local")
    cluster = calibrated_cluster(base, _measurements())
    # CPU: the best measured rate is the peak; 256^3 ran at 1/4 of it: W = 2 * 256^3 = 3.36e7
    # FLOPs, e = 0.25 -> W_half = W (1/e - 1) = 3 * 3.36e7 (1024^3 at e = 1 carries no info).
    assert cluster.device.peak_flops["fp32"] == 80e9
    assert cluster.device.peak_flops["bf16"] == 200e9
    assert cluster.calibration.gemm_half_efficiency_flops == pytest.approx(3 * 2 * 256**3)
    assert cluster.device.memory_bandwidth_bytes_per_s == 12e9
    assert cluster.calibration.kernel_overhead_s == 7e-6
    assert cluster.intra_node.latency_s == pytest.approx(1e-4)
    # Calibrating again replaces the stamp in the description instead of appending another.
    again = calibrated_cluster(cluster, _measurements())
    assert again.description.count("calibrated ") == 1
    assert again.description.startswith(base.description)
    assert cluster.intra_node.bandwidth_bytes_per_s == pytest.approx(1e9)
    assert cluster.calibration.all_gather_efficiency == pytest.approx(0.5)
    assert cluster.calibration.reduce_scatter_efficiency == pytest.approx(0.25)
    path = tmp_path / "local.yaml"  # type: ignore[operator]
    cluster.to_yaml(path)
    assert Cluster.from_yaml(path) == cluster
    monkeypatch.setenv("AUTOPLAN_LOCAL_CLUSTER", str(path))
    local = Cluster.local(num_devices=3)
    assert local.devices_per_node == 3
    # Rates stay one worker's on its own core; workers beyond the cores record the sharing.
    cores = len(os.sched_getaffinity(0))
    assert local.shared_cores_per_node == (cores if cores < 3 else None)
    assert local.device.peak_flops == cluster.device.peak_flops
    assert local.calibration.kernel_overhead_s == pytest.approx(7e-6)
    assert local.intra_node == cluster.intra_node
    assert local.calibration.gemm_half_efficiency_flops == (
        cluster.calibration.gemm_half_efficiency_flops
    )


@pytest.mark.slow
def test_calibrate_measures_this_machine(tmp_path: pytest.TempPathFactory) -> None:
    """A short real run through the CLI: 2 spawned gloo processes, a few matmul shapes, four
    short training jobs (~15 s here)."""
    path = tmp_path / "cli.yaml"  # type: ignore[operator]
    done = run_cli("calibrate", "--quick", "--processes", "2", "-o", str(path), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["path"] == str(path)
    measured = data["measurements"]
    assert measured["backend"] == "gloo"
    assert {c["op"] for c in measured["comm"]} == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "send_recv",
    }
    assert all(c["time_s"] > 0 for c in measured["comm"])
    assert all(m["flops_per_s"] > 0 for m in measured["matmul"])
    # Four real training jobs through autoplan.parallelize; the fitted host constants are >= 0
    # and written to the file.
    steps = measured["training_steps"]
    assert [s["name"] for s in steps] == [
        "ddp",
        "zero3, 1 micro-batch",
        "zero3, 2 micro-batches",
        "tp2",
        "pp2",
    ]
    assert all(s["step_s"] > 0 for s in steps)
    loaded = Cluster.from_yaml(path)
    assert loaded.name == "local"
    assert loaded.intra_node.bandwidth_bytes_per_s > 0
    assert loaded.calibration.dp_overlap_fraction == 0.0  # CPU: gloo shares the worker's core
    for name in (
        "kernel_overhead_s",
        "tp_module_overhead_s",
        "dp_unit_overhead_s",
        "sharded_optimizer_unit_overhead_s",
        "pp_message_overhead_s",
    ):
        assert getattr(loaded.calibration, name) == data["calibration"][name] >= 0.0


def test_fit_host_overheads_recovers_the_constants_behind_step_times() -> None:
    """Step times the cost model itself predicts with known host constants: the fit must give
    those constants back (it inverts `estimate` on the reference plans)."""
    import dataclasses

    from autoplan.calibration.host_overheads import (
        HOST_CONSTANTS,
        RuntimeMeasurement,
        calibration_profile,
        fit_host_overheads,
        predicted_step_s,
        reference_plans,
    )
    from tests.cost_profiles import round_cluster

    profile = calibration_profile()
    cluster = round_cluster(devices_per_node=2)
    truth = dataclasses.replace(
        cluster.calibration,
        kernel_overhead_s=2e-5,
        tp_module_overhead_s=3e-4,
        dp_unit_overhead_s=2e-4,
        sharded_optimizer_unit_overhead_s=5e-3,
        pp_message_overhead_s=4e-4,
    )
    plans = reference_plans(profile, cluster)
    assert {name for name, _, _ in plans} >= {"ddp", "tp2", "pp2"}
    runs = [
        RuntimeMeasurement(
            name=name,
            plan=data,
            step_s=predicted_step_s(profile, cluster, truth, data),
            fitted=fitted,
        )
        for name, data, fitted in plans
    ]
    fitted = fit_host_overheads(profile, cluster, runs)
    for name in HOST_CONSTANTS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-4), name
    # Faster than the model can explain without host costs: constants clip at 0, never negative.
    fast = [dataclasses.replace(r, step_s=r.step_s * 1e-3) for r in runs]
    clipped = fit_host_overheads(profile, cluster, fast)
    assert clipped.kernel_overhead_s == 0.0
    assert clipped.tp_module_overhead_s == 0.0
    assert clipped.dp_unit_overhead_s == 0.0
    assert clipped.sharded_optimizer_unit_overhead_s == 0.0
    assert clipped.pp_message_overhead_s == 0.0


def test_rates_measured_by_workers_sharing_cores_become_one_workers() -> None:
    from autoplan.calibration.machine import one_worker_rates

    cluster = Cluster.preset_file("local")
    assert one_worker_rates(cluster, 1.0) == cluster
    # 4 workers measured on 2 cores: each had half a core.
    alone = one_worker_rates(cluster, 2.0)
    assert alone.device.peak_flops == {k: 2 * v for k, v in cluster.device.peak_flops.items()}
    assert alone.device.memory_bandwidth_bytes_per_s == (
        2 * cluster.device.memory_bandwidth_bytes_per_s
    )
    assert alone.intra_node == cluster.intra_node
    assert alone.calibration == cluster.calibration


def _silent_worker(rank: int, seconds: float) -> None:
    import time

    time.sleep(seconds)


def _failing_worker(rank: int) -> None:
    raise ValueError(f"rank {rank} cannot measure")


def test_a_silent_measurement_job_is_stopped_with_one_line(
    tmp_path: Path,
) -> None:
    """Workers that report no progress for the stall timeout are killed and the error is one
    line with a hint. (A loaded machine can only make the verdict come later, not sooner.)"""
    import importlib

    from autoplan.calibration._workers import join_workers
    from autoplan.contract.errors import CalibrationError

    start: Any = importlib.import_module("torch.multiprocessing.spawn").start_processes
    context = start(_silent_worker, args=(600.0,), nprocs=2, join=False, start_method="spawn")
    with pytest.raises(CalibrationError) as raised:
        join_workers(
            context,
            tmp_path / "beat",
            stall_s=1.0,
            what="measuring x",
            hint="retry",
        )
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("measuring x made no progress for ") and message.endswith("; retry")
    for process in context.processes:
        process.join(timeout=30)
        assert not process.is_alive()

    context = start(_failing_worker, nprocs=2, join=False, start_method="spawn")
    with pytest.raises(CalibrationError) as raised:
        join_workers(context, tmp_path / "beat2", stall_s=600.0, what="measuring y", hint="retry")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("measuring y failed: ") and "cannot measure" in message
