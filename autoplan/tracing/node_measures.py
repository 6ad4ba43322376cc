"""What profiling a unit measures: `NodeMeasure` per node, `UnitMeasure` per unit.

Plain records, filled by `autoplan.tracing.profiler.profile_unit` and read by the ``measure``,
``units`` and ``unit_profiles`` steps; every figure is at the traced batch size. A
`NodeMeasure` is mutable while it is being measured; a `UnitMeasure` is frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["INPUT", "Gemm", "NodeMeasure", "SavedStorage", "UnitMeasure"]

INPUT = "<input>"  # producer of storages that enter the unit from outside


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
