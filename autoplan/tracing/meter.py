"""Metering ATen ops on meta tensors: `Meter` adds each op's FLOPs and bytes to a node's measure.

Expects to run as a dispatch mode over meta tensors, with the storages of the model's state
(``state_keys``) known. Guarantees: every op dispatched while ``Meter.current`` is set adds its
FLOPs (`op_flops`; composite ops through their decompositions, as torch's FlopCounterMode), to
the backward figure while ``Meter.backward`` is set; in the forward also its bytes read and
written (views skipped; reads of model state apart, an embedding lookup reading only the rows
it gathers), its category, and its largest weight and activation GEMMs and attention shapes.
`MetaKernels` answers calls from memory only where the answer is the same tensors.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.contract.ops import GROUPED_GEMM_OPS
from autoplan.tracing.call_keys import Unkeyable, arg_key
from autoplan.tracing.node_measures import Gemm, NodeMeasure
from autoplan.tracing.op_flops import FLASH_CPU, OpInfo, gemm_operands, op_info
from autoplan.tracing.tensor_specs import META, nbytes, storage_key, tensor_leaves

__all__ = ["MetaKernels", "Meter"]

aten = torch.ops.aten


class _Fresh(NamedTuple):
    """The outputs of a kernel call that made new tensors: (shape, stride, dtype) each."""

    specs: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]
    single: bool  # the op returns one tensor, not a tuple


class MetaKernels:
    """Meta kernels' outputs, remembered by the metadata of their inputs.

    On the meta device a kernel computes only its outputs' shapes, strides and dtypes, from its
    inputs' metadata and its non-tensor arguments. So a call of an op that mutates nothing and
    returns new tensors (`OpInfo.returns_new`) can be answered, when an earlier call with
    equal metadata returned new storages of exactly their tensors' size, by new empty tensors
    of those shapes: the same tensors, less the Python work of torch's meta kernels (most run
    the reference implementations of ``torch._refs``). Any other call runs the kernel.
    """

    def __init__(self) -> None:
        self._outputs: dict[Hashable, _Fresh | None] = {}

    def run(
        self,
        func: torch._ops.OpOverload,
        info: OpInfo,
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
                arg_key(args),
                tuple((name, arg_key(value)) for name, value in kwargs.items()),
            )
        except Unkeyable:
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


class Meter(TorchDispatchMode):  # type: ignore[no-untyped-call]
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
        info = op_info(func)
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
        elif func is FLASH_CPU or info.name.startswith("_scaled_dot_product"):
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
        operands = gemm_operands(name, args)
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
