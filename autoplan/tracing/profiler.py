"""Run fx nodes on the meta device and measure them: FLOPs, bytes, saved activations.

Expects the nodes of one pipeline unit of an fx graph (from `torch.fx` or `torch.export`), in
graph order, whose operators have meta kernels, plus a `MetaState` that resolves parameters and
buffers. Guarantees: nothing is allocated (every tensor is a meta tensor; a model on a real
device is called through `torch.func.functional_call` with meta stand-ins, never moved), the
model's parameters get no ``.grad``, and figures are at the batch size of the inputs given.

- FLOPs are those of `torch.utils.flop_counter` (GEMMs, convolutions, attention); element-wise
  and normalisation ops count 0 FLOPs, their traffic shows in the bytes. Causal flash attention
  counts the score blocks it computes, not torch's full square (`causal_fraction`).
- Bytes read and written are summed over the ATen ops a node dispatches, skipping views;
  reads of parameters and buffers are kept apart (``param_bytes_read``).
- Backward FLOPs are measured, not assumed: every node is re-run on fresh leaf tensors and
  differentiated under the same counter (a matmul comes out at 2x its forward, flash attention at
  2.5x, because its backward recomputes the scores).
- Saved activations are what ``torch.autograd.graph.saved_tensors_hooks`` sees during the
  forward, deduplicated by storage, parameters and buffers excluded, each storage attributed to
  the node that produced it (or to the unit's input).

Each node runs through `NodeRunner` (attention fused, as the `node_runner` module says) under
`Meter`, which counts its FLOPs (`op_flops`) and bytes.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx

from autoplan.contract.errors import TraceError
from autoplan.tracing.meter import Meter
from autoplan.tracing.node_measures import INPUT, NodeMeasure, SavedStorage, UnitMeasure
from autoplan.tracing.node_runner import MetaCalls, NodeRunner
from autoplan.tracing.tensor_specs import (
    META,
    map_leaves,
    materialize,
    nbytes,
    spec_of,
    storage_key,
    tensor_leaves,
)

__all__ = ["profile_unit"]

logger = logging.getLogger(__name__)


def _describe(node: fx.Node, module_path: str) -> str:
    where = f" in module {module_path!r}" if module_path else ""
    return f"fx node {node.name!r} ({node.op} {node.target}){where}"


def profile_unit(
    nodes: Sequence[fx.Node],
    external: Mapping[fx.Node, Any],
    runner: NodeRunner,
    module_path: Callable[[fx.Node], str],
) -> UnitMeasure:
    """Run ``nodes`` (one unit, graph order) on meta tensors and measure each of them.

    ``external`` maps every activation node of an earlier unit that these nodes read to its
    value as a `TensorSpec` pytree; each becomes a fresh meta tensor (a leaf, if it requires
    grad). Model state comes from ``runner``. Raises `TraceError` naming the node that failed.
    """
    meter = Meter(runner.state.keys, runner.kernels)
    env: dict[fx.Node, Any] = {}
    producers: dict[int, str] = {}
    saved: dict[int, SavedStorage] = {}
    measures: dict[str, NodeMeasure] = {}
    current = [""]

    for node, spec in external.items():
        env[node] = materialize(spec)
        for tensor in tensor_leaves(env[node]):
            producers.setdefault(storage_key(tensor), INPUT)

    def load(arg: fx.Node) -> Any:
        if arg in env:
            return env[arg]
        if runner.is_state(arg):
            return runner.state_value(arg)
        raise AssertionError(f"node {arg.name} is neither computed nor an input of the unit")

    # The last pack of the forward: the node that ran it, and whether the packed tensor existed
    # before that node (its input or a parameter) or is the node's own output.
    last_pack: list[tuple[str, bool]] = []
    boxes: list[weakref.ref[_Saved]] = []

    def pack(tensor: Tensor) -> _Saved:
        key = storage_key(tensor)
        preexisting = key in producers or key in runner.state.keys
        last_pack[:] = [(current[0], preexisting)]
        if key not in saved and key not in runner.state.keys:
            size = int(tensor.untyped_storage().nbytes())
            saved[key] = SavedStorage(size, producers.get(key, current[0]))
        box = _Saved(tensor)
        boxes.append(weakref.ref(box))
        return box

    try:
        with torch.enable_grad(), torch.device(META), MetaCalls(), meter:
            with torch.autograd.graph.saved_tensors_hooks(pack, _Saved.unpack):
                for node in nodes:
                    args = fx.node.map_arg(node.args, load)
                    kwargs = fx.node.map_arg(node.kwargs, load)
                    measure = NodeMeasure()
                    current[0] = node.name
                    # A placeholder's value is made here, not computed by the model: not metered.
                    meter.current = measure if node.op != "placeholder" else None
                    try:
                        value = runner.run(node, args, kwargs)
                    except Exception as error:
                        reason = str(error).splitlines()[0] if str(error) else ""
                        raise TraceError(
                            f"cannot run {_describe(node, module_path(node))} on the meta device: "
                            f"{type(error).__name__}: {reason}; mark the module a leaf "
                            "(trace(..., leaf_modules=[...])) or make the operation shape-static"
                        ) from error
                    finally:
                        meter.current = None
                    outputs = tensor_leaves(value)
                    for tensor in outputs:
                        producers.setdefault(storage_key(tensor), node.name)
                    measure.output = spec_of(value)
                    measure.output_bytes = float(sum(nbytes(t) for t in outputs))
                    measure.num_tensor_outputs = len(outputs)
                    measures[node.name] = measure
                    env[node] = value
            for node in nodes:
                _measure_backward(node, env, load, runner, meter, measures[node.name])
    finally:
        # A saved output holds its own grad_fn: its box's reference to it would keep the
        # unit's autograd graph, and through ``pack`` the runner and the model, alive for ever
        # (a cycle through C++ that Python's collector does not see).
        for ref in boxes:
            box = ref()
            if box is not None:
                box.tensor = None

    for storage in saved.values():
        if storage.producer != INPUT:
            measures[storage.producer].saved_bytes += storage.nbytes
    return UnitMeasure(
        nodes=measures,
        saved=tuple(saved.values()),
        recompute_tail=_recompute_tail(nodes, last_pack),
    )


class _Saved:
    """What the autograd graph of a unit's forward keeps of a saved tensor: the tensor, until
    `profile_unit` returns (so that nothing it saved outlives the unit)."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor: Tensor | None = tensor

    def unpack(self) -> Tensor:
        assert self.tensor is not None, "a unit's forward graph is not differentiated"
        return self.tensor


