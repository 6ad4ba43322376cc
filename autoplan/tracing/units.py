"""Pipeline units: find the repeated blocks, give every fx node a unit, detect TP structure.

Expects a model (for its module hierarchy) and its traced fx graph whose nodes carry module
ownership (``call_module`` targets and ``nn_module_stack``). Guarantees:

- `find_blocks`: the largest run of blocks (children of one class in a ``ModuleList``, so a
  mixture-of-experts model's dense first layers join its expert layers; structurally identical
  children of a ``Sequential``), by parameters covered, then length (a one-layer
  ``ModuleList`` counts), or None.
- `assign_units`: every node gets a unit; units are contiguous ranges of the graph's execution
  order, so every edge goes from a unit to itself or a later one (cuts between units are valid
  pipeline cuts). Nodes before the first block form the ``embedding`` unit, nodes after the last
  block the ``head`` unit; parameters/buffers belong to the unit of their first user.
- `classify_tp`: Megatron column/row pairs from data flow (a weight GEMM whose input comes, via an
  attention core or a nonlinearity, from other weight GEMMs is a row linear, those are column
  linears, and the nodes on the paths between are ``sharded``); module names are the fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx, nn

from autoplan.tracing.node_measures import NodeMeasure
from autoplan.tracing.tensor_specs import TensorSpec
from cost_model.workload import TpLinear, TpRole, TpStructure, UnitKind

__all__ = [
    "CALL_OPS",
    "Assignment",
    "BlockRun",
    "TpResult",
    "UnitSpec",
    "assign_units",
    "classify_tp",
    "find_blocks",
    "find_vocab",
    "module_structure",
    "unit_key",
]

logger = logging.getLogger(__name__)

CALL_OPS = frozenset({"call_module", "call_function", "call_method"})

# Last path component of linears that are conventionally column / row parallel (fallback only).
_COLUMN_NAMES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "qkv_proj",
        "query",
        "key",
        "value",
        "query_key_value",
        "c_attn",
        "wqkv",
        "in_proj",
        "gate_proj",
        "up_proj",
        "gate_up_proj",
        "c_fc",
        "fc1",
        "w1",
        "w3",
        "wi",
        "dense_h_to_4h",
    }
)
_ROW_NAMES = frozenset(
    {"o_proj", "out_proj", "c_proj", "dense", "down_proj", "fc2", "w2", "wo", "dense_4h_to_h"}
)


# --------------------------------------------------------------------------------------------
# Module structure and block discovery
# --------------------------------------------------------------------------------------------


def _attribute_key(value: Any) -> Hashable:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return tuple(_attribute_key(v) for v in value)
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    if hasattr(value, "__dataclass_fields__"):
        return repr(value)
    return type(value).__qualname__


def module_structure(module: nn.Module, *, with_attributes: bool) -> Hashable:
    """A hashable description of a module tree: types, parameter and buffer shapes, children.

    ``with_attributes`` adds the plain attributes (``head_dim``, ``layer_idx``, ...), which can
    change what ``forward`` does: two modules equal with attributes trace to the same graph.
    (Reads ``_parameters``/``_buffers``/``_modules`` directly: the public generators cost ten
    times more, and this runs for every module of a 126-block model.)
    """
    params = tuple(
        (name, tuple(p.shape), p.dtype, p.requires_grad)
        for name, p in module._parameters.items()
        if p is not None
    )
    buffers = tuple(
        (name, tuple(b.shape), b.dtype) for name, b in module._buffers.items() if b is not None
    )
    attributes: tuple[Hashable, ...] = ()
    if with_attributes:
        attributes = tuple(
            sorted(
                (name, _attribute_key(value))
                for name, value in vars(module).items()
                if not name.startswith("_") and name != "training"
            )
        )
    children = tuple(
        (name, module_structure(child, with_attributes=with_attributes))
        for name, child in module._modules.items()
        if child is not None
    )
    return (type(module), module.training, params, buffers, attributes, children)


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Repeated blocks: the container's path and the paths of its identical children."""

    container: str
    paths: tuple[str, ...]


