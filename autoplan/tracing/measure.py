"""Measure a traced graph's units on the meta device, each distinct unit once.

Expects a `TracedModel` and the `Assignment` of its nodes to units. `TracedGraph` is the traced
graph with the questions the later steps ask of a node (model state or activation, owning module,
parameters read); `measure_units` runs every unit whose structure and inputs differ from all
earlier units' through the unit profiler, and gives the others the figures of their first twin.
`target_name`, `spec_bytes` and `first_spec` read nodes and measured specs for the later steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, fx, nn

from autoplan.tracing.node_measures import NodeMeasure, UnitMeasure
from autoplan.tracing.node_runner import MetaState, NodeRunner
from autoplan.tracing.tensor_specs import TensorSpec, materialize, spec_of
from autoplan.tracing.tracer import TEMPLATE_META, TracedModel
from autoplan.tracing.units import Assignment, module_structure, unit_key

__all__ = [
    "Measurements",
    "NodeParams",
    "TracedGraph",
    "UnitProfiler",
    "first_spec",
    "measure_units",
    "spec_bytes",
    "target_name",
]

logger = logging.getLogger(__name__)

# `profiler.profile_unit`'s signature: a unit's nodes, the specs of the activations entering it,
# the runner holding model state on meta, and a node's module path (for error messages).
UnitProfiler = Callable[
    [Sequence[fx.Node], Mapping[fx.Node, Any], NodeRunner, Callable[[fx.Node], str]],
    UnitMeasure,
]


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeParams:
    """Parameters a node reads (each once), and the module paths owning them."""

    params: tuple[nn.Parameter, ...]
    owners: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TracedGraph:
    """A traced model, its graph's nodes in order, and the shape it was traced at.

    Its methods answer questions about single nodes; they read, and never change, the record.
    """

    model: nn.Module
    traced: TracedModel
    nodes: tuple[fx.Node, ...]
    params_by_fqn: Mapping[str, nn.Parameter]  # remove_duplicate=False: tied names too
    batch_size: int
    seq_len: int

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.traced.graph_module

    def is_state(self, node: fx.Node) -> bool:
        """Whether ``node`` holds model state (a parameter, buffer or lifted constant)."""
        if node.op == "get_attr":
            return True
        return node.op == "placeholder" and node.name in self.traced.state_placeholders

    def owner(self, node: fx.Node) -> str | None:
        """The innermost module running ``node``, or None if the graph does not say."""
        if node.op == "call_module":
            return str(node.target)
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = next(reversed(stack.values()))[0]
            return str(path)
        return None

    def module_path(self, node: fx.Node) -> str:
        return self.owner(node) or ""

    def input_value(self, node: fx.Node) -> Any:
        """A fresh meta value for a user-input placeholder."""
        key = node.name if self.traced.front_end == "export" else str(node.target)
        if key in self.traced.input_values:
            value = self.traced.input_values[key]
        else:
            value = node.args[0] if node.args else None
        return materialize(spec_of(value))

    def state_tensor(self, node: fx.Node) -> Any:
        """The model's own tensor (not a meta stand-in) behind a model-state node."""
        if node.op == "get_attr":
            value: Any = self.graph_module
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            return value
        fqn = self.traced.fqn_of_placeholder.get(node.name)
        if fqn is not None:
            return self.params_by_fqn.get(fqn)
        return node.meta.get("val")

    def state_fqn(self, node: fx.Node) -> str:
        if node.op == "get_attr":
            return str(node.target)
        return self.traced.fqn_of_placeholder.get(node.name, node.name)

    def node_params(self, node: fx.Node) -> NodeParams:
        """Parameters ``node`` reads: its module's, if a call_module, and state nodes it uses."""
        params: dict[int, nn.Parameter] = {}
        owners: list[str] = []
        if node.op == "call_module":
            module = self.graph_module.get_submodule(str(node.target))
            for param in module.parameters():
                params.setdefault(id(param), param)
            if params:
                owners.append(str(node.target))
        for arg in node.all_input_nodes:
            if self.is_state(arg):
                tensor = self.state_tensor(arg)
                if isinstance(tensor, nn.Parameter):
                    params.setdefault(id(tensor), tensor)
                    owners.append(self.module_path(node))
        return NodeParams(params=tuple(params.values()), owners=tuple(owners))

    def externals(self, nodes: Sequence[fx.Node]) -> list[fx.Node]:
        """Activations that ``nodes`` read from outside themselves, in first-read order."""
        members = set(nodes)
        found: dict[fx.Node, None] = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in members and not self.is_state(arg):
                    found.setdefault(arg, None)
        return list(found)


