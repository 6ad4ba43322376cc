"""Local-shapes pass: make a unit graph's hard-coded sizes fit its tensor-parallel shards.

Expects a unit ``fx.GraphModule`` (from `split_stages`) whose nodes carry their traced values in
``meta["val"]`` (``torch.export`` graphs do), the tensor-parallel style of each module it calls
by path (column, row, vocab_embedding, vocab_head) and the TP degree. Runs before
``parallelize_module``, on the unsharded module.

Between a column linear and its row linear each rank holds ``1/tp`` of the heads (or of the MLP's
features). A model written for TP reshapes with ``-1`` there; an exported graph bakes in the
global sizes: Hugging Face Llama's ``repeat_kv`` becomes ``expand(x, [b, kv_heads, n_rep, s,
d])`` and ``reshape(x, [b, heads, s, d])``. This pass propagates each value's local shape
through the unit on the meta device (the column linears' outputs lose ``1/tp`` of their last
dimension, the row linears' outputs are whole again) and rewrites those size arguments:

- ``view``/``reshape``/``_unsafe_view``: an input dimension split ``f`` ways maps to the output
  dimension that starts at the same flat offset (equal products of the dimensions before them)
  and whose size ``f`` divides; that size is divided by ``f`` (a ``-1`` stays ``-1``). This is
  exactly the dimension whose contiguous blocks are the input's shards: heads, not head_dim;
- ``expand``: a size equal to the input's global size on a split dimension becomes the local
  size; broadcast dimensions (global size 1) keep their size.

Guarantees, checked (each failure is a `PlanError` naming the node and the shapes):

- every op that reads a split value runs on the local meta shapes without error, after the
  rewrite;
- no op reduces, indexes, slices, splits or concatenates along a split dimension (that would
  need communication DTensor styles do not insert: e.g. GPT-2's fused q/k/v ``split``);
- a column linear reads a whole value; a row linear reads a value split on its last dimension
  into exactly ``1/tp``; no other module and no unit output sees a split value.

Graphs without ``meta["val"]`` (fx traces of the zoo, whose models reshape with ``-1``) are left
unchanged and reported as not checked.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autoplan.contract.errors import PlanError

__all__ = ["LocalShapesResult", "localize_shapes"]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
_EXPANDS = (_aten.expand.default,)
# Ops whose "dim" argument may name a split dimension without mixing shards.
_DIM_SAFE = (_aten.unsqueeze.default,)


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalShapesResult:
    """What the pass changed on one unit."""

    checked: bool  # False when the graph carries no traced values (nothing to check)
    rewritten: tuple[str, ...]  # names of the nodes whose size arguments changed


def localize_shapes(
    unit: fx.GraphModule, styles: Mapping[str, str], tp_degree: int, *, unit_name: str
) -> LocalShapesResult:
    """Rewrite ``unit``'s size arguments in place for ``tp_degree`` shards (module docstring)."""
    nodes = list(unit.graph.nodes)
    if tp_degree == 1 or not all("val" in n.meta for n in nodes if n.op == "placeholder"):
        return LocalShapesResult(checked=False, rewritten=())
    state = _Propagation(unit_name, tp_degree)
    rewritten: list[str] = []
    for node in nodes:
        if node.op == "call_module":
            state.module_call(node, styles.get(str(node.target)))
        elif node.op in ("call_function", "call_method"):
            if not any(state.is_split(a) for a in node.all_input_nodes):
                continue
            if state.rewrite_sizes(node):
                rewritten.append(node.name)
            state.run(node)
        elif node.op == "output":
            leaving = [a.name for a in node.all_input_nodes if state.is_split(a)]
            if leaving:
                raise PlanError(
                    f"unit {unit_name!r}: {leaving} leave the unit split across tensor-parallel "
                    "ranks; every column linear's output must reach a row linear in the same "
                    "unit: plan tp_degree 1 for this model"
                )
    if rewritten:
        unit.recompile()
    logger.debug("unit %s: local sizes for %s", unit_name, rewritten)
    return LocalShapesResult(checked=True, rewritten=tuple(rewritten))


