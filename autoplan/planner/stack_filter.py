"""The search space cut to what a training stack runs (the stack restriction of the search).

Expects a `SearchSpace`, a `FrameworkProfile` and the traced model. Reads the stack's limits
from `cost_model.frameworks.limits`, the one statement of what a stack runs (autoplan's own
runtime included, with its traced graph's limits: the search plans what is to be run).
Guarantees: `within_model` and `within_stack` return the space holding only the values each
axis limit allows, or raise a `ConstraintError` naming the limit the constraints run into;
`StackChoices` enumerates the outer choices shape by shape with each one's `Refusal` (None:
the stack runs it); `stack_recompute_modes` gives the modes the stack gives one choice's stages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from autoplan.planner.space import (
    ConstraintError,
    SearchSpace,
    Shape,
    ShapeOptions,
    shape_options,
    shape_strategies,
    shapes,
)
from cost_model.frameworks import FrameworkProfile, Refusal
from cost_model.frameworks.limits import (
    AxisLimit,
    axis_limits,
    compile_refusal,
    outer_refusals,
    precision_refusal,
    recompute_modes,
    recompute_refusal,
)
from cost_model.hardware import Cluster
from cost_model.strategy import RecomputeMode, Strategy
from cost_model.workload import ModelProfile

# the order the stack's limits are applied to the space in (the first one the constraints
# run into is the one named)
_SEARCH_ORDER = (
    "dtype",
    "schedules",
    "recompute",
    "rank_layouts",
    "sequence_parallel",
    "tp_comm_overlap",
    "zero",
    "tp",
    "pp",
    "cp",
    "ep",
)


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


def within_model(space: SearchSpace, stack: FrameworkProfile, profile: ModelProfile) -> SearchSpace:
    """``space`` cut to the limits the traced model sets on ``stack`` (autoplan's runtime on
    a torch.export graph or a model without RoPE tables: `AxisLimit.of_model`), before the
    cluster's defaults: an axis left open takes the value the model allows, unasked;
    `ConstraintError` with the stack's reason where the constraints ask for what it refuses."""
    for limit in axis_limits(stack, profile, running=True):
        if limit.of_model:
            space = _within_model_limit(space, limit)
    return space


def _within_model_limit(space: SearchSpace, limit: AxisLimit) -> SearchSpace:
    axis, kept = limit.axis, limit.allowed
    asked = getattr(space, axis)
    if axis == "dtype":
        refused = [dtype for dtype in asked or () if dtype not in kept]
        if refused:
            raise ConstraintError(
                f"{limit.refuse(refused[0])}; or price it for another stack (--framework)"
            )
        return replace(space, dtype=(kept[0],))
    if asked is not None and not any(choice in kept for choice in asked):
        # the refusal of the value asked (a sequence-parallel one, of the least tp it needs)
        value = 2 if axis == "sequence_parallel" else max(asked)
        raise ConstraintError(f"{limit.refuse(value)}; or price it for another stack (--framework)")
    if asked is not None:
        kept = tuple(choice for choice in asked if choice in kept)
    changes: dict[str, Any] = {axis: kept}
    return replace(space, **changes)


def within_stack(
    space: SearchSpace,
    stack: FrameworkProfile,
    profile: ModelProfile,
    cluster: Cluster,
    *,
    dtype_given: bool,
) -> SearchSpace:
    """``space`` cut to what ``stack`` runs: each axis limit of its own (dtypes, schedules,
    recompute modes, rank orders, sequence parallelism, ZeRO stages, degrees it lacks);
    `ConstraintError` naming the limit where the constraints leave it nothing."""
    if space.compile and stack.compile_scope is None:
        refusal = compile_refusal(stack)
        raise ConstraintError(f"compile=True: {refusal.rule}; {refusal.fix}")
    limits = [limit for limit in axis_limits(stack, profile) if not limit.of_model]
    for axis in _SEARCH_ORDER:
        for limit in limits:
            if limit.axis == axis:
                space = _within_stack_limit(space, stack, limit, cluster, dtype_given)
    _check_policy(space, stack)
    if space.tp_comm_overlap is None:
        space = replace(space, tp_comm_overlap=_stack_overlap(stack, compiled=space.compile))
    return space


