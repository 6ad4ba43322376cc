"""Compile pass: ``torch.compile`` each unit of a stage whose plan says ``compile``.

Expects a `StageModule` after tensor parallelism, context and expert parallelism and activation
recompute (each unit a submodule ``unit_<idx>``, possibly a ``CheckpointWrapper``), before data
parallelism: the order torchtitan applies them (``apply_tp``, ``apply_ac``, ``apply_compile``,
``apply_fsdp`` in torchtitan/models/llama3/parallelize.py).

Guarantees: every unit module of the stage is compiled in place with ``nn.Module.compile``
(inductor, the module itself kept: parameter names, hooks and the wrappers applied later are
unchanged), one ``torch.compile`` per unit as torchtitan compiles each ``TransformerBlock``
(torchtitan/distributed/compile.py, ``apply_compile``): the repeated blocks share one compiled
graph. Checked: the count of compiled units equals the stage's unit count. Nothing happens for
a stage that does not compile. Compilation itself runs on the first forward.
"""

from __future__ import annotations

from torch import nn

from passes.split import StageModule

__all__ = ["BACKEND", "apply_compile", "is_compiled"]

# torch.compile's default backend: TorchInductor (Triton kernels on GPUs, C++/OpenMP on CPUs)
BACKEND = "inductor"


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place (``nn.Module.compile`` keeps the compiled call
    in ``_compiled_call_impl``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def apply_compile(stage: StageModule, compile_stage: bool) -> int:
    """Compile each of ``stage``'s units in place when ``compile_stage``; returns how many."""
    if not compile_stage:
        return 0
    for unit in stage.units:
        stage.unit_module(unit).compile(backend=BACKEND)
    compiled = sum(is_compiled(stage.unit_module(unit)) for unit in stage.units)
    assert compiled == len(stage.units), (
        f"stage {stage.stage_idx}: compiled {compiled}/{len(stage.units)} units"
    )
    return compiled
