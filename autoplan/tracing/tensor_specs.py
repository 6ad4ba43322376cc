"""Tensors as metadata: `TensorSpec`, and the pytree walks between tensors and specs.

Expects pytrees of fx arguments and ATen results (tuples, lists, dicts, fx's immutable
containers, scalars, tensors, specs; any other node goes through torch's pytree). Guarantees:
`spec_of` and `materialize` keep a tree's structure and constants and only swap tensors for
specs and back; `materialize` makes fresh meta tensors (nothing is allocated); `tensor_leaves`
lists tensors in `tree_flatten` order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "META",
    "PYTREE_MAPPINGS",
    "PYTREE_SEQUENCES",
    "SCALAR_TYPES",
    "TensorSpec",
    "map_leaves",
    "materialize",
    "nbytes",
    "spec_of",
    "storage_key",
    "tensor_leaves",
]

META = torch.device("meta")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape, strides, dtype and autograd flag of a tensor: enough to recreate it on meta.

    A dataclass, not a NamedTuple, so that pytree utilities treat it as a leaf.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def materialize(self) -> Tensor:
        """A fresh meta tensor; one that requires grad is a clone of a leaf (in-place safe)."""
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=META)
        if self.requires_grad:
            return tensor.requires_grad_(True).clone()
        return tensor


# Scalars a key can hold as they are (with their type: 1, 1.0 and True are equal otherwise).
SCALAR_TYPES: frozenset[type] = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)
# The containers of fx arguments and ATen results, and leaves that hold no tensor: walked here
# as pytree would, without its per-node dispatch (any other type goes through pytree).
PYTREE_SEQUENCES: frozenset[type] = frozenset({tuple, list, immutable_list})
PYTREE_MAPPINGS: frozenset[type] = frozenset({dict, immutable_dict})
_PYTREE_SCALARS: frozenset[type] = SCALAR_TYPES | {slice}


def tensor_leaves(value: Any) -> list[Tensor]:
    """The tensors among ``value``'s pytree leaves, in `tree_flatten` order."""
    return _collect_tensors(value, [])


def _collect_tensors(value: Any, found: list[Tensor]) -> list[Tensor]:
    """``found`` extended by the tensors of ``value`` (see `tensor_leaves`)."""
    kind = type(value)
    if kind in PYTREE_SEQUENCES:
        for item in value:
            _collect_tensors(item, found)
    elif kind in PYTREE_MAPPINGS:
        for item in value.values():
            _collect_tensors(item, found)
    elif isinstance(value, Tensor):
        found.append(value)
    elif kind not in _PYTREE_SCALARS:
        found.extend(leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, Tensor))
    return found


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """``tree_map(fn, value)``: ``fn`` applied to every pytree leaf of ``value``."""
    kind = type(value)
    if kind in PYTREE_SEQUENCES:
        return kind([map_leaves(fn, item) for item in value])
    if kind in PYTREE_MAPPINGS:
        return kind({key: map_leaves(fn, item) for key, item in value.items()})
    if kind in _PYTREE_SCALARS or isinstance(value, (Tensor, TensorSpec)):
        return fn(value)
    return tree_map(fn, value)


def spec_of(value: Any) -> Any:
    """``value`` with every tensor replaced by its `TensorSpec`."""

    def one(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            return TensorSpec(
                tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.requires_grad
            )
        return leaf

    return map_leaves(one, value)


def materialize(spec: Any) -> Any:
    return map_leaves(
        lambda leaf: leaf.materialize() if isinstance(leaf, TensorSpec) else leaf, spec
    )


def storage_key(tensor: Tensor) -> int:
    """Identity of a tensor's storage (views share it)."""
    return int(tensor.untyped_storage()._cdata)


def nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()
