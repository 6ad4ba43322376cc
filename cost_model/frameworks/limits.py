"""What a training stack runs: its limits, read from its `FrameworkProfile` in one place.

Expects a profile (its capability fields: `FrameworkProfile.dtypes`, `schedules`, ...,
`Capabilities`) and the model's facts (`ModelFacts`: a traced `ModelProfile`, or what an
exporter states from the model's sizes).
Guarantees, for the search, `Plan.validate`, `parallelize` and the exporters alike:
- `axis_limits`: per plan axis, the values the stack runs; the search keeps to them
  (`autoplan.planner.stack_filter`), and a plan outside is refused with the limit's `Refusal`;
- `outer_refusals`: those of the axes of an outer choice, then the stack's rules that combine
  axes (ZeRO with pp, tp with pp, the interleaved schedule's micro-batches, ...);
- `recompute_modes`: the modes the stack gives the stages of one outer choice;
- `plan_refusals`: every limit a whole plan breaks, in one fixed order (the first is what
  `FrameworkProfile.plan_refusal` reports).
Each `Refusal` names the value, the rule and the fix, and its `limit`, by which an exporter
words it in the stack's own terms (`Capabilities.explained`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from cost_model.messages import shown
from cost_model.partial_recompute import block_method_count, stage_blocks
from cost_model.precision import FP8_RECIPE_NAMES, PLAIN_DTYPES, fp8_recipe, precision_policy
from cost_model.schedules import V_SCHEDULES, ScheduleName, runs_in_gpipe_order
from cost_model.stage_splits import StageSplitError
from cost_model.strategy import PlanLike, RecomputeMode, Strategy, is_subsequence

if TYPE_CHECKING:
    from cost_model.frameworks.profile import FrameworkProfile

# The limit a refusal comes from. Axis limits: a value of one plan axis the stack lacks.
# Combinations: rules over several axes. The runtime's: autoplan's own runtime on its model.
LimitKey = Literal[
    "cp",
    "ep",
    "pp",
    "tp",
    "zero",
    "dtype",
    "schedule",
    "sequence-parallel",
    "recompute",
    "rank-layout",
    "cp-zero",
    "moe-tp-sp",
    "interleaved",
    "pipeline-tp",
    "pipeline-zero",
    "recompute-scope",
    "stage-cuts",
    "expert-layout",
    "expert-groups",
    "ep-zero1",
    "ep-selective",
    "compile",
    "compile-scope",
    "optimizer-offload",
    "grad-reduce",
    "master-states",
    "hsdp",
    "tp-comm-overlap",
    "tp-overlap-compile",
    "partial-recompute",
    "etp",
    "activation-offload",
]
# The search-space field an axis limit restricts (`autoplan.planner.space.SearchSpace`).
SearchAxis = Literal[
    "cp", "ep", "pp", "tp", "zero", "dtype", "schedules", "sequence_parallel", "recompute",
    "rank_layouts", "tp_comm_overlap",
]  # fmt: skip


class ModelFacts(Protocol):
    """What a stack's limits read of the model (a traced `ModelProfile` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def num_units(self) -> int: ...
    @property
    def has_experts(self) -> bool: ...
    @property
    def exported(self) -> bool: ...
    @property
    def rope_tables(self) -> bool: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    """Why a stack cannot run a plan: the plan's value, the stack's rule, and the nearest
    change the stack runs. Prints as one line, ``value: rule; fix`` (or ``text``)."""

    # what the plan does, with its numbers: "schedule gpipe", "zero 1 with pp 2"
    value: str
    # the stack's limit, the same for every plan it refuses so (the search counts by it)
    rule: str
    # the nearest plan the stack runs: "set --schedule 1f1b"
    fix: str
    # which limit (`LimitKey`), and the plan field it refuses ("tp_degree", "schedule", ...)
    limit: LimitKey
    field: str
    # the whole message in the stack's own sentence, where it says more than value, rule
    # and fix (autoplan's runtime, which names the model and why its graph cannot)
    text: str = ""

    def __str__(self) -> str:
        return self.text or f"{self.value}: {self.rule}; {self.fix}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Explanation:
    """A limit in the stack's own terms, citing the code that sets it: what `autoplan export`
    says of a plan that breaks it. ``why`` and ``fix`` are `str.format` templates over the
    plan's facts (``autoplan.export._common.plan_facts``: ``{tp}``, ``{pp}``, ``{cp}``,
    ``{ep}``, ``{zero}``, ``{m}``, ``{v}``, ``{schedule}``, ``{framework}``, ...); ``value``
    too, where the export shows the refused value otherwise than the plan field's own."""

    why: str
    fix: str
    value: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class AxisLimit:
    """The values of one plan axis a stack runs (`axis_limits`)."""

    axis: SearchAxis
    allowed: tuple[Any, ...]
    # the stack's rule, as its refusals name it
    rule: str
    # the refusal of a value outside ``allowed``
    refuse: Callable[[Any], Refusal]
    # True: the traced model sets it (autoplan's runtime on an exported graph), so the search
    # takes it before the cluster's defaults, unasked; False: the stack's own limit
    of_model: bool = False


# recompute modes from the least kept to the most
RECOMPUTE_ORDER: tuple[RecomputeMode, ...] = ("none", "selective", "full")
# the order `outer_refusals` checks the axes of an outer choice in
_OUTER_AXES: tuple[SearchAxis, ...] = ("cp", "ep", "pp", "tp", "zero")
# the order `plan_refusals` checks the other axes in, after the outer choice's rules
_PLAN_AXES: tuple[SearchAxis, ...] = (
    "schedules",
    "sequence_parallel",
    "tp_comm_overlap",
    "dtype",
    "recompute",
    "rank_layouts",
)
_DEGREES: dict[str, tuple[str, str]] = {
    "cp": ("context_parallel", "ring-attention context parallelism"),
    "ep": ("expert_parallel", "expert parallelism as a plan degree"),
    "pp": ("pipeline_parallel", "pipeline parallelism"),
    "tp": ("tensor_parallel", "Megatron-style tensor parallelism"),
}


