"""Per-unit figures from measurements: TP structure, parameters, cut bytes, unit and node profiles.

Expects a `TracedGraph`, its `Assignment` and the `Measurements` of its units (at the traced
batch size). The steps, in order: `classify_units` (vocabulary and TP roles of each unit that was
run), `collect_params` (each unit's parameters; a tied one belongs to the first unit using it),
`cut_bytes` (what crosses each pipeline cut) and `profile_units` (a `UnitProfile` per unit and a
`NodeProfile` per node, per sample; a copied unit reuses its twin's figures under its own node
names).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, fx, nn

from autoplan.contract.graph import NodeProfile
from autoplan.tracing.fusion import with_fusion
from autoplan.tracing.measure import (
    Measurements,
    TracedGraph,
    first_spec,
    spec_bytes,
    target_name,
)
from autoplan.tracing.node_measures import INPUT, NodeMeasure, UnitMeasure
from autoplan.tracing.units import Assignment, TpResult, UnitSpec, classify_tp, find_vocab
from cost_model.strategy import SELECTIVE_SAVED_KINDS
from cost_model.workload import GemmShape, OpKind, OpProfile, TpStructure, UnitProfile

__all__ = [
    "NodeCopy",
    "ProfiledUnits",
    "TpAnalysis",
    "UnitParams",
    "classify_units",
    "collect_params",
    "cut_bytes",
    "op_kind",
    "profile_units",
]

logger = logging.getLogger(__name__)

# A node's kind is the "heaviest" category among the ATen ops it ran.
_KIND_ORDER: tuple[tuple[str, OpKind], ...] = (
    ("attention", "attention"),
    ("matmul", "matmul"),
    ("embedding", "embedding"),
    ("reduction", "reduction"),
    ("elementwise", "elementwise"),
)


def op_kind(measure: NodeMeasure) -> OpKind:
    """The first of `_KIND_ORDER`'s categories that the node's ATen ops ran, else "other"."""
    for category, kind in _KIND_ORDER:
        if category in measure.categories:
            return kind
    return "other"


# --------------------------------------------------------------------------------------------
# Tensor-parallel structure
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TpAnalysis:
    """The vocabulary size (None if neither lookup nor output projection was found) and the TP
    roles and structure of every unit that was run."""

    vocab_size: int | None
    units: Mapping[int, TpResult]  # by the index of a unit that was run


def classify_units(
    graph: TracedGraph, assignment: Assignment, measured: Measurements
) -> TpAnalysis:
    """Find the vocabulary lookup and head, then classify each unit that was run.

    Guarantees a `TpResult` for every unit in ``measured.rep_of``; copies share their twin's.
    """
    a = assignment
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    lookup_units = [
        nodes
        for spec, nodes in zip(a.units, a.compute_nodes, strict=True)
        if spec.kind in ("embedding", "other")
    ]
    head_nodes = a.compute_nodes[-1] if a.units[-1].kind in ("head", "other") else None
    lookup, head, vocab = find_vocab(
        [n for nodes in lookup_units for n in nodes],
        head_nodes,
        measured.nodes,
        is_state=graph.is_state,
        output=output,
    )
    units = {
        rep: classify_tp(
            a.compute_nodes[rep],
            measured.nodes,
            kind=a.units[rep].kind,
            root=a.units[rep].root,
            linear_path=graph.module_path,
            is_state=graph.is_state,
            vocab_embedding=lookup,
            vocab_head=head,
            vocab_size=vocab,
        )
        for rep in sorted(set(measured.rep_of))
    }
    return TpAnalysis(vocab_size=vocab, units=units)


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitParams:
    """Each unit's parameters by ``id`` (a tied one in every unit using it) and the module
    paths owning them; the parameters each node reads (nodes of units that were run, and nodes
    of copies that reach outside their block); the first unit using each parameter."""

    units: tuple[Mapping[int, nn.Parameter], ...]
    owners: tuple[tuple[str, ...], ...]
    of_node: Mapping[str, Sequence[nn.Parameter]]
    first_unit: Mapping[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class _OneUnitParams:
    """`UnitParams`'s figures for one unit."""

    params: dict[int, nn.Parameter]
    owners: tuple[str, ...]
    of_node: dict[str, Sequence[nn.Parameter]]


