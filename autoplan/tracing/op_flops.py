"""ATen operators: what kind each is and how many FLOPs a call does.

Expects ATen `OpOverload`s as a dispatch mode sees them. Guarantees: `op_info` (memoised per
op) gives an op's category (`autoplan.contract.ops.op_category`), whether it is a view, a
nonlinearity or returns only new tensors, and its FLOP formula: torch's
`torch.utils.flop_counter` registry, causal flash attention counted as the score blocks it
computes (`causal_fraction`), grouped GEMMs as one GEMM over all rows; None for ops that count
0 FLOPs (element-wise and normalisation ops).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from autoplan.contract.ops import GROUPED_GEMM_OPS, op_category

__all__ = [
    "FLASH_CPU",
    "OpInfo",
    "causal_fraction",
    "gemm_operands",
    "grouped_gemm_flops",
    "op_info",
]

aten = torch.ops.aten

FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

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


class OpInfo(NamedTuple):
    name: str
    category: str  # matmul, attention, embedding, reduction, elementwise, view, other
    is_view: bool
    activation: bool
    flops: Callable[[tuple[Any, ...], dict[str, Any], Any], int] | None
    returns_new: bool  # mutates nothing; every return is one tensor aliasing no input


@functools.cache
def op_info(func: torch._ops.OpOverload) -> OpInfo:
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
    return OpInfo(
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
    if func is FLASH_CPU:
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


def gemm_operands(name: str, args: tuple[Any, ...]) -> tuple[Tensor, Tensor] | None:
    if name in ("mm", "bmm"):
        return args[0], args[1]
    if name in ("addmm", "baddbmm"):
        return args[1], args[2]
    return None
