"""The mixture-of-experts layers of a traced model: experts as units of work.

Expects a `TracedGraph` traced with torch.fx (the zoo's `GroupedExperts` kept a leaf, as
`trace` does), its `Assignment` and the `Measurements` of its units. Guarantees one
`MoELayerProfile` per ``call_module`` node that runs a `GroupedExperts` whose parent is a
`MoEFeedForward`, in graph order, with per-token FLOPs taken from the measured node (on meta
tensors the experts see balanced routing, so every assignment costs the same). A model without
such nodes (every dense model, any torch.export trace) gets none.
"""

from __future__ import annotations

from torch import nn

from autoplan.contract.graph import MoELayerProfile
from autoplan.models.moe import GroupedExperts, MoEFeedForward
from autoplan.tracing.measure import Measurements, TracedGraph, first_spec
from autoplan.tracing.units import Assignment

__all__ = ["moe_layers"]


def moe_layers(
    graph: TracedGraph, assignment: Assignment, measured: Measurements
) -> tuple[MoELayerProfile, ...]:
    """A `MoELayerProfile` per experts call in ``graph`` (see the module docstring)."""
    if graph.traced.front_end != "fx":
        return ()
    found: list[MoELayerProfile] = []
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        experts_path = str(node.target)
        experts = graph.model.get_submodule(experts_path)
        if not isinstance(experts, GroupedExperts):
            continue
        path = experts_path.rpartition(".")[0]
        owner = graph.model.get_submodule(path) if path else None
        if not isinstance(owner, MoEFeedForward):
            continue
        measure = measured.nodes[node.name]
        rows = first_spec(measure.output)
        assert rows is not None and rows.shape, f"experts call {node.name} returned no tensor"
        # rows: (assignments at the traced batch, hidden size)
        assignments = rows.shape[0]
        per_expert = [p for p in experts.parameters()]
        shared = owner.shared_expert
        found.append(
            MoELayerProfile(
                unit=assignment.node_units[node.name],
                path=path,
                experts_path=experts_path,
                experts_node=node.name,
                num_experts=experts.num_experts,
                top_k=owner.top_k,
                hidden_size=owner.hidden_size,
                expert_ffn_hidden_size=experts.w_gate.shape[1],
                num_params_per_expert=sum(p.numel() for p in per_expert) // experts.num_experts,
                param_bytes_per_expert=_bytes(per_expert) // experts.num_experts,
                num_router_params=sum(p.numel() for p in owner.router.parameters()),
                num_shared_expert_params=(
                    sum(p.numel() for p in shared.parameters()) if shared is not None else 0
                ),
                forward_flops_per_token_per_expert=measure.forward_flops / assignments,
                backward_flops_per_token_per_expert=measure.backward_flops / assignments,
                routed_tokens_per_sample=assignments // graph.batch_size,
                dtype_bytes=rows.dtype.itemsize,
            )
        )
    return tuple(found)


def _bytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)
