"""Compiled plans run by `autoplan.parallelize` against the eager single-process reference
(issue 43 item 1), on CPU with inductor's C++ backend: loss and every gradient over 3 AdamW
steps (tests/numerics.py). Two jobs of two processes, the costliest tests here (inductor
compiles each rank's blocks, about 15-40 s a job); the rest of compile is tested without
running it (tests/test_compile.py).

Tolerances: the harness's fp32 ones (tests/numerics.py). Inductor's fused kernels sum a norm's
or a softmax's terms in another order than eager's separate kernels: a few ulps per element,
the same order of difference as a data-parallel reduction's, carried through three AdamW
steps; measured well inside them. A block that did not run compiled would still match, so each
rank also reports how many of its units it compiled.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from tests.dist_utils import run_distributed
from tests.numerics import (
    assert_matches,
    batch,
    build_model,
    full_grads,
    loss_fn,
    make_plan,
    optimizer_factory,
    reference,
)

STEPS = 3
TIMEOUT_S = 600.0  # inductor compiles every block on a cold cache first
BLOCKS = 1  # units: embedding, one block, head (one graph to compile per rank)


def compiled_worker(
    rank: int, world_size: int, model_name: str, plan_data: dict[str, Any], refused: Any
) -> dict[str, Any]:
    """Train the compiled plan; first hand `parallelize` the ``refused`` plan (if any), which
    every rank must refuse before building anything. Per step the loss and this rank's
    gradients; how many unit modules this rank compiled, and how many graphs dynamo captured
    and AOTAutograd compiled (forward and backward together) while it trained."""
    from torch._dynamo.utils import counters

    from autoplan.runtime.parallelizer import parallelize
    from passes import is_compiled

    refusal = ""
    if refused is not None:
        try:
            parallelize(build_model(model_name), plan=Plan.from_data(refused), loss_fn=loss_fn)
        except PlanError as error:
            refusal = str(error)
    plan = Plan.from_data(plan_data)
    job = parallelize(build_model(model_name, num_blocks=BLOCKS), plan=plan, loss_fn=loss_fn,
                      optimizer=optimizer_factory())  # fmt: skip
    compiled = sum(is_compiled(m) for stage in job.modules for m in stage.modules())
    records = []
    for step in range(STEPS):
        loss = job.train_step(*batch(plan.global_batch_size, step))
        records.append((float(loss), full_grads(job.named_parameters())))
    graphs = (counters["stats"]["unique_graphs"], counters["aot_autograd"]["ok"])
    return {"records": records, "compiled": compiled, "graphs": graphs, "refusal": refusal}


def _run(
    tmp_path: Path, model: str, plan: Plan, refused: Plan | None = None
) -> list[dict[str, Any]]:
    results = run_distributed(
        compiled_worker,
        model,
        plan.to_data(),
        refused.to_data() if refused is not None else None,
        world_size=plan.num_devices,
        tmp_path=tmp_path,
        timeout_s=TIMEOUT_S,
        # inductor's own cache for the test's ranks: a compile killed halfway (an interrupted
        # run) leaves a truncated kernel library in the shared /tmp/torchinductor_$USER that
        # a later run would load and fail on ("file too short")
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
    )
    expected = reference(model, plan.global_batch_size, model=build_model(model, num_blocks=BLOCKS))
    assert_matches([r["records"] for r in results], expected)
    for result in results:
        assert result["compiled"] == BLOCKS  # the block; the embedding and the head eager
        captured, compiled = result["graphs"]
        assert captured >= BLOCKS and compiled >= BLOCKS, result["graphs"]
    return results


@pytest.mark.slow
def test_llama_tensor_parallel_selective_recompute_compiled(tmp_path: Path) -> None:
    """DTensor TP with sequence parallelism, op-level selective recompute inside the compiled
    blocks, and Llama's RMSNorm, RoPE and SwiGLU fused."""
    plan = make_plan(tp=2, sequence_parallel=True, recompute="selective", num_units=BLOCKS + 2)
    _run(tmp_path, "llama", dataclasses.replace(plan, compile=True))


@pytest.mark.slow
def test_fsdp2_full_recompute_compiled_and_a_split_backward_refused(tmp_path: Path) -> None:
    """FSDP2 (ZeRO-3) around compiled, fully recomputed blocks; before it, a compiled plan on a
    zero-bubble schedule is refused on both ranks, in one line, before anything is built."""
    plan = make_plan(dp=2, zero=3, recompute="full", num_units=BLOCKS + 2)
    zero_bubble = make_plan(
        pp=2, schedule="zbv", virtual_stages=2, num_micro_batches=2, num_units=4
    )
    refused = dataclasses.replace(zero_bubble, compile=True)
    results = _run(tmp_path, "gpt", dataclasses.replace(plan, compile=True), refused=refused)
    for result in results:
        assert "compile with schedule 'zbv'" in result["refusal"]
        assert "\n" not in result["refusal"]
