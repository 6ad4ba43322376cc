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

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "models": "autoplan.models",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.endswith(f".{name}") else getattr(module, name)
    globals()[name] = value
    return value


__all__ = [
    "Cluster",
    "ClusterError",
    "DeviceSpec",
    "InputError",
    "LinkSpec",
    "ModelRef",
    "ModelSpecError",
    "NoFeasiblePlanError",
    "Plan",
    "PlanError",
    "PlanEstimate",
    "SchemaError",
    "StagePlan",
    "TraceError",
    "__version__",
    "models",
]