def collect_params(graph: TracedGraph, assignment: Assignment, rep_of: Sequence[int]) -> UnitParams:
    """Every unit's parameters; parameters no node uses join unit 0.

    Guarantees every model parameter is in some unit's set.
    """
    per_unit: list[_OneUnitParams] = []
    for idx, (spec, nodes) in enumerate(
        zip(assignment.units, assignment.compute_nodes, strict=True)
    ):
        per_unit.append(_unit_params(graph, spec.root, nodes, full=rep_of[idx] == idx))
    seen: set[int] = set()
    for unit in per_unit:
        seen.update(unit.params)
    leftovers = {id(p): p for p in graph.model.parameters() if id(p) not in seen}
    if leftovers:
        logger.debug("%d parameters used by no node join unit 0", len(leftovers))
    units = (per_unit[0].params | leftovers, *(unit.params for unit in per_unit[1:]))
    first_unit: dict[int, int] = {}
    for idx, params in enumerate(units):
        for key in params:
            first_unit.setdefault(key, idx)
    return UnitParams(
        units=units,
        owners=tuple(unit.owners for unit in per_unit),
        of_node={name: found for unit in per_unit for name, found in unit.of_node.items()},
        first_unit=first_unit,
    )


def _unit_params(
    graph: TracedGraph, root: str, nodes: Sequence[fx.Node], *, full: bool
) -> _OneUnitParams:
    """A unit's parameters (by id) and the module paths owning them.

    A block owns every parameter under its module path. ``full`` also records each node's
    parameters (for its `NodeProfile`); otherwise only nodes reaching outside the block's
    module are inspected (a copy of a profiled unit reuses its node figures).
    """
    params: dict[int, nn.Parameter] = {}
    owners: list[str] = []
    of_node: dict[str, Sequence[nn.Parameter]] = {}
    if root:
        owners.append(root)
        for param in graph.model.get_submodule(root).parameters():
            params.setdefault(id(param), param)
    inside = root + "."
    for node in nodes:
        if not full and not _reaches_outside(graph, node, inside):
            continue
        found = graph.node_params(node)
        of_node[node.name] = found.params
        for param in found.params:
            params.setdefault(id(param), param)
        owners.extend(found.owners)
    return _OneUnitParams(params=params, owners=tuple(owners), of_node=of_node)


def _reaches_outside(graph: TracedGraph, node: fx.Node, inside: str) -> bool:
    if node.op == "call_module" and not str(node.target).startswith(inside):
        return True
    return any(
        graph.is_state(arg) and not graph.state_fqn(arg).startswith(inside)
        for arg in node.all_input_nodes
    )


# --------------------------------------------------------------------------------------------
# Cuts
# --------------------------------------------------------------------------------------------


def cut_bytes(
    graph: TracedGraph, assignment: Assignment, specs: Mapping[fx.Node, Any]
) -> tuple[float, ...]:
    """Bytes per sample crossing a cut after each unit.

    A tensor made in unit u and last read in unit v > u crosses the cuts after u..v-1;
    model outputs cross every cut after their unit (for the last unit: what it returns).
    """
    a = assignment
    num_units = len(a.units)
    delta = [0.0] * (num_units + 1)
    for node in graph.nodes:
        if node.op == "output" or not node.users or node not in specs:
            continue
        size = spec_bytes(specs[node]) / graph.batch_size
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
    return tuple(crossing)


# --------------------------------------------------------------------------------------------
# Unit and node profiles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeCopy:
    """A node of a copied unit: the name of the node it copies, and its own node and unit."""

    twin: str
    node: fx.Node
    unit: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfiledUnits:
    """The profile of every unit; node profiles of the units that were run and of model state;
    the nodes of copied units, whose profiles are their twins' under their own names."""

    units: tuple[UnitProfile, ...]
    nodes: Mapping[str, NodeProfile]
    copies: Mapping[str, NodeCopy]


@dataclass(frozen=True, kw_only=True, slots=True)
class _SavedBuckets:
    """Saved bytes per sample, by what TP does to them and whether selective recompute drops
    them."""

    sharded: float
    replicated: float
    selective_sharded: float
    selective_replicated: float


@dataclass(frozen=True, kw_only=True, slots=True)
class _UnitFigures:
    """What copies of a profiled unit reuse: its ops, TP-sharded count, saved-bytes buckets."""

    ops: tuple[OpProfile, ...]
    tp_sharded: int
    buckets: _SavedBuckets
    recompute_skip_ops: int


