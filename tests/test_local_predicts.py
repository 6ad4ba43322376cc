"""This machine predicts itself: the `local` preset's first-use measurement (cached per
machine, measured once however many processes start together) and the predicted-vs-measured
line at the end of a run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.runtime.step_timing import CALIBRATE_HINT, StepTiming
from cost_model import local_rates, this_machine
from cost_model.hardware import Cluster

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No calibrated file, no pinned cluster file: `Cluster.local` measures on first use."""
    monkeypatch.delenv("AUTOPLAN_LOCAL_CLUSTER", raising=False)
    monkeypatch.delenv(this_machine.MEASURE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "autoplan"


def _count_measurements(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Calls of the real `local_rates.measure` (each one's duration), through a spy."""
    calls: list[float] = []
    real = local_rates.measure

    def spy(budget_s: float = 0.1) -> local_rates.QuickRates:
        rates = real(budget_s)
        calls.append(rates.seconds)
        return rates

    monkeypatch.setattr(local_rates, "measure", spy)
    return calls


def test_first_use_measures_caches_and_reuses(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = _count_measurements(monkeypatch)
    preset = Cluster.preset_file("local")
    first = Cluster.local(num_devices=2)
    assert len(calls) == 1
    [cached] = fresh_cache.glob("local-measured-*.yaml")
    assert any(
        str(cached) in r.getMessage() and "measured" in r.getMessage() for r in caplog.records
    )
    # measured rates, not the preset's assumptions
    assert first.device.peak_flops["fp32"] != preset.device.peak_flops["fp32"]
    assert first.calibration.kernel_overhead_s != preset.calibration.kernel_overhead_s
    assert "rates measured on first use" in first.description
    assert first.device.peak_flops["fp32"] > 0 and first.intra_node.latency_s > 0
    # the runtime's host costs: the shipped fit, scaled by this machine's measured op cost
    fit = local_rates.RUNTIME_HOST_FIT
    scale = first.calibration.kernel_overhead_s / fit.runtime_op_s
    assert first.calibration.tp_module_overhead_s == pytest.approx(fit.tp_module_s * scale)
    assert first.calibration.all_gather_efficiency == fit.all_gather_efficiency
    again = Cluster.local(num_devices=4)
    assert len(calls) == 1  # read from the cache
    assert again.device.peak_flops == first.device.peak_flops
    assert again.calibration == first.calibration and again.intra_node == first.intra_node


def test_another_machine_measures_its_own(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_measurements(monkeypatch)
    here = this_machine.cluster_file(2, 8 * 2**30)
    other = this_machine.cluster_file(2, 16 * 2**30)  # same host, other facts (RAM)
    assert here != other and here.exists() and other.exists()
    assert len(calls) == 2
    assert this_machine.cluster_file(2, 8 * 2**30) == here
    assert len(calls) == 2


def test_calibrated_file_pinned_file_or_opt_out_skip_the_measurement(
    fresh_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_measurements(monkeypatch)
    monkeypatch.setenv(this_machine.MEASURE_ENV, "0")
    assert this_machine.cluster_file(2, 2**30) == this_machine.calibrated_path()
    monkeypatch.delenv(this_machine.MEASURE_ENV)
    pinned = tmp_path / "mine.yaml"
    monkeypatch.setenv("AUTOPLAN_LOCAL_CLUSTER", str(pinned))
    assert this_machine.cluster_file(2, 2**30) == pinned
    monkeypatch.delenv("AUTOPLAN_LOCAL_CLUSTER")
    calibrated = this_machine.calibrated_path()
    calibrated.parent.mkdir(parents=True)
    Cluster.preset_file("local").to_yaml(calibrated)  # as `autoplan calibrate` leaves it
    assert this_machine.cluster_file(2, 2**30) == calibrated
    assert calls == []


def test_measured_cluster_inverts_the_cost_model_at_the_measured_shapes() -> None:
    # 64^3 at 60% of the peak: W_half = W (1/e - 1) = 2 * 64^3 * 2/3
    rates = local_rates.QuickRates(
        matmul_fp32=((64, 60e9), (128, 90e9), (256, 100e9), (512, 100e9)),
        bf16_flops_per_s=200e9,
        memory_bandwidth_bytes_per_s=30e9,
        op_overhead_s=3e-6,
        optimizer_tensor_s=15e-6,
        # forward: 1e6 FLOPs in 40 us + 3 us of op overhead: 2.5e10 FLOP/s, 25% of the peak
        attention_forward=(1e6, 43e-6),
        attention_backward=(2e6, 53e-6),
        all_reduce=((4096, 2 * 1e-4 + 4096 / 1e9), (4 * 2**20, 2 * 1e-4 + 4 * 2**20 / 1e9)),
        seconds=2.0,
    )
    cluster = local_rates.measured_cluster(Cluster.preset_file("local"), rates)
    assert cluster.device.peak_flops["fp32"] == 100e9
    half = 2 * 64**3 * (1 / 0.6 - 1)
    # (128^3 at 0.9 is above the fit's first ceiling of 75%: 64^3 alone decides)
    assert cluster.calibration.gemm_half_efficiency_flops == pytest.approx(half)
    # the cost model's attention rate is peak x e x W / (W + W_half): 25% of the peak at W
    w_half = cluster.calibration.gemm_half_efficiency_flops
    assert cluster.calibration.attention_efficiency == pytest.approx(0.25 * (1e6 + w_half) / 1e6)
    # backward: 2e6 FLOPs in 50 us, 40% of the peak
    assert cluster.calibration.attention_backward_efficiency == pytest.approx(
        0.4 * (1e6 + w_half) / 1e6
    )
    assert cluster.intra_node.latency_s == pytest.approx(1e-4, rel=1e-6)
    assert cluster.intra_node.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    # host costs of the distributed runtime: the shipped fit at this machine's op cost
    fit = local_rates.RUNTIME_HOST_FIT
    scale = 3e-6 / fit.reference_op_s
    assert cluster.calibration.kernel_overhead_s == pytest.approx(fit.runtime_op_s * scale)
    assert cluster.calibration.sharded_optimizer_unit_overhead_s == pytest.approx(
        fit.sharded_optimizer_unit_s * scale
    )
    assert cluster.calibration.reduce_scatter_efficiency == fit.reduce_scatter_efficiency
    assert cluster.device.memory_bandwidth_bytes_per_s == 30e9
    assert cluster.calibration.optimizer_tensor_overhead_s == 15e-6
    # the runtime's two small all-reduces a step (verdict, loss), each the 4 KiB one's time
    assert cluster.calibration.step_overhead_s == pytest.approx(2 * (2e-4 + 4096 / 1e9))


def test_optimizer_tensor_overhead_prices_each_parameter_tensor_on_cpu() -> None:
    # the zoo GPT block: 2 LayerNorms (one count each: a norm's bias is not told apart) and
    # 6 linears with biases (2 each) = 14; the embedding unit: 2 tables, no bias
    from autoplan.models import gpt
    from autoplan.tracing import trace
    from cost_model.estimate import estimate
    from cost_model.parts.host import parameter_tensors

    profile = trace(gpt(2, 64, 4, 32, 128, device="meta")).profile
    block = next(u for u in profile.units if u.kind == "block")
    embedding = profile.units[0]
    assert parameter_tensors(block) == 14
    assert parameter_tensors(embedding) == 2
    base = Cluster.preset_file("local")
    assert base.calibration.optimizer_tensor_overhead_s == 0.0
    priced = dataclasses.replace(
        base,
        calibration=dataclasses.replace(base.calibration, optimizer_tensor_overhead_s=1e-4),
    )
    from autoplan.api import manual_plan

    plan = manual_plan(profile, base, global_batch=4, dtype="fp32")
    tensors = sum(parameter_tensors(u) for u in profile.units)
    added = estimate(profile, priced, plan).step_time_s - estimate(profile, base, plan).step_time_s
    assert added == pytest.approx(tensors * 1e-4, rel=1e-6)


_CONCURRENT = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
from cost_model.hardware import Cluster
print(repr(Cluster.local(num_devices=2).to_data()))
"""


@pytest.mark.slow
def test_processes_starting_together_measure_once_and_agree(fresh_cache: Path) -> None:
    """Three processes (as the ranks of a torchrun job) use `local` at once on a machine never
    measured: one measures under the lock, the others wait and read its file."""

    env = {k: v for k, v in os.environ.items() if k != "AUTOPLAN_LOCAL_CLUSTER"}
    env.update(XDG_CACHE_HOME=str(fresh_cache.parent), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    clusters = {out.strip() for out, _ in outputs}
    assert len(clusters) == 1  # the same cluster in every process
    told = [err for _, err in outputs if "measured this machine's rates" in err]
    assert len(told) == 1, [err[-500:] for _, err in outputs]
    assert len(list(fresh_cache.glob("local-measured-*.yaml"))) == 1


def test_step_timing_line_says_when_the_run_is_outside_the_range() -> None:
    inside = StepTiming(predicted_s=0.053, range_s=(0.047, 0.061), measured_s=0.050, steps=97)
    assert inside.within_range
    assert inside.error == pytest.approx(0.06)
    assert inside.line() == (
        "predicted 53 ms a step (range 47-61 ms), measured 50 ms (+6%; median of 97 steps)"
    )
    slow = StepTiming(predicted_s=0.010, range_s=(0.009, 0.012), measured_s=0.040, steps=10)
    assert not slow.within_range
    assert slow.line().endswith(f"the run is slower than the predicted range; {CALIBRATE_HINT}")
    assert "(-75%;" in slow.line()
