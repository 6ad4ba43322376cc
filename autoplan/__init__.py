"""autoplan: automatic parallel-plan search and compiler for training Transformers.

The public API; everything not listed in ``__all__`` is private. Parts that need torch
(the model zoo, tracing, the runtime) load on first use, so ``import autoplan`` and the CLI's
file commands stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autoplan.contract.errors import (
    ClusterError,
    InputError,
    ModelSpecError,
    NoFeasiblePlanError,
    PlanError,
    SchemaError,
    TraceError,
)
from autoplan.contract.plan import ModelRef, Plan, PlanEstimate, StagePlan
from cost_model.hardware import Cluster, DeviceSpec, LinkSpec

if TYPE_CHECKING:
    from autoplan import models
    from autoplan.analysis.explain import explain
    from autoplan.analysis.whatif import whatif
    from autoplan.api import estimate, manual_plan, search
    from autoplan.contract.graph import ModelGraph
    from autoplan.export import export_plan
    from autoplan.runtime.checkpoint import Checkpointer, CheckpointError, CheckpointSaveError
    from autoplan.runtime.parallelizer import parallelize
    from autoplan.runtime.replicas import TorchFTReplicas
    from autoplan.runtime.trainer import Trainer, TrainingStopped
    from autoplan.tracing import trace
    from passes.progress import CrashedRankError, StalledRankError
    from passes.runtime import NonFiniteError

__version__ = "0.1.0"

# public name -> (module that defines it, attribute; None for the module itself), imported on
# first access. A public function never shares its name with a submodule: importing the
# submodule would replace the function on this package.
_LAZY: dict[str, tuple[str, str | None]] = {
    "models": ("autoplan.models", None),
    "trace": ("autoplan.tracing", "trace"),
    "ModelGraph": ("autoplan.contract.graph", "ModelGraph"),
    "manual_plan": ("autoplan.api", "manual_plan"),
    "estimate": ("autoplan.api", "estimate"),
    "search": ("autoplan.api", "search"),
    "parallelize": ("autoplan.runtime.parallelizer", "parallelize"),
    "whatif": ("autoplan.analysis.whatif", "whatif"),
    "explain": ("autoplan.analysis.explain", "explain"),
    "export_plan": ("autoplan.export", "export_plan"),
    "Checkpointer": ("autoplan.runtime.checkpoint", "Checkpointer"),
    "CheckpointError": ("autoplan.runtime.checkpoint", "CheckpointError"),
    "CheckpointSaveError": ("autoplan.runtime.checkpoint", "CheckpointSaveError"),
    "Trainer": ("autoplan.runtime.trainer", "Trainer"),
    "TrainingStopped": ("autoplan.runtime.trainer", "TrainingStopped"),
    "TorchFTReplicas": ("autoplan.runtime.replicas", "TorchFTReplicas"),
    "NonFiniteError": ("passes.runtime", "NonFiniteError"),
    "CrashedRankError": ("passes.progress", "CrashedRankError"),
    "StalledRankError": ("passes.progress", "StalledRankError"),
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
    "CheckpointSaveError",
    "Checkpointer",
    "Cluster",
    "ClusterError",
    "CrashedRankError",
    "DeviceSpec",
    "InputError",
    "LinkSpec",
    "ModelGraph",
    "ModelRef",
    "ModelSpecError",
    "NoFeasiblePlanError",
    "NonFiniteError",
    "Plan",
    "PlanError",
    "PlanEstimate",
    "SchemaError",
    "StagePlan",
    "StalledRankError",
    "TorchFTReplicas",
    "TraceError",
    "Trainer",
    "TrainingStopped",
    "__version__",
    "estimate",
    "explain",
    "export_plan",
    "manual_plan",
    "models",
    "parallelize",
    "search",
    "trace",
    "whatif",
]