@dataclass(frozen=True, kw_only=True, slots=True)
class _UnitNodes:
    """Profiles of a measured unit's nodes, and its ops (the nodes doing any work)."""

    nodes: dict[str, NodeProfile]
    ops: tuple[OpProfile, ...]


def profile_units(
    graph: TracedGraph,
    assignment: Assignment,
    measured: Measurements,
    tp: TpAnalysis,
    params: UnitParams,
    cuts: Sequence[float],
) -> ProfiledUnits:
    """A `UnitProfile` per unit, and the `NodeProfile` of every node but copies' and the output.

    Expects ``tp`` and ``params`` from the same measurements and ``cuts`` from `cut_bytes`.
    Guarantees a copied unit's ops and figures equal its twin's, renamed to its own nodes.
    """
    node_profiles: dict[str, NodeProfile] = {}
    copies: dict[str, NodeCopy] = {}
    figures: dict[int, _UnitFigures] = {}
    units: list[UnitProfile] = []
    for idx, (spec, nodes) in enumerate(
        zip(assignment.units, assignment.compute_nodes, strict=True)
    ):
        rep = measured.rep_of[idx]
        if rep == idx:
            own = _node_profiles(graph, idx, nodes, measured.nodes, tp.units[rep], params.of_node)
            node_profiles.update(own.nodes)
            figures[idx] = _measured_figures(
                graph,
                spec.root,
                nodes,
                with_fusion(own.ops, nodes, measured.specs, graph.batch_size),
                measured.units[rep],
                measured.nodes,
                tp.units[rep],
                params.units[idx],
            )
        else:
            twins = assignment.compute_nodes[rep]
            for node, twin in zip(nodes, twins, strict=True):
                copies[node.name] = NodeCopy(twin=twin.name, node=node, unit=idx)
            renamed = {twin.name: node.name for node, twin in zip(nodes, twins, strict=True)}
            figures[idx] = _renamed_figures(figures[rep], renamed)
        units.append(
            _unit_profile(
                graph,
                idx,
                spec,
                nodes,
                figures[idx],
                params,
                tp.units[rep].structure,
                measured.specs,
                cuts[idx],
            )
        )
    for node in graph.nodes:
        if node.name not in node_profiles and node.name not in copies and node.op != "output":
            node_profiles[node.name] = _state_profile(graph, assignment, node)
    return ProfiledUnits(units=tuple(units), nodes=node_profiles, copies=copies)


def _measured_figures(
    graph: TracedGraph,
    root: str,
    nodes: Sequence[fx.Node],
    ops: tuple[OpProfile, ...],
    unit: UnitMeasure,
    measures: Mapping[str, NodeMeasure],
    tp: TpResult,
    params: Mapping[int, nn.Parameter],
) -> _UnitFigures:
    """The figures of a unit that was run."""
    return _UnitFigures(
        ops=ops,
        tp_sharded=_tp_sharded(graph.model, root, tp, params),
        buckets=_saved_buckets(unit, nodes, tp, measures, graph.batch_size),
        recompute_skip_ops=_trailing_count(ops, set(unit.recompute_tail)),
    )


def _renamed_figures(figures: _UnitFigures, renamed: Mapping[str, str]) -> _UnitFigures:
    """``figures`` of a twin unit, its ops named after this unit's nodes."""
    return replace(figures, ops=tuple(_renamed_op(op, renamed[op.name]) for op in figures.ops))


def _unit_profile(
    graph: TracedGraph,
    idx: int,
    spec: UnitSpec,
    nodes: Sequence[fx.Node],
    figures: _UnitFigures,
    params: UnitParams,
    tp: TpStructure,
    specs: Mapping[fx.Node, Any],
    output_bytes: float,
) -> UnitProfile:
    """Unit ``idx``'s profile: its figures (its own or its twin's) and its own parameters,
    inputs and cut; a tied parameter counts as shared in every unit but the first using it."""
    own = params.units[idx]
    shared = sum(p.numel() for key, p in own.items() if params.first_unit[key] < idx)
    inputs = [*graph.externals(nodes), *(n for n in nodes if n.op == "placeholder")]
    buckets = figures.buckets
    return UnitProfile(
        name=spec.name,
        kind=spec.kind,
        ops=figures.ops,
        num_params=sum(p.numel() for p in own.values()),
        num_params_tp_sharded=figures.tp_sharded,
        param_bytes=sum(p.numel() * p.element_size() for p in own.values()),
        num_params_shared=shared,
        saved_bytes_sharded=buckets.sharded,
        saved_bytes_replicated=buckets.replicated,
        saved_bytes_selective_sharded=buckets.selective_sharded,
        saved_bytes_selective_replicated=buckets.selective_replicated,
        input_bytes=sum(spec_bytes(specs[n]) for n in inputs) / graph.batch_size,
        output_bytes=output_bytes,
        tp=tp,
        recompute_skip_ops=figures.recompute_skip_ops,
    )


