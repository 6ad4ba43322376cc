"""Split pass: cut a traced model into pipeline stages, and each stage into per-unit submodules.

Expects a `ModelGraph` (``autoplan.trace``) whose fx graph calls the model's leaf modules
(``call_module``) or reads its parameters (``get_attr``), with every node labelled by its
pipeline unit, and a `Plan` whose stages cover the units in order.

Guarantees, checked before returning:

- every compute node of the graph runs in exactly one unit module, of the unit it is labelled
  with; ``get_attr`` nodes (parameters, buffers) are copied into every unit that reads them;
- a unit module is an ``fx.GraphModule`` that keeps the model's own module paths
  (``blocks.3.attn.q_proj`` stays ``blocks.3.attn.q_proj``, unlike ``split_module``, which
  would rename it ``blocks_3_attn_q_proj``) and the persistence of its buffers (the model's
  non-persistent ones stay out of state dicts), and it is called from the stage module as a real
  submodule ``unit_<idx>``: forward hooks, ``fully_shard`` and activation checkpointing apply to
  it (they never fire on the containers a plain trace flattens away);
- a stage module takes the values live at its input cut (stage 0: the model's inputs) as
  positional tensors and returns the values live at its output cut (last stage: the model's
  output), so torch's ``PipelineStage`` can send them; a value needed two stages later is passed
  through the stages between; a non-tensor crossing a cut is an error naming the node;
- parameters shared by several stages (a head tied to the embedding) are untied: the first
  stage keeps the parameter, every later stage that reads it gets its own copy (same values),
  and `TiedParameter` records the copies so the runtime can sum their gradients (Megatron-LM's
  embedding group). Parameters shared by units of one stage stay shared.

Only the stages given in ``stage_indices`` (this rank's) are returned; the analysis (cuts, tied
copies) covers all stages, identically on every rank.
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from autoplan.contract.errors import PlanError
from autoplan.contract.graph import ModelGraph, keep_non_persistent_buffers
from autoplan.contract.plan import Plan
from cost_model.workload import UnitProfile
from passes.module_calls import restore_module_calls

__all__ = [
    "SplitModel",
    "StageModule",
    "TiedCopy",
    "TiedParameter",
    "UnitModule",
    "original_fqn",
    "split_stages",
    "unit_attr",
]

logger = logging.getLogger(__name__)

_COMPUTE_OPS = ("call_module", "call_function", "call_method")
# Prefixes that wrappers and our own stage structure add to parameter names.
_WRAPPER_SEGMENT = re.compile(r"(?:^|(?<=\.))(?:unit_\d+|_checkpoint_wrapped_module|_orig_mod)\.")


def unit_attr(unit_idx: int) -> str:
    """Attribute name of unit ``unit_idx``'s module inside its stage module."""
    return f"unit_{unit_idx}"


def original_fqn(stage_fqn: str) -> str:
    """The model's own name for a stage-module parameter or buffer name.

    ``unit_3._checkpoint_wrapped_module.blocks.3.attn.q_proj.weight`` ->
    ``blocks.3.attn.q_proj.weight``.
    """
    return _WRAPPER_SEGMENT.sub("", stage_fqn)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class UnitModule:
    """One pipeline unit inside a stage: its profile and the attribute holding its module."""

    unit_idx: int
    profile: UnitProfile
    attr: str  # attribute of the stage module: unit_attr(unit_idx)
    module_paths: tuple[str, ...]  # original paths of the leaf modules it calls


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StageModule:
    """A pipeline stage (model chunk) ready for the other passes and for ``PipelineStage``."""

    stage_idx: int
    module: fx.GraphModule
    units: tuple[UnitModule, ...]
    input_names: tuple[str, ...]  # fx node names of the values it receives
    output_names: tuple[str, ...]  # fx node names of the values it sends on (or returns)

    def unit_module(self, unit: UnitModule) -> nn.Module:
        """The unit's current module (possibly wrapped by a later pass)."""
        return self.module.get_submodule(unit.attr)