def axis_limits(
    stack: FrameworkProfile, model: ModelFacts, *, running: bool = False
) -> tuple[AxisLimit, ...]:
    """Per plan axis, the values ``stack`` runs on ``model`` (axes it runs whole are left
    out): the stack's own limits, then, for autoplan's runtime, its traced graph's.

    ``running`` True adds what running this traced model needs (a torch.export graph's,
    expert wrappers': `Capabilities.runs_traced_graph`, `expert_wrapper_limits`): the search,
    `Plan.validate` and `parallelize` ask so, the cost model prices a plan without them; so
    does every function here that takes it."""
    limits = [*_stack_limits(stack)]
    if running and stack.capabilities.runs_traced_graph:
        limits += _traced_graph_limits(model)
    return tuple(limits)


def _stack_limits(stack: FrameworkProfile) -> Iterator[AxisLimit]:
    name = stack.name
    for axis, (flag, what) in _DEGREES.items():
        if not getattr(stack, flag):
            rule = f"{name} has no {what}"
            yield AxisLimit(
                axis=axis,  # type: ignore[arg-type]
                allowed=(1,),
                rule=rule,
                refuse=_degree_refusal(axis, rule),
            )
    if (zero := stack.zero_stages) is not None:
        rule = f"{name} runs only ZeRO {', '.join(map(str, zero))}"
        yield AxisLimit(axis="zero", allowed=zero, rule=rule, refuse=_zero_refusal(rule, zero))
    if (schedules := stack.schedules) is not None:
        rule = f"{name} runs only {', '.join(schedules)}"
        yield AxisLimit(
            axis="schedules",
            allowed=schedules,
            rule=rule,
            refuse=_schedule_refusal(rule, schedules),
        )
    if stack.sequence_parallel is False:
        sp_rule = f"{name} has no Megatron-style sequence parallelism"
        yield AxisLimit(
            axis="sequence_parallel",
            allowed=(False,),
            rule=sp_rule,
            refuse=lambda _: Refusal(
                value="sequence parallelism",
                rule=sp_rule,
                fix="leave out --sequence-parallel",
                limit="sequence-parallel",
                field="sequence_parallel",
            ),
        )
    if stack.tp_comm_overlap is None:
        overlap_rule = f"{name} does not overlap its tensor-parallel communication with the GEMMs"
        yield AxisLimit(
            axis="tp_comm_overlap",
            allowed=(False,),
            rule=overlap_rule,
            refuse=lambda _: Refusal(
                value="tp_comm_overlap",
                rule=overlap_rule,
                fix="set tp_comm_overlap: false (leave out --tp-comm-overlap)",
                limit="tp-comm-overlap",
                field="tp_comm_overlap",
            ),
        )
    plain = stack.dtypes or PLAIN_DTYPES
    if stack.dtypes is not None or set(stack.fp8_recipes) != set(FP8_RECIPE_NAMES):
        dtypes = (*plain, *stack.fp8_recipes)
        fp8_words = (
            f"fp8 as {' or '.join(stack.fp8_recipes)}" if stack.fp8_recipes else "no fp8 recipe"
        )
        dtype_rule = f"{name} trains in {' or '.join(plain)}, with {fp8_words}"

        def _dtype_refusal(dtype: str) -> Refusal:
            fp8 = fp8_recipe(dtype)
            rule = (
                f"{name} has {fp8_words} ({fp8.summary} is {dtype})"
                if fp8 is not None
                else f"{name} trains in {' or '.join(plain)}"
            )
            # the stack's own words for why, where it states them (and they need no plan facts)
            words = stack.capabilities.explained.get(f"dtype:{dtype}") if fp8 else None
            if words is not None and "{" not in words.why + words.fix:
                rule, fix = f"{rule}: {words.why}", words.fix
            elif fp8 is not None and stack.fp8_recipes:
                fix = f"set --dtype {stack.fp8_recipes[0]}"
            else:
                fix = f"set --dtype {'bf16' if 'bf16' in plain else plain[0]}"
            return Refusal(value=f"dtype {dtype}", rule=rule, fix=fix, limit="dtype", field="dtype")

        yield AxisLimit(axis="dtype", allowed=dtypes, rule=dtype_rule, refuse=_dtype_refusal)
    if (modes := stack.recompute_modes) is not None:
        rule = f"{name} has only {' and '.join(modes)} recompute"
        yield AxisLimit(
            axis="recompute", allowed=modes, rule=rule, refuse=_recompute_refusal(rule, modes)
        )
    if (layouts := stack.rank_layouts) is not None:
        orders = " or ".join(str(list(layout)) for layout in layouts)
        layout_rule = f"{name} orders its process groups {orders}"
        yield AxisLimit(
            axis="rank_layouts",
            allowed=layouts,
            rule=layout_rule,
            refuse=lambda layout: Refusal(
                value=f"rank_layout {list(layout)}",
                rule=layout_rule,
                fix=f"set rank_layout {list(layouts[0])}",
                limit="rank-layout",
                field="rank_layout",
            ),
        )


def _degree_refusal(axis: str, rule: str) -> Callable[[Any], Refusal]:
    def refuse(degree: Any) -> Refusal:
        return Refusal(
            value=f"{axis} {degree}",
            rule=rule,
            fix=f"set --{axis} 1",
            limit=axis,  # type: ignore[arg-type]
            field=f"{axis}_degree",
        )

    return refuse


def _zero_refusal(rule: str, stages: tuple[int, ...]) -> Callable[[Any], Refusal]:
    def refuse(z: Any) -> Refusal:
        # the next stage up (the same traffic, less memory), else the largest below
        nearest = min((s for s in stages if s > z), default=max(stages))
        return Refusal(
            value=f"zero {z}",
            rule=rule,
            fix=f"set --zero {nearest}",
            limit="zero",
            field="zero_stage",
        )

    return refuse


