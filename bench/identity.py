"""The identity check for refactors that must not change what a user sees.

    python bench/identity.py write before.json      # on the commit before the refactor
    python bench/identity.py write after.json       # after it
    python bench/identity.py compare before.json after.json

A snapshot holds, as exact text (floats by ``repr``):

- estimates of seeded random plans (degrees, schedules, virtual stages, ZeRO, recompute, cp, ep,
  every framework profile) of four zoo models on GPU and CPU clusters, or the error each
  raises where it is built, validated or estimated;
- each of those plans as every exporter writes it (or its refusal) and `Plan.validate`'s and
  `parallelize`'s runtime refusals;
- budget-free searches (``budget_s=None``: visited until proven, no wall clock in the answer):
  their top plans, estimates and the deterministic parts of their statistics.

``compare`` prints the first differences per section and exits 1 when there are any.
`bench/validate_published.py`'s output is compared apart (its stdout, byte for byte).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = ("gpt2-small", "llama3-8b", "mixtral-8x7b", "gpt3-175b")
CLUSTERS = ("dgx-a100-80g:nodes=2", "dgx-h100-80g:nodes=4", "local:devices_per_node=8")
PLANS_PER_PAIR = 50
SEARCHES = (
    ("gpt2-small", "dgx-a100-80g", 64, "autoplan"),
    ("llama3-8b", "dgx-h100-80g:nodes=2", 256, "autoplan"),
    ("llama3-8b", "dgx-h100-80g:nodes=2", 256, "megatron-lm"),
    ("llama3-8b", "dgx-a100-80g:nodes=2", 256, "deepspeed"),
    ("llama3-8b", "dgx-h100-80g:nodes=2", 256, "torchtitan"),
    ("mixtral-8x7b", "dgx-h100-80g:nodes=4", 256, "autoplan"),
    ("gpt2-small", "local:devices_per_node=4", 16, "autoplan"),
)


def _text(value: Any) -> Any:
    """``value`` as JSON with floats exact (repr) and dataclasses as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _text(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_text(v) for v in value]
    if isinstance(value, float):
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return {"ok": _text(fn())}
    except Exception as error:  # the refusal is part of what a user sees
        return {"error": f"{type(error).__name__}: {error}"}


