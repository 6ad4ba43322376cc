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
- Scaled-dot-product attention runs as the fused flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``, which has a meta kernel), so it saves q,
  k, v, output and logsumexp as fused kernels do on CPU and GPU; on the meta device
  ``F.scaled_dot_product_attention`` would pick the math path and save the whole attention matrix.
  This holds for graph nodes and for calls inside leaf modules alike.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.func import functional_call
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from autoplan.contract.errors import TraceError
from autoplan.contract.ops import GROUPED_GEMM_OPS, op_category

__all__ = [
    "Gemm",
    "MetaState",
    "NodeMeasure",
    "NodeRunner",
    "TensorSpec",
    "UnitMeasure",
    "profile_unit",
    "spec_of",
    "tensor_leaves",
]

logger = logging.getLogger(__name__)

aten = torch.ops.aten
META = torch.device("meta")
INPUT = "<input>"  # producer of storages that enter the unit from outside

_FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# Attention ops of exported graphs, run through `_fused_sdpa` (calls of the Python function
# `F.scaled_dot_product_attention`, in fx graphs or inside leaf modules, go through
# `_MetaCalls`).
SDPA_TARGETS: frozenset[object] = frozenset({aten.scaled_dot_product_attention.default})

# Nonlinearities that make a linear -> op -> linear chain a Megatron column/row pair.
_ACTIVATION_OPS = frozenset(
    {
        "gelu",
        "silu",
        "relu",
        "tanh",
        "sigmoid",
        "elu",
        "leaky_relu",
        "hardswish",
        "hardsigmoid",
        "mish",
        "softplus",
        "glu",
        "erf",
        "relu6",
        "gelu_",
        "silu_",
        "relu_",
    }
)


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


class Gemm(NamedTuple):
    """``batch`` GEMMs of ``(m, k) @ (k, n)``, at the traced batch size."""

    batch: int
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n


@dataclass(slots=True)
class NodeMeasure:
    """What running one node measured, at the traced batch size (mutable while measuring)."""

    forward_flops: float = 0.0
    backward_flops: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    param_bytes_read: float = 0.0
    categories: set[str] = field(default_factory=set)
    activation_fn: bool = False  # ran a nonlinearity (gelu, silu, tanh, ...)
    weight_gemm: Gemm | None = None  # largest GEMM with a parameter operand
    activation_gemm: Gemm | None = None  # largest GEMM between two activations
    attention: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # fused attention q, k
    embedding_rows: int | None = None  # rows of the table an embedding lookup reads
    output: Any = None  # pytree of TensorSpec and constants
    output_bytes: float = 0.0
    num_tensor_outputs: int = 0
    saved_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class SavedStorage:
    """One storage autograd keeps for backward: its size and the node that produced it."""

    nbytes: int
    producer: str  # node name, or INPUT for a storage that entered the unit


@dataclass(frozen=True, slots=True)
class UnitMeasure:
    """Measurements of one unit's nodes (by name, graph order) and what the unit saves.

    ``recompute_tail`` names the nodes that a recompute of the unit under torch's non-reentrant
    checkpoint never runs: it stops as soon as the last tensor autograd saved is packed again
    (early stop, the default since torch 2.1), so the nodes after the one that packs it are
    skipped, and that node too when what it packs last existed before it ran (an input it
    saves before computing, like a linear's input and weight).
    """

    nodes: dict[str, NodeMeasure]
    saved: tuple[SavedStorage, ...]
    recompute_tail: tuple[str, ...] = ()


# Scalars a key can hold as they are (with their type: 1, 1.0 and True are equal otherwise).
_SCALAR_TYPES: frozenset[type] = frozenset(
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
_PYTREE_SEQUENCES: frozenset[type] = frozenset({tuple, list, immutable_list})
_PYTREE_MAPPINGS: frozenset[type] = frozenset({dict, immutable_dict})
_PYTREE_SCALARS: frozenset[type] = _SCALAR_TYPES | {slice}


def tensor_leaves(value: Any) -> list[Tensor]:
    """The tensors among ``value``'s pytree leaves, in `tree_flatten` order."""
    return _collect_tensors(value, [])


def _collect_tensors(value: Any, found: list[Tensor]) -> list[Tensor]:
    """``found`` extended by the tensors of ``value`` (see `tensor_leaves`)."""
    kind = type(value)
    if kind in _PYTREE_SEQUENCES:
        for item in value:
            _collect_tensors(item, found)
    elif kind in _PYTREE_MAPPINGS:
        for item in value.values():
            _collect_tensors(item, found)
    elif isinstance(value, Tensor):
        found.append(value)
    elif kind not in _PYTREE_SCALARS:
        found.extend(leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, Tensor))
    return found