def _schedule_refusal(rule: str, allowed: tuple[ScheduleName, ...]) -> Callable[[Any], Refusal]:
    def refuse(value: Any) -> Refusal:
        schedule, virtual_stages = value if isinstance(value, tuple) else (value, 1)
        return Refusal(
            value=f"schedule {schedule}",
            rule=rule,
            fix=_nearest_schedule(allowed, virtual_stages),
            limit="schedule",
            field="schedule",
        )

    return refuse


def _recompute_refusal(rule: str, allowed: tuple[RecomputeMode, ...]) -> Callable[[Any], Refusal]:
    def refuse(refused: Any) -> Refusal:
        # the next mode up that the stack has (keeps less), else the heaviest it has
        heavier = RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(refused) :]
        nearest = next((mode for mode in heavier if mode in allowed), allowed[-1])
        return Refusal(
            value=f"recompute {refused}",
            rule=rule,
            fix=f"set --recompute {nearest}",
            limit="recompute",
            field="stages[*].recompute",
        )

    return refuse


def _traced_graph_limits(model: ModelFacts) -> Iterator[AxisLimit]:
    """autoplan's runtime runs the traced graph itself: a torch.export graph pins its dtype,
    inlines its norms and fixes its sequence; context parallelism splits RoPE tables."""
    name = shown(model.name)
    if model.exported:
        yield AxisLimit(
            axis="cp",
            allowed=(1,),
            rule="a torch.export graph fixes the sequence length",
            of_model=True,
            refuse=lambda cp: _runtime_refusal(
                "cp",
                "cp_degree",
                f"cp_degree = {cp}, but {name} was traced with torch.export, whose graph fixes "
                "the sequence length and position tables that context parallelism must split; "
                "use cp_degree 1 for this model",
            ),
        )
    elif not model.rope_tables:
        yield AxisLimit(
            axis="cp",
            allowed=(1,),
            rule="context parallelism splits RoPE tables, which the model lacks",
            of_model=True,
            refuse=lambda cp: _runtime_refusal(
                "cp",
                "cp_degree",
                f"cp_degree = {cp}, but {name} has no RoPE tables (rope_cos/rope_sin buffers) "
                "for context parallelism to split by position; models with learned position "
                "embeddings (GPT) are not supported: use cp_degree 1",
            ),
        )
    if not model.exported:
        return
    yield AxisLimit(
        axis="dtype",
        allowed=("fp32",),
        rule="a torch.export graph pins fp32",
        of_model=True,
        refuse=lambda dtype: _runtime_refusal(
            "dtype",
            "dtype",
            f"dtype = {shown(dtype)}, but {name} was traced with torch.export in fp32, and the "
            "exported graph pins that dtype (it drops casts that were no-ops in fp32, such as an "
            "RMSNorm's cast back to the input dtype), so bf16/fp16 weights would meet fp32 "
            "activations; use dtype 'fp32' for this model",
        ),
    )
    yield AxisLimit(
        axis="sequence_parallel",
        allowed=(False,),
        rule="a torch.export graph inlines its norms",
        of_model=True,
        refuse=lambda tp: _runtime_refusal(
            "sequence-parallel",
            "sequence_parallel",
            f"sequence_parallel with tp_degree = {tp}, but {name} was traced with "
            "torch.export, which inlines its norms (sequence parallelism shards norm modules); "
            "turn sequence_parallel off (tensor parallelism itself works)",
        ),
    )


def _runtime_refusal(limit: LimitKey, field: str, text: str) -> Refusal:
    """A refusal of autoplan's runtime, in its own sentence ``value, but why; fix`` (or
    ``value: why; fix``)."""
    head, _, fix = text.rpartition("; ")
    value, _, rule = head.partition(", but " if ", but " in head else ": ")
    return Refusal(value=value, rule=rule, fix=fix, limit=limit, field=field, text=text)


def outer_refusals(
    stack: FrameworkProfile,
    strategy: Strategy,
    model: ModelFacts,
    *,
    running: bool = False,
    limits: Sequence[AxisLimit] | None = None,
) -> Iterator[Refusal]:
    """Every limit ``strategy``'s outer choices break on ``stack``: its axes' limits
    (cp, ep, pp, tp, ZeRO), then the rules over several axes (expert groups, pipelines).
    ``limits``: `axis_limits` of the same stack, model and ``running``, where the caller
    asks of many choices (an enumeration builds them once)."""
    if limits is None:
        limits = axis_limits(stack, model, running=running)
    values = {
        "cp": strategy.cp_degree,
        "ep": strategy.ep_degree,
        "pp": strategy.pp_degree,
        "tp": strategy.tp_degree,
        "zero": strategy.zero_stage,
    }
    for axis in _OUTER_AXES:
        value = values[axis]
        for limit in limits:
            if limit.axis == axis and value not in limit.allowed:
                yield limit.refuse(value)
    yield from _combination_refusals(stack, strategy, model, running)
    if (offload := optimizer_offload_refusal(stack, strategy)) is not None:
        yield offload


