"""Runtime benchmarks on this machine (CPU, gloo), side by side in one run.

    python bench/runtime.py                 # all parts
    python bench/runtime.py --part a        # only the overhead comparison
    python bench/runtime.py --calibrate     # run `autoplan calibrate` first (else: Cluster.local)

(a) Overhead: step time of autoplan's compiled module against a hand-written torch composition
    of the same plan (same zoo model and weights, degrees, schedule, micro-batches, optimizer),
    written directly with ``parallelize_module`` / ``fully_shard`` / ``PipelineStage`` on the
    eager model. Steps of the two alternate on the same ranks; the ratio of medians is reported
    (target <= 1.05).
(b) Cost-model fidelity: every feasible plan the planner finds for a small GPT on 2 and on 4
    processes (``search_plans(top_k=all)`` on ``Cluster.local`` as a user gets it: the
    `autoplan calibrate` file if there is one, else the first-use measurement), each measured
    (median step time over timed steps, the slowest rank per step): predicted vs measured, the
    median relative error, and whether the searched plan (rank 1) is the fastest measured or
    within 10% of it.
(c) Memory: predicted peak bytes per pipeline rank vs the measured peak resident-set growth of
    each rank (psutil, sampled every 2 ms, from just before the model is built to the end of
    the timed steps). RSS includes allocator caches and torch's own buffers: expect it above
    the prediction for tiny models.

Results go to the console and to ``bench/results/runtime.json``. Multi-process jobs reuse the
test launcher (tests/dist_utils.py: forkserver, gloo, file:// rendezvous).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.dist_utils import run_distributed  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "runtime.json"

# (a): a model big enough that compute, not Python, dominates a step on one core.
AB_MODEL = {"num_layers": 4, "hidden_size": 256, "num_heads": 8, "seq_len": 128, "vocab_size": 512}
# (b), (c): small enough that every plan of the space runs in seconds.
FIDELITY_MODEL = {
    "num_layers": 4,
    "hidden_size": 128,
    "num_heads": 4,
    "seq_len": 64,
    "vocab_size": 256,
}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _batch(
    global_batch: int, seq_len: int, vocab: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _gpt(spec: dict[str, int], device: str = "cpu", tie: bool = False) -> nn.Module:
    from autoplan.models import gpt

    torch.manual_seed(0)
    return gpt(
        spec["num_layers"],
        spec["hidden_size"],
        spec["num_heads"],
        spec["seq_len"],
        spec["vocab_size"],
        device=device,
        tie_embeddings=tie,
    )


def _timed(fn: Any) -> float:
    """Wall time of ``fn()`` on the slowest rank (barriers around it)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


# ============================================================================ (a) overhead