def _tree_map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``tree_map(fn, value)``: ``fn`` applied to every pytree leaf of ``value``."""
    kind = type(value)
    if kind in _PYTREE_SEQUENCES:
        return kind([_tree_map(fn, item) for item in value])
    if kind in _PYTREE_MAPPINGS:
        return kind({key: _tree_map(fn, item) for key, item in value.items()})
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

    return _tree_map(one, value)


def materialize(spec: Any) -> Any:
    return _tree_map(
        lambda leaf: leaf.materialize() if isinstance(leaf, TensorSpec) else leaf, spec
    )


def storage_key(tensor: Tensor) -> int:
    """Identity of a tensor's storage (views share it)."""
    return int(tensor.untyped_storage()._cdata)


def nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# --------------------------------------------------------------------------------------------
# Operator classification and FLOP formulas
# --------------------------------------------------------------------------------------------


class _OpInfo(NamedTuple):
    name: str
    category: str  # matmul, attention, embedding, reduction, elementwise, view, other
    is_view: bool
    activation: bool
    flops: Callable[[tuple[Any, ...], dict[str, Any], Any], int] | None
    returns_new: bool  # mutates nothing; every return is one tensor aliasing no input


@functools.cache
def _op_info(func: torch._ops.OpOverload) -> _OpInfo:
    name = func.overloadpacket.__name__
    returns = func._schema.returns
    is_view = bool(returns) and all(
        ret.alias_info is not None and not ret.alias_info.is_write for ret in returns
    )
    category = op_category(func)
    returns_new = (
        not func._schema.is_mutable
        and bool(returns)
        and all(
            ret.alias_info is None and isinstance(ret.type, torch.TensorType) for ret in returns
        )
    )
    return _OpInfo(
        name, category, is_view, name in _ACTIVATION_OPS, _flop_formula(func), returns_new
    )


def causal_fraction(queries: int, keys: int) -> float:
    """The share of the ``queries x keys`` scores a causal flash kernel computes: query i (of
    the last ``queries`` positions) sees ``keys - queries + i + 1`` keys. torch's flop counter
    counts the whole square ("We aren't accounting for causal attention here",
    torch/utils/flop_counter.py), but flash kernels skip the masked blocks, and the efficiencies
    the presets quote count the causal half (Dao 2023, FlashAttention-2, Sec. 4.1: "with causal
    mask, we divide this number by 2"; Megatron-LM's num_floating_point_operations likewise)."""
    if queries <= 0 or keys <= 0:
        return 1.0
    seen = queries * (keys - queries) + queries * (queries + 1) / 2
    return min(1.0, max(0.0, seen / (queries * keys)))


def _is_causal(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> bool:
    return bool(args[index] if len(args) > index else kwargs.get("is_causal", False))


def _flop_formula(
    func: torch._ops.OpOverload,
) -> Callable[[tuple[Any, ...], dict[str, Any], Any], int] | None:
    if func is _FLASH_CPU:
        # (query, key, value, dropout_p, is_causal): shapes (b, heads, s, d)
        return lambda args, kwargs, out: int(
            sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)  # type: ignore[no-untyped-call]
            * (
                causal_fraction(args[0].shape[-2], args[1].shape[-2])
                if _is_causal(args, kwargs, 4)
                else 1.0
            )
        )
    if func is _FLASH_CPU_BACKWARD:
        # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal)
        return lambda args, kwargs, out: int(
            sdpa_backward_flop_count(  # type: ignore[no-untyped-call]
                args[0].shape, args[1].shape, args[2].shape, args[3].shape
            )
            * (
                causal_fraction(args[1].shape[-2], args[2].shape[-2])
                if _is_causal(args, kwargs, 7)
                else 1.0
            )
        )
    name = func.overloadpacket.__name__
    if name in GROUPED_GEMM_OPS and func.namespace in ("aten", "transformers"):
        # the backward op makes both gradients: twice the forward's GEMM work
        times = 2 if name == "grouped_mm_fallback_backward" else 1
        return lambda args, kwargs, out: times * grouped_gemm_flops(args[0], args[1])
    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return None
    return lambda args, kwargs, out: int(formula(*args, **kwargs, out_val=out))


