"""Predicted vs measured step time and peak memory of autoplan's own runtime on this machine's
GPUs (issue 20, item 5): the check to run the day a CUDA machine is at hand.

One GPU: single-device plans of a small and a medium GPT (``gpt2-small``; ``gpt2-medium``, or
``gpt3-1.3b`` on a GPU of 40 GiB or more) over micro-batch (1, 2, 4), activation recompute
(none, selective, full), dtype (bf16, fp32) and sequence length (512, 1024, 2048), 108 plans
less those whose estimate does not fit (listed, not run). Two or more GPUs: also data, tensor
and pipeline parallel plans of the medium GPT (dp, tp, pp over all GPUs; dp x tp and pp x dp on
four or more; ZeRO 0/2/3), one process per GPU on NCCL, started here with
``torch.multiprocessing`` (env:// rendezvous on localhost).

Each plan runs ``--warmup`` steps, then ``--steps`` timed ones (``cuda.synchronize`` around each);
the measured step is their median, the measured peak each rank's ``max_memory_allocated`` over
the timed steps. The prediction is `autoplan.estimate`'s step time and, per rank, its
`MemoryBreakdown.predicted_bytes` (tensors; the framework reserve and allocator margin are what
``max_memory_reserved`` adds, which the row shows too). Prints one row per plan and the median
and max |error| per group; writes bench/results/gpu_fidelity.json.

``--calibrate PATH`` first runs `autoplan calibrate` on these GPUs (device rates, NCCL links,
the runtime's host overheads from real training steps), writes the calibrated cluster file to
PATH, and scores every plan against both clusters: the preset-based ``Cluster.local()`` and the
calibrated one. Without CUDA the script prints one line saying so and exits 0.

Run: .venv/bin/python bench/gpu_fidelity.py [--steps 10] [--only-single] [--calibrate PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import autoplan  # noqa: E402
from autoplan.calibration.machine import calibrate  # noqa: E402
from autoplan.contract.plan import Plan  # noqa: E402
from autoplan.models.spec import build_model  # noqa: E402
from autoplan.runtime.parallelizer import parallelize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import _batch, loss_fn  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu_fidelity.json"
GIB = 2.0**30
SEQ_LENS = (512, 1024, 2048)
MICRO_BATCHES = (1, 2, 4)
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16", "fp32")
# Micro-batches per step for single-device plans: enough that the step is not one kernel.
ACCUMULATION = 4


@dataclasses.dataclass(frozen=True)
class Case:
    """One plan to run: the model spec it was planned for and the plan itself."""

    group: str
    model_spec: str
    plan: Any  # autoplan.Plan

    @property
    def label(self) -> str:
        p = self.plan
        recompute = "/".join(sorted({s.recompute for s in p.stages}))
        return (
            f"{self.model_spec} dp{p.dp_degree} tp{p.tp_degree} pp{p.pp_degree} "
            f"mb{p.micro_batch_size}x{p.num_micro_batches} {p.dtype} z{p.zero_stage} "
            f"rc:{recompute}"
        )


# ----------------------------------------------------------------------------- the plans


@functools.cache
def _graph(spec: str) -> Any:
    """The traced graph of a model spec (on meta), once per spec: plans and scores share it."""

    return autoplan.trace(build_model(spec))


def _medium(memory_bytes: int) -> str:
    return "gpt3-1.3b" if memory_bytes >= 40 * GIB else "gpt2-medium"


def single_device_cases(cluster: Any, skipped: list[str]) -> Iterator[Case]:

    for name in ("gpt2-small", _medium(cluster.device.memory_bytes)):
        for seq in SEQ_LENS:
            spec = f"{name}:seq_len={seq}"
            graph = _graph(spec)
            for micro, recompute, dtype in itertools.product(MICRO_BATCHES, RECOMPUTE, DTYPES):
                plan = autoplan.manual_plan(
                    graph,
                    cluster,
                    micro_batch=micro,
                    global_batch=micro * ACCUMULATION,
                    recompute=recompute,  # type: ignore[arg-type]
                    dtype=dtype,  # type: ignore[arg-type]
                )
                case = Case("1 GPU", spec, plan)
                if _fits(graph, cluster, plan):
                    yield case
                else:
                    skipped.append(case.label)


def parallel_cases(cluster: Any, skipped: list[str]) -> Iterator[Case]:

    n = cluster.num_devices
    spec = f"{_medium(cluster.device.memory_bytes)}:seq_len=1024"
    graph = _graph(spec)
    shapes: list[dict[str, Any]] = [
        {"dp": n, "zero": 0},
        {"dp": n, "zero": 2},
        {"dp": n, "zero": 3},
        {"tp": n, "sequence_parallel": True},
        {"pp": n, "schedule": "1f1b"},
        {"pp": n, "schedule": "interleaved-1f1b", "virtual_stages": 2},
    ]
    if n >= 4:
        shapes += [{"tp": 2, "dp": n // 2}, {"pp": 2, "dp": n // 2, "zero": 2}]
    for shape, recompute in itertools.product(shapes, ("none", "selective")):
        dp = shape.get("dp", 1)
        micro = 2
        per_replica = micro * max(4, 2 * shape.get("pp", 1))
        try:
            plan = autoplan.manual_plan(
                graph,
                cluster,
                micro_batch=micro,
                global_batch=per_replica * dp,
                recompute=recompute,  # type: ignore[arg-type]
                dtype="bf16",
                **shape,
            )
        except autoplan.PlanError as error:
            skipped.append(f"{spec} {shape} {recompute}: {error}")
            continue
        case = Case(f"{n} GPUs", spec, plan)
        if _fits(graph, cluster, plan):
            yield case
        else:
            skipped.append(case.label)


def _fits(graph: Any, cluster: Any, plan: Any) -> bool:
    """Whether the predicted peak itself fits the GPU: the bench measures what can run, also
    where the product would keep a plan off for its headroom and the peak's range."""
    result = autoplan.estimate(graph, cluster, plan)
    return bool(result.peak_memory_bytes <= result.memory_capacity_bytes)


