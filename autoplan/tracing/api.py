"""`trace`: an ``nn.Module`` to a `ModelGraph`, with no real parameter or activation memory.

Expects a model (on any device; meta is cheapest) and example inputs, or a ``model.config`` with
``seq_len`` (or Hugging Face's ``max_position_embeddings``/``n_positions``) and ``vocab_size``
to build ``input_ids`` from. Guarantees a `ModelGraph` whose `ModelProfile` holds, per sample:
FLOPs (forward and measured backward), bytes, parameters, saved activations split into the
contract's buckets, cut bytes and TP structure of every pipeline unit. Structurally identical
units (same ops, same input shapes) are measured once and their figures reused.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_map

from autoplan.errors import TraceError
from autoplan.graph import ModelGraph, NodeProfile
from autoplan.tracing.fingerprint import fingerprint
from autoplan.tracing.profiler import (
    INPUT,
    MetaState,
    NodeMeasure,
    NodeRunner,
    TensorSpec,
    UnitMeasure,
    materialize,
    profile_unit,
    spec_of,
)
from autoplan.tracing.tracer import TEMPLATE_META, LeafSpec, TracedModel, trace_model
from autoplan.tracing.units import (
    Assignment,
    TpResult,
    assign_units,
    classify_tp,
    find_blocks,
    find_vocab,
    module_structure,
    unit_key,
)
from cost_model.workload import GemmShape, ModelProfile, OpKind, OpProfile, UnitProfile

__all__ = ["ExampleInputs", "trace"]

logger = logging.getLogger(__name__)

# A node's kind is the "heaviest" category among the ATen ops it ran.
_KIND_ORDER: tuple[tuple[str, OpKind], ...] = (
    ("attention", "attention"),
    ("matmul", "matmul"),
    ("embedding", "embedding"),
    ("reduction", "reduction"),
    ("elementwise", "elementwise"),
)
_SEQ_LEN_KEYS = ("seq_len", "max_position_embeddings", "n_positions")


ExampleInputs = Tensor | Sequence[Any] | Mapping[str, Any] | None


def trace(
    model: nn.Module,
    example_inputs: ExampleInputs = None,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    units: Sequence[str] | None = None,
    block_path: str | None = None,
    leaf_modules: Sequence[LeafSpec] = (),
    name: str | None = None,
) -> ModelGraph:
    """Trace and profile ``model`` on the meta device.

    Args:
        model: any ``nn.Module``; traced with torch.fx, or torch.export where fx fails.
        example_inputs: a tensor, a tuple of positional or a dict of keyword arguments for
            ``forward``. None builds ``input_ids`` of shape (batch_size, seq_len).
        batch_size, seq_len: shape of the built ``input_ids``; ``seq_len`` defaults to the
            model config's. Profiles are per sample whatever the batch size.
        units: module paths to use as the pipeline units (each one unit), overriding discovery.
        block_path: path of the ``ModuleList``/``Sequential`` whose children are the blocks.
        leaf_modules: module paths or types that fx keeps as single calls (not traced into).
        name: the profile's name (default: a zoo model's spec, e.g. ``llama3-8b:seq_len=4096``,
            which plans record so that the CLI can rebuild the model; else the class name).

    Raises:
        TraceError: the model cannot be traced or run on meta tensors, or inputs are missing.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace expects an nn.Module, got {type(model).__name__}")
    inputs = _resolve_inputs(model, example_inputs, batch_size=batch_size, seq_len=seq_len)
    anchors, mode = _layout(model, units=units, block_path=block_path)
    with _no_gc():
        traced = trace_model(
            model,
            inputs.args,
            inputs.kwargs,
            blocks=anchors if mode == "blocks" else (),
            leaf_modules=leaf_modules,
        )
        return _Build(model, traced, inputs, anchors, mode).run(name or _default_name(model))


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: tracing allocates ~10^5 long-lived fx objects, and
    the collections they trigger cost more than half the time of a large trace."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------------------------
# Inputs and unit layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Inputs:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch_size: int
    seq_len: int


def _config_int(config: object, keys: Sequence[str]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _default_name(model: nn.Module) -> str:
    """A zoo model's spec (plans record it, so the CLI can rebuild the model), else the
    model's class name."""
    from autoplan.model_spec import spec_of

    return spec_of(model) or type(model).__name__


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, Tensor) else value


