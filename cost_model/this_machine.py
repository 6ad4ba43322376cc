"""What this machine has: its visible CUDA devices, CPU cores and RAM, and where `autoplan
calibrate` saves its measured cluster file. Facts only; `cost_model.hardware.local_cluster`
describes them as a `Cluster`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True, kw_only=True, slots=True)
class CudaDevices:
    """The visible CUDA GPUs (all alike): how many, the first one's name and memory."""

    count: int
    name: str
    memory_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineFacts:
    """This machine as `facts` found it."""

    cuda: CudaDevices | None  # None: no CUDA device is visible
    cpu_cores: int  # cores this process may run on
    ram_bytes: int
    calibrated_path: Path  # `calibrated_path()`; the file may not exist


def calibrated_path() -> Path:
    """Where `autoplan calibrate` saves this machine's measured cluster file."""
    override = os.environ.get("AUTOPLAN_LOCAL_CLUSTER")
    if override:
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "autoplan" / "local-cluster.yaml"


def facts() -> MachineFacts:
    """This machine's devices, cores and memory, read now."""
    # (imported here: torch takes seconds to import and `import cost_model` must stay fast;
    # only detecting CUDA needs it)
    import torch

    cuda = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cuda = CudaDevices(
            count=torch.cuda.device_count(), name=props.name, memory_bytes=props.total_memory
        )
    return MachineFacts(
        cuda=cuda,
        cpu_cores=len(os.sched_getaffinity(0)),
        ram_bytes=psutil.virtual_memory().total,
        calibrated_path=calibrated_path(),
    )
