"""cost_model: how devices, memory and links behave under a parallel plan.

Pure functions of plain data (a `ModelProfile`, a `Cluster`, a plan); no torch.distributed.
Imports neither `autoplan` nor `passes`.
"""

from __future__ import annotations

from cost_model.calibration import Calibration
from cost_model.errors import ClusterError, InputError, SchemaError
from cost_model.hardware import Cluster, DeviceSpec, LinkSpec, load_cluster, preset_names
from cost_model.workload import (
    GemmShape,
    ModelProfile,
    OpProfile,
    TpLinear,
    TpStructure,
    UnitProfile,
)

__all__ = [
    "Calibration",
    "Cluster",
    "ClusterError",
    "DeviceSpec",
    "GemmShape",
    "InputError",
    "LinkSpec",
    "ModelProfile",
    "OpProfile",
    "SchemaError",
    "TpLinear",
    "TpStructure",
    "UnitProfile",
    "load_cluster",
    "preset_names",
]