@dataclass(frozen=True, kw_only=True, slots=True)
class TiedCopy:
    """One copy of a tied parameter: which stage holds it, under which stage-module name."""

    stage_idx: int
    stage_fqn: str  # e.g. "unit_5.lm_head.weight"


@dataclass(frozen=True, kw_only=True, slots=True)
class TiedParameter:
    """A parameter read by several stages; its copies' gradients must be summed each step."""

    name: str  # the model's name for the parameter (first stage's reference)
    copies: tuple[TiedCopy, ...]  # one per stage, in stage order (the first is the original)

    @property
    def stage_indices(self) -> tuple[int, ...]:
        return tuple(copy.stage_idx for copy in self.copies)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SplitModel:
    """Result of `split_stages`: this rank's stage modules and the plan-wide tied parameters."""

    stages: tuple[StageModule, ...]  # local stages, in stage order
    num_stages: int
    tied: tuple[TiedParameter, ...]
    # Parameters that several units of one stage share, per local stage (stage-module names).
    shared_in_stage: dict[int, tuple[tuple[str, ...], ...]]


def split_stages(
    graph: ModelGraph, plan: Plan, *, stage_indices: Sequence[int] | None = None
) -> SplitModel:
    """Cut ``graph`` at ``plan``'s stage boundaries; build the modules of ``stage_indices``.

    ``stage_indices`` defaults to every stage (handy for single-process checks).
    """
    gm = _splittable_module(graph)
    num_units = graph.profile.num_units
    if plan.num_units != num_units:
        raise PlanError(
            f"the plan's stages cover {plan.num_units} units but the traced model has "
            f"{num_units}; make a plan for this model"
        )
    stage_of_unit = {u: s for s, stage in enumerate(plan.stages) for u in stage.unit_range}
    wanted = tuple(range(plan.num_stages)) if stage_indices is None else tuple(stage_indices)

    nodes = list(gm.graph.nodes)
    # Inputs the graph reads (an exported graph keeps placeholders for constant arguments).
    placeholders = [n for n in nodes if n.op == "placeholder" and n.users]
    if len(placeholders) != 1:
        raise PlanError(
            f"the traced model reads {len(placeholders)} inputs "
            f"({', '.join(n.name for n in placeholders)}); autoplan's runtime feeds one tensor "
            "(input_ids) to the first stage: wrap the model so forward takes input_ids only"
        )
    output_node = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op in _COMPUTE_OPS]
    unit_of = {n: _unit_label(graph, n) for n in compute}
    _check_monotone(compute, unit_of)

    # stage_of[v]: stage producing value v; placeholders are available at stage 0's input.
    stage_of: dict[fx.Node, int] = {n: stage_of_unit[unit_of[n]] for n in compute}
    last = plan.num_stages - 1
    consumers: dict[fx.Node, set[int]] = {}
    for n in compute:
        for arg in n.all_input_nodes:
            if arg.op != "get_attr":
                consumers.setdefault(arg, set()).add(stage_of[n])
    outputs = _flat_outputs(output_node)
    for out in outputs:
        consumers.setdefault(out, set()).add(last + 1)  # the caller reads it after the last stage

    def live(cut: int) -> list[fx.Node]:
        """Values produced before stage ``cut`` and read at or after it, in graph order."""
        return [
            v
            for v in placeholders + compute
            if stage_of.get(v, -1) < cut and max(consumers.get(v, {-1})) >= cut
        ]

    stage_inputs = [list(placeholders)] + [live(s) for s in range(1, plan.num_stages)]
    stage_outputs = [live(s) for s in range(1, plan.num_stages)] + [outputs]
    for s in range(1, plan.num_stages):
        _check_crossing_tensors(graph, stage_inputs[s], s)

    built: dict[int, StageModule] = {}
    for s in range(plan.num_stages):
        built[s] = _build_stage(
            gm,
            graph,
            plan,
            s,
            [n for n in compute if stage_of[n] == s],
            unit_of,
            stage_inputs[s],
            stage_outputs[s],
        )

    tied, shared = _untie(built, wanted)
    result = SplitModel(
        stages=tuple(built[s] for s in wanted),
        num_stages=plan.num_stages,
        tied=tied,
        shared_in_stage=shared,
    )
    _check_split(graph, gm, built, compute)
    return result