def _combination_refusals(
    stack: FrameworkProfile, strategy: Strategy, model: ModelFacts, running: bool
) -> Iterator[Refusal]:
    name, caps, z = stack.name, stack.capabilities, strategy.zero_stage
    tp, pp, cp, ep = strategy.tp_degree, strategy.pp_degree, strategy.cp_degree, strategy.ep_degree
    if strategy.compile and stack.compile_scope is None:
        yield compile_refusal(stack)
    if caps.cp_min_zero is not None and cp > 1 and z < caps.cp_min_zero:
        yield Refusal(
            value=f"zero {z} with cp {cp}",
            rule=f"{name} shards the weights over dp x cp with context parallelism",
            fix=f"set --zero {caps.cp_min_zero} or more, or --cp 1",
            limit="cp-zero",
            field="zero_stage",
        )
    moe_tp = caps.moe_tp_needs_sequence_parallel and model.has_experts and tp > 1
    if moe_tp and not strategy.sequence_parallel:
        yield Refusal(
            value=f"tp {tp} without sequence parallelism on a mixture-of-experts model",
            rule=f"{name} needs sequence parallelism for experts with tp > 1",
            fix="set --sequence-parallel, or --tp 1",
            limit="moe-tp-sp",
            field="sequence_parallel",
        )
    wrappers = running and caps.expert_wrapper_limits
    if wrappers and ep > 1 and strategy.dp_wrapper == "ddp" and z == 1:
        yield _runtime_refusal(
            "ep-zero1",
            "zero_stage",
            f"zero_stage 1 with ep_degree = {ep}: ZeRO-1 runs as DDP + "
            "ZeroRedundancyOptimizer here, which would hand one rank's experts to the ranks "
            "holding others (it broadcasts each updated parameter over the whole data-parallel "
            "group); use zero_stage 0 or 2",
        )
    if strategy.etp_degree > 1 and not stack.expert_tensor_parallel:
        etp_rule, etp_fix = _own_words(
            caps.explained.get("etp"),
            f"{name} does not split routed experts over tensor-parallel ranks",
            "set etp_degree 1 (leave it out), or price it for megatron-lm",
        )
        yield Refusal(
            value=f"etp_degree {strategy.etp_degree}",
            rule=etp_rule,
            fix=etp_fix,
            limit="etp",
            field="etp_degree",
        )
    elif 1 < strategy.etp_degree < tp and caps.etp_below_tp_needs_sp_folding:
        yield from _etp_below_tp_refusals(stack, strategy)
    yield from _expert_group_refusals(stack, strategy)
    if pp > 1:
        yield from _pipeline_refusals(stack, strategy)
    if (precision := precision_refusal(stack, strategy)) is not None:
        yield precision
    if strategy.hsdp and z not in stack.hsdp_zero_stages:
        yield hsdp_refusal(stack, strategy)
    elif strategy.hsdp and cp > 1 and not caps.hsdp_context_parallel:
        yield Refusal(
            value=f"dp_shard {strategy.dp_shard_degree} with cp {cp}",
            rule=f"{name} runs HSDP on a 2-D (replicate, shard) mesh of dp ranks, without "
            "context parallelism",
            fix="leave dp_shard_degree out (the weights sharded over dp x cp), or set --cp 1",
            limit="hsdp",
            field="dp_shard_degree",
        )
    overlap = stack.tp_comm_overlap
    if strategy.tp_comm_overlap and overlap and overlap.needs_compile and not strategy.compile:
        yield tp_overlap_compile_refusal(stack)


def tp_overlap_compile_refusal(stack: FrameworkProfile) -> Refusal:
    """The refusal of a plan that overlaps TP communication on a stack whose overlap is a
    torch.compile pass (`TpCommOverlap.needs_compile`) with blocks left uncompiled."""
    overlap = stack.tp_comm_overlap
    assert overlap is not None
    return Refusal(
        value="tp_comm_overlap without compile",
        rule=f"{stack.name}'s overlap is {overlap.name}, a torch.compile pass over the blocks",
        fix="set compile: true on every stage, or tp_comm_overlap: false",
        limit="tp-overlap-compile",
        field="compile",
    )


def compile_refusal(stack: FrameworkProfile) -> Refusal:
    """The refusal of a compiled plan (or stage) on a stack that does not torch.compile the
    model (`FrameworkProfile.compile_scope` None), in its own words where it states them
    (`Capabilities.explained` "compile")."""
    rule = f"{stack.name} does not torch.compile the model"
    fix = "set compile: false (leave out --compile)"
    words = stack.capabilities.explained.get("compile")
    if words is not None and "{" not in words.why + words.fix:
        rule, fix = f"{rule}: {words.why}", words.fix
    return Refusal(value="compile", rule=rule, fix=fix, limit="compile", field="compile")


def _compile_refusals(stack: FrameworkProfile, plan: PlanLike) -> Iterator[Refusal]:
    """A stage's own ``compile`` (`autoplan.Plan`'s ``stages[i].compile``) on a stack that
    compiles nothing, or that differs from the other stages' on a stack with one compile
    setting for the whole model (`FrameworkProfile.compile_scope` "global")."""
    plan_compile = bool(getattr(plan, "compile", False))
    flags = []
    for stage in plan.stages:
        own = getattr(stage, "compile", None)
        flags.append(plan_compile if own is None else bool(own))
    if any(flags) and not plan_compile and stack.compile_scope is None:
        yield compile_refusal(stack)
    if stack.compile_scope == "global" and len(set(flags)) > 1:
        yield Refusal(
            value=f"compile on {sum(flags)} of {len(flags)} stages",
            rule=f"{stack.name} has one compile setting for the whole model",
            fix=f"set compile: {'true' if plan_compile else 'false'} on every stage (leave "
            "stages[*].compile out)",
            limit="compile-scope",
            field="stages[*].compile",
        )


