"""`trace`: an ``nn.Module`` to a `ModelGraph`, with no real parameter or activation memory.

Expects a model (on any device; meta is cheapest) and example inputs, or a ``model.config`` with
``seq_len`` (or Hugging Face's ``max_position_embeddings``/``n_positions``) and ``vocab_size``
to build ``input_ids`` from. Guarantees a `ModelGraph` whose `ModelProfile` holds, per sample:
FLOPs (forward and measured backward), bytes, parameters, saved activations split into the
contract's buckets, cut bytes and TP structure of every pipeline unit. Structurally identical
units (same ops, same input shapes) are measured once and their figures reused.

`trace` runs the steps in order: resolve the inputs and the unit layout, trace the graph
(`tracer`), assign nodes to units (`units`), measure each distinct unit on meta tensors
(`measure`), classify TP, collect parameters and profile units (`unit_profiles`), find the
mixture-of-experts layers (`experts`), then build the graph (`assemble`). Each step takes the
records it needs and returns a frozen one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from autoplan.contract.errors import TraceError
from autoplan.contract.graph import ModelGraph, MoELayerProfile
from autoplan.models.moe import GroupedExperts
from autoplan.models.spec import spec_of as model_spec_of
from autoplan.tracing.assemble import config_int, model_graph
from autoplan.tracing.experts import moe_layers
from autoplan.tracing.measure import measure_units, traced_graph
from autoplan.tracing.profiler import profile_unit
from autoplan.tracing.tracer import LeafSpec, trace_model
from autoplan.tracing.unit_profiles import (
    ProfiledUnits,
    classify_units,
    collect_params,
    cut_bytes,
    profile_units,
)
from autoplan.tracing.units import assign_units, find_blocks
from cost_model.degrees import is_whole
from cost_model.workload import MoELayerFacts

__all__ = ["ExampleInputs", "trace"]

logger = logging.getLogger(__name__)

_SEQ_LEN_KEYS = ("seq_len", "max_position_embeddings", "n_positions")
# Modules fx always keeps as single calls: the zoo's routed experts split their rows by the
# values of the routing counts, which a symbolic trace does not have (on meta tensors they assume
# balanced routing; see `autoplan.models.moe`).
_ALWAYS_LEAVES: tuple[LeafSpec, ...] = (GroupedExperts,)


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
    layout = _layout(model, units=units, block_path=block_path)
    with _no_gc():
        traced = trace_model(
            model,
            inputs.args,
            inputs.kwargs,
            blocks=layout.anchors if layout.mode == "blocks" else (),
            leaf_modules=(*leaf_modules, *_ALWAYS_LEAVES),
        )
        graph = traced_graph(model, traced, batch_size=inputs.batch_size, seq_len=inputs.seq_len)
        assignment = assign_units(
            graph.nodes,
            layout.anchors,
            mode=layout.mode,
            owner=graph.owner,
            is_state=graph.is_state,
        )
        measured = measure_units(graph, assignment, profile=profile_unit)
        tp = classify_units(graph, assignment, measured)
        params = collect_params(graph, assignment, measured.rep_of)
        cuts = cut_bytes(graph, assignment, measured.specs)
        profiled = profile_units(graph, assignment, measured, tp, params, cuts)
        layers = moe_layers(graph, assignment, measured)
        return model_graph(
            graph,
            assignment,
            measured,
            tp,
            params,
            _with_expert_facts(profiled, layers),
            name=name or _default_name(model),
            moe_layers=layers,
        )


def _with_expert_facts(
    profiled: ProfiledUnits, layers: tuple[MoELayerProfile, ...]
) -> ProfiledUnits:
    """The units with the cost model's record of their routed experts (`MoELayerFacts`)."""
    if not layers:
        return profiled
    by_unit = {layer.unit: layer for layer in layers}
    units = tuple(
        dataclasses.replace(
            unit,
            moe=MoELayerFacts(
                experts_op=layer.experts_node,
                num_experts=layer.num_experts,
                top_k=layer.top_k,
                hidden_size=layer.hidden_size,
                expert_ffn_hidden_size=layer.expert_ffn_hidden_size,
                params_per_expert=layer.num_params_per_expert,
                flops_per_routed_token=layer.forward_flops_per_token_per_expert,
                routed_tokens_per_sample=layer.routed_tokens_per_sample,
                shared_expert_params=layer.num_shared_expert_params,
            ),
        )
        if (layer := by_unit.get(i)) is not None
        else unit
        for i, unit in enumerate(profiled.units)
    )
    return dataclasses.replace(profiled, units=units)


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


