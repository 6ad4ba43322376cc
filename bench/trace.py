"""Wall time and peak memory of `autoplan.trace` on the largest presets.

Each model is built and traced in a fresh subprocess (so its peak RSS is its own); the parent
prints a table. Target on a 2-core CPU machine: trace + profile <= 2 s and <= 1 GB each.

    python bench/trace.py [MODEL ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

DEFAULT_MODELS = ("gpt3-175b", "llama3-405b")
TARGET_TIME_S = 2.0
TARGET_RSS_BYTES = 2**30


def child(model: str) -> None:
    """Build ``model`` on meta, trace it, print one JSON line of measurements."""
    start = time.perf_counter()
    import torch  # noqa: F401  (import time reported apart)

    from autoplan.models.spec import build_model
    from autoplan.tracing import trace

    imported = time.perf_counter()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    built = build_model(model)
    t0 = time.perf_counter()
    graph = trace(built)
    t1 = time.perf_counter()
    profile = graph.profile
    result = {
        "model": model,
        "import_s": imported - start,
        "build_s": t0 - imported,
        "trace_s": t1 - t0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_import_bytes": rss_before,
        "num_nodes": len(graph.graph_module.graph.nodes),
        "num_units": profile.num_units,
        "num_params": profile.num_params,
        "forward_flops_per_sample": profile.forward_flops_per_sample,
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    results = []
    for model in args.models:
        done = subprocess.run(
            [sys.executable, __file__, "--child", model],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            sys.exit(f"bench/trace.py: {model} failed:\n{done.stderr}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    header = (
        f"{'model':<14} {'nodes':>6} {'units':>5} {'params':>9} {'build s':>8} "
        f"{'trace s':>8} {'peak RSS':>9} {'target':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        ok = r["trace_s"] <= TARGET_TIME_S and r["peak_rss_bytes"] <= TARGET_RSS_BYTES
        print(
            f"{r['model']:<14} {r['num_nodes']:>6} {r['num_units']:>5} "
            f"{r['num_params'] / 1e9:>8.1f}B {r['build_s']:>8.2f} {r['trace_s']:>8.2f} "
            f"{r['peak_rss_bytes'] / 2**20:>6.0f} MB {'ok' if ok else 'MISSED':>7}"
        )
    print(
        f"trace = autoplan.trace (fx trace + unit discovery + profiling), target <= "
        f"{TARGET_TIME_S:g} s and <= {TARGET_RSS_BYTES / 2**30:g} GiB peak RSS per process"
    )


if __name__ == "__main__":
    main()