def activation_offload_refusals(
    stack: FrameworkProfile, plan: PlanLike, num_units: int
) -> Iterator[Refusal]:
    """A stage's ``activation_offload`` on a stack without activation offload
    (`FrameworkProfile.activation_offload`), or breaking Megatron-Core's checks
    (``activation_offload_rules`` "megatron-core": TransformerConfig.__post_init__ refuses
    cpu_offloading with pipeline parallelism, with recompute, and for N >= num_layers)."""
    counts = [int(getattr(stage, "activation_offload", 0) or 0) for stage in plan.stages]
    total = sum(counts)
    if total == 0:
        return
    value = f"activation_offload [{', '.join(map(str, counts))}]"
    field = "stages[*].activation_offload"
    limit: LimitKey = "activation-offload"
    fix = "leave stages[*].activation_offload out"
    if stack.activation_offload is None:
        rule = stack.activation_offload_why or f"{stack.name} does not offload activations"
        yield Refusal(
            value=value,
            rule=rule,
            fix=f"{fix}, or price the plan for autoplan or megatron-lm",
            limit=limit,
            field=field,
        )
        return
    if stack.activation_offload_rules != "megatron-core":
        return
    name = stack.name
    if plan.pp_degree > 1:
        yield Refusal(
            value=f"{value} with pp {plan.pp_degree}",
            rule=f"{name} offloads activations without pipeline parallelism only "
            "(TransformerConfig: no support for pipeline parallelism with CPU offloading)",
            fix=f"set pp 1, or {fix}",
            limit=limit,
            field=field,
        )
    modes = sorted({stage.recompute for stage in plan.stages} - {"none"})
    if modes:
        yield Refusal(
            value=f"{value} with recompute {' and '.join(modes)}",
            rule=f"{name}'s CPU offloading does not work with activation recompute "
            "(TransformerConfig)",
            fix=f"set recompute none on every stage, or {fix}",
            limit=limit,
            field=field,
        )
    blocks = sum(
        stage_blocks(stage.first_unit, stage.last_unit, num_units) for stage in plan.stages
    )
    if total >= blocks:
        yield Refusal(
            value=f"{value} of the model's {blocks} layers",
            rule=f"{name} offloads fewer layers than the model has (--cpu-offloading-num-"
            "layers below num_layers, TransformerConfig: the last layer's backward starts at "
            "once)",
            fix=f"offload at most {blocks - 1}, or {fix}",
            limit=limit,
            field=field,
        )


def activation_offload_twin_allowed(stack: FrameworkProfile, strategy: Strategy) -> bool:
    """Whether the search may offer ``strategy`` with its blocks' activations on the host
    (`Strategy.activation_offload`): the stack offloads activations, and under Megatron-Core's
    rules without pipeline parallelism (its recompute and last-layer rules are the twin's own:
    it offloads blocks under 'none' only, never the model's last)."""
    if stack.activation_offload is None:
        return False
    return stack.activation_offload_rules != "megatron-core" or strategy.pp_degree == 1


def optimizer_offload_refusal(stack: FrameworkProfile, strategy: Strategy) -> Refusal | None:
    """Why ``stack`` cannot run ``strategy``'s optimizer offload
    (`FrameworkProfile.optimizer_offload_zero_stages`), or None: no offload at all (in its own
    words where it states them), not at this ZeRO stage, or not a share below 1 there."""
    share, z = strategy.optimizer_offload, strategy.zero_stage
    if share <= 0.0:
        return None
    name, stages = stack.name, stack.optimizer_offload_zero_stages
    value = f"optimizer_offload {share:g} at zero {z}"
    fix = "set optimizer_offload: 0 (leave it out)"
    if not stages:
        rule = f"{name} does not offload the optimizer to the host"
        words = stack.capabilities.explained.get("optimizer_offload")
        if words is not None and "{" not in words.why + words.fix:
            rule, fix = f"{name}: {words.why}", words.fix
    elif z not in stages:
        rule = f"{name} offloads the optimizer at ZeRO {' or '.join(map(str, stages))} only"
        fix = f"set --zero {stages[0]}, or {fix}"
    elif share < 1.0 and z not in stack.optimizer_offload_partial_zero_stages:
        partial = stack.optimizer_offload_partial_zero_stages
        rule = f"{name} offloads all of the optimizer or none at ZeRO {z}"
        if partial:
            rule += f" (a share below 1 at ZeRO {' or '.join(map(str, partial))} only)"
        fix = f"set optimizer_offload: 1, or {fix}"
    elif strategy.fp8_all_gather and stack.optimizer_offload_fp8_gather_why:
        value += " with fp8_all_gather"
        rule = f"{name} {stack.optimizer_offload_fp8_gather_why}"
        fix = f"set fp8_all_gather: false, or {fix}"
    else:
        return None
    return Refusal(
        value=value, rule=rule, fix=fix, limit="optimizer-offload", field="optimizer_offload"
    )


def partial_refusals(stack: FrameworkProfile, plan: PlanLike, num_units: int) -> Iterator[Refusal]:
    """A stage's ``recompute_units`` (`autoplan.Plan`'s partial recompute) on a stack that
    recomputes whole stages only, or, under Megatron-LM's block method
    (`FrameworkProfile.partial_recompute` "block"), with selective recompute or with counts no
    single ``--recompute-num-layers`` states (`block_method_count`)."""
    stages = [
        (stage.first_unit, stage.last_unit, getattr(stage, "recompute_units", None))
        for stage in plan.stages
    ]
    counts = [count for _, _, count in stages]
    if all(count is None for count in counts):
        return
    value = f"recompute_units [{', '.join('all' if c is None else str(c) for c in counts)}]"
    field = "stages[*].recompute_units"
    fix = "leave stages[*].recompute_units out (every block of a stage recomputed)"
    if stack.partial_recompute is None:
        why = stack.partial_recompute_why or f"{stack.name} recomputes whole stages only"
        yield Refusal(
            value=value,
            rule=why,
            fix=f"{fix}, or price the plan for autoplan or megatron-lm",
            limit="partial-recompute",
            field=field,
        )
    elif stack.partial_recompute == "block":
        modes = {stage.recompute for stage in plan.stages}
        if modes != {"full"}:
            yield Refusal(
                value=f"{value} with recompute {' and '.join(sorted(modes))}",
                rule=f"{stack.name}'s block method recomputes whole layers "
                "(--recompute-granularity full); selective recompute covers every layer "
                "(TransformerConfig: recompute_num_layers must be None)",
                fix=f"set recompute full on every stage, or {fix}",
                limit="partial-recompute",
                field=field,
            )
            return
        _, mismatch = block_method_count(stages, num_units)
        if mismatch is not None:
            yield Refusal(
                value=value,
                rule=f"{stack.name} recomputes the first --recompute-num-layers N layers of "
                f"every pipeline stage, one N for all: {mismatch}",
                fix=f"give every stage the same recompute_units (at most its blocks), or {fix}",
                limit="partial-recompute",
                field=field,
            )