def traced_graph(
    model: nn.Module, traced: TracedModel, *, batch_size: int, seq_len: int
) -> TracedGraph:
    """The record the later steps read: ``traced`` with its nodes listed once."""
    return TracedGraph(
        model=model,
        traced=traced,
        nodes=tuple(traced.graph_module.graph.nodes),
        params_by_fqn=dict(model.named_parameters(remove_duplicate=False)),
        batch_size=batch_size,
        seq_len=seq_len,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurements:
    """Measures of every compute node, at the traced batch size.

    ``rep_of[u]`` is the unit whose run unit ``u``'s figures come from: ``u`` itself if it was
    run (its `UnitMeasure` is in ``units``), else the first earlier unit with an equal key, whose
    nodes pair with ``u``'s in order.
    """

    nodes: Mapping[str, NodeMeasure]  # by node name
    specs: Mapping[fx.Node, Any]  # each node's output, a pytree of TensorSpec and constants
    units: Mapping[int, UnitMeasure]  # the units that were run
    rep_of: tuple[int, ...]


def measure_units(
    graph: TracedGraph, assignment: Assignment, *, profile: UnitProfiler
) -> Measurements:
    """Run each distinct unit's nodes on meta tensors through ``profile``.

    Expects ``assignment`` made from ``graph``'s nodes. Guarantees a measure and a spec for every
    compute node. Blocks and ``other`` units that are structurally identical with equal inputs
    (see `_unit_key`) are run once; embedding and head units are always run.
    """
    gm = graph.graph_module
    state = MetaState(gm, graph.model, graph.traced.fqn_of_placeholder)
    runner = NodeRunner(gm, state, input_value=graph.input_value, is_state=graph.is_state)
    structures: dict[str, Hashable] = {}  # module_structure by call_module target
    specs: dict[fx.Node, Any] = {}
    measures: dict[str, NodeMeasure] = {}
    unit_measures: dict[int, UnitMeasure] = {}
    rep_of: list[int] = []
    reps: dict[Hashable, int] = {}
    units = zip(assignment.units, assignment.compute_nodes, strict=True)
    for idx, (spec, nodes) in enumerate(units):
        if spec.kind in ("block", "other") and nodes:
            key = _unit_key(graph, nodes, spec.root, specs, structures)
            rep = reps.setdefault(key, idx)
            if rep != idx:
                for mine, theirs in zip(nodes, assignment.compute_nodes[rep], strict=True):
                    measures[mine.name] = measures[theirs.name]
                    specs[mine] = specs[theirs]
                rep_of.append(rep)
                continue
        external = {n: specs[n] for n in graph.externals(nodes)}
        measured = profile(nodes, external, runner, graph.module_path)
        for node in nodes:
            measures[node.name] = measured.nodes[node.name]
            specs[node] = measured.nodes[node.name].output
        unit_measures[idx] = measured
        rep_of.append(idx)
    logger.debug(
        "profiled %d of %d units (identical units reuse their figures)",
        len(unit_measures),
        len(assignment.units),
    )
    return Measurements(nodes=measures, specs=specs, units=unit_measures, rep_of=tuple(rep_of))


# --------------------------------------------------------------------------------------------
# Structural key of a unit
# --------------------------------------------------------------------------------------------


def _unit_key(
    graph: TracedGraph,
    nodes: Sequence[fx.Node],
    root: str,
    specs: Mapping[fx.Node, Any],
    structures: dict[str, Hashable],
) -> Hashable:
    """Key equal for units that measure the same (see `unit_key`).

    A unit made only of nodes inlined from one traced block graph (``TEMPLATE_META``) is
    keyed by that template and its inputs (activation specs, model state read from outside
    the unit), which is cheaper and equivalent: the nodes are copies of the same graph.
    ``structures`` caches module structures across the units of one trace.
    """
    templates = {node.meta.get(TEMPLATE_META) for node in nodes}
    if len(templates) == 1 and None not in templates:
        members = set(nodes)
        inputs: dict[fx.Node, None] = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in members:
                    inputs.setdefault(arg, None)
        return (
            "template",
            templates.pop(),
            len(nodes),
            tuple(
                ("s", _state_key(graph, arg, root)) if graph.is_state(arg) else _freeze(specs[arg])
                for arg in inputs
            ),
        )
    return unit_key(
        nodes,
        root,
        target_key=partial(_target_key, graph.graph_module, structures),
        state_key=partial(_state_key, graph),
        is_state=graph.is_state,
        external_value=lambda node: _freeze(specs[node]),
    )


def _target_key(
    gm: fx.GraphModule, structures: dict[str, Hashable], node: fx.Node, root: str
) -> Hashable:
    if node.op == "call_module":
        target = str(node.target)
        if target not in structures:
            module = gm.get_submodule(target)
            structures[target] = module_structure(module, with_attributes=True)
        return (_relative(target, root), structures[target])
    if node.op == "call_function":
        function = node.target
        where = getattr(function, "__module__", "")
        return f"{where}.{getattr(function, '__qualname__', function)}"
    return str(node.target)


def _state_key(graph: TracedGraph, node: fx.Node, root: str) -> Hashable:
    tensor = graph.state_tensor(node)
    shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else None
    return (_relative(graph.state_fqn(node), root), shape)


def _freeze(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return value  # type: ignore[no-any-return]


def _relative(path: str, root: str) -> str:
    if root and (path == root or path.startswith(root + ".")):
        return path[len(root) + 1 :]
    return path


# --------------------------------------------------------------------------------------------
# Reading nodes and specs
# --------------------------------------------------------------------------------------------


def target_name(node: fx.Node) -> str:
    """A node's target as profiles show it: a name, or a function's ``__name__``."""
    if isinstance(node.target, str):
        return node.target
    return getattr(node.target, "__name__", str(node.target))


def spec_bytes(value: Any) -> float:
    """Bytes of all the tensors in a pytree of `TensorSpec` and constants."""
    if isinstance(value, TensorSpec):
        return float(value.nbytes)
    if isinstance(value, (list, tuple)):
        return sum(spec_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(spec_bytes(v) for v in value.values())
    return 0.0


def first_spec(value: Any) -> TensorSpec | None:
    """The first tensor of a pytree of `TensorSpec` (in lists and tuples), or None."""
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = first_spec(item)
            if found is not None:
                return found
    return None