def _model_device(model: nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("meta")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{name} = {value!r} must be a whole number >= 1")


def _resolve_inputs(
    model: nn.Module, example_inputs: ExampleInputs, *, batch_size: int, seq_len: int | None
) -> _Inputs:
    _check_positive("batch_size", batch_size)
    if seq_len is not None:
        _check_positive("seq_len", seq_len)
    config = getattr(model, "config", None)
    max_len = _config_int(config, ("seq_len",))
    if example_inputs is None:
        length = seq_len if seq_len is not None else _config_int(config, _SEQ_LEN_KEYS)
        vocab = _config_int(config, ("vocab_size",))
        if length is None or vocab is None:
            raise TraceError(
                f"cannot build example inputs for {type(model).__name__}: it has no "
                "config.seq_len and config.vocab_size; pass example_inputs=(input_ids,) or "
                "seq_len=... (with a config.vocab_size)"
            )
        ids = torch.zeros((batch_size, length), dtype=torch.long, device=_model_device(model))
        args: tuple[Any, ...] = (ids,)
        kwargs: dict[str, Any] = {}
    elif isinstance(example_inputs, Tensor):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        raise TraceError(
            f"example_inputs must be a tensor, a tuple of arguments or a dict of keyword "
            f"arguments, got {type(example_inputs).__name__}"
        )
    if _model_device(model).type == "meta":  # a meta model runs on meta inputs (export)
        args, kwargs = tree_map(_to_meta, (args, kwargs))
    first = next(
        (t for t in (*args, *kwargs.values()) if isinstance(t, Tensor) and t.dim() >= 1), None
    )
    if first is None:
        raise TraceError(
            "example_inputs contain no tensor with a batch dimension; pass e.g. "
            "(input_ids,) with input_ids of shape (batch, seq_len)"
        )
    batch = int(first.shape[0])
    length = int(first.shape[1]) if first.dim() >= 2 else 1
    if example_inputs is not None and seq_len is not None and seq_len != length:
        raise TraceError(
            f"seq_len = {seq_len} but example_inputs have sequence length {length} "
            "(dim 1 of the first input); give one or the other"
        )
    if max_len is not None and length > max_len:
        raise TraceError(
            f"sequence length {length} exceeds {type(model).__name__}'s config.seq_len = "
            f"{max_len}; build the model with seq_len={length} (e.g. --model NAME:seq_len="
            f"{length}) or trace a shorter sequence"
        )
    return _Inputs(args=args, kwargs=kwargs, batch_size=batch, seq_len=length)


def _layout(
    model: nn.Module, *, units: Sequence[str] | None, block_path: str | None
) -> tuple[tuple[str, ...], Literal["blocks", "children"]]:
    """Module paths that start units, and whether they are blocks or top-level children."""
    if units is not None and block_path is not None:
        raise TraceError("give units= or block_path=, not both")
    if units is not None:
        if isinstance(units, str) or not units:
            raise TraceError(f"units = {units!r} must be a non-empty list of module paths")
        for path in units:
            _submodule(model, path, "units")
        return tuple(units), "blocks"
    if block_path is not None:
        container = _submodule(model, block_path, "block_path")
        children = [name for name, _ in container.named_children()]
        if not children:
            raise TraceError(
                f"block_path = {block_path!r} ({type(container).__name__}) has no child "
                "modules; name the ModuleList/Sequential that holds the blocks"
            )
        prefix = f"{block_path}." if block_path else ""
        return tuple(prefix + child for child in children), "blocks"
    run = find_blocks(model)
    if run is not None:
        return run.paths, "blocks"
    children = [name for name, _ in model.named_children()]
    logger.warning(
        "%s has no repeated blocks (no ModuleList/Sequential of identical children): one "
        "pipeline unit per top-level child (%s); pass block_path= or units= to choose",
        type(model).__name__,
        ", ".join(children) or "none",
    )
    return tuple(children), "children"


def _submodule(model: nn.Module, path: str, argument: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        names = [name for name, _ in model.named_modules() if name][:12]
        raise TraceError(
            f"{argument}: {type(model).__name__} has no module {path!r}; module paths look "
            f"like: {', '.join(names)}"
        ) from None


# --------------------------------------------------------------------------------------------
# Profiling
# --------------------------------------------------------------------------------------------


def _freeze(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return value  # type: ignore[no-any-return]


def _spec_bytes(value: Any) -> float:
    if isinstance(value, TensorSpec):
        return float(value.nbytes)
    if isinstance(value, (list, tuple)):
        return sum(_spec_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_spec_bytes(v) for v in value.values())
    return 0.0


def _first_spec(value: Any) -> TensorSpec | None:
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_spec(item)
            if found is not None:
                return found
    return None


def op_kind(measure: NodeMeasure) -> OpKind:
    for category, kind in _KIND_ORDER:
        if category in measure.categories:
            return kind
    return "other"


def _target_name(node: fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    return getattr(node.target, "__name__", str(node.target))


def _collapse(paths: Sequence[str]) -> tuple[str, ...]:
    """Paths in order, dropping any inside an earlier-kept or later shallower one."""
    kept: list[str] = []
    for path in sorted(dict.fromkeys(paths), key=lambda p: p.count(".")):
        if not any(path == k or path.startswith(k + ".") for k in kept):
            kept.append(path)
    order = {path: i for i, path in enumerate(dict.fromkeys(paths))}
    return tuple(sorted(kept, key=order.__getitem__))


class _NodeProfiles(Mapping[str, NodeProfile]):
    """Node profiles; those of copies of a profiled unit are made on first access (a 126-block
    model has ~7000 nodes, and most callers read a few)."""

    def __init__(
        self,
        names: Sequence[str],
        profiles: dict[str, NodeProfile],
        copies: Mapping[str, tuple[str, fx.Node, int]],
        module_path: Callable[[fx.Node], str],
    ) -> None:
        self._names = tuple(names)
        self._profiles = profiles
        self._copies = copies
        self._module_path = module_path

    def __getitem__(self, name: str) -> NodeProfile:
        found = self._profiles.get(name)
        if found is None:
            rep_name, node, unit = self._copies[name]
            found = replace(
                self[rep_name],
                name=name,
                unit=unit,
                module_path=self._module_path(node),
                target=_target_name(node),
            )
            self._profiles[name] = found
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._profiles or name in self._copies


def _renamed_op(op: OpProfile, name: str) -> OpProfile:
    return OpProfile(
        name=name,
        kind=op.kind,
        tp=op.tp,
        forward_flops=op.forward_flops,
        backward_flops=op.backward_flops,
        activation_bytes=op.activation_bytes,
        param_bytes_read=op.param_bytes_read,
        gemm=op.gemm,
    )


@dataclass(frozen=True, slots=True)
class _UnitFigures:
    """What copies of a profiled unit reuse: its ops, TP-sharded count, saved-bytes buckets."""

    ops: tuple[OpProfile, ...]
    tp_sharded: int
    buckets: tuple[float, float, float, float]
    recompute_skip_ops: int


@dataclass(frozen=True, slots=True)
class _UnitNodes:
    nodes: dict[str, NodeProfile]
    ops: tuple[OpProfile, ...]


class _Build:
    """One trace's profiling state: the graph, its units, model state on meta."""

    def __init__(
        self,
        model: nn.Module,
        traced: TracedModel,
        inputs: _Inputs,
        anchors: Sequence[str],
        mode: Literal["blocks", "children"],
    ) -> None:
        self.model = model
        self.traced = traced
        self.gm = traced.graph_module
        self.nodes = list(self.gm.graph.nodes)
        self.inputs = inputs
        self.batch = inputs.batch_size
        self.mode = mode
        self.params_by_fqn = dict(model.named_parameters(remove_duplicate=False))
        self.state = MetaState(self.gm, model, traced.fqn_of_placeholder)
        self.runner = NodeRunner(
            self.gm, self.state, input_value=self._input_value, is_state=self.is_state
        )
        self._structures: dict[str, Hashable] = {}
        self.assignment: Assignment = assign_units(
            self.nodes, anchors, mode=mode, owner=self.owner, is_state=self.is_state
        )

    # ---------------------------------------------------------------- node helpers

    def is_state(self, node: fx.Node) -> bool:
        if node.op == "get_attr":
            return True
        return node.op == "placeholder" and node.name in self.traced.state_placeholders

    def owner(self, node: fx.Node) -> str | None:
        if node.op == "call_module":
            return str(node.target)
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = next(reversed(stack.values()))[0]
            return str(path)
        return None

    def module_path(self, node: fx.Node) -> str:
        return self.owner(node) or ""

    def linear_path(self, node: fx.Node) -> str:
        return self.module_path(node)

    def _input_value(self, node: fx.Node) -> Any:
        key = node.name if self.traced.front_end == "export" else str(node.target)
        if key in self.traced.input_values:
            value = self.traced.input_values[key]
        else:
            value = node.args[0] if node.args else None
        return materialize(spec_of(value))

    def _state_tensor(self, node: fx.Node) -> Any:
        if node.op == "get_attr":
            value: Any = self.gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            return value
        fqn = self.traced.fqn_of_placeholder.get(node.name)
        if fqn is not None:
            return self.params_by_fqn.get(fqn)
        return node.meta.get("val")

    def _state_fqn(self, node: fx.Node) -> str:
        if node.op == "get_attr":
            return str(node.target)
        return self.traced.fqn_of_placeholder.get(node.name, node.name)

    def node_params(self, node: fx.Node) -> tuple[list[nn.Parameter], list[str]]:
        """Parameters a node reads, and the module paths owning them."""
        params: dict[int, nn.Parameter] = {}
        owners: list[str] = []
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            for param in module.parameters():
                params.setdefault(id(param), param)
            if params:
                owners.append(str(node.target))
        for arg in node.all_input_nodes:
            if self.is_state(arg):
                tensor = self._state_tensor(arg)
                if isinstance(tensor, nn.Parameter):
                    params.setdefault(id(tensor), tensor)
                    owners.append(self.module_path(node))
        return list(params.values()), owners

    def _target_key(self, node: fx.Node, root: str) -> Hashable:
        if node.op == "call_module":
            target = str(node.target)
            if target not in self._structures:
                module = self.gm.get_submodule(target)
                self._structures[target] = module_structure(module, with_attributes=True)
            return (_relative(target, root), self._structures[target])
        if node.op == "call_function":
            function = node.target
            where = getattr(function, "__module__", "")
            return f"{where}.{getattr(function, '__qualname__', function)}"
        return str(node.target)

    def _state_key(self, node: fx.Node, root: str) -> Hashable:
        tensor = self._state_tensor(node)
        shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else None
        return (_relative(self._state_fqn(node), root), shape)

    def _unit_key(
        self, nodes: Sequence[fx.Node], root: str, specs: Mapping[fx.Node, Any]
    ) -> Hashable:
        """Key equal for units that measure the same (see `unit_key`).

        A unit made only of nodes inlined from one traced block graph (``TEMPLATE_META``) is
        keyed by that template and its inputs (activation specs, model state read from outside
        the unit), which is cheaper and equivalent: the nodes are copies of the same graph.
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
                    ("s", self._state_key(arg, root)) if self.is_state(arg) else _freeze(specs[arg])
                    for arg in inputs
                ),
            )
        return unit_key(
            nodes,
            root,
            target_key=self._target_key,
            state_key=self._state_key,
            is_state=self.is_state,
            external_value=lambda node: _freeze(specs[node]),
        )

    def _externals(self, nodes: Sequence[fx.Node]) -> list[fx.Node]:
        members = set(nodes)
        found: dict[fx.Node, None] = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in members and not self.is_state(arg):
                    found.setdefault(arg, None)
        return list(found)

    # ---------------------------------------------------------------- the run

    def run(self, name: str) -> ModelGraph:
        a = self.assignment
        specs: dict[fx.Node, Any] = {}
        measures: dict[str, NodeMeasure] = {}
        unit_measures: dict[int, UnitMeasure] = {}
        rep_of: list[int] = []
        reps: dict[Hashable, int] = {}
        for idx, (spec, nodes) in enumerate(zip(a.units, a.compute_nodes, strict=True)):
            external = self._externals(nodes)
            if spec.kind in ("block", "other") and nodes:
                key = self._unit_key(nodes, spec.root, specs)
                rep = reps.setdefault(key, idx)
                if rep != idx:
                    for mine, theirs in zip(nodes, a.compute_nodes[rep], strict=True):
                        measures[mine.name] = measures[theirs.name]
                        specs[mine] = specs[theirs]
                    rep_of.append(rep)
                    continue
            measured = profile_unit(
                nodes, {n: specs[n] for n in external}, self.runner, self.module_path
            )
            for node in nodes:
                measures[node.name] = measured.nodes[node.name]
                specs[node] = measured.nodes[node.name].output
            unit_measures[idx] = measured
            rep_of.append(idx)
        logger.debug(
            "profiled %d of %d units (identical units reuse their figures)",
            len(unit_measures),
            len(a.units),
        )
        return self._assemble(name, measures, specs, unit_measures, rep_of)

    def _assemble(
        self,
        name: str,
        measures: dict[str, NodeMeasure],
        specs: dict[fx.Node, Any],
        unit_measures: dict[int, UnitMeasure],
        rep_of: list[int],
    ) -> ModelGraph:
        a = self.assignment
        batch = self.batch
        output = next(n for n in reversed(self.nodes) if n.op == "output")
        lookup_units = [
            nodes
            for spec, nodes in zip(a.units, a.compute_nodes, strict=True)
            if spec.kind in ("embedding", "other")
        ]
        head_nodes = a.compute_nodes[-1] if a.units[-1].kind in ("head", "other") else None
        lookup, head, vocab = find_vocab(
            [n for nodes in lookup_units for n in nodes],
            head_nodes,
            measures,
            is_state=self.is_state,
            output=output,
        )
        tp_results: dict[int, TpResult] = {
            rep: classify_tp(
                a.compute_nodes[rep],
                measures,
                kind=a.units[rep].kind,
                root=a.units[rep].root,
                linear_path=self.linear_path,
                is_state=self.is_state,
                vocab_embedding=lookup,
                vocab_head=head,
                vocab_size=vocab,
            )
            for rep in sorted(set(rep_of))
        }

        # Parameters: each unit's set; a tied parameter belongs to the first unit using it.
        unit_params: list[dict[int, nn.Parameter]] = []
        unit_owners: list[list[str]] = []
        node_params: dict[str, list[nn.Parameter]] = {}
        for idx, (spec, nodes) in enumerate(zip(a.units, a.compute_nodes, strict=True)):
            params, owners = self._unit_params(spec.root, nodes, node_params, rep_of[idx] == idx)
            unit_params.append(params)
            unit_owners.append(owners)
        seen: set[int] = set()
        for params in unit_params:
            seen.update(params)
        leftovers = [p for p in self.model.parameters() if id(p) not in seen]
        if leftovers:
            logger.debug("%d parameters used by no node join unit 0", len(leftovers))
            for param in leftovers:
                unit_params[0].setdefault(id(param), param)

        crossing = self._cut_bytes(specs)
        node_profiles: dict[str, NodeProfile] = {}
        unit_profiles: list[UnitProfile] = []
        owner_unit: dict[int, int] = {}
        figures: dict[int, _UnitFigures] = {}
        copies: dict[str, tuple[str, fx.Node, int]] = {}
        shapes_for_fingerprint: list[tuple[str, list[tuple[int, ...]]]] = []
        for idx, (spec, nodes) in enumerate(zip(a.units, a.compute_nodes, strict=True)):
            rep = rep_of[idx]
            params = unit_params[idx]
            if rep == idx:
                measured = self._node_profiles(idx, nodes, measures, tp_results[rep], node_params)
                node_profiles.update(measured.nodes)
                tail = set(unit_measures[rep].recompute_tail)
                figures[idx] = _UnitFigures(
                    ops=measured.ops,
                    tp_sharded=self._tp_sharded(spec.root, tp_results[rep], params),
                    buckets=_saved_buckets(
                        unit_measures[rep], nodes, tp_results[rep], measures, batch
                    ),
                    recompute_skip_ops=_trailing_count(measured.ops, tail),
                )
            else:  # identical to an earlier unit: its figures under this unit's node names
                renamed: dict[str, str] = {}
                for node, theirs in zip(nodes, a.compute_nodes[rep], strict=True):
                    renamed[theirs.name] = node.name
                    copies[node.name] = (theirs.name, node, idx)
                figures[idx] = _UnitFigures(
                    ops=tuple(_renamed_op(op, renamed[op.name]) for op in figures[rep].ops),
                    tp_sharded=figures[rep].tp_sharded,
                    buckets=figures[rep].buckets,
                    recompute_skip_ops=figures[rep].recompute_skip_ops,
                )
            unit_figures = figures[idx]
            buckets = unit_figures.buckets
            for key in params:
                owner_unit.setdefault(key, idx)
            shared = sum(p.numel() for key, p in params.items() if owner_unit[key] < idx)
            inputs = [*self._externals(nodes), *(n for n in nodes if n.op == "placeholder")]
            unit_profiles.append(
                UnitProfile(
                    name=spec.name,
                    kind=spec.kind,
                    ops=unit_figures.ops,
                    num_params=sum(p.numel() for p in params.values()),
                    num_params_tp_sharded=unit_figures.tp_sharded,
                    param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
                    num_params_shared=shared,
                    saved_bytes_sharded=buckets[0],
                    saved_bytes_replicated=buckets[1],
                    saved_bytes_selective_sharded=buckets[2],
                    saved_bytes_selective_replicated=buckets[3],
                    input_bytes=sum(_spec_bytes(specs[n]) for n in inputs) / batch,
                    output_bytes=crossing[idx],
                    tp=tp_results[rep].structure,
                    recompute_skip_ops=unit_figures.recompute_skip_ops,
                )
            )
            shapes_for_fingerprint.append((spec.kind, [tuple(p.shape) for p in params.values()]))
        for node in self.nodes:
            if node.name not in node_profiles and node.name not in copies and node.op != "output":
                node_profiles[node.name] = self._state_profile(node)

        blocks = [u for u in unit_profiles if u.kind == "block"]
        first_block = blocks[0] if blocks else None
        profile = ModelProfile(
            name=name,
            units=tuple(unit_profiles),
            seq_len=self.inputs.seq_len,
            hidden_size=self._hidden_size(specs),
            vocab_size=vocab,
            num_heads=first_block.tp.num_heads if first_block else None,
            num_kv_heads=first_block.tp.num_kv_heads if first_block else None,
            traced_dtype_bytes=self._dtype_bytes(),
            fingerprint=fingerprint(shapes_for_fingerprint, seq_len=self.inputs.seq_len),
        )
        unit_modules = tuple(_collapse([p for p in owners if p]) for owners in unit_owners)
        return ModelGraph(
            profile=profile,
            graph_module=self.gm,
            front_end=self.traced.front_end,
            node_units=MappingProxyType(dict(a.node_units)),
            node_profiles=_NodeProfiles(
                [n.name for n in self.nodes if n.op != "output"],
                node_profiles,
                copies,
                self.module_path,
            ),
            unit_modules=unit_modules,
            batch_size=batch,
            exported_program=self.traced.exported_program,
        )

    # ---------------------------------------------------------------- pieces

    def _unit_params(
        self,
        root: str,
        nodes: Sequence[fx.Node],
        node_params: dict[str, list[nn.Parameter]],
        full: bool,
    ) -> tuple[dict[int, nn.Parameter], list[str]]:
        """A unit's parameters (by id) and the module paths owning them.

        A block owns every parameter under its module path. ``full`` also records each node's
        parameters (for its `NodeProfile`); otherwise only nodes reaching outside the block's
        module are inspected (a copy of a profiled unit reuses its node figures).
        """
        params: dict[int, nn.Parameter] = {}
        owners: list[str] = []
        if root:
            owners.append(root)
            for param in self.model.get_submodule(root).parameters():
                params.setdefault(id(param), param)
        inside = root + "."
        for node in nodes:
            if not full and not self._reaches_outside(node, inside):
                continue
            found, paths = self.node_params(node)
            node_params[node.name] = found
            for param in found:
                params.setdefault(id(param), param)
            owners.extend(paths)
        return params, owners

    def _reaches_outside(self, node: fx.Node, inside: str) -> bool:
        if node.op == "call_module" and not str(node.target).startswith(inside):
            return True
        return any(
            self.is_state(arg) and not self._state_fqn(arg).startswith(inside)
            for arg in node.all_input_nodes
        )

    def _node_profiles(
        self,
        idx: int,
        nodes: Sequence[fx.Node],
        measures: Mapping[str, NodeMeasure],
        tp: TpResult,
        node_params: Mapping[str, list[nn.Parameter]],
    ) -> _UnitNodes:
        batch = self.batch
        profiles: dict[str, NodeProfile] = {}
        ops: list[OpProfile] = []
        for pos, node in enumerate(nodes):
            measure = measures[node.name]
            kind = op_kind(measure)
            params = node_params.get(node.name, [])
            gemm = _gemm_shape(measure, batch)
            profile = NodeProfile(
                name=node.name,
                op=node.op,
                target=_target_name(node),
                module_path=self.module_path(node),
                unit=idx,
                kind=kind,
                tp=tp.roles[pos],
                forward_flops=measure.forward_flops / batch,
                backward_flops=measure.backward_flops / batch,
                activation_read_bytes=measure.read_bytes / batch,
                activation_write_bytes=measure.write_bytes / batch,
                param_bytes_read=measure.param_bytes_read,
                num_params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                output_bytes=measure.output_bytes / batch,
                saved_bytes=measure.saved_bytes / batch,
                shape=_shape(measure.output),
                dtype=_dtype(measure.output),
                gemm=gemm,
            )
            profiles[node.name] = profile
            activation_bytes = profile.activation_read_bytes + profile.activation_write_bytes
            if profile.forward_flops or activation_bytes:
                ops.append(
                    OpProfile(
                        name=node.name,
                        kind=kind,
                        tp=profile.tp,
                        forward_flops=profile.forward_flops,
                        backward_flops=profile.backward_flops,
                        activation_bytes=activation_bytes,
                        param_bytes_read=profile.param_bytes_read,
                        gemm=gemm,
                    )
                )
        return _UnitNodes(nodes=profiles, ops=tuple(ops))

    def _cut_bytes(self, specs: Mapping[fx.Node, Any]) -> list[float]:
        """Bytes per sample crossing a cut after each unit.

        A tensor made in unit u and last read in unit v > u crosses the cuts after u..v-1;
        model outputs cross every cut after their unit (for the last unit: what it returns).
        """
        a = self.assignment
        num_units = len(a.units)
        delta = [0.0] * (num_units + 1)
        for node in self.nodes:
            if node.op == "output" or not node.users or node not in specs:
                continue
            size = _spec_bytes(specs[node]) / self.batch
            if not size:
                continue
            src = a.node_units[node.name]
            dst = max(num_units if u.op == "output" else a.node_units[u.name] for u in node.users)
            if dst > src:
                delta[src] += size
                delta[dst] -= size
        crossing = []
        running = 0.0
        for idx in range(num_units):
            running += delta[idx]
            crossing.append(max(running, 0.0))
        return crossing

    def _tp_sharded(self, root: str, tp: TpResult, params: Mapping[int, nn.Parameter]) -> int:
        counted: dict[int, int] = {}
        for linear in tp.structure.linears:
            path = f"{root}.{linear.path}" if root else linear.path
            try:
                module = self.model.get_submodule(path)
            except AttributeError:
                continue
            for param in module.parameters():
                if id(param) not in params:
                    continue
                if linear.style == "row" and param.dim() < 2:
                    continue  # a row linear's bias is added after the all-reduce
                counted[id(param)] = param.numel()
        return sum(counted.values())

    def _state_profile(self, node: fx.Node) -> NodeProfile:
        tensor = self._state_tensor(node) if self.is_state(node) else None
        params = [tensor] if isinstance(tensor, nn.Parameter) else []
        return NodeProfile(
            name=node.name,
            op=node.op,
            target=_target_name(node),
            module_path=self.module_path(node),
            unit=self.assignment.node_units[node.name],
            kind="other",
            tp="replicated",
            forward_flops=0.0,
            backward_flops=0.0,
            activation_read_bytes=0.0,
            activation_write_bytes=0.0,
            param_bytes_read=0.0,
            num_params=sum(p.numel() for p in params),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            output_bytes=0.0,
            saved_bytes=0.0,
            shape=tuple(tensor.shape) if isinstance(tensor, Tensor) else None,
            dtype=str(tensor.dtype).removeprefix("torch.") if isinstance(tensor, Tensor) else None,
        )

    def _hidden_size(self, specs: Mapping[fx.Node, Any]) -> int:
        config = getattr(self.model, "config", None)
        size = _config_int(config, ("hidden_size", "n_embd", "d_model"))
        if size is not None:
            return size
        a = self.assignment
        for spec, nodes in zip(a.units, a.compute_nodes, strict=True):
            if spec.kind == "block":
                for node in self._externals(nodes):
                    first = _first_spec(specs[node])
                    if first is not None and first.shape:
                        return first.shape[-1]
        for node in a.compute_nodes[0]:
            first = _first_spec(specs.get(node))
            if first is not None and first.shape and first.dtype.is_floating_point:
                return first.shape[-1]
        return 1

    def _dtype_bytes(self) -> int:
        sizes: dict[int, int] = {}
        for param in self.model.parameters():
            if param.is_floating_point():
                sizes[param.element_size()] = sizes.get(param.element_size(), 0) + param.numel()
        return max(sizes, key=sizes.__getitem__) if sizes else 4


def _relative(path: str, root: str) -> str:
    if root and (path == root or path.startswith(root + ".")):
        return path[len(root) + 1 :]
    return path


def _shape(output: Any) -> tuple[int, ...] | None:
    first = _first_spec(output)
    return first.shape if first is not None else None


def _dtype(output: Any) -> str | None:
    first = _first_spec(output)
    return str(first.dtype).removeprefix("torch.") if first is not None else None


def _gemm_shape(measure: NodeMeasure, batch: int) -> GemmShape | None:
    """The node's main GEMM per sample (attention: ``Q @ K^T``; ``A @ V`` has equal FLOPs)."""
    if measure.attention is not None:
        q_shape, k_shape = measure.attention
        return GemmShape(m_per_sample=q_shape[2], n=k_shape[2], k=q_shape[3], batch=q_shape[1])
    candidates = [g for g in (measure.weight_gemm, measure.activation_gemm) if g is not None]
    if not candidates:
        return None
    gemm = max(candidates, key=lambda g: g.flops)
    if gemm.batch == 1:
        m = gemm.m // batch if gemm.m % batch == 0 else gemm.m
        return GemmShape(m_per_sample=m, n=gemm.n, k=gemm.k)
    per_sample = gemm.batch // batch if gemm.batch % batch == 0 else gemm.batch
    return GemmShape(m_per_sample=gemm.m, n=gemm.n, k=gemm.k, batch=per_sample)


def _saved_buckets(
    measured: UnitMeasure,
    nodes: Sequence[fx.Node],
    tp: TpResult,
    measures: Mapping[str, NodeMeasure],
    batch: int,
) -> tuple[float, float, float, float]:
    """(sharded, replicated, selective sharded, selective replicated) saved bytes per sample.

    A storage is sharded when its producer runs inside the TP region (column linear, attention
    core, activation); selective recompute drops what non-GEMM, non-attention nodes produced.
    The unit's inputs (and model inputs) are replicated and always kept.
    """
    info = {
        node.name: (tp.roles[pos], op_kind(measures[node.name]), node.op)
        for pos, node in enumerate(nodes)
    }
    sharded = replicated = selective_sharded = selective_replicated = 0.0
    for storage in measured.saved:
        size = storage.nbytes / batch
        producer = info.get(storage.producer)
        if storage.producer == INPUT or producer is None or producer[2] == "placeholder":
            replicated += size
            continue
        role, kind, _ = producer
        cheap = kind not in ("matmul", "attention")
        if role in ("column", "sharded"):
            sharded += size
            selective_sharded += size if cheap else 0.0
        else:
            replicated += size
            selective_replicated += size if cheap else 0.0
    return sharded, replicated, selective_sharded, selective_replicated


def _trailing_count(ops: Sequence[OpProfile], names: set[str]) -> int:
    """How many ops at the end of ``ops`` are named in ``names`` (a recompute's skipped tail)."""
    count = 0
    for op in reversed(ops):
        if op.name not in names:
            break
        count += 1
    return count