def find_blocks(model: nn.Module) -> BlockRun | None:
    """The run of consecutive blocks covering the most parameters.

    Blocks are structurally identical children of a ``Sequential``, or children of one class in
    a ``ModuleList`` (a mixture-of-experts model's dense first layers and expert layers are one
    run). Ties go to the longer run, then to the one found first (the shallowest). A run of one
    is a block only in a ``ModuleList`` (a one-layer model) and only if no longer run exists.
    """
    best: tuple[int, int, int] | None = None
    found: BlockRun | None = None
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        if not children:
            continue
        keys: list[object] = (
            [type(child) for _, child in children]
            if isinstance(container, nn.ModuleList)
            else [module_structure(child, with_attributes=False) for _, child in children]
        )
        start = 0
        while start < len(children):
            end = start + 1
            while end < len(children) and keys[end] == keys[start]:
                end += 1
            length = end - start
            # A lone child counts only in a ModuleList (a one-layer model), and loses to any
            # real run; a Sequential's lone children are steps (Linear, GeLU), not blocks.
            if length >= 2 or isinstance(container, nn.ModuleList):
                sizes = [sum(p.numel() for p in c.parameters()) for _, c in children[start:end]]
                per_block = sizes[0]
                score = (int(length >= 2), sum(sizes), length)
                if per_block and (best is None or score > best):
                    best = score
                    prefix = f"{path}." if path else ""
                    found = BlockRun(
                        container=path,
                        paths=tuple(prefix + name for name, _ in children[start:end]),
                    )
            start = end
    return found


# --------------------------------------------------------------------------------------------
# Node -> unit assignment
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """A unit's name, kind and the module path its relative paths are taken from."""

    name: str
    kind: UnitKind
    root: str  # "" for the embedding and head units, which span several top-level modules


@dataclass(frozen=True, slots=True)
class Assignment:
    """Units in execution order, the unit of every node, and each unit's nodes to run."""

    units: tuple[UnitSpec, ...]
    node_units: dict[str, int]
    compute_nodes: tuple[tuple[fx.Node, ...], ...]  # user inputs and call_* nodes, graph order


def assign_units(
    nodes: Sequence[fx.Node],
    anchors: Sequence[str],
    *,
    mode: Literal["blocks", "children"],
    owner: Callable[[fx.Node], str | None],
    is_state: Callable[[fx.Node], bool],
) -> Assignment:
    """Give each node a unit (see the module docstring).

    ``anchors`` are the module paths that start units: the blocks (``mode="blocks"``: nodes
    before/after them form the embedding/head units) or top-level children (``"children"``:
    nodes before the first one join it, nodes after the last one join that).
    """
    anchor_set = set(anchors)
    anchor_cache: dict[str | None, str | None] = {}

    def anchor_of(path: str | None) -> str | None:
        if path not in anchor_cache:
            found = None
            probe = path
            while probe:
                if probe in anchor_set:
                    found = probe
                    break
                probe = probe.rpartition(".")[0]
            anchor_cache[path] = found
        return anchor_cache[path]

    compute = [n for n in nodes if n.op in CALL_OPS or (n.op == "placeholder" and not is_state(n))]
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for pos, node in enumerate(compute):
        anchor = anchor_of(owner(node)) if node.op in CALL_OPS else None
        if anchor is not None:
            first.setdefault(anchor, pos)
            last[anchor] = pos
    present = sorted(first, key=first.__getitem__)
    units: list[UnitSpec] = []
    starts: list[int] = []
    pre = post = False
    if present:
        pre = mode == "blocks" and any(n.op in CALL_OPS for n in compute[: first[present[0]]])
        post = mode == "blocks" and last[present[-1]] < len(compute) - 1
        if pre:
            units.append(UnitSpec(name="embedding", kind="embedding", root=""))
        kind: UnitKind = "block" if mode == "blocks" else "other"
        units.extend(UnitSpec(name=p, kind=kind, root=p) for p in present)
        starts = [first[p] for p in present]
        if post:
            units.append(UnitSpec(name="head", kind="head", root=""))
    else:
        units.append(UnitSpec(name="model", kind="other", root=""))
        starts = [0]
    offset = 1 if pre else 0

    per_unit: list[list[fx.Node]] = [[] for _ in units]
    node_units: dict[str, int] = {}
    cursor = 0
    for pos, node in enumerate(compute):
        while cursor + 1 < len(starts) and starts[cursor + 1] <= pos:
            cursor += 1
        if pos < starts[0]:
            unit = 0  # the embedding unit, or the first anchor's
        elif post and pos > last[present[-1]]:
            unit = len(units) - 1
        else:
            unit = offset + cursor
        per_unit[unit].append(node)
        node_units[node.name] = unit
    for node in nodes:
        if node.name in node_units:
            continue
        if node.op == "output":
            node_units[node.name] = len(units) - 1
        else:  # model state: the unit of its first user
            users = [node_units[u.name] for u in node.users if u.name in node_units]
            node_units[node.name] = min(users) if users else 0
    return Assignment(
        units=tuple(units),
        node_units=node_units,
        compute_nodes=tuple(tuple(unit_nodes) for unit_nodes in per_unit),
    )