@dataclass(frozen=True, kw_only=True, slots=True)
class _Inputs:
    """The arguments ``forward`` is traced with, and their batch size and sequence length."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch_size: int
    seq_len: int


@dataclass(frozen=True, kw_only=True, slots=True)
class _Layout:
    """Module paths that start units: blocks (the nodes before and after them form the
    embedding and head units) or top-level children (every node joins one of them)."""

    anchors: tuple[str, ...]
    mode: Literal["blocks", "children"]


def _default_name(model: nn.Module) -> str:
    """A zoo model's spec (plans record it, so the CLI can rebuild the model), else the
    model's class name."""
    return model_spec_of(model) or type(model).__name__


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, Tensor) else value


def _model_device(model: nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("meta")


def _check_positive(name: str, value: object) -> None:
    if not is_whole(value):
        raise TraceError(f"{name} = {value!r} must be a whole number >= 1")


def _resolve_inputs(
    model: nn.Module, example_inputs: ExampleInputs, *, batch_size: int, seq_len: int | None
) -> _Inputs:
    _check_positive("batch_size", batch_size)
    if seq_len is not None:
        _check_positive("seq_len", seq_len)
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) is True:
        raise TraceError(
            f"{type(model).__name__} is an encoder-decoder model (config.is_encoder_decoder): "
            "autoplan plans models that run as one stack of blocks over input_ids (decoder-only "
            "or encoder-only Transformers); trace its encoder or decoder on its own"
        )
    max_len = config_int(config, ("seq_len",))
    if example_inputs is None:
        length = seq_len if seq_len is not None else config_int(config, _SEQ_LEN_KEYS)
        vocab = config_int(config, ("vocab_size",))
        if length is None or vocab is None:
            missing = " and ".join(
                name
                for name, found in (("config.seq_len", length), ("config.vocab_size", vocab))
                if found is None
            )
            raise TraceError(
                f"cannot build example inputs for {type(model).__name__}: it has no {missing}; "
                "pass seq_len=... (and a config with vocab_size), or "
                "example_inputs=(input_ids,)"
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
    positions = _learned_positions(model)
    if positions is not None and length > positions[1]:
        path, rows = positions
        raise TraceError(
            f"sequence length {length} exceeds the {rows} learned positions of "
            f"{type(model).__name__} ({path}, an nn.Embedding): position {rows} has no row to "
            f"look up; trace at most {rows} tokens, or build the model with at least {length} "
            "positions (e.g. n_positions or max_position_embeddings in its config)"
        )
    return _Inputs(args=args, kwargs=kwargs, batch_size=batch, seq_len=length)


# Names of learned absolute-position tables (GPT-2's wpe, BERT's position_embeddings, OPT's
# embed_positions, the zoo GPT's pos_emb): a longer sequence indexes past the table's last row.
_POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions", "pos_emb")


def _learned_positions(model: nn.Module) -> tuple[str, int] | None:
    """The first learned position table's path and row count, if ``model`` has one."""
    for path, module in model.named_modules():
        if isinstance(module, nn.Embedding) and path.rpartition(".")[2] in _POSITION_TABLES:
            return path, module.num_embeddings
    return None


def _layout(model: nn.Module, *, units: Sequence[str] | None, block_path: str | None) -> _Layout:
    """The units the user chose (``units``, ``block_path``), else the repeated blocks found,
    else the top-level children (with a warning)."""
    if units is not None and block_path is not None:
        raise TraceError("give units= or block_path=, not both")
    if units is not None:
        if isinstance(units, str) or not units:
            raise TraceError(f"units = {units!r} must be a non-empty list of module paths")
        for path in units:
            _submodule(model, path, "units")
        return _Layout(anchors=tuple(units), mode="blocks")
    if block_path is not None:
        container = _submodule(model, block_path, "block_path")
        children = [name for name, _ in container.named_children()]
        if not children:
            raise TraceError(
                f"block_path = {block_path!r} ({type(container).__name__}) has no child "
                "modules; name the ModuleList/Sequential that holds the blocks"
            )
        prefix = f"{block_path}." if block_path else ""
        return _Layout(anchors=tuple(prefix + child for child in children), mode="blocks")
    run = find_blocks(model)
    if run is not None:
        return _Layout(anchors=run.paths, mode="blocks")
    children = [name for name, _ in model.named_children()]
    logger.warning(
        "%s has no repeated blocks (no ModuleList/Sequential of identical children): one "
        "pipeline unit per top-level child (%s); pass block_path= or units= to choose",
        type(model).__name__,
        ", ".join(children) or "none",
    )
    return _Layout(anchors=tuple(children), mode="children")


def _submodule(model: nn.Module, path: str, argument: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        names = [name for name, _ in model.named_modules() if name][:12]
        raise TraceError(
            f"{argument}: {type(model).__name__} has no module {path!r}; module paths look "
            f"like: {', '.join(names)}"
        ) from None