class _FirstStage(nn.Module):
    """Hand-written pipeline stage 0 of the zoo GPT: embeddings and the first blocks."""

    def __init__(self, model: Any, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleList(blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x: torch.Tensor = self.tok_emb(input_ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(nn.Module):
    """Hand-written last pipeline stage: the remaining blocks, final norm and head."""

    def __init__(self, model: Any, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.lm_head(self.ln_f(x))
        return out


def _handwritten(plan: Any, model: Any) -> Any:
    """The plan written by hand with torch's building blocks; returns a step function."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.rank_layout)
    pp_rank = mesh.get_local_rank("pp")
    blocks = list(model.blocks)
    half = len(blocks) // 2
    if plan.pp_degree == 1:
        module: nn.Module = model
        mine = blocks
    elif pp_rank == 0:
        module, mine = _FirstStage(model, blocks[:half]), blocks[:half]
    else:
        module, mine = _LastStage(model, blocks[half:]), blocks[half:]
    if plan.tp_degree > 1:
        tp_mesh = mesh["tp"]
        for block in mine:
            parallelize_module(
                block,
                tp_mesh,
                {
                    "attn.q_proj": ColwiseParallel(),
                    "attn.k_proj": ColwiseParallel(),
                    "attn.v_proj": ColwiseParallel(),
                    "attn.o_proj": RowwiseParallel(),
                    "mlp.up_proj": ColwiseParallel(),
                    "mlp.down_proj": RowwiseParallel(),
                },
            )
        if isinstance(module, _FirstStage) or plan.pp_degree == 1:
            parallelize_module(
                module.get_submodule("tok_emb"), tp_mesh, RowwiseParallel(input_layouts=Replicate())
            )
        if isinstance(module, _LastStage) or plan.pp_degree == 1:
            parallelize_module(
                module.get_submodule("lm_head"),
                tp_mesh,
                ColwiseParallel(output_layouts=Replicate()),
            )
    if plan.dp_degree > 1 and plan.zero_stage == 0 and plan.tp_degree == 1:
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(module, process_group=mesh["dp"].get_group())
    elif plan.dp_degree > 1:
        for block in mine:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=plan.zero_stage == 3)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=plan.zero_stage == 3)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    local = plan.micro_batch_size * plan.num_micro_batches
    dp_rank = mesh.get_local_rank("dp")
    scale = plan.dp_degree * plan.tp_degree

    if plan.pp_degree == 1:

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
            x = inputs[dp_rank * local : (dp_rank + 1) * local]
            y = targets[dp_rank * local : (dp_rank + 1) * local]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(module(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            reported = loss.detach() / scale
            dist.all_reduce(reported)

        return step

    stage = PipelineStage(
        module, pp_rank, plan.pp_degree, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    schedule_type = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_type(stage, plan.num_micro_batches, loss_fn=loss_fn)

    def pipelined_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        x = inputs[dp_rank * local : (dp_rank + 1) * local]
        y = targets[dp_rank * local : (dp_rank + 1) * local]
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if pp_rank == 0:
            schedule.step(x, return_outputs=False)
        else:
            schedule.step(target=y, losses=losses, return_outputs=False)
        optimizer.step()
        reported = torch.stack(losses).mean() / scale if losses else torch.zeros(())
        dist.all_reduce(reported)

    return pipelined_step


def overhead_worker(
    rank: int, world_size: int, plan_data: dict[str, Any], steps: int
) -> dict[str, Any]:
    from autoplan.contract.plan import Plan
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    ours = parallelize(
        _gpt(AB_MODEL),
        plan=plan,
        loss_fn=loss_fn,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
    )
    theirs = _handwritten(plan, _gpt(AB_MODEL))
    seq, vocab = AB_MODEL["seq_len"], AB_MODEL["vocab_size"]
    times: dict[str, list[float]] = {"autoplan": [], "handwritten": []}
    for step in range(steps + 3):
        x, y = _batch(plan.global_batch_size, seq, vocab, step)
        # Alternate which goes first, so neither always follows the other.
        order = ("autoplan", "handwritten") if step % 2 == 0 else ("handwritten", "autoplan")
        for name in order:
            if name == "autoplan":
                elapsed = _timed(functools.partial(ours.train_step, x, y))
            else:
                elapsed = _timed(functools.partial(theirs, x, y))
            if step >= 3:  # warm-up: first-call costs (shape inference, allocations)
                times[name].append(elapsed)
    return times


def part_a(steps: int, only: str | None = None) -> list[dict[str, Any]]:
    from tests.numerics import make_plan

    units = AB_MODEL["num_layers"] + 2  # embedding, blocks, head: the pipeline split is even
    configs = [
        (
            "pp2 x tp2, 1f1b, 4 micro-batches",
            make_plan(pp=2, tp=2, micro_batch=2, num_micro_batches=4, num_units=units),
        ),
        (
            "dp2 x tp2, ZeRO-3",
            make_plan(dp=2, tp=2, zero=3, micro_batch=4, num_micro_batches=1, num_units=units),
        ),
        (
            "dp2, ZeRO-0 (hand-written: DDP)",
            make_plan(dp=2, micro_batch=4, num_micro_batches=1, num_units=units),
        ),
        (
            "pp2 x dp2, gpipe, ZeRO-2",
            make_plan(
                pp=2,
                dp=2,
                zero=2,
                micro_batch=2,
                num_micro_batches=2,
                schedule="gpipe",
                num_units=units,
            ),
        ),
    ]
    rows = []
    for name, plan in configs:
        if only is not None and only not in name:
            continue
        results = run_distributed(
            overhead_worker,
            plan.to_data(),
            steps,
            world_size=plan.num_devices,
            tmp_path=Path("/tmp"),
            timeout_s=900,
        )
        times = results[0]  # every rank saw the same (all-reduced MAX) times
        ours = statistics.median(times["autoplan"])
        theirs = statistics.median(times["handwritten"])
        # Paired: each autoplan step against the hand-written step next to it (same load).
        paired = statistics.median(
            a / b for a, b in zip(times["autoplan"], times["handwritten"], strict=True)
        )
        rows.append(
            {
                "plan": name,
                "processes": plan.num_devices,
                "autoplan_step_s": ours,
                "handwritten_step_s": theirs,
                "ratio_of_medians": ours / theirs,
                "median_paired_ratio": paired,
                "autoplan_min_s": min(times["autoplan"]),
                "handwritten_min_s": min(times["handwritten"]),
                "steps": steps,
            }
        )
        print(
            f"(a) {name}: autoplan {ours * 1e3:.1f} ms, hand-written {theirs * 1e3:.1f} ms "
            f"(medians of {steps}); ratio {ours / theirs:.3f}, median paired ratio {paired:.3f}, "
            f"ratio of minima {min(times['autoplan']) / min(times['handwritten']):.3f}",
            flush=True,
        )
    return rows


# ============================================================================ (b), (c) fidelity


class _PeakRss:
    """Samples this process's resident set size in a thread; keeps the maximum."""

    def __init__(self, interval_s: float = 0.002) -> None:
        import psutil

        self._process = psutil.Process()
        self._interval_s = interval_s
        self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(self._interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        return self.peak


def measure_worker(
    rank: int,
    world_size: int,
    plan_data: dict[str, Any],
    steps: int,
    spec: dict[str, int] = FIDELITY_MODEL,
) -> dict[str, Any]:
    import psutil

    from autoplan.contract.plan import Plan
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    seq, vocab = spec["seq_len"], spec["vocab_size"]
    baseline = psutil.Process().memory_info().rss
    sampler = _PeakRss()
    model = _gpt(spec, device="meta", tie=True)
    trainer = parallelize(
        model, plan=plan, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3)
    )
    times = []
    for step in range(steps + 2):
        x, y = _batch(plan.global_batch_size, seq, vocab, step)
        elapsed = _timed(functools.partial(trainer.train_step, x, y))
        if step >= 2:
            times.append(elapsed)
    peak = sampler.stop()
    return {
        "rank": rank,
        "pp_rank": trainer.mesh.pp_rank,
        "step_s": statistics.median(times),
        "rss_growth_bytes": peak - baseline,
        "peak_rss_bytes": peak,
    }


def _describe(plan: Any) -> str:
    recompute = "/".join(sorted({s.recompute for s in plan.stages}))
    sched = plan.schedule + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    return (
        f"dp{plan.dp_degree} tp{plan.tp_degree} pp{plan.pp_degree} mb{plan.micro_batch_size}x"
        f"{plan.num_micro_batches} {sched} z{plan.zero_stage} rc:{recompute}"
        f"{' sp' if plan.sequence_parallel else ''} {'/'.join(plan.rank_layout)}"
    )


def _technique(described: str) -> str:
    """The plan's class for the error breakdown (from `_describe`): tp, pp, dp (DDP or FSDP2's
    replicate) or fsdp (ZeRO-2/3), joined by '+'."""
    fields = described.split()
    zero = next(f for f in fields if f[0] == "z" and f[1:].isdigit())
    parts = [axis for axis in ("tp", "pp") if not any(f == f"{axis}1" for f in fields)]
    if "dp1" not in fields:
        parts.append("fsdp" if zero in ("z2", "z3") else "dp")
    return "+".join(parts) or "single"


def _median_errors(
    rows: list[dict[str, Any]], group: Callable[[dict[str, Any]], str], *, absolute: bool
) -> dict[str, tuple[float, int]]:
    """Per group of measured rows: the median relative error (or |error|) and the count."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(group(r), []).append(r["relative_error"])
    return {
        name: (statistics.median(abs(e) if absolute else e for e in errors), len(errors))
        for name, errors in sorted(groups.items())
    }


def part_bc(
    world_sizes: list[int], global_batch: int, steps: int, max_plans: int
) -> dict[str, Any]:
    from autoplan.contract.errors import NoFeasiblePlanError
    from autoplan.contract.plan import SCHEDULES
    from autoplan.planner.search import search_plans
    from autoplan.planner.space import ConstraintError
    from autoplan.tracing import trace
    from cost_model.estimate import estimate
    from cost_model.hardware import Cluster

    profile = trace(_gpt(FIDELITY_MODEL, device="meta", tie=True)).profile
    report: dict[str, Any] = {}
    for world in world_sizes:
        cluster = Cluster.local(num_devices=world)
        result = search_plans(
            profile, cluster, global_batch=global_batch, top_k=max_plans, dtype="fp32"
        )
        plans = list(result.plans)
        # Every schedule the search can pick: the best plan of each one the top-k missed.
        for schedule in SCHEDULES:
            if any(p.schedule == schedule for p in plans):
                continue
            try:
                extra = search_plans(
                    profile,
                    cluster,
                    global_batch=global_batch,
                    dtype="fp32",
                    schedules=(schedule,),
                )
            except (NoFeasiblePlanError, ConstraintError) as error:
                print(f"(b) {world} procs: no {schedule} plan ({error})", flush=True)
                continue
            plans.extend(extra.plans)
        rows: list[dict[str, Any]] = []
        for idx, plan in enumerate(plans):
            predicted = estimate(profile, cluster, plan)
            try:
                ranks = run_distributed(
                    measure_worker,
                    plan.to_data(),
                    steps,
                    world_size=world,
                    tmp_path=Path("/tmp"),
                    timeout_s=600,
                )
            except Exception as error:
                rows.append(
                    {"plan": _describe(plan), "search_rank": idx + 1, "error": str(error)[:2000]}
                )
                print(f"(b) {world} procs, plan {idx + 1}: FAILED {str(error)[:300]}", flush=True)
                continue
            measured = statistics.median(r["step_s"] for r in ranks)
            memory = []
            for r in ranks:
                breakdown = predicted.ranks[r["pp_rank"]].memory
                memory.append(
                    {
                        "rank": r["rank"],
                        # Everything the cost model counts, reserved runtime memory included:
                        # compare with the process's absolute peak RSS.
                        "predicted_total_bytes": breakdown.total_bytes,
                        # Tensors only (weights, grads, optimizer state, activations): compare
                        # with the RSS growth from just before the model was built.
                        "predicted_tensor_bytes": breakdown.param_bytes
                        + breakdown.grad_bytes
                        + breakdown.optimizer_bytes
                        + breakdown.activation_bytes,
                        "measured_peak_rss_bytes": r["peak_rss_bytes"],
                        "measured_rss_growth_bytes": r["rss_growth_bytes"],
                    }
                )
            rows.append(
                {
                    "plan": _describe(plan),
                    "search_rank": idx + 1,
                    "predicted_step_s": predicted.step_time_s,
                    "measured_step_s": measured,
                    "relative_error": (predicted.step_time_s - measured) / measured,
                    "memory": memory,
                }
            )
            mib = 2.0**20
            print(
                f"(b) {world} procs, plan {idx + 1}/{len(plans)} {_describe(plan)}: predicted "
                f"{predicted.step_time_s * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms"
                "\n(c)   memory per rank, predicted total / peak RSS, predicted tensors / RSS "
                "growth: "
                + "; ".join(
                    f"r{m['rank']} {m['predicted_total_bytes'] / mib:.0f}/"
                    f"{m['measured_peak_rss_bytes'] / mib:.0f} MiB, "
                    f"{m['predicted_tensor_bytes'] / mib:.1f}/"
                    f"{m['measured_rss_growth_bytes'] / mib:.1f} MiB"
                    for m in memory
                ),
                flush=True,
            )
        ok: list[dict[str, Any]] = [r for r in rows if "measured_step_s" in r]
        summary: dict[str, Any] = {"plans": rows, "num_plans": len(plans), "num_measured": len(ok)}
        if ok:
            fastest = min(r["measured_step_s"] for r in ok)
            searched = next((r for r in ok if r["search_rank"] == 1), None)
            summary["median_abs_relative_error"] = statistics.median(
                abs(r["relative_error"]) for r in ok
            )
            summary["fastest_measured_s"] = fastest
            if searched is not None:
                summary["searched_plan"] = searched["plan"]
                summary["searched_measured_s"] = searched["measured_step_s"]
                summary["searched_within_10pct_of_fastest"] = (
                    searched["measured_step_s"] <= 1.1 * fastest
                )
            for key, measured_key in (
                ("total", "measured_peak_rss_bytes"),
                ("tensor", "measured_rss_growth_bytes"),
            ):
                ratios = [
                    m[f"predicted_{key}_bytes"] / m[measured_key]
                    for r in ok
                    for m in r["memory"]
                    if m[measured_key] > 0
                ]
                summary[f"memory_{key}_median_predicted_over_measured"] = statistics.median(ratios)
            by_kind = _median_errors(ok, lambda r: _technique(r["plan"]), absolute=False)
            by_schedule = _median_errors(ok, lambda r: r["plan"].split()[4], absolute=True)
            summary["median_relative_error_by_technique"] = {k: e for k, (e, _) in by_kind.items()}
            summary["median_abs_relative_error_by_schedule"] = {
                k: e for k, (e, _) in by_schedule.items()
            }
            print(
                f"(b) {world} procs, median signed error by technique: "
                + ", ".join(f"{k} {e:+.0%} ({n})" for k, (e, n) in by_kind.items())
                + f"\n(b) {world} procs, median |error| by schedule: "
                + ", ".join(f"{k} {e:.0%} ({n})" for k, (e, n) in by_schedule.items()),
                flush=True,
            )
            searched_s = summary.get("searched_measured_s", float("nan"))
            print(
                f"(b) {world} procs: {len(ok)} of {len(plans)} plans measured, median |error| "
                f"{summary['median_abs_relative_error']:.0%}; searched plan "
                f"{summary.get('searched_plan')} at {searched_s * 1e3:.1f} ms vs fastest "
                f"{fastest * 1e3:.1f} ms -> within 10%: "
                f"{summary.get('searched_within_10pct_of_fastest')}\n"
                f"(c) {world} procs: predicted/measured memory, median over ranks and plans: "
                f"total/peak RSS {summary['memory_total_median_predicted_over_measured']:.2f}, "
                f"tensors/RSS growth {summary['memory_tensor_median_predicted_over_measured']:.2f}",
                flush=True,
            )
        report[str(world)] = summary
    return report


# (c): big enough that tensors, not the runtime's own allocations, dominate the growth.
MEMORY_MODEL = {
    "num_layers": 4,
    "hidden_size": 512,
    "num_heads": 8,
    "seq_len": 128,
    "vocab_size": 2048,
}


def _memory_row(plan: Any, predicted: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    memory = []
    for r in ranks:
        breakdown = predicted.ranks[r["pp_rank"]].memory
        tensors = (
            breakdown.param_bytes
            + breakdown.grad_bytes
            + breakdown.optimizer_bytes
            + breakdown.activation_bytes
        )
        memory.append(
            {
                "rank": r["rank"],
                "predicted_total_bytes": breakdown.total_bytes,
                "predicted_tensor_bytes": tensors,
                "measured_peak_rss_bytes": r["peak_rss_bytes"],
                "measured_rss_growth_bytes": r["rss_growth_bytes"],
            }
        )
    return {"plan": _describe(plan), "memory": memory}


def part_c(steps: int) -> list[dict[str, Any]]:
    """Predicted vs measured memory per rank for a few layouts of a 13M-parameter GPT."""
    from autoplan.api import manual_plan
    from autoplan.tracing import trace
    from cost_model.estimate import estimate
    from cost_model.hardware import Cluster

    graph = trace(_gpt(MEMORY_MODEL, device="meta", tie=True))
    cluster = Cluster.local(num_devices=2)
    layouts = [
        {"tp": 1, "pp": 1, "zero": 0},
        {"tp": 1, "pp": 1, "zero": 3},
        {"tp": 1, "pp": 2, "zero": 0},
        {"tp": 2, "pp": 1, "zero": 0},
    ]
    rows = []
    mib = 2.0**20
    for layout in layouts:
        plan = manual_plan(graph, cluster, micro_batch=2, global_batch=8, dtype="fp32", **layout)  # type: ignore[arg-type]
        predicted = estimate(graph.profile, cluster, plan)
        ranks = run_distributed(
            measure_worker,
            plan.to_data(),
            steps,
            MEMORY_MODEL,
            world_size=2,
            tmp_path=Path("/tmp"),
            timeout_s=900,
        )
        row = _memory_row(plan, predicted, ranks)
        rows.append(row)
        print(
            f"(c) {row['plan']}: predicted tensors / measured RSS growth, predicted total / "
            "peak RSS: "
            + "; ".join(
                f"r{m['rank']} {m['predicted_tensor_bytes'] / mib:.0f}/"
                f"{m['measured_rss_growth_bytes'] / mib:.0f} MiB, "
                f"{m['predicted_total_bytes'] / mib:.0f}/"
                f"{m['measured_peak_rss_bytes'] / mib:.0f} MiB"
                for m in row["memory"]
            ),
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="autoplan runtime benchmarks")
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--calibrate", action="store_true", help="run autoplan calibrate first")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--max-plans", type=int, default=40)
    parser.add_argument("--only", help="(a): run only the plans whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from cost_model.local_machine import calibrated_path

    report: dict[str, Any] = {"machine": {"torch": torch.__version__}}
    if args.part in ("a", "all"):
        report["a_overhead"] = part_a(args.steps * 2, args.only)
    if args.part in ("b", "all"):
        # Scored on the cluster a user gets: `autoplan calibrate`'s file when there is one
        # (--calibrate makes it now), else the `local` preset's first-use measurement.
        if args.calibrate:
            from autoplan.calibration.machine import calibrate

            _, path, _ = calibrate()
            print(f"calibrated this machine: {path}", flush=True)
        from cost_model.hardware import Cluster

        report["cluster"] = Cluster.local(num_devices=2).description
        report["calibrated_cluster"] = (
            str(calibrated_path()) if calibrated_path().exists() else None
        )
        print(f"(b) cluster: {report['cluster']}", flush=True)
        report["b_c_fidelity"] = part_bc(
            [int(w) for w in args.world_sizes.split(",")],
            args.global_batch,
            args.steps,
            args.max_plans,
        )
    if args.part in ("c", "all"):
        report["c_memory"] = part_c(max(3, args.steps // 2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"results written to {RESULTS}")


if __name__ == "__main__":
    main()
