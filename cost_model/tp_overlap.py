"""How a training stack overlaps its sequence-parallel TP collectives with the GEMMs they feed
or follow (`Plan.tp_comm_overlap`): the record a stack's profile states
(`FrameworkProfile.tp_comm_overlap`) and the time one collective still takes beside its GEMM.

The technique is the decomposition of Wang et al., ASPLOS 2023 ("Overlap Communication with
Dependent Computation via Decomposition in Large Deep Learning Models"): a collective whose
result a GEMM consumes (an all-gather before a column-parallel linear) or whose input a GEMM
produces (a reduce-scatter after a row-parallel one) is cut into per-shard steps, each
overlapped with the part of the GEMM that needs (or makes) one shard. The stacks split it so:

- ``ring``: one shard a step, ``tp`` steps, the local shard first (an all-gather) or last (a
  reduce-scatter), so every transfer has a GEMM chunk beside it. With communication ``c``
  and GEMM ``w``: ``total = (tp - 1) max(w / tp, c / (tp - 1)) + w / tp``, so
  ``hidden = min(c, (tp - 1) / tp x w)``. Transformer Engine's ``ring_exchange`` (its
  default for the all-gathers, ``initialize_ub`` in transformer_engine/pytorch/module/
  base.py), torch's ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``
  (torch/distributed/_symmetric_memory, what inductor's micro-pipeline TP pass emits).
- ``pipeline``: the GEMM and the collective cut into ``chunks`` pieces, each piece's
  collective beside the next piece's GEMM, the last one after the GEMM:
  ``hidden = (chunks - 1) / chunks x min(c, w)``. Transformer Engine's forward
  reduce-scatters (``pipeline``, ``num_splits`` 4).
- ``bulk``: the whole collective beside an independent GEMM: ``hidden = min(c, w)``.
  Transformer Engine's backward reduce-scatter of the input gradient beside the weight
  gradient's GEMM.

What is hidden still slows the GEMM beside it by ``slowdown`` seconds a second (the SMs the
collective's kernels take), and only ``achieved_fraction`` of the ideal overlap is counted
(the stack's profile says what backs it). Guarantees: `exposed_s` is never more than the
collective's time and never less than zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OverlapMethod = Literal["ring", "pipeline", "bulk"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlapSplit:
    """How a stack splits one kind of TP collective against its GEMM (module docstring)."""

    method: OverlapMethod
    # the pieces of a ``pipeline`` split (a ``ring`` takes tp steps, ``bulk`` none)
    chunks: int = 1
    # compute lost per second of hidden communication: the SMs the collective takes from
    # the GEMM beside it, as a share of those left to it
    slowdown: float = 0.0

    def __post_init__(self) -> None:
        if self.method == "pipeline" and self.chunks < 2:
            raise ValueError(f"a pipeline split needs chunks >= 2, not {self.chunks}")
        if not 0.0 <= self.slowdown < 1.0:
            raise ValueError(f"slowdown = {self.slowdown} must be in [0, 1)")

    def hidden_s(self, comm_s: float, gemm_s: float, tp_degree: int) -> float:
        """The part of ``comm_s`` an ideal split hides behind ``gemm_s``."""
        if self.method == "ring":
            return min(comm_s, (tp_degree - 1) / tp_degree * gemm_s)
        if self.method == "pipeline":
            return (self.chunks - 1) / self.chunks * min(comm_s, gemm_s)
        return min(comm_s, gemm_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class TpCommOverlap:
    """A stack's overlap of the four sequence-parallel TP collectives of a column/row region
    (Korthikanti et al. 2022, section 4.2.2: an all-gather before the column-parallel GEMMs
    and a reduce-scatter after the row-parallel one, and their transposes in the backward)."""

    # the stack's name for it, for refusals and notes
    name: str
    # forward: the all-gather of the input beside the column-parallel GEMMs it feeds, the
    # reduce-scatter of the output beside the row-parallel GEMM that makes it
    forward_all_gather: OverlapSplit
    forward_reduce_scatter: OverlapSplit
    # backward: the all-gather of the output gradient beside the row-parallel linear's input-
    # gradient GEMM; the reduce-scatter of the input gradient beside the column-parallel
    # linears' input-gradient GEMMs (``ring``/``pipeline``: the GEMMs that make it) or their
    # weight-gradient GEMMs (``bulk``: independent of it)
    backward_all_gather: OverlapSplit
    backward_reduce_scatter: OverlapSplit
    # the share of the ideal overlap the stack achieves (1: the split's own formula)
    achieved_fraction: float
    # the backward reduce-scatter overlaps only a region whose input gradient one GEMM makes
    # (a compiler that fuses a reduce-scatter with the matmul producing it, not with a sum of
    # matmuls: q, k and v as three linears, or gate and up as two, are summed first)
    backward_reduce_scatter_needs_one_gemm: bool = False
    # the overlap is a torch.compile pass (inductor's micro-pipeline TP), so it needs the
    # blocks compiled (`Plan.compile`)
    needs_compile: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.achieved_fraction <= 1.0:
            raise ValueError(f"achieved_fraction = {self.achieved_fraction} must be in [0, 1]")


def exposed_s(
    split: OverlapSplit, comm_s: float, gemm_s: float, tp_degree: int, achieved_fraction: float
) -> float:
    """What a collective of ``comm_s`` adds beside ``gemm_s`` of GEMMs under ``split``: the part
    it does not hide, and the slowdown of the GEMM for the part it does."""
    hidden = achieved_fraction * split.hidden_s(comm_s, gemm_s, tp_degree)
    return comm_s - hidden + split.slowdown * hidden
