"""The search space cut to what a training stack runs (the stack restriction of the search).

Expects a `SearchSpace` and a `FrameworkProfile` (autoplan's own runtime: `within_runtime`).
Guarantees: the space returned holds only choices the stack's limits allow, or a
`ConstraintError` names the limit the constraints run into; `stack_strategies` enumerates the
outer choices with each one's `Refusal` (None: the stack runs it). Moved as it was from
`autoplan.planner.search`; the frameworks' capability table is to replace it (issue 39).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from autoplan.contract.plan import runtime_refusal
from autoplan.planner.space import ConstraintError, SearchSpace, shown, strategies
from cost_model.frameworks import FrameworkProfile, Refusal
from cost_model.hardware import Cluster
from cost_model.strategy import Strategy
from cost_model.workload import ModelProfile


def restricted(
    space: SearchSpace, name: str, allowed: Sequence[object] | None, refusal: str
) -> SearchSpace:
    """``space`` with its choices ``name`` cut to ``allowed`` (None: all); `ConstraintError`
    ending in ``refusal`` when none is left."""
    if allowed is None:
        return space
    choices = getattr(space, name)
    kept = tuple(choice for choice in choices if choice in allowed)
    if not kept:
        shown = [list(c) if isinstance(c, tuple) else c for c in choices]
        raise ConstraintError(f"{name}={shown}: {refusal}; allow one of them")
    changes: dict[str, Any] = {name: kept}
    return replace(space, **changes)


def within_runtime(space: SearchSpace, profile: ModelProfile) -> SearchSpace:
    """``space`` cut to what autoplan's own runtime runs for this model (`runtime_refusal`:
    a torch.export graph only in fp32, without sequence or context parallelism; context
    parallelism only with RoPE tables); `ConstraintError` with the runtime's reason where the
    constraints ask for what it refuses."""
    exported, cp_ok = profile.exported, profile.rope_tables and not profile.exported
    limits: list[tuple[str, Any, Any]] = []  # (axis, what is left, a plan it refuses)
    if exported:
        limits += [("dtype", "fp32", {"dtype": space.dtype or "bf16"})]
        limits += [("sequence_parallel", (False,), {"sequence_parallel": True, "tp_degree": 2})]
    if not cp_ok:
        limits += [("cp", (1,), {"cp_degree": max(space.cp or (2,))})]
    if profile.moe_layers:
        # expert parallelism runs neither on DDP + ZeroRedundancyOptimizer (ZeRO-1) nor with
        # selective recompute around FSDP2's separately wrapped experts: a MoE model's search
        # leaves both out, as parallelize's own always has
        limits += [("zero", (0, 2, 3), None), ("recompute", ("none", "full"), None)]
    for axis, kept, refused in limits:
        asked = getattr(space, axis)
        if axis == "dtype":
            allowed = asked in (None, kept)
        else:
            allowed = asked is None or any(choice in kept for choice in asked)
        if not allowed:
            if refused is None:
                reason = (
                    f"{axis}={shown(asked)}: autoplan's runtime runs a mixture-of-experts model "
                    "without ZeRO-1 and selective recompute (with expert parallelism they break "
                    f"its wrappers); allow {shown(kept)}"
                )
            else:
                plan = {"dtype": "fp32", "sequence_parallel": False, "tp_degree": 1}
                plan |= {"cp_degree": 1, "ep_degree": 1}
                reason = str(runtime_refusal(SimpleNamespace(**{**plan, **refused}), profile))
            raise ConstraintError(f"{reason}; or price it for another stack (--framework)")
        if axis != "dtype" and asked is not None:
            kept = tuple(choice for choice in asked if choice in kept)
        changes: dict[str, Any] = {axis: kept}
        space = replace(space, **changes)
    return space


def within_stack(
    space: SearchSpace, stack: FrameworkProfile, cluster: Cluster, *, dtype_given: bool
) -> SearchSpace:
    """``space`` cut to what ``stack`` runs: its dtypes, schedules, recompute modes, rank
    orders and sequence parallelism (`FrameworkProfile`); `ConstraintError` naming the limit
    where the constraints leave it nothing."""
    name = stack.name
    if stack.dtypes is not None and space.dtype not in stack.dtypes:
        given = "" if dtype_given else f" (the fastest on {cluster.device.name})"
        # the first of the stack's dtypes the device has its own peak for (V100: fp32)
        native = [d for d in stack.dtypes if d in cluster.device.peak_flops]
        fix = (native or list(stack.dtypes))[0]
        raise ConstraintError(
            f"dtype={space.dtype}{given}: {name} trains in {' or '.join(stack.dtypes)}; "
            f"pass dtype={fix!r} (--dtype {fix})"
        )
    space = restricted(
        space, "schedules", stack.schedules, f"{name} runs only {', '.join(stack.schedules or ())}"
    )
    space = restricted(
        space,
        "recompute",
        stack.recompute_modes,
        f"{name} has only {' and '.join(stack.recompute_modes or ())} recompute",
    )
    orders = " or ".join(str(list(layout)) for layout in stack.rank_layouts or ())
    space = restricted(
        space,
        "rank_layouts",
        stack.rank_layouts,
        f"{name} orders its process groups {orders} (outermost first)",
    )
    if stack.sequence_parallel is False:
        if space.sequence_parallel == (True,):
            raise ConstraintError(
                f"sequence_parallel=True: {name} has no Megatron-style sequence parallelism"
            )
        space = replace(space, sequence_parallel=(False,))
    space = restricted(
        space,
        "zero",
        stack.zero_stages,
        f"{name} runs only ZeRO {', '.join(map(str, stack.zero_stages or ()))}",
    )
    # degrees the stack does not have: 1 only (`FrameworkProfile.refusal` names the same)
    for axis, has, what in (
        ("tp", stack.tensor_parallel, "Megatron-style tensor parallelism"),
        ("pp", stack.pipeline_parallel, "pipeline parallelism"),
        ("cp", stack.context_parallel, "ring-attention context parallelism"),
        ("ep", stack.expert_parallel, "expert parallelism as a plan degree"),
    ):
        if has:
            continue
        allowed = getattr(space, axis)
        if allowed is not None and 1 not in allowed:
            raise ConstraintError(
                f"{axis}={list(allowed)}: {name} has no {what}; allow {axis} 1 (--{axis} 1)"
            )
        changes: dict[str, Any] = {axis: (1,)}
        space = replace(space, **changes)
    return space


def stack_strategies(
    space: SearchSpace,
    stack: FrameworkProfile,
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
) -> Iterator[tuple[Strategy, Refusal | None]]:
    """The outer choices of ``space``, each with why ``stack`` cannot run it (None: it can).
    Under a pipeline engine's limits (`FrameworkProfile.refusal`) the pipelined choices are
    enumerated again within them, so that a choice the enumeration drops as dominated by one
    the stack refuses (ZeRO-1 by ZeRO-2) is still offered."""
    limited = stack.pipeline_max_zero is not None or not stack.pipeline_tensor_parallel
    moe = bool(profile.moe_layers)
    for strategy in strategies(space, profile, cluster, global_batch):
        refusal = stack.refusal(strategy, moe=moe)
        if not limited or strategy.pp_degree == 1 or refusal is not None:
            yield strategy, refusal
    if not limited:
        return
    top = stack.pipeline_max_zero
    zero = tuple(z for z in space.zero if top is None or z <= top)
    tp = space.tp
    if not stack.pipeline_tensor_parallel:
        tp = (1,) if space.tp is None or 1 in space.tp else ()
    if not zero or tp == ():
        return
    within = replace(space, zero=zero, tp=tp)
    for strategy in strategies(within, profile, cluster, global_batch):
        # (one refused for another reason was counted by the first pass)
        if strategy.pp_degree > 1 and stack.refusal(strategy, moe=moe) is None:
            yield strategy, None