# --------------------------------------------------------------------------------------------
# Structural key of a unit (profile once, reuse for identical units)
# --------------------------------------------------------------------------------------------


def _relative(path: str, root: str) -> str:
    if root and (path == root or path.startswith(root + ".")):
        return path[len(root) + 1 :]
    return path


def _constant_key(value: Any) -> Hashable:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_constant_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _constant_key(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _constant_key(value.start), _constant_key(value.stop), value.step)
    if isinstance(value, fx.Node):
        raise AssertionError("nodes are mapped before constants")
    return repr(value)


def unit_key(
    nodes: Sequence[fx.Node],
    root: str,
    *,
    target_key: Callable[[fx.Node, str], Hashable],
    state_key: Callable[[fx.Node, str], Hashable],
    is_state: Callable[[fx.Node], bool],
    external_value: Callable[[fx.Node], Any],
) -> Hashable:
    """A key equal for two units exactly when they run the same ops on equal inputs.

    Covers every node's op, target (module paths relative to ``root``, module structure), the
    wiring between nodes, constants, model state read (relative path, shape) and the specs of the
    activations entering the unit. Equal keys pair the nodes of the two units in order.
    """
    index = {node: i for i, node in enumerate(nodes)}
    external: dict[fx.Node, int] = {}
    externals: list[Any] = []

    def arg_key(value: Any) -> Hashable:
        if type(value) is int or value is None:
            return value
        if isinstance(value, fx.Node):
            if value in index:
                return ("n", index[value])
            if is_state(value):
                return ("s", state_key(value, root))
            if value not in external:
                external[value] = len(externals)
                externals.append(external_value(value))
            return ("x", external[value])
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(arg_key(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((k, arg_key(v)) for k, v in value.items()))
        return _constant_key(value)

    items = tuple(
        (node.op, target_key(node, root), arg_key(node.args), arg_key(node.kwargs))
        for node in nodes
    )
    return (items, tuple(externals))


# --------------------------------------------------------------------------------------------
# Tensor-parallel structure
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TpResult:
    """TP role of each node of a unit (by position in the unit) and the unit's structure."""

    roles: tuple[TpRole, ...]
    structure: TpStructure
    sharded_params: frozenset[str]  # module paths (absolute) whose weights TP splits
    row_params: frozenset[str]  # of those, row linears (their bias stays replicated)


def _specs(measure: NodeMeasure) -> list[TensorSpec]:
    return [leaf for leaf in _leaves(measure.output) if isinstance(leaf, TensorSpec)]


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, TensorSpec):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)


def _view_only(measure: NodeMeasure) -> bool:
    return measure.categories <= {"view"}


