"""What the three exporters share: the error, the model's sizes, the stages as layers, and the
launch line.

Pipeline units are the trace's: unit 0 is the embedding, units 1..L the transformer blocks,
unit L + 1 the final norm and the head (docs/plan-format.md, ``stages``). Frameworks count
transformer layers and place the embedding and the head by rule or by name, so each stage is
read back as (embedding?, number of blocks, head?).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from autoplan.contract.errors import InputError
from autoplan.contract.plan import MeshAxis, Plan, Recompute
from autoplan.export.checks import MemoryCheck
from cost_model.frameworks import FRAMEWORKS as PROFILES
from cost_model.frameworks import FrameworkProfile, framework_profile
from cost_model.frameworks.limits import cuts_text, plan_refusals
from cost_model.stage_splits import StageSplitError
from cost_model.strategy import Strategy

Framework = Literal["megatron-lm", "torchtitan", "deepspeed"]
FRAMEWORKS: tuple[Framework, ...] = ("megatron-lm", "torchtitan", "deepspeed")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportProblem:
    """One plan field a framework cannot express: the field and its value, the framework
    option that falls short, and the nearest plan it can run."""

    field: str
    value: str
    option: str
    fix: str
    # the stack's limit it comes from (`cost_model.frameworks.limits.LimitKey`); None: what
    # the file format or the model's sizes cannot hold
    limit: str | None = None

    def __str__(self) -> str:
        return f"{self.field} = {self.value}: {self.option}; {self.fix}"


class ExportError(InputError):
    """A plan (or its model) that a framework cannot express; ``problems`` lists every one."""

    def __init__(self, framework: str, problems: Sequence[ExportProblem]) -> None:
        self.framework = framework
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            body = str(self.problems[0])
        else:
            body = " ".join(f"({idx}) {p};" for idx, p in enumerate(self.problems, 1))[:-1]
        super().__init__(f"cannot export this plan to {framework}: {body}")


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEDims:
    """The routed experts of a mixture-of-experts model (autoplan/models/moe.py `MoEConfig`):
    the model args a launch config restates; the plan holds only how they are split (ep)."""

    num_experts: int
    top_k: int
    moe_ffn_hidden_size: int  # SwiGLU inner size of one expert
    shared_ffn_hidden_size: int  # 0: no shared expert
    num_dense_layers: int  # leading layers with a dense MLP
    norm_topk_prob: bool  # renormalise the top-k probabilities (Mixtral) or not (DeepSeekMoE)
    aux_loss_coef: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelDims:
    """The architecture a launch config must restate (from the zoo config of the plan's
    ``model.name``)."""

    spec: str
    family: Literal["gpt", "llama"]
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    seq_len: int
    vocab_size: int
    tie_embeddings: bool
    dropout: float = 0.0
    rope_theta: float | None = None  # llama only
    norm_eps: float = 1e-5
    moe: MoEDims | None = None  # None: a dense model
    head_dim: int | None = None  # None: hidden_size // num_heads

    @property
    def attention_head_dim(self) -> int:
        """The width of one attention head (Qwen3-30B-A3B's 128 is not hidden / heads)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


@dataclass(frozen=True, kw_only=True, slots=True)
class StageLayers:
    """One pipeline stage in a framework's terms."""

    embedding: bool
    num_layers: int  # transformer blocks
    head: bool
    first_layer: int  # index of its first block among the blocks (0-based)


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """How many processes where: ``devices_per_node`` is None when unknown (placeholders).

    torchrun and the DeepSpeed launcher start the same number of processes on every node, so
    the devices must be whole nodes, or fewer than one node (one partial node, as `autoplan
    validate` and `explain` rebuild a plan's cluster: `autoplan.analysis.whatif.ClusterType`).
    """

    num_devices: int
    devices_per_node: int | None = None

    def __post_init__(self) -> None:
        per_node = self.devices_per_node
        if per_node is not None and self.num_devices > per_node and self.num_devices % per_node:
            nodes = self.num_devices // per_node
            raise InputError(
                f"cannot launch the plan's {self.num_devices} devices on nodes of {per_node}: "
                f"{self.num_devices} is not whole nodes (a launcher starts the same number of "
                f"processes on every node); use a plan for {nodes * per_node} or "
                f"{(nodes + 1) * per_node} devices (autoplan plan ... --cluster NAME:nodes=N), or "
                f"fewer than {per_node} for one partial node"
            )

    @property
    def nodes(self) -> str:
        if self.devices_per_node is None:
            return "$NNODES"
        return str(max(1, self.num_devices // self.devices_per_node))

    @property
    def procs_per_node(self) -> str:
        if self.devices_per_node is None:
            return "$NPROC_PER_NODE"
        return str(min(self.devices_per_node, self.num_devices))


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchVariable:
    """A ``$NAME`` of the launch line that the user sets on every node before running it."""

    name: str
    meaning: str

    def __str__(self) -> str:
        return f"{self.name}: {self.meaning}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Export:
    """What launches a plan on a framework: files (name -> text), the command line that starts
    it (one process per device, the same line on every node; `autoplan.export.launch`), the
    variables it names that the user sets first, and notes on what the user still supplies."""

    framework: Framework
    files: Mapping[str, str]
    command: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    # the command's $NAME placeholders (rendezvous, node counts), each with what to set
    variables: tuple[LaunchVariable, ...] = field(default=())
    # the plan was priced for another stack (`stack_note`): its estimate describes that one
    stack_note: str | None = None
    # the memory check against the cluster (`checks.check_memory`); None: not checked
    memory: MemoryCheck | None = None

    @property
    def command_line_words(self) -> tuple[str, ...]:
        """The command's words quoted as the shell reads them back."""
        return tuple(_quote(part) for part in self.command)

    @property
    def command_line(self) -> str:
        return " ".join(self.command_line_words)


def _quote(part: str) -> str:
    """``part`` as the shell reads it back: bare when it holds only safe characters and
    ``$NAME`` placeholders (which the shell must expand), else single-quoted."""
    if all(c.isalnum() or c in "-_=./:,+" for c in _PLACEHOLDER.sub("", part)):
        return part
    return "'" + part.replace("'", "'\\''") + "'"


_PLACEHOLDER = re.compile(r"\$[A-Z_]+")


def framework_options(plan: Plan) -> dict[str, str]:
    """The options of the plan's framework spec (``megatron-lm:overlap-grad-reduce=off`` ->
    ``{"overlap-grad-reduce": "off"}``; the plan checked the spec when it was read)."""
    _, _, rest = plan.framework.partition(":")
    pairs = (item.partition("=") for item in rest.split(",") if item.strip())
    return {key.strip(): value.strip() for key, _, value in pairs}


def overlap_option(plan: Plan) -> tuple[str, bool] | None:
    """The option of the plan's framework that sets gradient-sync overlap, as ``key=value``
    and whether it overlaps (megatron-lm's ``overlap-grad-reduce=on|off``, megatron-lm-2021's
    ``ddp=torch|local``: each option whose choices set the profile's ``dp_overlap``); None
    when the spec sets none."""
    choices = PROFILES[plan.framework.partition(":")[0]].options
    found = None
    for key, value in framework_options(plan).items():
        changes = choices.get(key, {}).get(value, {})
        if "dp_overlap" in changes:
            found = (f"{key}={value}", float(changes["dp_overlap"]) > 0)  # type: ignore[arg-type]
    return found


def overlaps_grad_sync(plan: Plan) -> bool:
    """Whether the plan is priced with data-parallel gradient sync overlapping the backward:
    its framework profile's `FrameworkProfile.overlaps_dp_sync` (options applied; autoplan's
    runtime overlaps)."""
    return framework_profile(plan.framework).overlaps_dp_sync(Strategy.of(plan))


def stack_note(plan: Plan, framework: str) -> str | None:
    """A note when the plan is priced for another stack than ``framework``: its estimate (step
    time, memory) describes that stack; None when it is priced for ``framework``."""
    priced = plan.framework.partition(":")[0]
    if priced == framework:
        return None
    return (
        f"the plan is priced for {plan.framework} (its framework): its estimate describes that "
        f"stack, not {framework}; re-price it with `autoplan explain PLAN.yaml --framework "
        f"{framework}` or `autoplan estimate ... --framework {framework}`"
    )


def stage_layers(plan: Plan, dims: ModelDims) -> tuple[StageLayers, ...]:
    """Each stage as (embedding?, blocks, head?); the model must have ``num_layers + 2`` units."""
    last_unit = dims.num_layers + 1
    stages = []
    for stage in plan.stages:
        blocks = [u for u in stage.unit_range if 1 <= u <= dims.num_layers]
        stages.append(
            StageLayers(
                embedding=stage.first_unit == 0,
                num_layers=len(blocks),
                head=stage.last_unit == last_unit,
                first_layer=(blocks[0] - 1) if blocks else max(0, stage.first_unit - 1),
            )
        )
    return tuple(stages)


def units_problem(plan: Plan, dims: ModelDims) -> ExportProblem | None:
    """The plan must be for the model the launch config restates: its ``model.seq_len`` (the
    sequence its micro-batch and memory were priced for) is the model's, and its stages cover
    the model's units: the embedding, each block, the head."""
    if plan.model is not None and plan.model.seq_len != dims.seq_len:
        name, _, rest = dims.spec.partition(":")
        items = [item for item in rest.split(",") if item and "seq_len=" not in item]
        spec = f"{name}:{','.join([*items, f'seq_len={plan.model.seq_len}'])}"
        return ExportProblem(
            field="model.seq_len",
            value=str(plan.model.seq_len),
            option=(
                f"model {dims.spec!r} has seq_len {dims.seq_len}, which the launch config "
                "restates (the plan's micro-batch and memory are priced for its own)"
            ),
            fix=(
                f"set model.seq_len back to {dims.seq_len}, or export a plan made for "
                f"{plan.model.seq_len} tokens (autoplan plan --model {spec} ...)"
            ),
        )
    expected = dims.num_layers + 2
    if plan.num_units == expected:
        return None
    return ExportProblem(
        field="stages",
        value=f"units 0..{plan.num_units - 1}",
        option=(
            f"model {dims.spec!r} has {expected} pipeline units (embedding, {dims.num_layers} "
            "blocks, head)"
        ),
        fix="export a plan made for this model, or pass the model it was made for (--model)",
    )


def uniform_recompute(plan: Plan) -> Recompute | None:
    """The one recompute mode of every stage, or None when the stages mix modes."""
    modes = {stage.recompute for stage in plan.stages}
    return next(iter(modes)) if len(modes) == 1 else None


def effective_layout(plan: Plan) -> tuple[MeshAxis, ...]:
    """The plan's rank layout restricted to the axes of degree > 1 (outermost first): the only
    part of the layout that changes which ranks talk to which."""
    return tuple(axis for axis in plan.rank_layout if plan.degree(axis) > 1)


def expert_problems(plan: Plan, dims: ModelDims) -> list[ExportProblem]:
    """Expert parallelism needs experts, and ep must divide them (every framework's rule)."""
    if plan.ep_degree == 1:
        return []
    if dims.moe is None:
        return [
            ExportProblem(
                field="ep_degree",
                value=str(plan.ep_degree),
                option=f"model {dims.spec!r} is dense: it has no experts to split",
                fix="set ep_degree to 1, or export a plan made for a mixture-of-experts model",
            )
        ]
    if dims.moe.num_experts % plan.ep_degree:
        divisors = [e for e in range(1, dims.moe.num_experts + 1) if dims.moe.num_experts % e == 0]
        return [
            ExportProblem(
                field="ep_degree",
                value=str(plan.ep_degree),
                option=(
                    f"expert parallelism splits the experts evenly; {plan.ep_degree} does not "
                    f"divide num_experts = {dims.moe.num_experts} of {dims.spec!r}"
                ),
                fix=f"use an ep_degree among {divisors}",
            )
        ]
    return []


def cp_sequence_problem(plan: Plan, dims: ModelDims, option: str) -> ExportProblem | None:
    """Load-balanced causal context parallelism cuts each sequence into 2 cp chunks."""
    if plan.cp_degree == 1 or dims.seq_len % (2 * plan.cp_degree) == 0:
        return None
    return ExportProblem(
        field="cp_degree",
        value=str(plan.cp_degree),
        option=(
            f"{option} cuts each sequence into 2 x cp_degree = {2 * plan.cp_degree} chunks, "
            f"which must divide seq_len = {dims.seq_len}"
        ),
        fix="use a cp_degree whose double divides the sequence length",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StatedModel:
    """The model as a stack's limits read it (`cost_model.frameworks.ModelFacts`), stated
    from its sizes: an export has no traced model."""

    name: str
    num_units: int
    has_experts: bool
    exported: bool = False
    rope_tables: bool = True


def stack_problems(plan: Plan, dims: ModelDims, framework: Framework) -> list[ExportProblem]:
    """Every limit of ``framework``'s stack that ``plan`` breaks, from its profile (the one
    statement of what it runs, `cost_model.frameworks.limits`), each in the stack's own words
    where its profile gives them (`Capabilities.explained`)."""
    stack = framework_profile(framework)
    model = StatedModel(
        name=dims.spec, num_units=dims.num_layers + 2, has_experts=dims.moe is not None
    )
    refusals = list(plan_refusals(stack, plan, model))
    facts = plan_facts(plan, stack, model) if refusals else {}
    problems = []
    for refusal in refusals:
        words = stack.capabilities.explained
        value = _field_value(plan, refusal.field, refusal.limit, stack)
        explained = words.get(f"{refusal.limit}:{value}") or words.get(refusal.limit)
        if explained is None:
            problem = ExportProblem(
                field=refusal.field,
                value=value,
                option=refusal.rule,
                fix=refusal.fix,
                limit=refusal.limit,
            )
        else:
            problem = ExportProblem(
                field=refusal.field,
                value=explained.value.format(**facts) if explained.value else value,
                option=explained.why.format(**facts),
                fix=(explained.fix or _EXPORT_FIX[refusal.limit]).format(**facts),
                limit=refusal.limit,
            )
        problems.append(problem)
    return problems


# the fix an export gives where the stack's words leave it to the export (`Explanation.fix`
# empty): what every stack with the limit asks alike
_EXPORT_FIX = {
    # the nearest plan recomputes every stage as its most-recomputing stage does (memory
    # still fits; a weaker mode could overflow the stages that needed the stronger one)
    "recompute-scope": "use recompute={strongest} on every stage (the nearest plan that still "
    "fits), e.g. autoplan plan ... --recompute {strongest}, or edit the plan file",
}

_STRENGTH: dict[Recompute, int] = {"none": 0, "selective": 1, "full": 2}


def plan_facts(plan: Plan, stack: FrameworkProfile, model: StatedModel) -> dict[str, object]:
    """What a stack's words (`Explanation` templates) may name of ``plan``; ``own_cuts``:
    the cut a stack that cuts its stages itself makes (`FrameworkProfile.stage_starts`)."""
    modes = sorted({s.recompute for s in plan.stages}, key=_STRENGTH.__getitem__)
    own: list[tuple[int, int]] = []
    if stack.stage_cuts == "own" and plan.num_stages > 1:
        with contextlib.suppress(StageSplitError):
            starts = stack.stage_starts(model, plan.num_stages)
            ends = [*starts[1:], plan.num_units]
            own = [(first, end - 1) for first, end in zip(starts, ends, strict=True)]
    fork = ""
    if framework_options(plan).get("fork") == "zero-bubble":
        fork = (
            f"; the plan's {plan.framework} prices sail-sg's zero-bubble fork of Megatron-LM, "
            "whose own flags this export does not write"
        )
    return {
        "tp": plan.tp_degree,
        "pp": plan.pp_degree,
        "cp": plan.cp_degree,
        "ep": plan.ep_degree,
        "tp_cp": plan.tp_degree * plan.cp_degree,
        "zero": plan.zero_stage,
        "m": plan.num_micro_batches,
        "v": plan.virtual_stages,
        "schedule": plan.schedule,
        "layout": ", ".join(plan.rank_layout),
        "modes": " and ".join(modes),
        "strongest": modes[-1],
        "own_cuts": cuts_text(own),
        "fork_note": fork,
        "stack": stack.name,
    }


def _field_value(plan: Plan, name: str, limit: str, stack: FrameworkProfile) -> str:
    """The plan's value of field ``name`` as a plan file writes it."""
    if name == "stages[*].recompute":
        modes = [stage.recompute for stage in plan.stages]
        return f"[{', '.join(modes)}]" if limit == "recompute-scope" else _refused_mode(plan, stack)
    if name == "stages":
        return cuts_text([(s.first_unit, s.last_unit) for s in plan.stages])
    if name == "stages[*].recompute_units":
        counts = [stage.recompute_units for stage in plan.stages]
        return f"[{', '.join('all' if c is None else str(c) for c in counts)}]"
    if name == "stages[*].activation_offload":
        return f"[{', '.join(str(stage.activation_offload) for stage in plan.stages)}]"
    if name == "stages[*].compile":
        flags = [plan.stage_compiled(idx) for idx in range(plan.num_stages)]
        return f"[{', '.join(str(flag).lower() for flag in flags)}]"
    if name == "rank_layout":
        return f"[{', '.join(plan.rank_layout)}]"
    value = getattr(plan, name)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _refused_mode(plan: Plan, stack: FrameworkProfile) -> str:
    """The first of the plan's recompute modes that ``stack`` lacks."""
    modes = sorted({s.recompute for s in plan.stages}, key=_STRENGTH.__getitem__)
    allowed = stack.recompute_modes or modes
    return next(m for m in modes if m not in allowed)
