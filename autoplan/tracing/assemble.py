"""The `ModelGraph`: the model's `ModelProfile` around its unit profiles, and node profiles.

Expects the records of the earlier steps (`measure`, `unit_profiles`). Guarantees the model's
dimensions (hidden size from the config or the blocks' inputs, vocabulary, heads), its
structural fingerprint, and a node profile for every node but the output, those of copied units
made on first access.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from torch import fx, nn

from autoplan.contract.graph import ModelGraph, MoELayerProfile, NodeProfile
from autoplan.tracing.fingerprint import fingerprint
from autoplan.tracing.measure import Measurements, TracedGraph, first_spec, target_name
from autoplan.tracing.unit_profiles import NodeCopy, ProfiledUnits, TpAnalysis, UnitParams
from autoplan.tracing.units import Assignment
from cost_model.workload import ModelProfile

__all__ = ["config_int", "model_graph"]

_HIDDEN_SIZE_KEYS = ("hidden_size", "n_embd", "d_model")


def config_int(config: object, keys: Sequence[str]) -> int | None:
    """The first of ``keys`` that ``config`` has as an int attribute, or None."""
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def model_graph(
    graph: TracedGraph,
    assignment: Assignment,
    measured: Measurements,
    tp: TpAnalysis,
    params: UnitParams,
    profiled: ProfiledUnits,
    *,
    name: str,
    moe_layers: tuple[MoELayerProfile, ...] = (),
) -> ModelGraph:
    """The `ModelProfile` (model dimensions, fingerprint) and the `ModelGraph` around it.

    Guarantees ``node_profiles`` lists every node but the output, in graph order; copies'
    profiles are made on first access.
    """
    blocks = [u for u in profiled.units if u.kind == "block"]
    first_block = blocks[0] if blocks else None
    shapes = [
        (spec.kind, [tuple(p.shape) for p in unit_params.values()])
        for spec, unit_params in zip(assignment.units, params.units, strict=True)
    ]
    profile = ModelProfile(
        name=name,
        units=profiled.units,
        seq_len=graph.seq_len,
        hidden_size=_hidden_size(graph, assignment, measured.specs),
        vocab_size=tp.vocab_size,
        num_heads=first_block.tp.num_heads if first_block else None,
        num_kv_heads=first_block.tp.num_kv_heads if first_block else None,
        traced_dtype_bytes=_dtype_bytes(graph.model),
        fingerprint=fingerprint(shapes, seq_len=graph.seq_len),
        exported=graph.traced.front_end == "export",
        rope_tables=_has_rope_tables(graph.model),
    )
    return ModelGraph(
        profile=profile,
        graph_module=graph.graph_module,
        front_end=graph.traced.front_end,
        node_units=MappingProxyType(dict(assignment.node_units)),
        node_profiles=_NodeProfiles(
            [n.name for n in graph.nodes if n.op != "output"],
            dict(profiled.nodes),
            profiled.copies,
            graph.module_path,
        ),
        unit_modules=tuple(_collapse([p for p in owners if p]) for owners in params.owners),
        batch_size=graph.batch_size,
        exported_program=graph.traced.exported_program,
        moe_layers=moe_layers,
    )


class _NodeProfiles(Mapping[str, NodeProfile]):
    """Node profiles; those of copies of a profiled unit are made on first access (a 126-block
    model has ~7000 nodes, and most callers read a few)."""

    def __init__(
        self,
        names: Sequence[str],
        profiles: dict[str, NodeProfile],
        copies: Mapping[str, NodeCopy],
        module_path: Callable[[fx.Node], str],
    ) -> None:
        self._names = tuple(names)
        self._profiles = profiles
        self._copies = copies
        self._module_path = module_path

    def __getitem__(self, name: str) -> NodeProfile:
        found = self._profiles.get(name)
        if found is None:
            copy = self._copies[name]
            found = replace(
                self[copy.twin],
                name=name,
                unit=copy.unit,
                module_path=self._module_path(copy.node),
                target=target_name(copy.node),
            )
            self._profiles[name] = found
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._profiles or name in self._copies


def _hidden_size(graph: TracedGraph, assignment: Assignment, specs: Mapping[fx.Node, Any]) -> int:
    """The config's hidden size, else the last dim of a block's (else the first unit's) input."""
    size = config_int(getattr(graph.model, "config", None), _HIDDEN_SIZE_KEYS)
    if size is not None:
        return size
    a = assignment
    for spec, nodes in zip(a.units, a.compute_nodes, strict=True):
        if spec.kind == "block":
            for node in graph.externals(nodes):
                first = first_spec(specs[node])
                if first is not None and first.shape:
                    return first.shape[-1]
    for node in a.compute_nodes[0]:
        first = first_spec(specs.get(node))
        if first is not None and first.shape and first.dtype.is_floating_point:
            return first.shape[-1]
    return 1


def _dtype_bytes(model: nn.Module) -> int:
    """Element size of most of the model's floating-point parameters (4 if it has none)."""
    sizes: dict[int, int] = {}
    for param in model.parameters():
        if param.is_floating_point():
            sizes[param.element_size()] = sizes.get(param.element_size(), 0) + param.numel()
    return max(sizes, key=sizes.__getitem__) if sizes else 4


def _collapse(paths: Sequence[str]) -> tuple[str, ...]:
    """Paths in order, dropping any inside an earlier-kept or later shallower one."""
    kept: list[str] = []
    for path in sorted(dict.fromkeys(paths), key=lambda p: p.count(".")):
        if not any(path == k or path.startswith(k + ".") for k in kept):
            kept.append(path)
    order = {path: i for i, path in enumerate(dict.fromkeys(paths))}
    return tuple(sorted(kept, key=order.__getitem__))


def _has_rope_tables(model: nn.Module) -> bool:
    """Whether ``model`` keeps RoPE tables (``rope_cos``/``rope_sin`` buffers, the zoo's), which
    context parallelism cuts to each rank's positions."""
    return any(name in ("rope_cos", "rope_sin") for sub in model.modules() for name in sub._buffers)