def _stack_overlap(stack: FrameworkProfile, *, compiled: bool) -> tuple[bool, ...]:
    """The overlapped TP communication the search gives ``stack``'s sequence-parallel plans
    when the constraints leave it to the stack: wherever it runs on them (`space` module
    docstring). An overlap that is a torch.compile pass (torchtitan's and autoplan's async TP)
    needs the space's plans ``compiled`` (`SearchSpace.compile`): off on eager ones, as on a
    stack without one."""
    overlap = stack.tp_comm_overlap
    if overlap is None or (overlap.needs_compile and not compiled):
        return (False,)
    return (True, False)


def _check_policy(space: SearchSpace, stack: FrameworkProfile) -> None:
    """`ConstraintError` where ``stack`` runs the space's precision policy at none of its
    dtypes and ZeRO stages (where it runs it at some, the search keeps to those: the outer
    choices' refusals, `cost_model.frameworks.limits.precision_refusal`)."""
    master, reduce, states = space.policy
    refusals = [
        precision_refusal(
            stack,
            Strategy(
                dtype=dtype,
                zero_stage=zero,
                master_dtype=master,
                grad_reduce_dtype=reduce,
                optimizer_state_dtype=states,
            ),
        )
        for dtype in space.dtype or ()
        for zero in space.zero
    ]
    if refusals and all(refusal is not None for refusal in refusals):
        raise ConstraintError(f"the precision policy: {refusals[0]}")


def _within_stack_limit(
    space: SearchSpace,
    stack: FrameworkProfile,
    limit: AxisLimit,
    cluster: Cluster,
    dtype_given: bool,
) -> SearchSpace:
    axis, allowed, rule = limit.axis, limit.allowed, limit.rule
    if axis == "dtype":
        refused = [dtype for dtype in space.dtype or () if dtype not in allowed]
        if not refused:
            return space
        given = "" if dtype_given else f" (the fastest on {cluster.device.name})"
        # the first of the stack's dtypes the device has its own peak for (V100: fp32)
        native = [d for d in allowed if d in cluster.device.peak_flops]
        fix = (native or list(allowed))[0]
        raise ConstraintError(
            f"dtype={refused[0]}{given}: {limit.refuse(refused[0]).rule}; pass dtype={fix!r} "
            f"(--dtype {fix})"
        )
    if axis == "sequence_parallel":
        if space.sequence_parallel == (True,):
            raise ConstraintError(f"sequence_parallel=True: {rule}")
        return replace(space, sequence_parallel=(False,))
    if axis == "tp_comm_overlap":
        if space.tp_comm_overlap == (True,):
            raise ConstraintError(f"tp_comm_overlap=True: {rule}")
        return replace(space, tp_comm_overlap=(False,))
    if axis in ("tp", "pp", "cp", "ep"):
        asked = getattr(space, axis)
        if asked is not None and 1 not in asked:
            raise ConstraintError(f"{axis}={list(asked)}: {rule}; allow {axis} 1 (--{axis} 1)")
        changes: dict[str, Any] = {axis: (1,)}
        return replace(space, **changes)
    if axis == "rank_layouts":
        rule += " (outermost first)"
    return restricted(space, axis, allowed, rule)