def _random_plan_kwargs(
    rng: random.Random, num_devices: int, frameworks: list[str], moe: bool
) -> dict[str, Any]:
    """Mostly plans that build (and some that do not: their errors are compared too)."""

    def divisor(limit: int) -> int:
        return rng.choice([d for d in (1, 2, 4, 8) if d <= limit])

    tp = divisor(8)
    cp = rng.choice([1, 1, 1, 1, 2])
    pp = divisor(max(1, num_devices // (tp * cp)))
    dp = num_devices // (tp * cp * pp)
    ep = rng.choice([d for d in (1, 2, 4, 8) if dp % d == 0]) if moe else 1
    schedules = ["1f1b", "gpipe"]
    if pp >= 2:
        schedules += ["interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"]
    schedule = rng.choice(schedules)
    virtual = 1
    if schedule.startswith("interleaved"):
        virtual = rng.choice([2, 3])
    elif schedule in ("zbv", "dualpipev"):
        virtual = 2
    return {
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "ep": ep,
        "micro_batch": rng.choice([1, 1, 2, 4]),
        "zero": rng.choice([0, 1, 2, 3]),
        "schedule": schedule,
        "virtual_stages": virtual,
        "recompute": rng.choice(["none", "selective", "full"]),
        "sequence_parallel": tp > 1 and rng.random() < 0.5,
        "framework": rng.choice(["autoplan", *frameworks]),
    }


def _plan_row(plan: Any, graph: Any, cluster: Any) -> dict[str, Any]:
    from autoplan.contract.plan import runtime_refusal
    from autoplan.export import export_plan
    from cost_model.estimate import estimate

    row: dict[str, Any] = {"plan": _text(plan.to_data())}
    row["validate"] = _outcome(functools.partial(plan.validate, graph, cluster))
    row["estimate"] = _outcome(functools.partial(estimate, graph.profile, cluster, plan))
    row["runtime_refusal"] = _outcome(functools.partial(runtime_refusal, plan, graph.profile))
    for framework in ("megatron-lm", "deepspeed", "torchtitan"):
        row[f"export {framework}"] = _outcome(
            functools.partial(export_plan, plan, framework, devices_per_node=8)
        )
    return row


def _plans_section(traced: dict[str, Any]) -> dict[str, Any]:
    import autoplan
    from cost_model.frameworks import FRAMEWORKS
    from cost_model.hardware import as_cluster

    rng = random.Random(20261129)
    out: dict[str, Any] = {}
    for model, graph in traced.items():
        for spec in CLUSTERS:
            cluster = as_cluster(spec)
            for i in range(PLANS_PER_PAIR):
                kwargs = _random_plan_kwargs(
                    rng, cluster.num_devices, list(FRAMEWORKS), moe=model.startswith("mixtral")
                )
                key = f"{model} @ {spec} #{i} {json.dumps(kwargs, sort_keys=True)}"
                global_batch = 8 * cluster.num_devices
                try:
                    plan = autoplan.manual_plan(graph, cluster, global_batch=global_batch, **kwargs)
                except Exception as error:
                    out[key] = {"build": f"{type(error).__name__}: {error}"}
                    continue
                out[key] = _plan_row(plan, graph, cluster)
    return out


def _searches_section(traced: dict[str, Any]) -> dict[str, Any]:
    from autoplan.planner.search import search_plans
    from cost_model.estimate import estimate
    from cost_model.hardware import as_cluster

    out: dict[str, Any] = {}
    for model, spec, global_batch, framework in SEARCHES:
        cluster = as_cluster(spec)
        graph = traced[model]
        key = f"{model} @ {spec} gb{global_batch} {framework}"

        def run(
            graph: Any = graph, cluster: Any = cluster, gb: int = global_batch, fw: str = framework
        ) -> Any:
            result = search_plans(
                graph.profile, cluster, global_batch=gb, top_k=3, budget_s=None, framework=fw
            )
            # wall-clock figures, and the gap: a solve that stops at its time limit proves
            # more or less depending on the machine's speed (issue 40 makes that deterministic)
            timings = (
                "bounds_s",
                "seed_s",
                "enumerate_s",
                "costs_s",
                "solver_s",
                "total_s",
                "optimality_gap",
            )
            stats = {k: v for k, v in dataclasses.asdict(result.stats).items() if k not in timings}
            return {
                "plans": [p.to_data() for p in result.plans],
                "estimates": [estimate(graph.profile, cluster, p) for p in result.plans],
                "stats": stats,
            }

        out[key] = _outcome(run)
    return out


def write(path: Path) -> None:
    # `local` as shipped, never this machine's measurement: the snapshot is the code's alone
    os.environ["AUTOPLAN_MEASURE_LOCAL"] = "0"
    os.environ["AUTOPLAN_LOCAL_CLUSTER"] = str(path.with_suffix(".no-cluster.yaml"))
    import autoplan
    from autoplan.models.presets import preset

    traced = {name: autoplan.trace(preset(name), name=name) for name in MODELS}
    snapshot = {"plans": _plans_section(traced), "searches": _searches_section(traced)}
    path.write_text(json.dumps(snapshot, indent=1, sort_keys=True))
    counts = {k: len(v) for k, v in snapshot.items()}
    print(f"wrote {path}: {counts}")


def compare(before: Path, after: Path, shown: int = 5) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differences = 0
    for section in sorted(set(a) | set(b)):
        left, right = a.get(section, {}), b.get(section, {})
        keys = sorted(set(left) | set(right))
        changed = [k for k in keys if left.get(k) != right.get(k)]
        differences += len(changed)
        print(f"{section}: {len(keys)} entries, {len(changed)} differ")
        for key in changed[:shown]:
            print(
                f"  {key}\n    before: {json.dumps(left.get(key))[:600]}\n"
                f"    after:  {json.dumps(right.get(key))[:600]}"
            )
    return 1 if differences else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("path", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "write":
        write(args.path)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
