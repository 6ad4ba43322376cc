"""Compile pass: ``torch.compile`` each unit of a stage whose plan says ``compile``.

Expects a `StageModule` after tensor parallelism, context and expert parallelism and activation
recompute (each unit a submodule ``unit_<idx>``, possibly a ``CheckpointWrapper``), before data
parallelism: the order torchtitan applies them (``apply_tp``, ``apply_ac``, ``apply_compile``,
``apply_fsdp`` in torchtitan/models/llama3/parallelize.py).

Guarantees: each unit of the kinds the plan's decisions compile (`Plan.decisions`
``compiled_unit_kinds``: the blocks, as torchtitan compiles each ``TransformerBlock`` and
leaves the embedding and the head eager, torchtitan/distributed/compile.py ``apply_compile``;
the cost model prices the same units fused) is compiled in place with ``nn.Module.compile``
(inductor; the module itself is kept, so parameter names, hooks and the wrappers applied later
are unchanged), one ``torch.compile`` per unit. Checked: the count of compiled units equals the
stage's count of those units. Nothing happens for a stage that does not compile. Compilation
itself runs on the first forward.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from passes.split import StageModule

__all__ = ["BACKEND", "apply_compile", "is_compiled"]

# torch.compile's default backend: TorchInductor (Triton kernels on GPUs, C++/OpenMP on CPUs)
BACKEND = "inductor"


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place (``nn.Module.compile`` keeps the compiled call
    in ``_compiled_call_impl``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def apply_compile(stage: StageModule, compile_stage: bool, unit_kinds: Collection[str]) -> int:
    """Compile ``stage``'s units of ``unit_kinds`` in place when ``compile_stage``; returns
    how many."""
    if not compile_stage:
        return 0
    units = [unit for unit in stage.units if unit.profile.kind in unit_kinds]
    for unit in units:
        stage.unit_module(unit).compile(backend=BACKEND)
    compiled = sum(is_compiled(stage.unit_module(unit)) for unit in stage.units)
    assert compiled == len(units), f"stage {stage.stage_idx}: compiled {compiled}/{len(units)}"
    return compiled
