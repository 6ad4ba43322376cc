"""autoplan: automatic parallel-plan search and compiler for training Transformers.

The public API; everything not listed in ``__all__`` is private.
"""

from __future__ import annotations

from autoplan.errors import (
    ClusterError,
    InputError,
    ModelSpecError,
    NoFeasiblePlanError,
    PlanError,
    SchemaError,
    TraceError,
)
from autoplan import models
from autoplan.plan import ModelRef, Plan, PlanEstimate, StagePlan
from cost_model.hardware import Cluster, DeviceSpec, LinkSpec

__version__ = "0.1.0"

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