def _node_profiles(
    graph: TracedGraph,
    idx: int,
    nodes: Sequence[fx.Node],
    measures: Mapping[str, NodeMeasure],
    tp: TpResult,
    node_params: Mapping[str, Sequence[nn.Parameter]],
) -> _UnitNodes:
    """Per-sample profiles of a measured unit's nodes, and the ops (nodes doing any work)."""
    batch = graph.batch_size
    profiles: dict[str, NodeProfile] = {}
    ops: list[OpProfile] = []
    for pos, node in enumerate(nodes):
        measure = measures[node.name]
        kind = op_kind(measure)
        params = node_params.get(node.name, ())
        gemm = _gemm_shape(measure, batch)
        profile = NodeProfile(
            name=node.name,
            op=node.op,
            target=target_name(node),
            module_path=graph.module_path(node),
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


def _state_profile(graph: TracedGraph, assignment: Assignment, node: fx.Node) -> NodeProfile:
    """The profile of a model-state node (parameter, buffer, constant): it computes nothing."""
    tensor = graph.state_tensor(node) if graph.is_state(node) else None
    params = [tensor] if isinstance(tensor, nn.Parameter) else []
    return NodeProfile(
        name=node.name,
        op=node.op,
        target=target_name(node),
        module_path=graph.module_path(node),
        unit=assignment.node_units[node.name],
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


def _tp_sharded(
    model: nn.Module, root: str, tp: TpResult, params: Mapping[int, nn.Parameter]
) -> int:
    """Parameters of the unit that TP splits (a row linear's bias is not split)."""
    counted: dict[int, int] = {}
    for linear in tp.structure.linears:
        path = f"{root}.{linear.path}" if root else linear.path
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        for param in module.parameters():
            if id(param) not in params:
                continue
            if linear.style == "row" and param.dim() < 2:
                continue  # a row linear's bias is added after the all-reduce
            counted[id(param)] = param.numel()
    return sum(counted.values())


def _saved_buckets(
    measured: UnitMeasure,
    nodes: Sequence[fx.Node],
    tp: TpResult,
    measures: Mapping[str, NodeMeasure],
    batch: int,
) -> _SavedBuckets:
    """Saved bytes per sample of a unit, by bucket.

    A storage is sharded when its producer runs inside the TP region (column linear, attention
    core, activation); selective recompute drops what nodes of kinds it does not keep produced
    (`cost_model.strategy.SELECTIVE_SAVED_KINDS`, the runtime's and the cost model's rule).
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
        cheap = kind not in SELECTIVE_SAVED_KINDS
        if role in ("column", "sharded"):
            sharded += size
            selective_sharded += size if cheap else 0.0
        else:
            replicated += size
            selective_replicated += size if cheap else 0.0
    return _SavedBuckets(
        sharded=sharded,
        replicated=replicated,
        selective_sharded=selective_sharded,
        selective_replicated=selective_replicated,
    )


def _trailing_count(ops: Sequence[OpProfile], names: set[str]) -> int:
    """How many ops at the end of ``ops`` are named in ``names`` (a recompute's skipped tail)."""
    count = 0
    for op in reversed(ops):
        if op.name not in names:
            break
        count += 1
    return count


def _renamed_op(op: OpProfile, name: str) -> OpProfile:
    return replace(op, name=name)


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


def _shape(output: Any) -> tuple[int, ...] | None:
    first = first_spec(output)
    return first.shape if first is not None else None


def _dtype(output: Any) -> str | None:
    first = first_spec(output)
    return str(first.dtype).removeprefix("torch.") if first is not None else None
