"""Running single fx nodes on the meta device: `MetaState` (the model's state on meta) and
`NodeRunner`.

Expects an fx graph module (from `torch.fx` or `torch.export`) whose operators have meta
kernels, and the model it was traced from, on any device. Guarantees: nothing is allocated and
the model is never moved (a tensor not on meta gets a meta stand-in, and a module with one is
called through `torch.func.functional_call`); under `MetaCalls` every call stays on meta,
however deeply nested.

Scaled-dot-product attention runs as the fused flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, which has a meta kernel), so it saves q,
k, v, output and logsumexp as fused kernels do on CPU and GPU; on the meta device
``F.scaled_dot_product_attention`` would pick the math path and save the whole attention matrix.
This holds for graph nodes and for calls inside leaf modules alike.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from autoplan.tracing.call_keys import PLAIN_TENSORS, Unkeyable, module_key
from autoplan.tracing.meter import MetaKernels
from autoplan.tracing.op_flops import FLASH_CPU
from autoplan.tracing.tensor_specs import (
    META,
    PYTREE_MAPPINGS,
    PYTREE_SEQUENCES,
    SCALAR_TYPES,
    materialize,
    spec_of,
    storage_key,
    tensor_leaves,
)

__all__ = ["SDPA_TARGETS", "MetaCalls", "MetaState", "NodeRunner"]

aten = torch.ops.aten

# Attention ops of exported graphs, run through `_fused_sdpa` (calls of the Python function
# `F.scaled_dot_product_attention`, in fx graphs or inside leaf modules, go through
# `MetaCalls`).
SDPA_TARGETS: frozenset[object] = frozenset({aten.scaled_dot_product_attention.default})


class MetaState:
    """The model's parameters and buffers as meta tensors, created on first use.

    ``get_attr`` targets resolve on ``root``, the traced graph module (it also holds the
    submodules of higher-order ops of exported graphs, ``submod_1``); the parameters lifted to
    placeholders by `torch.export` resolve on ``model`` by their fully qualified names.

    A tensor already on meta is used as is; any other gets a meta stand-in of the same shape,
    dtype and ``requires_grad`` (tied tensors keep one stand-in). ``keys`` holds the storages of
    all of them, so measurements can tell model state from activations.
    """

    def __init__(
        self, root: nn.Module, model: nn.Module, fqn_of_placeholder: Mapping[str, str]
    ) -> None:
        self.root = root
        self.model = model
        self.fqn_of_placeholder = dict(fqn_of_placeholder)
        self.keys: set[int] = set()
        self._stand_ins: dict[int, Tensor] = {}

    def meta(self, tensor: Tensor) -> Tensor:
        stand_in = self._stand_ins.get(id(tensor))
        if stand_in is None:
            if tensor.is_meta:
                stand_in = tensor
            else:
                stand_in = torch.empty_strided(
                    tuple(tensor.shape), tensor.stride(), dtype=tensor.dtype, device=META
                )
                stand_in.requires_grad_(tensor.requires_grad)
            self._stand_ins[id(tensor)] = stand_in
            self.keys.add(storage_key(stand_in))
        return stand_in

    def attribute(self, fqn: str, *, of_model: bool = False) -> Any:
        """``root.<fqn>`` (``model.<fqn>`` with ``of_model``), as a meta tensor if a tensor."""
        value: Any = self.model if of_model else self.root
        for part in fqn.split("."):
            value = getattr(value, part)
        return self.meta(value) if isinstance(value, Tensor) else value

    def module_tensors(self, module: nn.Module) -> dict[str, Tensor]:
        tensors: dict[str, Tensor] = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        return {name: self.meta(tensor) for name, tensor in tensors.items()}

    def call_module(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tensors = self.module_tensors(module)
        if all(stand_in is original for stand_in, original in _pairs(module, tensors)):
            return module(*args, **kwargs)
        return functional_call(module, tensors, args, kwargs, strict=False)


def _pairs(module: nn.Module, stand_ins: dict[str, Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
    for name, param in module.named_parameters(remove_duplicate=False):
        yield stand_ins[name], param
    for name, buffer in module.named_buffers(remove_duplicate=False):
        yield stand_ins[name], buffer


def _fused_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """`F.scaled_dot_product_attention` through the fused flash kernel (see the module doc)."""
    if query.dim() != 4 or key.dim() != 4:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    # Grouped-query attention (fewer kv heads) goes to the kernel as is: it shares kv heads
    # natively and saves the un-repeated k and v, as CPU and flash-attention GPU kernels do.
    out, _logsumexp = FLASH_CPU(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out  # type: ignore[no-any-return]


class MetaCalls(TorchFunctionMode):
    """Keeps every call on the meta device and attention fused, however deeply nested (inside
    leaf modules and the submodules of exported higher-order ops too).

    ``F.scaled_dot_product_attention`` runs through `_fused_sdpa`; explicit devices
    (``device=...``, a ``torch.device`` argument, ``.to("cuda")``) become meta, and
    ``.cuda()``/``.cpu()`` return the tensor itself: nothing is allocated or copied.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            return _fused_sdpa(*args, **kwargs)
        if func in _DEVICE_MOVES:
            return args[0]
        if kwargs.get("device") is not None:
            kwargs["device"] = META
        if func is Tensor.to:
            args = [META if isinstance(a, str) else a for a in args]
        args = [META if isinstance(a, torch.device) else a for a in args]
        return func(*args, **kwargs)


