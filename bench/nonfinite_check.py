"""What the non-finite check of `DistributedModel.train_step` costs a step (issue 37, item 2).

    python bench/nonfinite_check.py [--steps 40]

The example's model (examples/train_gpt.py: 4 layers, hidden 64, sequence 64, vocabulary 128,
global batch 16) on 2 gloo processes, under a data-parallel and a pipeline plan. Per plan it
reports, as medians over ``--steps`` steps:

- the check itself, timed inside `train_step` on every rank (the fused norm of the local
  gradients, the loss flag and the one all-reduce of three integers): the faster rank per step
  (the one that reached the all-reduce last, so about the check's own cost) and the slower one
  (which also waited there for its peer to finish its backward);
- of that, the gradient scan (the slower rank) and the all-reduce (the faster rank);
- the step with the check against the same model with the check cut out (`_agree` replaced by a
  verdict of "all finite"), steps of the two alternating on the same ranks; the difference is
  noisier than the direct timing (2 busy cores), and is shown for scale.

Multi-process jobs reuse the test launcher (tests/dist_utils.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from tests.dist_utils import run_distributed  # noqa: E402

PLANS: dict[str, dict[str, Any]] = {"dp2": {"dp": 2}, "pp2-1f1b": {"pp": 2, "schedule": "1f1b"}}
GLOBAL_BATCH = 16


def _worker(rank: int, world_size: int, degrees: dict[str, Any], steps: int) -> dict[str, Any]:
    from train_gpt import loss_fn, small_gpt

    import autoplan
    from passes import runtime
    from passes.runtime import DistributedModel, _StepVerdict

    plan = autoplan.manual_plan(
        autoplan.trace(small_gpt()),
        autoplan.Cluster.local(num_devices=world_size),
        global_batch=GLOBAL_BATCH,
        micro_batch=4,
        dtype="fp32",
        **degrees,
    )
    checked = autoplan.parallelize(small_gpt(), plan=plan, loss_fn=loss_fn)
    plain = autoplan.parallelize(small_gpt(), plan=plan, loss_fn=loss_fn)
    plain._agree = lambda loss_flag, grads: _StepVerdict(  # type: ignore[method-assign]
        loss_rank=None, grad_rank=None, stop=False, world_size=world_size
    )
    check_s: list[float] = []  # the whole check, per step
    scan_s: list[float] = []  # its gradient scan
    reduce_s: list[float] = []  # its all-reduce
    agree, nonfinite, all_reduce = DistributedModel._agree, runtime._nonfinite, dist.all_reduce

    def timed(self: DistributedModel, loss_flag: torch.Tensor, grads: list[torch.Tensor]) -> Any:
        started = time.perf_counter()
        verdict = agree(self, loss_flag, grads)
        check_s.append(time.perf_counter() - started)
        return verdict

    def timed_scan(tensors: list[torch.Tensor]) -> torch.Tensor:
        started = time.perf_counter()
        flag = nonfinite(tensors)
        scan_s.append(time.perf_counter() - started)
        return flag

    class _TimedDist:  # torch.distributed as passes.runtime sees it, its flag all-reduce timed
        def __getattr__(self, name: str) -> Any:
            return getattr(dist, name)

        def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            work = all_reduce(tensor, *args, **kwargs)
            if tensor.dtype == torch.int64 and tensor.numel() == 3:
                reduce_s.append(time.perf_counter() - started)
            return work

    checked._agree = timed.__get__(checked)  # type: ignore[method-assign]
    runtime._nonfinite = timed_scan  # type: ignore[assignment]
    runtime.dist = _TimedDist()  # type: ignore[assignment]
    tokens = torch.randint(0, 128, (GLOBAL_BATCH, 65), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with_s, without_s = [], []
    for step in range(steps + 3):  # 3 warm-up steps of each
        for model, times in ((checked, with_s), (plain, without_s)):
            dist.barrier()
            started = time.perf_counter()
            model.train_step(inputs, targets)
            if step >= 3:
                times.append(time.perf_counter() - started)
    runtime.dist, runtime._nonfinite = dist, nonfinite
    return {
        "check": check_s[3:],  # 3 warm-up steps
        "scan": scan_s[3:],
        "reduce": reduce_s[3:],
        "with": with_s,
        "without": without_s,
        "grads": len(checked._local_gradients()),
    }


def _per_step(results: list[dict[str, Any]], key: str, pick: Any) -> float:
    """The median over steps of ``pick`` (min or max) over the ranks, in ms."""
    steps = zip(*(r[key] for r in results), strict=True)
    return float(statistics.median(pick(values) for values in steps)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    for name, degrees in PLANS.items():
        with tempfile.TemporaryDirectory() as tmp:
            results = run_distributed(
                _worker, degrees, args.steps, world_size=2, tmp_path=Path(tmp), timeout_s=600
            )
        check, slower = _per_step(results, "check", min), _per_step(results, "check", max)
        scan, reduce = _per_step(results, "scan", max), _per_step(results, "reduce", min)
        step, plain = _per_step(results, "with", max), _per_step(results, "without", max)
        print(
            f"{name}: check {check:.2f} ms a step (the faster rank; {slower:.2f} ms on the slower,"
            f" which waited for its peer): gradient scan {scan:.2f} ms "
            f"({'/'.join(str(r['grads']) for r in results)} local gradients), all-reduce "
            f"{reduce:.2f} ms; step {step:.1f} ms with it, {plain:.1f} ms without "
            f"({step - plain:+.1f} ms, {(step - plain) / plain:+.1%}; medians of {args.steps})"
        )


if __name__ == "__main__":
    main()