def grouped_gemm_flops(a: Tensor, b: Tensor) -> int:
    """FLOPs of a grouped GEMM (torch.ops.aten._grouped_mm's layouts): each row of ``a`` (or
    column, for the weight gradient) meets one group's matrix, so the work is that of one GEMM
    over all rows. ``(S, K) @ (G, K, N)``: 2 S K N; ``(K, S) @ (S, N)`` grouped along S (a
    weight gradient): 2 K S N; ``(G, M, K) @ (G, K, N)``: 2 G M K N; ``(G, M, K) @ (K, N)``
    grouped along N: 2 M K N."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 2 * a.shape[-2] * a.shape[-1] * b.shape[-1]


def _gemm_operands(name: str, args: tuple[Any, ...]) -> tuple[Tensor, Tensor] | None:
    if name in ("mm", "bmm"):
        return args[0], args[1]
    if name in ("addmm", "baddbmm"):
        return args[1], args[2]
    return None


# --------------------------------------------------------------------------------------------
# Meta kernels, memoised
# --------------------------------------------------------------------------------------------


class _Unkeyable(Exception):
    """A value that `_arg_key` or `NodeRunner.call_key` cannot describe completely."""


_PLAIN_TENSORS: frozenset[type] = frozenset({Tensor, nn.Parameter})


def _arg_key(value: Any) -> Hashable:
    """Everything a meta kernel can read of ``value`` (raises `_Unkeyable` if unsure)."""
    kind = type(value)
    if kind in _PLAIN_TENSORS:
        if not value.is_meta or value.is_conj() or value.is_neg() or value.is_sparse:
            raise _Unkeyable
        return (
            value.shape,
            value.stride(),
            value.dtype,
            value.storage_offset(),
            value.requires_grad,
        )
    if kind in _SCALAR_TYPES:
        return (kind, value)
    if kind is tuple or kind is list:
        return (kind, tuple(_arg_key(item) for item in value))
    raise _Unkeyable


class _Fresh(NamedTuple):
    """The outputs of a kernel call that made new tensors: (shape, stride, dtype) each."""

    specs: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]
    single: bool  # the op returns one tensor, not a tuple


class MetaKernels:
    """Meta kernels' outputs, remembered by the metadata of their inputs.

    On the meta device a kernel computes only its outputs' shapes, strides and dtypes, from its
    inputs' metadata and its non-tensor arguments. So a call of an op that mutates nothing and
    returns new tensors (`_OpInfo.returns_new`) can be answered, when an earlier call with
    equal metadata returned new storages of exactly their tensors' size, by new empty tensors
    of those shapes: the same tensors, less the Python work of torch's meta kernels (most run
    the reference implementations of ``torch._refs``). Any other call runs the kernel.
    """

    def __init__(self) -> None:
        self._outputs: dict[Hashable, _Fresh | None] = {}

    def run(
        self,
        func: torch._ops.OpOverload,
        info: _OpInfo,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``func(*args, **kwargs)``, on meta tensors, from memory where it is safe."""
        if not info.returns_new:
            return func(*args, **kwargs)
        try:
            key = (
                func,
                torch.get_default_dtype(),
                torch.is_grad_enabled(),
                _arg_key(args),
                tuple((name, _arg_key(value)) for name, value in kwargs.items()),
            )
        except _Unkeyable:
            return func(*args, **kwargs)
        if key in self._outputs:
            fresh = self._outputs[key]
            if fresh is not None:
                made = tuple(
                    aten.empty_strided.default(shape, stride, dtype=dtype, device=META)
                    for shape, stride, dtype in fresh.specs
                )
                return made[0] if fresh.single else made
        out = func(*args, **kwargs)
        if key not in self._outputs:
            self._outputs[key] = _fresh_outputs(out, (args, kwargs))
        return out