_DEVICE_MOVES: frozenset[object] = frozenset({Tensor.cuda, Tensor.cpu})


class NodeRunner:
    """Executes single fx nodes on meta tensors.

    ``state_value`` resolves a node that holds model state (a ``get_attr``, or a lifted
    parameter/buffer placeholder of an exported graph); ``input_value`` a user-input placeholder.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        state: MetaState,
        *,
        input_value: Callable[[fx.Node], Any],
        is_state: Callable[[fx.Node], bool],
    ) -> None:
        self.gm = gm
        self.state = state
        self.input_value = input_value
        self.is_state = is_state
        self.kernels = MetaKernels()  # shared by the units of one trace
        # Backward FLOPs of a node call by `call_key` (None: the 2x-forward fallback).
        self.backward_flops: dict[Hashable, float | None] = {}
        self._state_cache: dict[str, Any] = {}

    def state_value(self, node: fx.Node) -> Any:
        if node.name not in self._state_cache:
            if node.op == "get_attr":
                assert isinstance(node.target, str)
                value = self.state.attribute(node.target)
            elif node.name in self.state.fqn_of_placeholder:
                fqn = self.state.fqn_of_placeholder[node.name]
                value = self.state.attribute(fqn, of_model=True)
            else:  # a lifted constant of an exported graph
                value = materialize(spec_of(node.meta.get("val")))
                for tensor in tensor_leaves(value):
                    self.state.keys.add(storage_key(tensor))
            self._state_cache[node.name] = value
        return self._state_cache[node.name]

    def run(self, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if node.op == "placeholder":
            return self.input_value(node)
        if node.op == "get_attr":
            return self.state_value(node)
        if node.op == "call_module":
            assert isinstance(node.target, str)
            return self.state.call_module(self.gm.get_submodule(node.target), args, kwargs)
        if node.op == "call_function":
            if node.target in SDPA_TARGETS:
                return _fused_sdpa(*args, **kwargs)
            assert callable(node.target)
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            assert isinstance(node.target, str)
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        raise AssertionError(f"cannot run fx node {node.name} with op {node.op!r}")

    def call_key(self, node: fx.Node, args: Any, kwargs: Any) -> Hashable | None:
        """A key equal for two calls of ``run`` that do the same work on equal inputs: the op,
        its target (a module by `module_key`), and the arguments (tensors by their metadata,
        model state apart), or None when an argument or module is not fully described."""
        target: Hashable = node.target
        if node.op == "call_module":
            assert isinstance(node.target, str)
            try:
                target = module_key(self.gm.get_submodule(node.target))
            except Unkeyable:
                return None
        states: dict[int, int] = {}
        try:
            key = (node.op, target, self._value_key(args, states), self._value_key(kwargs, states))
            hash(key)
        except (Unkeyable, TypeError):  # TypeError: an unhashable target or constant
            return None
        return key

    def _value_key(self, value: Any, states: dict[int, int]) -> Hashable:
        kind = type(value)
        if isinstance(value, Tensor):
            if kind not in PLAIN_TENSORS:
                raise Unkeyable
            meta = (value.shape, value.stride(), value.dtype, value.requires_grad)
            if storage_key(value) in self.state.keys:  # kept as is: its identity and place count
                ordinal = states.setdefault(id(value), len(states))
                return ("state", kind, ordinal, value.storage_offset(), value.is_leaf, *meta)
            return ("activation", *meta)  # replaced by a fresh tensor (`profiler._fresh`)
        if kind in SCALAR_TYPES or value is Ellipsis:
            return (kind, value)
        if kind in PYTREE_SEQUENCES or kind is torch.Size:
            return (kind, tuple(self._value_key(item, states) for item in value))
        if kind in PYTREE_MAPPINGS:
            return (kind, tuple((k, self._value_key(v, states)) for k, v in value.items()))
        if kind is slice:
            return (
                kind,
                *(self._value_key(v, states) for v in (value.start, value.stop, value.step)),
            )
        raise Unkeyable

    def node_params(self, node: fx.Node, args: tuple[Any, ...]) -> list[Tensor]:
        """Meta tensors requiring grad that ``node`` reads as model state."""
        found = [t for t in tensor_leaves(args) if t.requires_grad and t.is_leaf]
        if node.op == "call_module":
            assert isinstance(node.target, str)
            module = self.gm.get_submodule(node.target)
            found += [t for t in self.state.module_tensors(module).values() if t.requires_grad]
        return found
