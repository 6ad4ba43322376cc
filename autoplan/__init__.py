"""autoplan: automatic parallel-plan search and compiler for training Transformers.

The public API; everything not listed in ``__all__`` is private. Parts that need torch
(the model zoo, tracing, the runtime) load on first use, so ``import autoplan`` and the CLI's
file commands stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autoplan.errors import (
    ClusterError,
    InputError,
    ModelSpecError,
    NoFeasiblePlanError,
    PlanError,
    SchemaError,
    TraceError,
)
from autoplan.plan import ModelRef, Plan, PlanEstimate, StagePlan
from cost_model.hardware import Cluster, DeviceSpec, LinkSpec

if TYPE_CHECKING:
    from autoplan import models
    from autoplan.api import estimate, manual_plan
    from autoplan.checkpoint import Checkpointer, CheckpointError
    from autoplan.explanation import explain
    from autoplan.graph import ModelGraph
    from autoplan.parallelizer import parallelize
    from autoplan.planner.search import search
    from autoplan.replicas import TorchFTReplicas
    from autoplan.sweep import whatif
    from autoplan.tracing import trace
    from autoplan.trainer import Trainer

__version__ = "0.1.0"

# public name -> (module that defines it, attribute; None for the module itself), imported on
# first access. A public function never shares its name with a submodule: importing the
# submodule would replace the function on this package.
_LAZY: dict[str, tuple[str, str | None]] = {
    "models": ("autoplan.models", None),
    "trace": ("autoplan.tracing", "trace"),
    "ModelGraph": ("autoplan.graph", "ModelGraph"),
    "manual_plan": ("autoplan.api", "manual_plan"),
    "estimate": ("autoplan.api", "estimate"),
    "search": ("autoplan.planner.search", "search"),
    "parallelize": ("autoplan.parallelizer", "parallelize"),
    "whatif": ("autoplan.sweep", "whatif"),
    "explain": ("autoplan.explanation", "explain"),
    "Checkpointer": ("autoplan.checkpoint", "Checkpointer"),
    "CheckpointError": ("autoplan.checkpoint", "CheckpointError"),
    "Trainer": ("autoplan.trainer", "Trainer"),
    "TorchFTReplicas": ("autoplan.replicas", "TorchFTReplicas"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Cluster",
    "ClusterError",
    "DeviceSpec",
    "InputError",
    "LinkSpec",
    "ModelGraph",
    "ModelRef",
    "ModelSpecError",
    "NoFeasiblePlanError",
    "Plan",
    "PlanError",
    "PlanEstimate",
    "SchemaError",
    "StagePlan",
    "TorchFTReplicas",
    "TraceError",
    "Trainer",
    "__version__",
    "estimate",
    "explain",
    "manual_plan",
    "models",
    "parallelize",
    "search",
    "trace",
    "whatif",
]