# ----------------------------------------------------------------------------- labelling


def _splittable_module(graph: ModelGraph) -> fx.GraphModule:
    """An fx module whose parameters are ``get_attr`` nodes of the model's own parameters.

    fx traces are that already. A ``torch.export`` graph lifts parameters to inputs; its
    ``module()`` puts them back as ``get_attr`` of the same ``Parameter`` objects, keeping the
    node names the unit labels refer to. Its input-guard call is dropped: a split module's
    stages see micro-batches, and the guard belongs to the whole model's signature. Its inlined
    ``nn.Linear``/``nn.Embedding`` calls become module calls again (`restore_module_calls`), so
    the later passes (tensor parallelism) find the model's layers by path, as on an fx trace.
    """
    if graph.front_end != "export":
        return graph.graph_module
    program = graph.exported_program
    if program is None:
        raise PlanError("the traced graph says front_end 'export' but has no exported_program")
    module = program.module()
    assert isinstance(module, fx.GraphModule)
    for node in list(module.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            if node.users:
                raise PlanError(f"exported graph uses the result of guard {node.name!r}")
            module.graph.erase_node(node)
    restore_module_calls(module)  # lints and recompiles
    return module


def _unit_label(graph: ModelGraph, node: fx.Node) -> int:
    try:
        return graph.unit_of(node)
    except KeyError:
        raise PlanError(
            f"fx node {node.name!r} ({node.op} {node.target}) has no pipeline unit in the traced "
            "graph; this is a tracer bug: report it with the model"
        ) from None


def _check_monotone(compute: list[fx.Node], unit_of: dict[fx.Node, int]) -> None:
    for node in compute:
        for arg in node.all_input_nodes:
            if arg in unit_of and unit_of[arg] > unit_of[node]:
                raise PlanError(
                    f"fx node {node.name!r} of unit {unit_of[node]} reads {arg.name!r} of the "
                    f"later unit {unit_of[arg]}: the model's units do not run in order, so no "
                    "pipeline cut can be placed between them"
                )


def _flat_outputs(output_node: fx.Node) -> list[fx.Node]:
    (value,) = output_node.args
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, fx.Node) for v in value):
        return [v for v in value if isinstance(v, fx.Node)]
    raise PlanError(
        f"the model returns {value!r}; pipelining needs a tensor or a flat tuple of tensors "
        "(return the logits; compute the loss in loss_fn)"
    )


def _is_tensor_value(graph: ModelGraph, node: fx.Node) -> bool | None:
    """True/False if the trace recorded whether the value is a tensor, None if it did not."""
    profile = graph.node_profiles.get(node.name)
    if profile is not None:
        return profile.dtype is not None
    if "tensor_meta" in node.meta:
        return True
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None:
        return None
    return isinstance(val, torch.Tensor)


def _check_crossing_tensors(graph: ModelGraph, values: list[fx.Node], cut: int) -> None:
    for v in values:
        if _is_tensor_value(graph, v) is False:
            raise PlanError(
                f"value {v.name!r} ({v.op} {v.target}) crosses the cut before stage {cut} but is "
                "not a tensor; a pipeline stage can only send tensors: move the cut, or compute "
                "the value from tensors the next stage receives"
            )


# ----------------------------------------------------------------------------- building


def _build_unit(
    gm: fx.GraphModule,
    unit_idx: int,
    unit_nodes: list[fx.Node],
    inputs: list[fx.Node],
    outputs: list[fx.Node],
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[value] = graph.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in unit_nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg)
        env[node] = graph.node_copy(node, lambda n: env[n])
    if len(outputs) == 1:
        graph.output(env[outputs[0]])
    else:
        graph.output(tuple(env[v] for v in outputs))
    graph.lint()
    # GraphModule(root, graph) copies each call_module/get_attr target by reference under its
    # original dotted path (intermediate containers become plain nn.Modules), every buffer as
    # a persistent one: the model's non-persistent buffers (RoPE tables, which context
    # parallelism cuts to each rank's rows) are marked so again, or checkpoints would hold them.
    unit = fx.GraphModule(gm, graph, class_name=f"Unit{unit_idx}")
    keep_non_persistent_buffers(gm, unit)
    return unit