class StackChoices:
    """The outer choices of ``space`` on ``cluster``, each with why ``stack`` cannot run it
    (None: it can), shape by shape (`space.shapes`): ``shapes`` lists them, ``choices`` yields
    one shape's members. Under a pipeline engine's limits (`FrameworkProfile.pipeline_max_zero`,
    `pipeline_tensor_parallel`) a pipelined shape's members are enumerated again within them,
    so that a choice the enumeration drops as dominated by one the stack refuses (ZeRO-1 by
    ZeRO-2) is still offered."""

    def __init__(
        self,
        space: SearchSpace,
        stack: FrameworkProfile,
        profile: ModelProfile,
        cluster: Cluster,
        global_batch: int,
    ) -> None:
        self.space = space = space.for_cluster(cluster)
        self._stack, self._profile = stack, profile
        self._cluster, self._global_batch = cluster, global_batch
        self._limits = axis_limits(stack, profile, running=True)
        # Under a pipeline engine's limits, the space again within them (None: none left)
        self._limited = stack.pipeline_max_zero is not None or not stack.pipeline_tensor_parallel
        self._within: SearchSpace | None = None
        if self._limited:
            top = stack.pipeline_max_zero
            zero = tuple(z for z in space.zero if top is None or z <= top)
            tp = space.tp
            if not stack.pipeline_tensor_parallel:
                tp = (1,) if space.tp is None or 1 in space.tp else ()
            if zero and tp != ():
                self._within = replace(space, zero=zero, tp=tp)

    def shapes(self) -> list[Shape]:
        """Every shape of the space, in `space.shapes` order."""
        return list(shapes(self.space, self._profile, self._cluster, self._global_batch))

    def options(self, shape: Shape) -> ShapeOptions:
        """What the members of ``shape`` choose from."""
        return shape_options(self.space, self._profile, shape)

    def choices(
        self, shape: Shape, options: ShapeOptions | None = None
    ) -> Iterator[tuple[Strategy, Refusal | None]]:
        """The members of ``shape`` (of ``options``, its `options`), each with its refusal."""
        if options is None:
            options = self.options(shape)
        for strategy in shape_strategies(self.space, shape, options):
            refusal = self._refusal(strategy)
            if (
                refusal is not None
                and strategy.tp_comm_overlap
                and False in (self.space.tp_comm_overlap or ())
            ):
                # the overlap is a policy: where the stack cannot run it with this choice (its
                # overlap a compile pass, the blocks eager), the choice without it
                plain = replace(strategy, tp_comm_overlap=False)
                if self._refusal(plain) is None:
                    strategy, refusal = plain, None
            if not self._limited or strategy.pp_degree == 1 or refusal is not None:
                yield strategy, refusal
        within = self._within
        if within is None or shape.pp == 1 or (within.tp is not None and shape.tp not in within.tp):
            return
        for strategy in shape_strategies(
            within, shape, shape_options(within, self._profile, shape)
        ):
            # (one refused for another reason was counted by the first pass)
            if self._refusal(strategy) is None:
                yield strategy, None

    def _refusal(self, strategy: Strategy) -> Refusal | None:
        found = outer_refusals(
            self._stack, strategy, self._profile, running=True, limits=self._limits
        )
        return next(found, None)


def stack_strategies(
    space: SearchSpace,
    stack: FrameworkProfile,
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
) -> Iterator[tuple[Strategy, Refusal | None]]:
    """Every member of every shape of `StackChoices`, with its refusal."""
    choices = StackChoices(space, stack, profile, cluster, global_batch)
    for shape in choices.shapes():
        yield from choices.choices(shape)


def stack_recompute_modes(
    stack: FrameworkProfile,
    strategy: Strategy,
    profile: ModelProfile,
    modes: Sequence[RecomputeMode],
) -> tuple[tuple[RecomputeMode, ...], Refusal | None]:
    """The ``modes`` (the space's, for the schedule) ``stack`` gives ``strategy``'s stages
    (`cost_model.frameworks.limits.recompute_modes`), and, when it gives none, why."""
    kept = recompute_modes(stack, strategy, profile, modes)
    if kept or not modes:
        return kept, None
    return kept, recompute_refusal(stack, strategy, modes[0])