class _Flow:
    """Data-flow queries inside one unit."""

    def __init__(
        self,
        nodes: Sequence[fx.Node],
        measures: Mapping[str, NodeMeasure],
        is_state: Callable[[fx.Node], bool],
    ) -> None:
        self.nodes = nodes
        self.members = set(nodes)
        self.measures = measures
        self.is_state = is_state
        self.linears = {
            n
            for n in nodes
            if measures[n.name].weight_gemm is not None
            and "embedding" not in measures[n.name].categories
        }

    def measure(self, node: fx.Node) -> NodeMeasure:
        return self.measures[node.name]

    def back(self, starts: Iterable[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
        """Nodes reached backwards from ``starts`` without crossing linears; linears reached."""
        region: set[fx.Node] = set()
        sources: set[fx.Node] = set()
        stack = [n for n in starts if n in self.members and not self.is_state(n)]
        seen: set[fx.Node] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in self.linears:
                sources.add(node)
                continue
            if self.measure(node).num_tensor_outputs == 0:
                continue  # shapes and dtypes: no data flows through them
            region.add(node)
            stack.extend(
                a for a in node.all_input_nodes if a in self.members and not self.is_state(a)
            )
        return region, sources

    def activation_inputs(self, node: fx.Node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes if a in self.members and not self.is_state(a)]

    def forward(self, sources: Iterable[fx.Node]) -> set[fx.Node]:
        """Nodes reachable from ``sources`` through tensor-valued nodes of the unit."""
        reached: set[fx.Node] = set()
        stack = list(sources)
        while stack:
            node = stack.pop()
            for user in node.users:
                if (
                    user in self.members
                    and user not in reached
                    and self.measure(user).num_tensor_outputs > 0
                ):
                    reached.add(user)
                    stack.append(user)
        return reached

    def is_core(self, node: fx.Node) -> bool:
        measure = self.measure(node)
        return measure.attention is not None or measure.activation_gemm is not None

    def fused_parts(self, linear: fx.Node) -> int:
        """How many outputs a column linear packs (3 for fused q/k/v), from a split of its
        output features; 1 when its output is not split."""
        gemm = self.measure(linear).weight_gemm
        assert gemm is not None
        stack = [linear]
        seen: set[fx.Node] = set()
        while stack:
            node = stack.pop()
            for user in node.users:
                if user not in self.members or user in seen:
                    continue
                seen.add(user)
                measure = self.measure(user)
                specs = _specs(measure)
                if len(specs) > 1 and all(s.shape and s.shape[-1] < gemm.n for s in specs):
                    if sum(s.shape[-1] for s in specs) == gemm.n:
                        return len(specs)
                elif (
                    len(specs) == 1
                    and _view_only(measure)
                    and specs[0].shape
                    and specs[0].shape[-1] == gemm.n
                ):
                    stack.append(user)
        return 1


def classify_tp(
    nodes: Sequence[fx.Node],
    measures: Mapping[str, NodeMeasure],
    *,
    kind: UnitKind,
    root: str,
    linear_path: Callable[[fx.Node], str],
    is_state: Callable[[fx.Node], bool],
    vocab_embedding: fx.Node | None = None,
    vocab_head: fx.Node | None = None,
    vocab_size: int | None = None,
) -> TpResult:
    """TP roles of a unit's nodes and its `TpStructure` (see the module docstring).

    ``vocab_embedding``/``vocab_head`` are the model's vocabulary lookup and output projection
    if they are in this unit (found by `find_vocab`).
    """
    flow = _Flow(nodes, measures, is_state)
    roles: dict[fx.Node, TpRole] = {}
    linears: list[TpLinear] = []
    sharded: set[str] = set()
    row_paths: set[str] = set()
    num_heads = num_kv_heads = ffn = None

    pairs = _pairs_from_flow(flow, nodes)
    if not pairs and kind == "block":
        pairs = _pairs_from_names(flow, nodes, linear_path)
        if pairs:
            logger.info("TP structure of unit %r from module names (no data-flow pairs)", root)
    for sources, row, region, has_attention in pairs:
        roles[row] = "row"
        for source in sources:
            roles[source] = "column"
        for node in region & flow.forward(sources):
            roles.setdefault(node, "sharded")
        if has_attention:
            heads = _heads(flow, region, sources)
            if heads is not None and num_heads is None:
                num_heads, num_kv_heads = heads
        elif ffn is None:
            row_gemm = flow.measure(row).weight_gemm
            ffn = row_gemm.k if row_gemm is not None else None
    for node in nodes:
        role = roles.get(node)
        if role in ("column", "row"):
            path = linear_path(node)
            style: Literal["column", "row"] = "column" if role == "column" else "row"
            fused = flow.fused_parts(node) if role == "column" else 1
            linears.append(TpLinear(path=_relative(path, root), style=style, fused=fused))
            sharded.add(path)
            if role == "row":
                row_paths.add(path)
    if vocab_embedding is not None and vocab_embedding in flow.members:
        roles[vocab_embedding] = "vocab"
        path = linear_path(vocab_embedding)
        linears.insert(0, TpLinear(path=_relative(path, root), style="vocab_embedding"))
        sharded.add(path)
    if vocab_head is not None and vocab_head in flow.members:
        roles[vocab_head] = "column"
        path = linear_path(vocab_head)
        linears.append(TpLinear(path=_relative(path, root), style="vocab_head"))
        sharded.add(path)
    has_vocab = any(t.style in ("vocab_embedding", "vocab_head") for t in linears)
    structure = TpStructure(
        linears=tuple(linears),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        ffn_hidden_size=ffn,
        vocab_size=vocab_size if has_vocab else None,
    )
    return TpResult(
        roles=tuple(roles.get(node, "replicated") for node in nodes),
        structure=structure,
        sharded_params=frozenset(sharded),
        row_params=frozenset(row_paths),
    )


_Pair = tuple[set[fx.Node], fx.Node, set[fx.Node], bool]


def _pairs_from_flow(flow: _Flow, nodes: Sequence[fx.Node]) -> list[_Pair]:
    pairs: list[_Pair] = []
    rows: set[fx.Node] = set()
    for node in nodes:
        if node not in flow.linears:
            continue
        region, sources = flow.back(flow.activation_inputs(node))
        if not sources or sources & rows:
            continue
        has_attention = any(flow.is_core(n) for n in region)
        if not has_attention and not any(flow.measure(n).activation_fn for n in region):
            continue
        rows.add(node)
        pairs.append((sources, node, region, has_attention))
    return pairs


def _pairs_from_names(
    flow: _Flow, nodes: Sequence[fx.Node], linear_path: Callable[[fx.Node], str]
) -> list[_Pair]:
    pairs: list[_Pair] = []
    columns: set[fx.Node] = set()
    for node in nodes:
        if node not in flow.linears:
            continue
        leaf = linear_path(node).rpartition(".")[2].lower()
        if leaf in _COLUMN_NAMES:
            columns.add(node)
        elif leaf in _ROW_NAMES and columns:
            region, _ = flow.back(flow.activation_inputs(node))
            has_attention = any(flow.is_core(n) for n in region)
            pairs.append((set(columns), node, region, has_attention))
            columns = set()
    return pairs


def _heads(
    flow: _Flow, region: set[fx.Node], sources: set[fx.Node]
) -> tuple[int, int | None] | None:
    """(num_heads, num_kv_heads) from the attention core's query/key shapes and its inputs."""
    for node in flow.nodes:
        if node not in region or not flow.is_core(node):
            continue
        measure = flow.measure(node)
        inputs = flow.activation_inputs(node)
        if measure.attention is not None:
            q_shape, k_shape = measure.attention
        else:
            shapes = [s.shape for a in inputs for s in _specs(flow.measure(a)) if len(s.shape) == 4]
            if len(shapes) < 2:
                continue
            q_shape, k_shape = shapes[0], shapes[1]
        num_heads, head_dim = q_shape[1], q_shape[3]
        num_kv = k_shape[1]
        query = _input_at(node, 0, "query")
        key = _input_at(node, 1, "key")
        if query is not None and key is not None:
            _, q_linears = flow.back([query])
            _, k_linears = flow.back([key])
            if len(k_linears) == 1:
                (k_linear,) = k_linears
                gemm = flow.measure(k_linear).weight_gemm
                assert gemm is not None
                if k_linear in q_linears:  # fused q/k/v: q heads first, then k and v
                    num_kv = (gemm.n - num_heads * head_dim) // (2 * head_dim)
                else:
                    num_kv = gemm.n // head_dim
        return num_heads, num_kv
    return None


def _input_at(node: fx.Node, position: int, name: str) -> fx.Node | None:
    value = node.args[position] if len(node.args) > position else node.kwargs.get(name)
    return value if isinstance(value, fx.Node) else None


def find_vocab(
    lookup_nodes: Sequence[fx.Node],
    head_nodes: Sequence[fx.Node] | None,
    measures: Mapping[str, NodeMeasure],
    *,
    is_state: Callable[[fx.Node], bool],
    output: fx.Node,
) -> tuple[fx.Node | None, fx.Node | None, int | None]:
    """(vocabulary lookup, output projection, vocabulary size), each None if not found.

    The lookup is the embedding among ``lookup_nodes`` whose indices come from a model input
    (through views only), else the one with the most rows. The projection is the single weight
    GEMM of ``head_nodes`` that the model output reads through non-GEMM ops.
    """
    lookups = [n for n in lookup_nodes if measures[n.name].embedding_rows is not None]
    lookup = next((n for n in lookups if _indexed_by_input(n, measures, is_state)), None)
    if lookup is None and lookups:
        lookup = max(lookups, key=lambda n: measures[n.name].embedding_rows or 0)
    head = None
    if head_nodes:
        flow = _Flow(head_nodes, measures, is_state)
        _, sources = flow.back(output.all_input_nodes)
        if len(sources) == 1:
            head = next(iter(sources))
    size = None
    if head is not None:
        gemm = measures[head.name].weight_gemm
        size = gemm.n if gemm is not None else None
    elif lookup is not None:
        size = measures[lookup.name].embedding_rows
    return lookup, head, size


def _indexed_by_input(
    lookup: fx.Node, measures: Mapping[str, NodeMeasure], is_state: Callable[[fx.Node], bool]
) -> bool:
    stack = [a for a in lookup.all_input_nodes if not is_state(a)]
    while stack:
        node = stack.pop()
        if node.op == "placeholder":
            return True
        measure = measures.get(node.name)
        if measure is not None and _view_only(measure):
            stack.extend(a for a in node.all_input_nodes if not is_state(a))
    return False
