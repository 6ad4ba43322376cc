"""The operator vocabulary the trace and the runtime share: which ATen operator is a matrix
multiply, an attention kernel, an embedding lookup, a reduction, an element-wise op, a view, or
a collective.

The tracer (`autoplan.tracing.meter`) counts FLOPs and bytes by these categories and gives
each op of the profile its `OpKind`; the recompute pass (`passes.recompute`) keeps or recomputes
an op's output by the same category, as the plan's decisions say (`Plan.decisions`), so what
the cost model prices as recomputed is what runs again.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

__all__ = ["GROUPED_GEMM_OPS", "OpCategory", "is_collective", "op_category"]

OpCategory = Literal[
    "matmul", "attention", "embedding", "reduction", "elementwise", "view", "other"
]

# Grouped GEMMs run a mixture-of-experts layer's experts in one call: aten._grouped_mm, and
# transformers' own opaque op where that is unavailable (transformers/integrations/moe.py,
# `transformers::grouped_mm_fallback` and its backward).
GROUPED_GEMM_OPS = frozenset({"_grouped_mm", "grouped_mm_fallback", "grouped_mm_fallback_backward"})
_GEMM_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "matmul", *GROUPED_GEMM_OPS}
)
_EMBEDDING_OPS = frozenset({"embedding", "embedding_bag", "_embedding_bag"})
_REDUCTION_OPS = frozenset(
    {
        "native_layer_norm",
        "layer_norm",
        "rms_norm",
        "_fused_rms_norm",
        "native_group_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training",
        "_softmax",
        "softmax",
        "_safe_softmax",
        "_log_softmax",
        "log_softmax",
        "sum",
        "mean",
        "amax",
        "amin",
        "max",
        "min",
        "var",
        "var_mean",
        "std",
        "norm",
        "linalg_vector_norm",
        "cumsum",
        "logsumexp",
        "prod",
        "argmax",
        "argmin",
        "any",
        "all",
    }
)

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d"})


@functools.cache
def op_category(func: torch._ops.OpOverload) -> OpCategory:
    """The category of an ATen (or other dispatcher) operator."""
    name = func.overloadpacket.__name__
    returns = func._schema.returns
    is_view = bool(returns) and all(
        ret.alias_info is not None and not ret.alias_info.is_write for ret in returns
    )
    if "scaled_dot_product" in name or name.endswith(("flash_attention", "efficient_attention")):
        return "attention"
    if name in _GEMM_OPS:
        return "matmul"
    if name in _EMBEDDING_OPS:
        return "embedding"
    if name in _REDUCTION_OPS:
        return "reduction"
    if is_view:
        return "view"
    if torch.Tag.pointwise in func.tags:
        return "elementwise"
    return "other"


def is_collective(func: torch._ops.OpOverload) -> bool:
    """Whether the operator communicates (functional collectives, as DTensor issues them)."""
    return func.namespace in _COLLECTIVE_NAMESPACES
