"""Predicted vs measured per-rank peak tensor memory on this machine (issue 16, item 3).

For plans of a small GPT on 2 and 4 CPU processes covering every schedule, ZeRO 0-3, the three
recompute modes, TP and SP, each rank runs one warm training step, then one measured step under
`tests.live_bytes.LiveBytes` (live tensor storages, equal to torch's MemTracker on a plain step;
MemTracker itself refuses modules that run forward more than once per step, as pipelines do),
with its weight shards, gradients and optimizer state registered before it. The prediction is
the cost model's for the rank's pipeline stage: `MemoryBreakdown.predicted_bytes` (weights,
gradients, optimizer state, held activations, working set and buffers; no framework reserve: the
local cluster's allocator margin is 0). Prints per plan and rank, then the median and max
|error|. Target (issue 16): median <= 10%, max <= 25%. Results go to bench/results/memory.json.

With ``--cuda`` (issue 16, item 5) it runs single-GPU plans of the same GPT instead (micro-batch
1-4, the three recompute modes, fp32 and bf16) and compares the prediction with
``torch.cuda.max_memory_allocated`` (tensors: `MemoryBreakdown.predicted_bytes`) and
``max_memory_reserved`` (the caching allocator's segments: the prediction with the allocator
margin, i.e. the total without the framework reserve, which the CUDA context holds outside the
allocator); on a machine without CUDA it says so in one line and exits 0.

Run: .venv/bin/python bench/memory.py [--world-sizes 2,4] [--only zbv] [--cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import _batch, _describe, _gpt, loss_fn  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "memory.json"
# Activations comparable to the weights, so that both halves of the prediction are tested.
MODEL = {"num_layers": 4, "hidden_size": 128, "num_heads": 4, "seq_len": 128, "vocab_size": 512}
GLOBAL_BATCH = 16
TARGET_MEDIAN, TARGET_MAX = 0.10, 0.25


def measure_worker(rank: int, world_size: int, plan_data: dict[str, Any]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from autoplan.contract.plan import Plan
    from autoplan.runtime.parallelizer import parallelize
    from tests.live_bytes import LiveBytes

    plan = Plan.from_data(plan_data)
    trainer = parallelize(_gpt(MODEL, device="meta", tie=True), plan=plan, loss_fn=loss_fn)
    # one warm step: the optimizer state exists from here on
    trainer.train_step(*_batch(GLOBAL_BATCH, MODEL["seq_len"], MODEL["vocab_size"], 0))
    live = LiveBytes.after_warm_step(trainer)
    with live:
        trainer.train_step(*_batch(GLOBAL_BATCH, MODEL["seq_len"], MODEL["vocab_size"], 1))
    # DDP's reducer allocates its gradient buckets in C++, below the dispatch mode: add them
    buckets = 0
    for wrapper in trainer.wrappers:
        if isinstance(wrapper, DistributedDataParallel):
            logged = wrapper._get_ddp_logging_data()  # type: ignore[no-untyped-call]
            buckets += sum(int(size) for size in re.findall(r"\d+", str(logged["bucket_sizes"])))
    return {"rank": rank, "pp_rank": trainer.mesh.pp_rank, "peak_bytes": live.peak + buckets}


def _plans(world: int, profile: Any, cluster: Any) -> list[Any]:
    """Plans covering schedules, ZeRO levels, recompute modes, TP and SP for ``world``."""
    from autoplan.api import manual_plan
    from autoplan.contract.errors import InputError

    options: list[dict[str, Any]] = []
    for zero, recompute in itertools.product((0, 1, 2, 3), ("none", "selective", "full")):
        options.append({"zero": zero, "recompute": recompute})  # pure data parallelism
    for sp, recompute in itertools.product((False, True), ("none", "full")):
        options.append({"tp": 2, "sequence_parallel": sp, "recompute": recompute})
    schedules = (
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved-1f1b", 2),
        ("interleaved-zb", 2),
        ("zbv", 2),
        ("dualpipev", 2),
    )
    for (schedule, v), micro in itertools.product(schedules, (1, 2)):
        pp = 2 if world == 2 else 4 if schedule not in ("zbv", "dualpipev") else 2
        options.append({"pp": pp, "schedule": schedule, "virtual_stages": v, "micro_batch": micro})
    if world == 4:
        options += [
            {"tp": 2, "pp": 2, "sequence_parallel": True},
            {"pp": 2, "zero": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2},
            {"pp": 2, "zero": 3, "schedule": "1f1b", "recompute": "full"},
            {"tp": 2, "zero": 3},
        ]
    plans = []
    for option in options:
        try:
            plans.append(
                manual_plan(profile, cluster, global_batch=GLOBAL_BATCH, dtype="fp32", **option)
            )
        except InputError as error:
            print(f"skipped {option}: {error}", flush=True)
    return plans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--only", default="", help="measure only plans whose summary has this")
    parser.add_argument("--cuda", action="store_true", help="single-GPU plans on this GPU")
    parser.add_argument(
        "--write-residuals",
        action="store_true",
        help="write each rank's log(measured / predicted) to cost_model/validation/"
        "residuals.json (the peak-memory ranges of `cost_model.uncertainty`)",
    )
    args = parser.parse_args()
    if args.cuda:
        return cuda_main()
    from autoplan.tracing import trace
    from cost_model.estimate import estimate
    from cost_model.hardware import Cluster

    profile = trace(_gpt(MODEL, device="meta", tie=True)).profile
    report: dict[str, Any] = {}
    ok = True
    for world in (int(w) for w in args.world_sizes.split(",")):
        cluster = Cluster.local(num_devices=world)
        rows = []
        for plan in _plans(world, profile, cluster):
            if args.only not in _describe(plan):
                continue
            predicted = estimate(profile, cluster, plan)
            ranks = run_distributed(
                measure_worker,
                plan.to_data(),
                world_size=world,
                tmp_path=Path("/tmp"),
                timeout_s=600,
            )
            for r in ranks:
                guess = predicted.ranks[r["pp_rank"]].memory.predicted_bytes
                error = (guess - r["peak_bytes"]) / r["peak_bytes"]
                rows.append(
                    {
                        "plan": _describe(plan),
                        **r,
                        "predicted_bytes": guess,
                        "error": error,
                        "features": list(predicted.features),
                    }
                )
            kib = 1024.0
            print(
                f"{world} procs, {_describe(plan)}: "
                + "; ".join(
                    f"r{row['rank']} predicted {row['predicted_bytes'] / kib:,.0f} KiB, measured "
                    f"{row['peak_bytes'] / kib:,.0f} KiB ({row['error']:+.0%})"
                    for row in rows[-len(ranks) :]
                ),
                flush=True,
            )
        errors = [abs(row["error"]) for row in rows]
        median, worst = statistics.median(errors), max(errors)
        ok &= median <= TARGET_MEDIAN and worst <= TARGET_MAX
        print(
            f"{world} procs: {len(rows)} rank measurements, median |error| {median:.1%} (target "
            f"<= {TARGET_MEDIAN:.0%}), max {worst:.1%} (target <= {TARGET_MAX:.0%})",
            flush=True,
        )
        report[str(world)] = {"rows": rows, "median_abs_error": median, "max_abs_error": worst}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    if args.write_residuals and not args.only:
        from cost_model.uncertainty import write_residuals

        write_residuals(
            "memory",
            [
                {
                    "id": f"{world} procs, {row['plan']}, rank {row['rank']}",
                    "source": "this machine (bench/memory.py)",
                    "features": row["features"],
                    "residual": round(math.log(row["peak_bytes"] / row["predicted_bytes"]), 6),
                }
                for world, part in report.items()
                for row in part["rows"]
            ],
            "bench/memory.py",
        )
        print("wrote the residuals to cost_model/validation/residuals.json")
    return 0 if ok else 1


def cuda_main() -> int:
    """Single-GPU plans: predicted vs the CUDA caching allocator's peaks."""
    import gc

    import torch

    if not torch.cuda.is_available():
        print("skipped: bench/memory.py --cuda needs a CUDA device; this machine has none")
        return 0
    from autoplan.api import manual_plan
    from autoplan.runtime.parallelizer import parallelize
    from autoplan.tracing import trace
    from cost_model.estimate import estimate
    from cost_model.hardware import Cluster

    cluster = Cluster.local(num_devices=1)
    profile = trace(_gpt(MODEL, device="meta", tie=True)).profile
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for dtype, micro, recompute in itertools.product(
        ("fp32", "bf16"), (1, 2, 4), ("none", "selective", "full")
    ):
        plan = manual_plan(
            profile,
            cluster,
            global_batch=GLOBAL_BATCH,
            dtype=dtype,
            micro_batch=micro,
            recompute=recompute,
        )
        predicted = estimate(profile, cluster, plan).ranks[0].memory
        trainer = parallelize(_gpt(MODEL, device="meta", tie=True), plan=plan, loss_fn=loss_fn)
        batch = [
            t.to(device) for t in _batch(GLOBAL_BATCH, MODEL["seq_len"], MODEL["vocab_size"], 0)
        ]
        trainer.train_step(*batch)  # the optimizer state exists from here on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step(*batch)
        torch.cuda.synchronize()
        allocated = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
        with_margin = predicted.total_bytes - cluster.calibration.reserved_memory_bytes
        row = {
            "plan": _describe(plan),
            "predicted_bytes": predicted.predicted_bytes,
            "max_memory_allocated": allocated,
            "error_allocated": (predicted.predicted_bytes - allocated) / allocated,
            "predicted_with_margin_bytes": with_margin,
            "max_memory_reserved": reserved,
            "error_reserved": (with_margin - reserved) / reserved,
        }
        rows.append(row)
        mib = 2.0**20
        print(
            f"{row['plan']}: predicted {predicted.predicted_bytes / mib:,.1f} MiB vs allocated "
            f"{allocated / mib:,.1f} MiB ({row['error_allocated']:+.0%}); with margin "
            f"{with_margin / mib:,.1f} MiB vs reserved {reserved / mib:,.1f} MiB "
            f"({row['error_reserved']:+.0%})",
            flush=True,
        )
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
    for key in ("error_allocated", "error_reserved"):
        errors = [abs(row[key]) for row in rows]
        print(f"{key}: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}")
    # What the process holds outside the caching allocator (CUDA context, library workspaces,
    # NCCL buffers): the measured counterpart of calibration.reserved_memory_bytes.
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    print(
        f"held outside the caching allocator: {outside / 2**20:,.0f} MiB (the cluster's "
        f"calibration.reserved_memory_bytes assumes "
        f"{cluster.calibration.reserved_memory_bytes / 2**20:,.0f} MiB)"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.with_name("memory_cuda.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
