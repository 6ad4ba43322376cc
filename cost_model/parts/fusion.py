"""torch.compile's fusion: which ops of a compiled unit run as fused kernels, and what those
kernels move.

Expects a unit whose ops carry their fusion group and fused bytes (`OpProfile.fusion_group`,
`OpProfile.fused_bytes`: the trace's `autoplan.tracing.fusion` groups them over the fx graph by
the rules below) and a strategy. Guarantees: under a plain (eager) strategy, or for a unit
kind the runtime does not compile, or an op the trace gave no fused bytes, every op is priced
as before, kernel by kernel; GEMMs, attention and embedding lookups are never changed.

What inductor fuses (TorchInductor, Ansel et al. 2024, "PyTorch 2: Faster Machine Learning
Through Dynamic Python Bytecode Transformation and Graph Compilation", ASPLOS '24, section 4:
its scheduler fuses pointwise ops and reductions that share loop iterations into one kernel,
vertically (a producer into its consumer) and horizontally (siblings reading the same input);
matrix multiplies and convolutions go to library kernels, ``extern`` nodes that are not fused
under the default mode; SDPA runs as its flash / memory-efficient kernel):

- fused: ATen's pointwise ops (the ``pointwise`` tag: activations, residual adds, dropout,
  casts, the rotary embedding's multiplies and adds, the scale of a softmax) and reductions
  (layer and RMS norms, softmax outside attention, sums and means), and the copies inductor
  lowers as indexing (`FUSED_OTHER_TARGETS`: concatenation, ``to``/``clone``/``contiguous``,
  tensor factories);
- not fused: GEMMs (the linears, a MoE layer's grouped experts), attention kernels, embedding
  lookups, and the remaining ops (``topk``, ``sort``, ``scatter_add``, ``index_select``:
  inductor's fallbacks or gathers, kept apart to err on the eager side).

A group of fused ops connected by producer-consumer edges, with no path between two members
through an unfused op (that would be a cycle between kernels), is one kernel per reduction it
holds (at least one) that reads the group's inputs once and writes only what leaves it: the
tensors an op outside the group (or another unit) reads. The intermediates stay in registers
and are not saved for backward: AOTAutograd's min-cut partitioner recomputes cheap pointwise
work in the backward rather than storing it (Ansel et al. 2024, section 5.2; torch/_functorch/
partitioners.py, ``min_cut_rematerialization_partition``). The backward of a group is priced
as eager backward is, ``BACKWARD_BYTES_FACTOR`` times the forward's traffic (it reads the
saved inputs and the outputs' gradients and writes the inputs' gradients), at the same kernel
count.

Memory: the activations autograd saves are priced as eager's. The partitioner usually saves
less (it keeps a group's inputs rather than its intermediates), so compiled peaks are priced
high, not low; the fp8 casts' working set is the fused casts' (`cost_model.parts.fp8`).

Speed-ups reported for torch.compile on Llama 3 training: torchtitan (Liang et al. 2025,
"TorchTitan", ICLR '25, arXiv:2410.06511, Llama 3.1 8B, FSDP and selective AC, on H100: Table
1, 8 GPUs, 6,258 to 6,674 tokens/s/GPU with compile, +6.6%; Table 2, 128 GPUs, 5,645 to
6,482, +14.8%; bench/data/published_runs.yaml). Nothing here is fitted to them: the fused bytes
are the traced graph's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cost_model.strategy import COMPILED_UNIT_KINDS, Strategy
from cost_model.workload import OpKind, OpProfile, UnitProfile

# The op kinds inductor fuses (module docstring).
FUSED_KINDS: frozenset[OpKind] = frozenset({"elementwise", "reduction"})
# Ops of kind "other" (neither pointwise nor a reduction in ATen's tags) that inductor lowers
# to indexing into the fused loop, by their fx target's name: concatenation and stacking
# (torch/_inductor/lowering.py, ``cat`` as a pointwise concat), copies and casts, factories.
FUSED_OTHER_TARGETS: frozenset[str] = frozenset(
    {
        "cat",
        "concat",
        "concatenate",
        "stack",
        "to",
        "type",
        "float",
        "half",
        "bfloat16",
        "clone",
        "contiguous",
        "arange",
        "zeros_like",
        "ones_like",
        "full_like",
        "new_zeros",
        "new_ones",
        "new_full",
        "floordiv",
        "where",
        "masked_fill",
    }
)


def is_fusible(kind: OpKind, target: str) -> bool:
    """Whether inductor fuses an op of this kind and fx target (module docstring)."""
    return kind in FUSED_KINDS or (kind == "other" and target in FUSED_OTHER_TARGETS)


def compiles(unit: UnitProfile, strategy: Strategy) -> bool:
    """Whether the runtime compiles ``unit`` under ``strategy``: a compiled plan's blocks (and
    the units of a model traced without blocks), as torchtitan compiles each TransformerBlock
    and leaves the embedding and the head eager (`cost_model.strategy.COMPILED_UNIT_KINDS`)."""
    return strategy.compile and unit.kind in COMPILED_UNIT_KINDS


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedOp:
    """An op as a compiled unit runs it: the op with its fused traffic, and the kernels it
    launches (a group's first op launches the group's kernels; the rest none)."""

    op: OpProfile
    kernels: float


def fused_ops(unit: UnitProfile, strategy: Strategy) -> tuple[FusedOp, ...]:
    """Each op of ``unit`` as it runs under ``strategy``: in a compiled unit the fused ops carry
    their group's traffic (`OpProfile.fused_bytes`) and the group's kernels are launched once,
    one per reduction in the group (at least one); every other op is itself, one kernel."""
    if not compiles(unit, strategy):
        return tuple(FusedOp(op=op, kernels=1.0) for op in unit.ops)
    reductions: dict[int, int] = {}
    for op in unit.ops:
        if _fused(op):
            reductions[op.fusion_group] = reductions.get(op.fusion_group, 0) + (
                op.kind == "reduction"
            )
    launched: set[int] = set()
    out = []
    for op in unit.ops:
        if not _fused(op):
            out.append(FusedOp(op=op, kernels=1.0))
            continue
        first = op.fusion_group not in launched
        launched.add(op.fusion_group)
        assert op.fused_bytes is not None
        kernels = float(max(1, reductions[op.fusion_group])) if first else 0.0
        fused = dataclasses.replace(op, activation_bytes=op.fused_bytes)
        out.append(FusedOp(op=fused, kernels=kernels))
    return tuple(out)


def _fused(op: OpProfile) -> bool:
    return op.fusion_group >= 0 and op.fused_bytes is not None
