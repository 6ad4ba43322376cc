"""Keys that describe a kernel or module call completely, so that equal keys mean equal work.

Expects the arguments of a meta kernel call, or a module about to be called. Guarantees: a key
holds everything the call can read (tensors by their metadata, scalars with their types,
modules by type, mode, plain attributes, parameters, buffers and children); whatever a key
could not describe exactly raises `Unkeyable`, so a caller never reuses a result on a guess.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from torch import Tensor, nn

from autoplan.tracing.tensor_specs import SCALAR_TYPES

__all__ = ["PLAIN_TENSORS", "Unkeyable", "arg_key", "module_key"]


class Unkeyable(Exception):
    """A value that `arg_key` or `NodeRunner.call_key` cannot describe completely."""


PLAIN_TENSORS: frozenset[type] = frozenset({Tensor, nn.Parameter})


def arg_key(value: Any) -> Hashable:
    """Everything a meta kernel can read of ``value`` (raises `Unkeyable` if unsure)."""
    kind = type(value)
    if kind in PLAIN_TENSORS:
        if not value.is_meta or value.is_conj() or value.is_neg() or value.is_sparse:
            raise Unkeyable
        return (
            value.shape,
            value.stride(),
            value.dtype,
            value.storage_offset(),
            value.requires_grad,
        )
    if kind in SCALAR_TYPES:
        return (kind, value)
    if kind is tuple or kind is list:
        return (kind, tuple(arg_key(item) for item in value))
    raise Unkeyable


def module_key(module: nn.Module) -> Hashable:
    """All that a module's call can read of it: its type, mode, plain attributes (exact),
    parameters, buffers and children. Raises `Unkeyable` for a module with hooks or with an
    attribute of another kind (an object or a function), which this key would not describe."""
    if (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    ):
        raise Unkeyable
    attributes = tuple(
        (name, _exact_key(value))
        for name, value in vars(module).items()
        if not name.startswith("_") and name != "training"
    )
    tensors = tuple(
        (
            kind,
            name,
            None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.requires_grad),
        )
        for kind, members in (("p", module._parameters), ("b", module._buffers))
        for name, t in members.items()
    )
    children = tuple(
        (name, None if child is None else module_key(child))
        for name, child in module._modules.items()
    )
    return (type(module), module.training, attributes, tensors, children)


def _exact_key(value: Any) -> Hashable:
    """A scalar, or a tuple or list of them, with their types (else `Unkeyable`)."""
    kind = type(value)
    if kind in SCALAR_TYPES:
        return (kind, value)
    if kind is tuple or kind is list:
        return (kind, tuple(_exact_key(item) for item in value))
    raise Unkeyable