def _fresh_outputs(out: Any, inputs: Any) -> _Fresh | None:
    """``out`` as a `_Fresh` record if it is plain meta tensors on new storages that hold just
    them (what ``empty_strided`` makes), else None."""
    single = isinstance(out, Tensor)
    outputs = (out,) if single else out
    if not isinstance(outputs, tuple):
        return None
    storages = {storage_key(t) for t in tensor_leaves(inputs)}
    specs = []
    for tensor in outputs:
        if (
            type(tensor) is not Tensor
            or not tensor.is_meta
            or tensor.layout != torch.strided
            or tensor.requires_grad
            or tensor.is_conj()
            or tensor.is_neg()
            or tensor.storage_offset() != 0
            or storage_key(tensor) in storages
        ):
            return None
        storages.add(storage_key(tensor))
        spec = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        remade = aten.empty_strided.default(spec[0], spec[1], dtype=spec[2], device=META)
        if tensor.untyped_storage().nbytes() != remade.untyped_storage().nbytes():
            return None
        specs.append(spec)
    return _Fresh(specs=tuple(specs), single=single)


class _Meter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Adds every dispatched ATen op's FLOPs and bytes to ``current`` (when set)."""

    def __init__(self, state_keys: set[int], kernels: MetaKernels) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.state_keys = state_keys
        self.kernels = kernels
        self.current: NodeMeasure | None = None
        self.backward = False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        info = _op_info(func)
        if (
            info.flops is None
            and func is not torch.ops.prim.device.default
            and func._can_decompose()
        ):
            # As FlopCounterMode: count a composite op through its decomposition.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = self.kernels.run(func, info, args, kwargs)
        measure = self.current
        if measure is None:
            return out
        flops = info.flops(args, kwargs, out) if info.flops is not None else 0
        if self.backward:
            measure.backward_flops += flops
            return out
        measure.forward_flops += flops
        measure.categories.add(info.category)
        measure.activation_fn |= info.activation
        if not info.is_view:
            outputs = tensor_leaves(out)
            if outputs:
                for tensor in tensor_leaves((args, kwargs)):
                    if storage_key(tensor) in self.state_keys:
                        measure.param_bytes_read += nbytes(tensor)
                    else:
                        measure.read_bytes += nbytes(tensor)
                measure.write_bytes += sum(nbytes(t) for t in outputs)
                if info.category == "embedding" and storage_key(args[0]) in self.state_keys:
                    # A lookup reads the rows it gathers, not the whole table.
                    measure.param_bytes_read -= nbytes(args[0]) - min(
                        nbytes(args[0]), nbytes(outputs[0])
                    )
        if info.category == "matmul":
            self._record_gemm(measure, info.name, args)
        elif info.category == "embedding":
            measure.embedding_rows = int(args[0].shape[0])
        elif func is _FLASH_CPU or info.name.startswith("_scaled_dot_product"):
            measure.attention = (tuple(args[0].shape), tuple(args[1].shape))
        return out

    def _record_gemm(self, measure: NodeMeasure, name: str, args: tuple[Any, ...]) -> None:
        if name in GROUPED_GEMM_OPS:
            a, b = args[0], args[1]
            if a.dim() == 2 and b.dim() == 3:
                # One GEMM over the routed rows, for its shape. Not a weight GEMM: no pass
                # shards these experts over TP (only autoplan's own MoE layers, by expert
                # parallelism), so the node must not classify as a TP linear.
                gemm = Gemm(1, a.shape[0], a.shape[1], b.shape[2])
                if measure.activation_gemm is None or gemm.flops > measure.activation_gemm.flops:
                    measure.activation_gemm = gemm
            return
        operands = _gemm_operands(name, args)
        if operands is None:
            return
        a, b = operands
        if a.dim() == 2:
            gemm = Gemm(1, a.shape[0], a.shape[1], b.shape[1])
        else:
            gemm = Gemm(a.shape[0], a.shape[1], a.shape[2], b.shape[2])
        if storage_key(a) in self.state_keys or storage_key(b) in self.state_keys:
            if measure.weight_gemm is None or gemm.flops > measure.weight_gemm.flops:
                measure.weight_gemm = gemm
        elif measure.activation_gemm is None or gemm.flops > measure.activation_gemm.flops:
            measure.activation_gemm = gemm