def _build_stage(
    gm: fx.GraphModule,
    graph: ModelGraph,
    plan: Plan,
    stage_idx: int,
    stage_nodes: list[fx.Node],
    unit_of: dict[fx.Node, int],
    inputs: list[fx.Node],
    outputs: list[fx.Node],
) -> StageModule:
    units_range = plan.stages[stage_idx].unit_range
    nodes_of = {u: [n for n in stage_nodes if unit_of[n] == u] for u in units_range}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # A unit returns the values that a later unit of this stage reads or the stage sends on.
    stage_outputs = set(outputs)
    last_reader: dict[fx.Node, int] = {}
    for n in stage_nodes:
        for arg in n.all_input_nodes:
            last_reader[arg] = max(last_reader.get(arg, -1), unit_of[n])
    needed_after = {
        u: [n for n in nodes_of[u] if n in stage_outputs or last_reader.get(n, -1) > u]
        for u in units_range
    }

    holder = nn.Module()
    stage_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[value] = stage_graph.placeholder(value.name)
    units: list[UnitModule] = []
    for u in units_range:
        own = nodes_of[u]
        own_set = set(own)
        unit_inputs = []
        for n in own:
            for arg in n.all_input_nodes:
                if arg.op != "get_attr" and arg not in own_set and arg not in unit_inputs:
                    unit_inputs.append(arg)
        # Graph order, so the unit's signature is deterministic.
        unit_inputs.sort(key=order.__getitem__)
        unit_outputs = needed_after[u]
        missing = [v for v in unit_inputs if v not in env]
        if missing:
            raise PlanError(
                f"unit {u} reads {[v.name for v in missing]}, which no earlier unit of stage "
                f"{stage_idx} or its inputs provide (internal error in the stage cut)"
            )
        module = _build_unit(gm, u, own, unit_inputs, unit_outputs)
        attr = unit_attr(u)
        holder.add_module(attr, module)
        call = stage_graph.call_module(attr, tuple(env[v] for v in unit_inputs))
        if len(unit_outputs) == 1:
            env[unit_outputs[0]] = call
        else:
            for i, v in enumerate(unit_outputs):
                env[v] = stage_graph.call_function(operator.getitem, (call, i))
        paths = tuple(dict.fromkeys(str(n.target) for n in own if n.op == "call_module").keys())
        units.append(
            UnitModule(unit_idx=u, profile=graph.profile.units[u], attr=attr, module_paths=paths)
        )
    if len(outputs) == 1:
        stage_graph.output(env[outputs[0]])
    else:
        stage_graph.output(tuple(env[v] for v in outputs))
    stage_graph.lint()
    return StageModule(
        stage_idx=stage_idx,
        module=fx.GraphModule(holder, stage_graph, class_name=f"Stage{stage_idx}"),
        units=tuple(units),
        input_names=tuple(v.name for v in inputs),
        output_names=tuple(v.name for v in outputs),
    )


# ----------------------------------------------------------------------------- tied parameters