def hsdp_refusal(stack: FrameworkProfile, strategy: Strategy) -> Refusal:
    """Why ``stack`` cannot run ``strategy``'s HSDP (`FrameworkProfile.hsdp_zero_stages`): no
    HSDP at all (in its own words where it states them), or not at this ZeRO stage."""
    name, stages, z = stack.name, stack.hsdp_zero_stages, strategy.zero_stage
    value = f"dp_shard {strategy.dp_shard_degree} of dp {strategy.dp_degree} at zero {z}"
    fix = "leave dp_shard_degree out (the weights sharded over all of dp)"
    if stages:
        zeros = " or ".join(map(str, stages))
        return Refusal(
            value=value,
            rule=f"{name} runs HSDP at ZeRO {zeros} only",
            fix=f"set --zero {stages[0]}, or {fix}",
            limit="hsdp",
            field="dp_shard_degree",
        )
    words = stack.capabilities.explained.get("hsdp")
    rule = f"{name} has no HSDP (sharding within groups of dp, replicating across them)"
    if words is not None and "{" not in words.why + words.fix:
        rule, fix = f"{name}: {words.why}", words.fix
    return Refusal(value=value, rule=rule, fix=fix, limit="hsdp", field="dp_shard_degree")


def _pipeline_refusals(stack: FrameworkProfile, strategy: Strategy) -> Iterator[Refusal]:
    name, needs = stack.name, stack.capabilities.interleaved_microbatches
    tp, pp, z, m = (
        strategy.tp_degree,
        strategy.pp_degree,
        strategy.zero_stage,
        strategy.num_micro_batches,
    )
    if strategy.schedule == "interleaved-1f1b":
        value = f"interleaved-1f1b with m = {m} micro-batch{'es' if m > 1 else ''} on pp = {pp}"
        if needs == "pp-or-more" and m < pp:
            yield Refusal(
                value=value,
                rule=f"{name}'s interleaved schedule needs m >= pp",
                fix=f"use at least {pp} micro-batches, or --schedule 1f1b",
                limit="interleaved",
                field="num_micro_batches",
            )
        if needs == "multiple-of-pp" and (m % pp or pp <= 2):
            fix = (
                f"use a multiple of {pp} micro-batches ({-(-m // pp) * pp})"
                if pp > 2
                else "use pp > 2"
            )
            yield Refusal(
                value=value,
                rule=f"{name}'s interleaved schedule needs pp > 2 and a multiple of pp "
                "micro-batches",
                fix=f"{fix}, or --schedule 1f1b",
                limit="interleaved",
                field="num_micro_batches",
            )
    if not stack.pipeline_tensor_parallel and tp > 1:
        yield Refusal(
            value=f"tp {tp} with pp {pp}",
            rule=f"{name}'s pipeline engine has no tensor parallelism",
            fix="set --tp 1, or --pp 1",
            limit="pipeline-tp",
            field="tp_degree",
        )
    if stack.pipeline_max_zero is not None and z > stack.pipeline_max_zero:
        yield Refusal(
            value=f"zero {z} with pp {pp}",
            rule=f"{name}'s pipeline engine runs ZeRO {stack.pipeline_max_zero} at most",
            fix=f"set --zero {stack.pipeline_max_zero}, or --pp 1",
            limit="pipeline-zero",
            field="zero_stage",
        )


def precision_refusal(stack: FrameworkProfile, strategy: Strategy) -> Refusal | None:
    """Why ``stack`` cannot run ``strategy``'s precision policy (`FrameworkProfile.
    grad_reduce_dtypes`, `master_and_states`), in its own words where its profile states them
    (`Capabilities.explained` "grad-reduce", "master-states"); None when it can."""
    policy, name, z = strategy.precision, stack.name, strategy.zero_stage
    words = stack.capabilities.explained
    reduces = stack.grad_reduce_dtypes
    if reduces is not None and policy.grad_reduce not in reduces:
        rule = f"{name} reduces gradients in {' or '.join(reduces)}"
        default = precision_policy(strategy.dtype).grad_reduce
        fix = f"set grad_reduce_dtype {default if default in reduces else reduces[0]}"
        rule, fix = _own_words(words.get("grad-reduce"), rule, fix)
        return Refusal(
            value=f"grad_reduce_dtype {policy.grad_reduce}",
            rule=rule,
            fix=fix,
            limit="grad-reduce",
            field="grad_reduce_dtype",
        )
    combos = stack.master_and_states
    if combos is None:
        return None
    pair = (policy.master, policy.optimizer_state)
    stages = [least for master, states, least in combos if (master, states) == pair]
    if stages and z >= min(stages):
        return None
    value = f"master_dtype {pair[0]} with optimizer_state_dtype {pair[1]}"
    if stages:
        value, least = f"{value} at zero {z}", min(stages)
        rule = (
            f"{name} keeps {pair[0]} master weights with {pair[1]} AdamW states from ZeRO {least}"
        )
        fix = f"set --zero {least}"
    else:
        kept = " or ".join(f"{m} master with {s} states" for m, s, _ in combos)
        rule = f"{name} keeps {kept}"
        fix = f"set master_dtype {combos[0][0]} and optimizer_state_dtype {combos[0][1]}"
    rule, fix = _own_words(words.get("master-states"), rule, fix)
    return Refusal(value=value, rule=rule, fix=fix, limit="master-states", field="master_dtype")


def _own_words(words: Explanation | None, rule: str, fix: str) -> tuple[str, str]:
    """``rule`` with the stack's reason after it, and its fix where it gives one (words with
    plan facts to fill in, ``{...}``, are the exporters': left to them)."""
    if words is None or "{" in words.why + words.fix:
        return rule, fix
    return f"{rule}: {words.why}", words.fix or fix


def recompute_modes(
    stack: FrameworkProfile,
    strategy: Strategy,
    model: ModelFacts,
    modes: Sequence[RecomputeMode] = RECOMPUTE_ORDER,
) -> tuple[RecomputeMode, ...]:
    """The ``modes`` ``stack`` gives the stages of ``strategy`` on ``model``."""
    return tuple(mode for mode in modes if recompute_refusal(stack, strategy, mode) is None)


