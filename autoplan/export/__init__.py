"""Export a plan to the launch config of another training stack.

``export_plan(plan, "megatron-lm" | "torchtitan" | "deepspeed")`` returns an `Export`: the
files that launch the plan there (Megatron-LM arguments, a torchtitan config module, a DeepSpeed
JSON), the command line and notes on what the user still supplies (data, tokenizer). Each
framework is one module whose docstring maps every plan field to the framework option that
expresses it, with the framework file that defines the option. A plan a framework cannot
express raises `ExportError` naming each field, the option it lacks and the nearest plan that
it can run; the options of the plan's framework (``megatron-lm:overlap-grad-reduce=off``) set
the flags they describe, or are refused where the target has none. The exporters are pure
functions of the plan and the model's sizes (`ModelDims`). Given the cluster it runs on,
`export_plan` first checks the plan as `autoplan validate` does (`checks`: the devices, the
model's fingerprint, memory), and says when the plan is priced for another stack
(`Export.stack_note`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autoplan.contract.errors import InputError
from autoplan.contract.plan import HasProfile, Plan
from autoplan.export._common import (
    FRAMEWORKS,
    Export,
    ExportError,
    ExportProblem,
    Framework,
    Launch,
    ModelDims,
    MoEDims,
    stack_note,
)
from autoplan.export.checks import MemoryCheck, check_devices, check_memory, check_model
from autoplan.export.deepspeed import export_deepspeed
from autoplan.export.megatron import export_megatron
from autoplan.export.model import model_dims, plan_model_spec
from autoplan.export.torchtitan import export_torchtitan
from cost_model.hardware import Cluster, as_cluster
from cost_model.workload import ModelProfile

__all__ = [
    "FRAMEWORKS",
    "Export",
    "ExportError",
    "ExportProblem",
    "Framework",
    "MemoryCheck",
    "MoEDims",
    "ModelDims",
    "check_devices",
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
    cluster: Cluster | str | None = None,
    graph: HasProfile | ModelProfile | None = None,
    allow_over_memory: bool = False,
    allow_cross_node_tp: bool = False,
) -> Export:
    """What launches ``plan`` on ``framework``.

    ``model`` is the zoo spec of the plan's model (default: the plan's ``model.name``) or its
    sizes. ``cluster`` is the cluster the plan runs on and ``graph`` the model traced
    (`autoplan.trace`; the CLI traces the spec): given both, the plan is checked against them
    as `autoplan validate` checks it (`checks`: its devices and the model's fingerprint, TP
    groups first; memory after the framework's own check; ``allow_over_memory`` and
    ``allow_cross_node_tp`` as validate's flags), and the launch line takes the cluster's
    devices per node. Without them, ``devices_per_node`` fills in the launch line
    (placeholders ``$NNODES`` and ``$NPROC_PER_NODE`` when None) and nothing is checked but
    what the framework can express.
    Raises `ExportError` (an `InputError`) listing every plan field the framework cannot
    express, `InputError` for an unknown framework, devices that are not whole nodes, or a plan
    that the check refuses, and `ModelSpecError` when the model is unknown.
    """
    if framework not in _EXPORTERS:
        raise InputError(
            f"unknown framework {framework!r}; valid frameworks: {', '.join(FRAMEWORKS)}"
        )
    checked: tuple[ModelProfile, Cluster] | None = None
    if (cluster is None) != (graph is None):
        raise InputError(
            "checking the plan needs both the cluster it runs on and its model traced: pass "
            "cluster= and graph= (autoplan.trace(model)) together, or neither"
        )
    if cluster is not None and graph is not None:
        if devices_per_node is not None:
            raise InputError(
                "pass cluster or devices_per_node, not both (the cluster has its devices per node)"
            )
        target = as_cluster(cluster)
        profile = check_model(plan, graph, target, allow_cross_node_tp=allow_cross_node_tp)
        checked = (profile, target)
        devices_per_node = target.devices_per_node
    dims = model if isinstance(model, ModelDims) else model_dims(plan_model_spec(plan, model))
    launch = Launch(num_devices=plan.num_devices, devices_per_node=devices_per_node)
    exported = _EXPORTERS[framework](plan, dims, launch)
    memory = None
    if checked is not None:
        # after the framework's check: a plan it cannot express fails on that first
        memory = check_memory(plan, *checked, allow_over_memory=allow_over_memory)
    return dataclasses.replace(exported, stack_note=stack_note(plan, framework), memory=memory)