def _param_owner(module: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, name = fqn.rpartition(".")
    return (module.get_submodule(path) if path else module), name


def _untie(
    built: dict[int, StageModule], local: Sequence[int]
) -> tuple[tuple[TiedParameter, ...], dict[int, tuple[tuple[str, ...], ...]]]:
    """Give every stage after the first its own copy of a parameter several stages read."""
    uses: dict[int, list[tuple[int, str]]] = {}  # id(param) -> [(stage, stage fqn)]
    params: dict[int, nn.Parameter] = {}
    for s, stage in built.items():
        for fqn, param in stage.module.named_parameters(remove_duplicate=False):
            uses.setdefault(id(param), []).append((s, fqn))
            params[id(param)] = param
    tied: list[TiedParameter] = []
    shared: dict[int, list[tuple[str, ...]]] = {s: [] for s in local}
    for key, occurrences in uses.items():
        stages_using = sorted({s for s, _ in occurrences})
        for s in stages_using:
            names = tuple(fqn for t, fqn in occurrences if t == s)
            if len(names) > 1 and s in shared:
                shared[s].append(names)
        if len(stages_using) == 1:
            continue
        _check_owners_distinct(built, occurrences)
        original = params[key]
        copies = []
        for s in stages_using:
            first_fqn = next(fqn for t, fqn in occurrences if t == s)
            copies.append(TiedCopy(stage_idx=s, stage_fqn=first_fqn))
            if s == stages_using[0] or s not in local:
                continue
            with torch.no_grad():
                copy = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
            for t, fqn in occurrences:
                if t == s:
                    owner, name = _param_owner(built[s].module, fqn)
                    setattr(owner, name, copy)
        tied.append(
            TiedParameter(
                name=original_fqn(occurrences[0][1]),
                copies=tuple(copies),
            )
        )
    return tuple(tied), {s: tuple(v) for s, v in shared.items()}


def _check_owners_distinct(
    built: dict[int, StageModule], occurrences: list[tuple[int, str]]
) -> None:
    """A module object called from two stages cannot be untied by giving one stage a copy."""
    owners: dict[int, int] = {}
    for s, fqn in occurrences:
        owner, _ = _param_owner(built[s].module, fqn)
        if owners.setdefault(id(owner), s) != s:
            raise PlanError(
                f"module owning {original_fqn(fqn)!r} runs in stages {owners[id(owner)]} and {s}; "
                "a module called from two pipeline stages is not supported: place both calls "
                "in one stage"
            )


# ----------------------------------------------------------------------------- checks


def _check_split(
    graph: ModelGraph, gm: fx.GraphModule, built: dict[int, StageModule], compute: list[fx.Node]
) -> None:
    seen: dict[str, int] = {}
    for stage in built.values():
        for unit in stage.units:
            module = stage.module.get_submodule(unit.attr)
            assert isinstance(module, fx.GraphModule)
            for node in module.graph.nodes:
                if node.op in _COMPUTE_OPS:
                    seen[node.name] = seen.get(node.name, 0) + 1
                    expected = graph.unit_of(node.name)
                    assert expected == unit.unit_idx, (
                        f"node {node.name} of unit {expected} placed in unit {unit.unit_idx}"
                    )
    missing = [n.name for n in compute if seen.get(n.name) != 1]
    assert not missing, f"nodes not placed exactly once: {missing[:10]}"
    # Every parameter of the model is read by some stage (else it would never train).
    model_params = {id(p) for p in gm.parameters()}
    staged = {id(p) for stage in built.values() for p in stage.module.parameters()} & model_params
    unused = [
        name for name, p in gm.named_parameters() if id(p) not in staged and id(p) in model_params
    ]
    if unused:
        logger.warning("parameters no stage reads (they will not train): %s", unused[:10])


def retarget_devices(split: SplitModel, device: torch.device) -> int:
    """Point every device constant in the stages' graphs at ``device``; returns how many.

    An exported graph bakes in the device it was traced on: ``_assert_tensor_metadata`` checks
    and ``device=`` arguments (``arange``, ``ones``, ``.to``) name it, so a graph traced on meta,
    or on the CPU for a CUDA run, fails at its first such node ("Tensor device mismatch"). The
    run's device replaces them; fx graphs, which read devices from their inputs, have none."""
    changed = 0

    def swap(value: fx.node.Argument) -> fx.node.Argument:
        nonlocal changed
        if isinstance(value, torch.device) and value != device:
            changed += 1
            return device
        return value

    for stage in split.stages:
        for module in stage.module.modules():
            if not isinstance(module, fx.GraphModule):
                continue
            before = changed
            for node in module.graph.nodes:
                node.args = fx.node.map_aggregate(node.args, swap)
                node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
            if changed != before:
                module.recompile()
    return changed