def recompute_refusal(
    stack: FrameworkProfile, strategy: Strategy, mode: RecomputeMode
) -> Refusal | None:
    """Why ``stack`` cannot recompute ``mode`` in ``strategy``'s stages (its modes are an axis
    limit, checked apart); None when it can."""
    ep = strategy.ep_degree
    if not stack.capabilities.expert_wrapper_limits or mode != "selective" or ep == 1:
        return None
    if strategy.dp_wrapper not in ("fsdp", "replicate"):
        return None
    # the stage the runtime runs (`Strategy.decisions`), as `autoplan.Plan.zero_text` says it
    run = strategy.runtime_zero_stage
    zero = f"ZeRO-{strategy.zero_stage}" + (
        "" if run == strategy.zero_stage else f" (runs as ZeRO-{run})"
    )
    return _runtime_refusal(
        "ep-selective",
        "stages[*].recompute",
        f"recompute 'selective' with ep_degree = {ep} under FSDP2 ({zero}): the "
        "experts are wrapped on their own (their data-parallel group differs from the "
        "block's), so FSDP2's hooks run inside the selectively recomputed block and the "
        "recompute diverges from the forward; use recompute 'full' or 'none' on those stages, "
        "or zero_stage 0 without tensor or pipeline parallelism (DDP)",
    )


def plan_refusals(
    stack: FrameworkProfile, plan: PlanLike, model: ModelFacts, *, running: bool = False
) -> Iterator[Refusal]:
    """Every limit ``plan`` breaks on ``stack`` and ``model``, in a fixed order: the outer
    choice's (`outer_refusals`), its other axes' (schedule, sequence parallelism, dtype,
    recompute, rank order), then its stages' (one recompute setting, the stack's own cut)."""
    strategy = Strategy.of(plan)
    limits = axis_limits(stack, model, running=running)
    yield from outer_refusals(stack, strategy, model, running=running, limits=limits)
    modes = cast(
        "list[RecomputeMode]",
        sorted({stage.recompute for stage in plan.stages}, key=RECOMPUTE_ORDER.index),
    )
    for axis in _PLAN_AXES:
        for limit in limits:
            if limit.axis == axis and (refusal := _plan_axis_refusal(limit, strategy, modes)):
                yield refusal
    for mode in modes if running else ():
        if (why := recompute_refusal(stack, strategy, mode)) is not None:
            yield why
    yield from _compile_refusals(stack, plan)
    yield from partial_refusals(stack, plan, model.num_units)
    yield from activation_offload_refusals(stack, plan, model.num_units)
    overlap = stack.tp_comm_overlap
    # a stage that turns compile off runs its blocks eager, without the overlap pass
    eager_stage = any(getattr(stage, "compile", None) is False for stage in plan.stages)
    needs_compile = bool(overlap and overlap.needs_compile)
    if strategy.tp_comm_overlap and strategy.compile and needs_compile and eager_stage:
        yield tp_overlap_compile_refusal(stack)
    if stack.recompute_scope == "global" and len(modes) > 1:
        yield Refusal(
            value=f"recompute {' and '.join(modes)} by stage",
            rule=f"{stack.name} has one recompute setting for all stages",
            fix=f"set --recompute {modes[-1]} for all",
            limit="recompute-scope",
            field="stages[*].recompute",
        )
    if stack.stage_cuts == "own" and len(plan.stages) > 1:
        cuts = [(stage.first_unit, stage.last_unit) for stage in plan.stages]
        if (why := _stage_cut_refusal(stack, model, cuts)) is not None:
            yield why


def _plan_axis_refusal(
    limit: AxisLimit, strategy: Strategy, modes: Sequence[RecomputeMode]
) -> Refusal | None:
    """``limit``'s refusal of ``strategy`` (with its stages' recompute ``modes``), or None."""
    if limit.axis == "schedules":
        pipelined = strategy.pp_degree > 1
        gpipe_order = runs_in_gpipe_order(
            strategy.schedule, strategy.num_micro_batches, strategy.pp_degree
        )
        allowed = strategy.schedule in limit.allowed or (gpipe_order and "1f1b" in limit.allowed)
        if not pipelined or allowed:
            return None
        return limit.refuse((strategy.schedule, strategy.virtual_stages))
    if limit.axis == "sequence_parallel":
        if not strategy.sequence_parallel:
            return None
        if limit.of_model:
            # a traced graph's limit is on what sequence parallelism shards: nothing without tp
            return limit.refuse(strategy.tp_degree) if strategy.tp_degree > 1 else None
        return limit.refuse(True)
    if limit.axis == "tp_comm_overlap":
        return limit.refuse(True) if strategy.tp_comm_overlap else None
    if limit.axis == "dtype":
        return None if strategy.dtype in limit.allowed else limit.refuse(strategy.dtype)
    if limit.axis == "recompute":
        refused_modes = [mode for mode in modes if mode not in limit.allowed]
        return limit.refuse(refused_modes[0]) if refused_modes else None
    # the rank order as the stack sees it: the axes of degree > 1, cp just outside tp
    used = [axis for axis in strategy.rank_layout if strategy.degree(axis) > 1]
    orders = [[*layout[:-1], "cp", layout[-1]] for layout in limit.allowed]
    return (
        None if any(is_subsequence(used, o) for o in orders) else limit.refuse(strategy.rank_layout)
    )


def _stage_cut_refusal(
    stack: FrameworkProfile, model: ModelFacts, cuts: list[tuple[int, int]]
) -> Refusal | None:
    """A stated cut other than the one ``stack`` makes itself."""
    try:
        starts = stack.stage_starts(model, len(cuts))
    except StageSplitError as err:
        return Refusal(
            value=f"{len(cuts)} stages",
            rule=f"{stack.name} cuts the stages itself: {err}",
            fix="price another pipeline degree",
            limit="stage-cuts",
            field="stages",
        )
    ends = [*starts[1:], model.num_units]
    own = [(first, end - 1) for first, end in zip(starts, ends, strict=True)]
    if cuts == own:
        return None
    return Refusal(
        value=f"stages {cuts_text(cuts)}",
        rule=f"{stack.name} cuts the stages itself",
        fix=f"use its cut {cuts_text(own)} (leave the stages to it)",
        limit="stage-cuts",
        field="stages",
    )