# --------------------------------------------------------------------------------------------
# Model state on meta and running single nodes
# --------------------------------------------------------------------------------------------


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


def _module_key(module: nn.Module) -> Hashable:
    """All that a module's call can read of it: its type, mode, plain attributes (exact),
    parameters, buffers and children. Raises `_Unkeyable` for a module with hooks or with an
    attribute of another kind (an object or a function), which this key would not describe."""
    if (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    ):
        raise _Unkeyable
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
        (name, None if child is None else _module_key(child))
        for name, child in module._modules.items()
    )
    return (type(module), module.training, attributes, tensors, children)


def _exact_key(value: Any) -> Hashable:
    """A scalar, or a tuple or list of them, with their types (else `_Unkeyable`)."""
    kind = type(value)
    if kind in _SCALAR_TYPES:
        return (kind, value)
    if kind is tuple or kind is list:
        return (kind, tuple(_exact_key(item) for item in value))
    raise _Unkeyable


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
    out, _logsumexp = _FLASH_CPU(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out  # type: ignore[no-any-return]


class _MetaCalls(TorchFunctionMode):
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
        its target (a module by `_module_key`), and the arguments (tensors by their metadata,
        model state apart), or None when an argument or module is not fully described."""
        target: Hashable = node.target
        if node.op == "call_module":
            assert isinstance(node.target, str)
            try:
                target = _module_key(self.gm.get_submodule(node.target))
            except _Unkeyable:
                return None
        states: dict[int, int] = {}
        try:
            key = (node.op, target, self._value_key(args, states), self._value_key(kwargs, states))
            hash(key)
        except (_Unkeyable, TypeError):  # TypeError: an unhashable target or constant
            return None
        return key

    def _value_key(self, value: Any, states: dict[int, int]) -> Hashable:
        kind = type(value)
        if isinstance(value, Tensor):
            if kind not in _PLAIN_TENSORS:
                raise _Unkeyable
            meta = (value.shape, value.stride(), value.dtype, value.requires_grad)
            if storage_key(value) in self.state.keys:  # kept as is: its identity and place count
                ordinal = states.setdefault(id(value), len(states))
                return ("state", kind, ordinal, value.storage_offset(), value.is_leaf, *meta)
            return ("activation", *meta)  # replaced by a fresh tensor (`_fresh`)
        if kind in _SCALAR_TYPES or value is Ellipsis:
            return (kind, value)
        if kind in _PYTREE_SEQUENCES or kind is torch.Size:
            return (kind, tuple(self._value_key(item, states) for item in value))
        if kind in _PYTREE_MAPPINGS:
            return (kind, tuple((k, self._value_key(v, states)) for k, v in value.items()))
        if kind is slice:
            return (
                kind,
                *(self._value_key(v, states) for v in (value.start, value.stop, value.step)),
            )
        raise _Unkeyable

    def node_params(self, node: fx.Node, args: tuple[Any, ...]) -> list[Tensor]:
        """Meta tensors requiring grad that ``node`` reads as model state."""
        found = [t for t in tensor_leaves(args) if t.requires_grad and t.is_leaf]
        if node.op == "call_module":
            assert isinstance(node.target, str)
            module = self.gm.get_submodule(node.target)
            found += [t for t in self.state.module_tensors(module).values() if t.requires_grad]
        return found


# --------------------------------------------------------------------------------------------
# One unit
# --------------------------------------------------------------------------------------------


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
    meter = _Meter(runner.state.keys, runner.kernels)
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
        with torch.enable_grad(), torch.device(META), _MetaCalls(), meter:
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

    return _tree_map(one, value)


def _measure_backward(
    node: fx.Node,
    env: dict[fx.Node, Any],
    load: Callable[[fx.Node], Any],
    runner: NodeRunner,
    meter: _Meter,
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
    meter: _Meter,
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