# ----------------------------------------------------------------------------- measuring


def _run_rank(spec: str, plan_data: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """This rank's measurements of one plan: step times (s) and peak memory (bytes)."""
    plan = Plan.from_data(plan_data)
    model = build_model(spec)
    trainer = parallelize(model, plan=plan, loss_fn=loss_fn)
    device = torch.device("cuda", torch.cuda.current_device())
    config = model.config  # type: ignore[attr-defined]
    inputs, targets = (
        t.to(device) for t in _batch(plan.global_batch_size, config.seq_len, config.vocab_size, 0)
    )
    for _ in range(warmup):
        trainer.train_step(inputs, targets)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(inputs, targets)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result = {
        "step_s": times,
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
    }
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _spawned_rank(
    rank: int, world: int, port: int, spec: str, plan_data: dict[str, Any], args: tuple[int, int]
) -> None:
    out = Path(os.environ["GPU_FIDELITY_OUT"]) / f"rank{rank}.json"
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.cuda.set_device(rank)
    out.write_text(json.dumps(_run_rank(spec, plan_data, *args)))


def measure(case: Case, steps: int, warmup: int) -> list[dict[str, Any]]:
    """Per-rank measurements of ``case`` (one process here, or one per GPU)."""
    world = case.plan.num_devices
    if world == 1:
        return [_run_rank(case.model_spec, case.plan.to_data(), steps, warmup)]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        os.environ["GPU_FIDELITY_OUT"] = folder
        mp.start_processes(
            _spawned_rank,
            args=(world, port, case.model_spec, case.plan.to_data(), (steps, warmup)),
            nprocs=world,
            start_method="spawn",
        )
        return [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(world)]


# ----------------------------------------------------------------------------- scoring


def score(case: Case, ranks: Sequence[dict[str, Any]], clusters: dict[str, Any]) -> dict[str, Any]:

    graph = _graph(case.model_spec)
    measured_s = statistics.median(t for r in ranks for t in r["step_s"])
    row: dict[str, Any] = {
        "group": case.group,
        "plan": case.label,
        "measured_step_s": measured_s,
        "measured_peak_bytes": [r["max_allocated"] for r in ranks],
        "measured_reserved_bytes": [r["max_reserved"] for r in ranks],
    }
    for name, cluster in clusters.items():
        estimate = autoplan.estimate(graph, cluster, case.plan)
        predicted_peak = [rank.memory.predicted_bytes for rank in estimate.ranks]
        row[name] = {
            "predicted_step_s": estimate.step_time_s,
            "step_error": estimate.step_time_s / measured_s - 1,
            "predicted_peak_bytes": predicted_peak,
            "peak_error": max(
                p / m - 1 for p, m in zip(predicted_peak, row["measured_peak_bytes"], strict=True)
            ),
        }
    return row


def _cell(name: str, scored: dict[str, Any]) -> str:
    peak = max(scored["predicted_peak_bytes"]) / GIB
    return (
        f"{name}: step {scored['predicted_step_s'] * 1e3:,.1f} ms ({scored['step_error']:+.0%}), "
        f"peak {peak:.2f} GiB ({scored['peak_error']:+.0%})"
    )


def _summary(rows: Sequence[dict[str, Any]], cluster_name: str) -> None:
    for group in sorted({r["group"] for r in rows}):
        chosen = [r[cluster_name] for r in rows if r["group"] == group]
        for key in ("step_error", "peak_error"):
            errors = [abs(c[key]) for c in chosen]
            print(
                f"  {cluster_name}, {group}, {key.replace('_', ' ')}: median |error| "
                f"{statistics.median(errors):.1%}, max {max(errors):.1%} ({len(errors)} plans)"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--only-single", action="store_true", help="single-GPU plans only")
    parser.add_argument(
        "--calibrate", metavar="PATH", help="calibrate these GPUs first, write the cluster here"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("skipped: bench/gpu_fidelity.py needs CUDA GPUs; this machine has none")
        return 0
    count = torch.cuda.device_count()
    clusters: dict[str, Any] = {"preset": autoplan.Cluster.local(num_devices=count)}
    if args.calibrate:
        calibrated, path, _ = calibrate(args.calibrate, world_size=max(2, min(count, 4)))
        clusters["calibrated"] = dataclasses.replace(calibrated, devices_per_node=count)
        print(f"calibrated cluster written to {path}")
    one = {name: dataclasses.replace(c, devices_per_node=1) for name, c in clusters.items()}
    skipped: list[str] = []
    cases: list[tuple[Case, dict[str, Any]]] = [
        (case, one) for case in single_device_cases(one["preset"], skipped)
    ]
    if count >= 2 and not args.only_single:
        cases += [(case, clusters) for case in parallel_cases(clusters["preset"], skipped)]
    print(
        f"{len(cases)} plans on {count} x {torch.cuda.get_device_name(0)}; "
        f"{len(skipped)} skipped (predicted not to fit, or not expressible)"
    )
    rows = []
    for case, scored_on in cases:
        row = score(case, measure(case, args.steps, args.warmup), scored_on)
        rows.append(row)
        cells = "; ".join(_cell(name, row[name]) for name in scored_on)
        print(
            f"{row['plan']}: measured {row['measured_step_s'] * 1e3:,.1f} ms, "
            f"{max(row['measured_peak_bytes']) / GIB:.2f} GiB allocated "
            f"({max(row['measured_reserved_bytes']) / GIB:.2f} reserved) | {cells}",
            flush=True,
        )
    print("summary (error = predicted / measured - 1):")
    for name in clusters:
        _summary(rows, name)
    for label in skipped:
        print(f"  skipped: {label}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