def _recompute_tail(nodes: Sequence[fx.Node], last_pack: list[tuple[str, bool]]) -> tuple[str, ...]:
    """Names of the nodes an early-stopping recompute skips (see `UnitMeasure`)."""
    names = [node.name for node in nodes if node.op != "placeholder"]
    if not last_pack:
        return tuple(names)  # nothing saved: nothing to recompute
    stop, before_compute = last_pack[0]
    if stop not in names:
        return ()
    first_skipped = names.index(stop) + (0 if before_compute else 1)
    return tuple(names[first_skipped:])


def _fresh(value: Any, leaves: list[Tensor], state_keys: set[int]) -> Any:
    """Copy of ``value`` with new meta tensors (model state kept), recording new leaves. A
    view of a parameter (an exported graph's transpose of an expert weight before its grouped
    GEMM) is made a leaf too: kept, it is no leaf, and its gradient, the weight's, would go
    uncounted."""

    def one(leaf: Any) -> Any:
        if not isinstance(leaf, Tensor):
            return leaf
        if storage_key(leaf) in state_keys and (leaf.is_leaf or not leaf.requires_grad):
            return leaf
        fresh = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=META)
        if leaf.requires_grad:
            fresh.requires_grad_(True)
            leaves.append(fresh)
            return fresh.clone()
        return fresh

    return map_leaves(one, value)


def _measure_backward(
    node: fx.Node,
    env: dict[fx.Node, Any],
    load: Callable[[fx.Node], Any],
    runner: NodeRunner,
    meter: Meter,
    measure: NodeMeasure,
) -> None:
    """Re-run ``node`` on fresh leaves and count the FLOPs of differentiating it; a call equal
    to an earlier one of the trace (`NodeRunner.call_key`) takes its figure."""
    outputs = [t for t in tensor_leaves(env[node]) if t.requires_grad]
    if not outputs or node.op in ("placeholder", "get_attr"):
        return
    args = fx.node.map_arg(node.args, load)
    kwargs = fx.node.map_arg(node.kwargs, load)
    key = runner.call_key(node, args, kwargs)
    if key is not None and key in runner.backward_flops:
        known = runner.backward_flops[key]
        measure.backward_flops = 2.0 * measure.forward_flops if known is None else known
        return
    fell_back = _run_backward(node, args, kwargs, runner, meter, measure)
    if key is not None:
        runner.backward_flops[key] = None if fell_back else measure.backward_flops


def _run_backward(
    node: fx.Node,
    args: Any,
    kwargs: Any,
    runner: NodeRunner,
    meter: Meter,
    measure: NodeMeasure,
) -> bool:
    """Run ``node`` on fresh copies of ``args`` and ``kwargs`` (model state kept) and add the
    FLOPs of its backward to ``measure``; True if that failed and 2x forward stands in."""
    leaves: list[Tensor] = []
    args = _fresh(args, leaves, runner.state.keys)
    kwargs = _fresh(kwargs, leaves, runner.state.keys)
    try:
        value = runner.run(node, args, kwargs)
        outputs = [t for t in tensor_leaves(value) if t.requires_grad]
        inputs = leaves + runner.node_params(node, (args, kwargs))
        if not outputs or not inputs:
            return False
        meter.current, meter.backward = measure, True
        torch.autograd.grad(
            outputs,
            inputs,
            grad_outputs=[torch.empty_like(t) for t in outputs],
            allow_unused=True,
        )
    except Exception as error:  # an op without a meta backward: fall back to the GEMM rule
        logger.debug("backward of %s not measurable on meta (%s); using 2x forward", node, error)
        measure.backward_flops = 2.0 * measure.forward_flops
        return True
    finally:
        meter.current, meter.backward = None, False
    return False