def _etp_below_tp_refusals(stack: FrameworkProfile, strategy: Strategy) -> Iterator[Refusal]:
    """Why ``stack`` (`Capabilities.etp_below_tp_needs_sp_folding`) cannot split experts over
    part of the TP group in ``strategy``: without sequence parallelism, or with ep > 1 inside
    dp; nothing when it can."""
    etp, tp, ep = strategy.etp_degree, strategy.tp_degree, strategy.ep_degree
    rule, _ = _own_words(
        stack.capabilities.explained.get("etp"),
        f"{stack.name} splits an expert over part of a TP group only with sequence "
        "parallelism and folded expert-parallel groups (or ep 1)",
        "",
    )
    if not strategy.sequence_parallel:
        value, field = "without sequence parallelism", "sequence_parallel"
        fix = f"set sequence_parallel: true, or etp_degree {tp} or 1"
    elif ep > 1 and not strategy.ep_folding:
        value, field = f"and ep_degree {ep} inside dp", "ep_folding"
        fix = f"set ep_folding: true, or etp_degree {tp} or 1"
    else:
        return
    yield Refusal(
        value=f"etp_degree {etp} with tp_degree {tp} {value}",
        rule=rule,
        fix=fix,
        limit="etp",
        field=field,
    )


def _expert_group_refusals(stack: FrameworkProfile, strategy: Strategy) -> Iterator[Refusal]:
    """Where the stack puts an expert-parallel group (`expert_layout_refusal`), and
    Megatron-Core's rule for its groups with data parallelism outside the pipeline."""
    ep, tp, cp, pp = strategy.ep_degree, strategy.tp_degree, strategy.cp_degree, strategy.pp_degree
    layout = expert_layout_refusal(
        stack,
        ep_degree=ep,
        tp_degree=tp,
        cp_degree=cp,
        ep_folding=strategy.ep_folding,
        etp_degree=strategy.etp_degree,
    )
    if layout is not None:
        yield layout
    used = [axis for axis in strategy.rank_layout if strategy.degree(axis) > 1]
    dp_outer = bool(used) and not is_subsequence(used, ("pp", "dp", "cp", "tp"))
    rule = stack.capabilities.dp_outer_ep_is_tp_cp and dp_outer and pp > 1
    if rule and ep > 1 and ep != tp * cp:
        yield Refusal(
            value=f"ep {ep} with rank_layout {list(strategy.rank_layout)} and pp {pp}",
            rule=f"{stack.name} needs the experts' data-parallel size to equal the dense "
            "one with data parallelism outside the pipeline",
            fix=f"set rank_layout [pp, dp, cp, tp], or --ep {tp * cp}",
            limit="expert-groups",
            field="ep_degree",
        )


def expert_layout_refusal(
    stack: FrameworkProfile,
    *,
    ep_degree: int,
    tp_degree: int,
    cp_degree: int,
    ep_folding: bool,
    etp_degree: int = 1,
) -> Refusal | None:
    """Why ``stack``, which places an expert-parallel group one way only
    (`FrameworkProfile.expert_layout`), cannot run the other, where the two differ (ep taking
    TP or CP ranks, or not); None when it can."""
    layout, name = stack.expert_layout, stack.name
    # ep folds over the tp / etp expert-TP groups, so with etp = tp and cp = 1 the folded
    # groups are ep consecutive dp ranks at one tp coordinate: the two layouts agree
    if layout is None or ep_degree == 1 or tp_degree // etp_degree == cp_degree == 1:
        return None
    if layout == "folded" and not ep_folding:
        return Refusal(
            value=f"ep {ep_degree} inside dp with tp {tp_degree}, cp {cp_degree}",
            rule=f"{name} places an expert-parallel group on consecutive ranks of the "
            "dp x cp x tp block",
            fix="set ep_folding: true (and sequence_parallel with tp > 1)",
            limit="expert-layout",
            field="ep_folding",
            text=f"framework {shown(name)} places an expert-parallel group on consecutive ranks of "
            "the dp x cp x tp block (its expert rank generator), not inside dp: with "
            f"ep_degree = {ep_degree} and tp_degree = {tp_degree}, cp_degree = {cp_degree} set "
            "ep_folding: true (and sequence_parallel with tp > 1)",
        )
    if layout == "dp" and ep_folding:
        return Refusal(
            value=f"ep {ep_degree} folded over dp x cp x tp",
            rule=f"{name} keeps expert parallelism inside data parallelism",
            fix="set ep_folding: false",
            limit="expert-layout",
            field="ep_folding",
            text=f"framework {shown(name)} keeps expert parallelism inside data parallelism: set "
            "ep_folding: false",
        )
    return None


def _nearest_schedule(allowed: tuple[ScheduleName, ...], virtual_stages: int) -> str:
    """The change to an ``allowed`` schedule nearest a plan with ``virtual_stages`` stages a
    rank: one with as many stages a rank where there is one, 1F1B for one stage a rank."""
    several = [s for s in allowed if s not in ("gpipe", "1f1b")]
    if virtual_stages > 1 and several:
        pick = several[0]
        v_fix = " --virtual-stages 2" if pick in V_SCHEDULES and virtual_stages != 2 else ""
        return f"set --schedule {pick}{v_fix}"
    one = [s for s in ("1f1b", "gpipe") if s in allowed]
    if one:
        return f"set --schedule {one[0]}" + (" --virtual-stages 1" if virtual_stages > 1 else "")
    return f"set --schedule {allowed[0]} --virtual-stages 2"


def cuts_text(cuts: Sequence[tuple[int, int]]) -> str:
    """Stages as unit ranges, ``[0-4, 5-9]``."""
    return "[" + ", ".join(f"{first}-{last}" for first, last in cuts) + "]"
