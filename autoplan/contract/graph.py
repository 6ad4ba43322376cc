"""`ModelGraph`: a traced model, as `autoplan.trace` returns it.

It carries the `ModelProfile` (all the cost model and the search read, per sample), the fx
`GraphModule` it was measured on, which pipeline unit every fx node belongs to (so the passes can
`torch.fx.passes.split_module` by unit or stage: node names are kept as traced), a profile of
every node, `unit_graph()`, a networkx view of the units and the bytes that cross each cut, and
for a mixture-of-experts model one `MoELayerProfile` per expert layer (the experts as units of
work: their parameters, FLOPs per routed token, tokens per expert, all-to-all bytes).

Per-sample means one sequence of ``profile.seq_len`` tokens; tensor shapes in ``node.meta`` and
`NodeProfile.shape` are at the traced batch size (``batch_size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import networkx as nx
from torch import fx, nn

from cost_model.workload import GemmShape, ModelProfile, OpKind, TpRole

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = [
    "FrontEnd",
    "MoELayerProfile",
    "ModelGraph",
    "NodeProfile",
    "keep_non_persistent_buffers",
]

FrontEnd = Literal["fx", "export"]


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeProfile:
    """One fx node, measured on the meta device; FLOPs and activation bytes are per sample.

    ``saved_bytes`` counts storages this node produced that autograd keeps for backward (within
    its unit, deduplicated by storage); what a unit saves of its inputs belongs to no node of it.
    ``num_params``/``param_bytes`` count the parameters the node uses (tied ones included).
    Parameter and buffer nodes (``get_attr``, lifted placeholders) report ``output_bytes == 0``:
    they are model state, not activations, and never cross a pipeline cut.
    """

    name: str
    op: str  # fx opcode: placeholder, get_attr, call_module, call_function, call_method, output
    target: str
    module_path: str  # innermost owning module ("" for the root module)
    unit: int
    kind: OpKind
    tp: TpRole
    forward_flops: float
    backward_flops: float
    activation_read_bytes: float
    activation_write_bytes: float
    param_bytes_read: float
    num_params: int
    param_bytes: int
    output_bytes: float
    saved_bytes: float
    shape: tuple[int, ...] | None  # first tensor output, at the traced batch size
    dtype: str | None
    gemm: GemmShape | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class MoELayerProfile:
    """One mixture-of-experts layer: its routed experts as units of work.

    Per sample means one sequence of ``seq_len`` tokens. Token counts assume balanced routing:
    each of the ``num_experts`` experts gets the expected share ``seq_len * top_k / num_experts``
    of a sample's ``seq_len * top_k`` token-expert assignments (what the trace measured on meta
    tensors; real routing is uneven, which a cost model prices as an imbalance factor). FLOPs
    are measured on the traced experts call, per (token, expert) assignment. The dispatch
    all-to-all sends every assignment's hidden vector to its expert and the combine sends the
    expert's output back: each moves ``seq_len * top_k * hidden_size`` elements per sample
    (under expert parallelism of degree ep, the (ep - 1) / ep of them bound for other ranks
    cross the network). The router, the shared expert and attention are ordinary ops of the
    unit (``UnitProfile.ops``); the experts call is one op there too, named ``experts_node``.
    """

    unit: int  # index into profile.units
    path: str  # the MoEFeedForward module, e.g. "blocks.3.mlp"
    experts_path: str  # its GroupedExperts, e.g. "blocks.3.mlp.experts"
    experts_node: str  # the fx node that runs the experts (a call_module)
    num_experts: int
    top_k: int
    hidden_size: int
    expert_ffn_hidden_size: int
    num_params_per_expert: int
    param_bytes_per_expert: int
    num_router_params: int
    num_shared_expert_params: int  # 0 without a shared expert
    forward_flops_per_token_per_expert: float  # one routed token through one expert
    backward_flops_per_token_per_expert: float
    routed_tokens_per_sample: int  # seq_len * top_k token-expert assignments
    dtype_bytes: int  # element size of the dispatched hidden vectors, as traced

    @property
    def tokens_per_expert_per_sample(self) -> float:
        """Expected assignments per expert per sample: seq_len * top_k / num_experts."""
        return self.routed_tokens_per_sample / self.num_experts

    def tokens_per_expert(self, micro_batch_size: int) -> float:
        """Expected tokens each expert processes per micro-batch (balanced routing)."""
        return micro_batch_size * self.tokens_per_expert_per_sample

    def expert_forward_flops(self, micro_batch_size: int) -> float:
        """Forward FLOPs of one expert per micro-batch (balanced routing)."""
        return self.tokens_per_expert(micro_batch_size) * self.forward_flops_per_token_per_expert

    def dispatch_bytes(self, micro_batch_size: int, dtype_bytes: int | None = None) -> float:
        """Bytes one all-to-all dispatch moves per micro-batch, all ranks together: tokens *
        top_k * hidden_size * element size (the traced one unless given). The combine moves
        the same."""
        size = self.dtype_bytes if dtype_bytes is None else dtype_bytes
        return float(micro_batch_size * self.routed_tokens_per_sample * self.hidden_size * size)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ModelGraph:
    """A traced model: profile, fx graph, node -> unit map and per-node profiles.

    With ``front_end == "export"`` the graph module is the `torch.export` graph (ATen ops,
    parameters lifted to placeholders), also available as ``exported_program``.
    """

    profile: ModelProfile
    graph_module: fx.GraphModule
    front_end: FrontEnd
    node_units: Mapping[str, int]  # every node name -> index into profile.units
    node_profiles: Mapping[str, NodeProfile]  # every node except the output
    unit_modules: tuple[tuple[str, ...], ...]  # module paths each unit runs, in first-use order
    batch_size: int  # batch size the graph was traced and propagated at
    exported_program: ExportedProgram | None = None
    moe_layers: tuple[MoELayerProfile, ...] = ()  # in unit order; empty for a dense model

    def unit_moe_layers(self, unit: int) -> tuple[MoELayerProfile, ...]:
        """The mixture-of-experts layers of ``unit`` (none for a dense unit)."""
        return tuple(layer for layer in self.moe_layers if layer.unit == unit)

    def unit_of(self, node: fx.Node | str) -> int:
        """Index of the unit a node belongs to (a `split_module` callback)."""
        return self.node_units[node if isinstance(node, str) else node.name]

    def unit_nodes(self, unit: int) -> list[str]:
        """Names of the nodes of ``unit``, in graph order."""
        return [name for name, idx in self.node_units.items() if idx == unit]

    def cut_bytes(self, after_unit: int) -> float:
        """Activation bytes per sample crossing a pipeline cut placed after ``after_unit``."""
        return self.profile.units[after_unit].output_bytes

    def unit_graph(self) -> nx.DiGraph:
        """Units as nodes (with their costs), data flow between units as edges.

        Node ``i`` has ``name``, ``kind``, ``forward_flops``, ``backward_flops``, ``num_params``,
        ``param_bytes``, ``saved_bytes`` and ``output_bytes`` (all per sample). Edge ``(u, v)``
        has ``bytes``: activations produced in ``u`` and read in ``v``, per sample, and
        ``tensors``: the producing node names. A tensor read by several later units appears on
        several edges; a cut's traffic is ``cut_bytes`` (each tensor counted once).
        """
        graph = nx.DiGraph()
        for idx, unit in enumerate(self.profile.units):
            graph.add_node(
                idx,
                name=unit.name,
                kind=unit.kind,
                forward_flops=unit.forward_flops,
                backward_flops=unit.backward_flops,
                num_params=unit.num_params,
                param_bytes=unit.param_bytes,
                saved_bytes=unit.saved_bytes,
                output_bytes=unit.output_bytes,
            )
        edges: dict[tuple[int, int], list[str]] = {}
        for node in self.graph_module.graph.nodes:
            prof = self.node_profiles.get(node.name)
            if prof is None or prof.output_bytes == 0:  # parameters and buffers report 0
                continue
            src = self.node_units[node.name]
            for dst in sorted({self.node_units[user.name] for user in node.users}):
                if dst > src:
                    edges.setdefault((src, dst), []).append(node.name)
        for (src, dst), names in edges.items():
            total = sum(self.node_profiles[name].output_bytes for name in names)
            graph.add_edge(src, dst, bytes=total, tensors=tuple(names))
        return graph


def keep_non_persistent_buffers(source: nn.Module, target: nn.Module) -> None:
    """Mark ``target``'s buffers non-persistent where ``source`` has them so, at the same path
    (`fx.GraphModule` registers every buffer it copies as persistent: a model's derived tables,
    such as RoPE's, would land in state dicts and checkpoints)."""
    for path, module in target.named_modules():
        if not module._buffers:
            continue
        try:
            origin = source.get_submodule(path)
        except AttributeError:
            continue
        module._non_persistent_buffers_set.update(
            name for name in module._buffers if name in origin._non_persistent_buffers_set
        )
