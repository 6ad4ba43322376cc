"""Export a plan to the launch config of another training stack.

``export_plan(plan, "megatron-lm" | "torchtitan" | "deepspeed")`` returns an `Export`: the
files that launch the plan there (Megatron-LM arguments, a torchtitan config module, a DeepSpeed
JSON), the command line and notes on what the user still supplies (data, tokenizer). Each
framework is one module whose docstring maps every plan field to the framework option that
expresses it, with the framework file that defines the option. A plan a framework cannot
express raises `ExportError` naming each field, the option it lacks and the nearest plan that
it can run. Pure functions of the plan and the model's sizes (`ModelDims`).
"""

from __future__ import annotations

from collections.abc import Callable

from autoplan.contract.errors import InputError
from autoplan.contract.plan import Plan
from autoplan.export._common import (
    FRAMEWORKS,
    Export,
    ExportError,
    ExportProblem,
    Framework,
    Launch,
    ModelDims,
    MoEDims,
)
from autoplan.export.deepspeed import export_deepspeed
from autoplan.export.megatron import export_megatron
from autoplan.export.model import model_dims, plan_model_spec
from autoplan.export.torchtitan import export_torchtitan

__all__ = [
    "FRAMEWORKS",
    "Export",
    "ExportError",
    "ExportProblem",
    "Framework",
    "MoEDims",
    "ModelDims",
    "export_plan",
    "model_dims",
]

_EXPORTERS: dict[Framework, Callable[[Plan, ModelDims, Launch], Export]] = {
    "megatron-lm": export_megatron,
    "torchtitan": export_torchtitan,
    "deepspeed": export_deepspeed,
}


def export_plan(
    plan: Plan,
    framework: str,
    *,
    model: str | ModelDims | None = None,
    devices_per_node: int | None = None,
) -> Export:
    """What launches ``plan`` on ``framework``.

    ``model`` is the zoo spec of the plan's model (default: the plan's ``model.name``) or its
    sizes; ``devices_per_node`` fills in the launch line (placeholders ``$NNODES`` and
    ``$NPROC_PER_NODE`` when None). Raises `ExportError` (an `InputError`) listing every plan
    field the framework cannot express, `InputError` for an unknown framework, and
    `ModelSpecError` when the model is unknown.
    """
    if framework not in _EXPORTERS:
        raise InputError(
            f"unknown framework {framework!r}; valid frameworks: {', '.join(FRAMEWORKS)}"
        )
    dims = model if isinstance(model, ModelDims) else model_dims(plan_model_spec(plan, model))
    launch = Launch(num_devices=plan.num_devices, devices_per_node=devices_per_node)
    return _EXPORTERS[framework](plan, dims, launch)