def _global(node: fx.Node) -> Any:
    return node.meta.get("val")


def _meta_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_meta_like(v) for v in value)
    return value


def _differs(local: Any, whole: Any) -> bool:
    """True if a local value (a tensor, or a tuple of them) is shaped unlike the global one."""
    if isinstance(local, torch.Tensor) and isinstance(whole, torch.Tensor):
        return _shape(local) != _shape(whole)
    if isinstance(local, (tuple, list)) and isinstance(whole, (tuple, list)):
        return any(_differs(a, b) for a, b in zip(local, whole, strict=True))
    return False


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in value.shape)


class _Propagation:
    """Local meta values of the unit's split values (absent: the value is whole)."""

    def __init__(self, unit_name: str, tp_degree: int) -> None:
        self.unit_name = unit_name
        self.tp = tp_degree
        self.local: dict[fx.Node, Any] = {}

    def is_split(self, node: fx.Node) -> bool:
        return node in self.local

    def value(self, node: fx.Node) -> Any:
        if node in self.local:
            return self.local[node]
        return _meta_like(_global(node))

    def split_dims(self, node: fx.Node) -> set[int]:
        local, whole = self.local.get(node), _global(node)
        if not isinstance(local, torch.Tensor) or not isinstance(whole, torch.Tensor):
            return set()
        return {d for d, (a, b) in enumerate(zip(local.shape, whole.shape, strict=True)) if a != b}

    def _fail(self, node: fx.Node, what: str) -> PlanError:
        return PlanError(
            f"unit {self.unit_name!r}, node {node.name!r} ({node.target}): {what}; tensor "
            f"parallelism over {self.tp} ranks needs the layers between a column and a row "
            "linear to work on 1/tp of the heads: plan tp_degree 1 for this model"
        )

    # --------------------------------------------------------------------- modules

    def module_call(self, node: fx.Node, style: str | None) -> None:
        (source, *_) = node.all_input_nodes or (None,)
        split_input = source is not None and self.is_split(source)
        whole = _global(node)
        if style == "column" and not split_input:
            out_features = whole.shape[-1]
            if out_features % self.tp:
                raise self._fail(node, f"{out_features} output features do not split evenly")
            local_shape = (*_shape(whole)[:-1], out_features // self.tp)
            self.local[node] = torch.empty(local_shape, dtype=whole.dtype, device="meta")
        elif style == "row" and split_input:
            assert source is not None
            local, full = self.local[source], _global(source)
            expected = (*_shape(full)[:-1], full.shape[-1] // self.tp)
            if _shape(local) != expected:
                raise self._fail(
                    node,
                    f"the row linear reads a value of local shape {_shape(local)}, but "
                    f"RowwiseParallel needs {expected} (global {_shape(full)} split on the last "
                    "dimension)",
                )
        elif split_input:
            raise self._fail(node, f"module ({style or 'not sharded'}) reads a split value")

    # --------------------------------------------------------------------- ops

    def rewrite_sizes(self, node: fx.Node) -> bool:
        """Rewrite a view's or an expand's global sizes to local ones; True if changed."""
        if node.target not in _VIEWS + _EXPANDS:
            return False
        source, size_arg = node.args[0], node.args[1]
        assert isinstance(source, fx.Node)
        if not isinstance(size_arg, (list, tuple)) or not all(isinstance(s, int) for s in size_arg):
            raise self._fail(node, f"size argument {size_arg!r} is not a list of ints")
        sizes = [int(s) for s in size_arg]  # type: ignore[arg-type]  # ints, checked above
        global_in, local_in = _shape(_global(source)), _shape(self.local[source])
        if node.target in _VIEWS:
            new = self._view_sizes(node, global_in, local_in, _shape(_global(node)), sizes)
        else:
            new = self._expand_sizes(node, global_in, local_in, sizes)
        if new == sizes:
            return False
        node.args = (source, new, *node.args[2:])
        return True

    def _view_sizes(
        self,
        node: fx.Node,
        global_in: tuple[int, ...],
        local_in: tuple[int, ...],
        global_out: tuple[int, ...],
        sizes: Sequence[int],
    ) -> list[int]:
        local_out = list(global_out)
        for d, (g, loc) in enumerate(zip(global_in, local_in, strict=True)):
            if g == loc:
                continue
            if g % loc:
                raise self._fail(node, f"input dimension {d} ({g}) is split into {loc}s")
            factor = g // loc
            offset = math.prod(global_in[:d])
            # The output dimension starting at the same flat offset: its contiguous blocks are
            # the input's shards.
            k = next(
                (
                    k
                    for k in range(len(global_out))
                    if math.prod(global_out[:k]) == offset
                    and local_out[k] > 1
                    and local_out[k] % factor == 0
                ),
                None,
            )
            if k is None:
                raise self._fail(
                    node,
                    f"no output dimension of {global_out} carries input dimension {d} of "
                    f"{global_in} split {factor} ways",
                )
            local_out[k] //= factor
        return [s if s == -1 else local_out[k] for k, s in enumerate(sizes)]

    def _expand_sizes(
        self,
        node: fx.Node,
        global_in: tuple[int, ...],
        local_in: tuple[int, ...],
        sizes: Sequence[int],
    ) -> list[int]:
        new = list(sizes)
        lead = len(sizes) - len(global_in)
        for d, (g, loc) in enumerate(zip(global_in, local_in, strict=True)):
            if g == loc or sizes[lead + d] == -1:
                continue
            if sizes[lead + d] != g:
                raise self._fail(
                    node, f"expands split dimension {d} ({g}, local {loc}) to {sizes[lead + d]}"
                )
            new[lead + d] = loc
        return new

    def run(self, node: fx.Node) -> None:
        """Check the op's dims against the split dims, run it on local meta values."""
        self._check_dims(node)
        args, kwargs = fx.map_arg((node.args, node.kwargs), self.value)
        try:
            if node.op == "call_method":
                result = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                assert callable(node.target)
                result = node.target(*args, **kwargs)
        except Exception as error:
            shapes = {
                a.name: (_shape(self.value(a)), _shape(_global(a)))
                for a in node.all_input_nodes
                if isinstance(_global(a), torch.Tensor)
            }
            raise self._fail(
                node, f"fails on local shapes (local, global by input: {shapes}): {error}"
            ) from error
        if _differs(result, _global(node)):
            self.local[node] = result

    def _check_dims(self, node: fx.Node) -> None:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target in _DIM_SAFE:
            return
        split = self._first_tensor_split_dims(node)
        if not split:
            return
        schema = target._schema
        for position, argument in enumerate(schema.arguments):
            if argument.name != "dim":
                continue
            if position < len(node.args):
                value = node.args[position]
            else:
                value = node.kwargs.get("dim", argument.default_value)
            dims = value if isinstance(value, (list, tuple)) else [value]
            rank = len(self._first_tensor(node).shape)
            touched = {d % rank for d in dims if isinstance(d, int)}
            if dims == [None] or touched & split:
                raise self._fail(
                    node,
                    f"works along dimension {value} of a value split on dimensions "
                    f"{sorted(split)} (that needs communication between the shards)",
                )

    def _first_tensor(self, node: fx.Node) -> Any:
        for arg in node.all_input_nodes:
            if isinstance(_global(arg), torch.Tensor):
                return self.value(arg)
        raise AssertionError(f"{node.name} reads no tensor")

    def _first_tensor_split_dims(self, node: fx.Node) -> set[int]:
        for arg in node.all_input_nodes:
            if isinstance(_global(arg), torch.Tensor):
                return self.split_dims(arg)
        return set()
