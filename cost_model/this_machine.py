"""What this machine has: its visible CUDA devices, CPU cores and RAM, and which cluster file
describes it. `cost_model.hardware.local_cluster` describes the facts as a `Cluster`.

The file (`cluster_file`): the one `autoplan calibrate` saved (`calibrated_path`), else, on a
CPU-only machine, the rates measured the first time they are needed (`cost_model.local_rates`,
a few seconds), cached per machine under ``$XDG_CACHE_HOME/autoplan`` (`measured_path`: the name
carries a digest of the machine's facts, so another machine, or the same home folder seen from
another machine, measures its own). No measurement when ``AUTOPLAN_MEASURE_LOCAL=0``, nor when
``AUTOPLAN_LOCAL_CLUSTER`` names the file to use (missing: the `local` preset's defaults).
"""

from __future__ import annotations

import hashlib
import os
import platform
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
    # the cluster file `local_cluster` loads (`cluster_file`); missing: the `local` preset
    calibrated_path: Path


def calibrated_path() -> Path:
    """Where `autoplan calibrate` saves this machine's measured cluster file."""
    override = os.environ.get("AUTOPLAN_LOCAL_CLUSTER")
    if override:
        return Path(override)
    return _cache_folder() / "local-cluster.yaml"


MEASURE_ENV = "AUTOPLAN_MEASURE_LOCAL"
# Part of the cache key: bumped when `local_rates` changes what it measures or writes, so a
# newer autoplan measures again instead of reading an older one's file.
MEASUREMENT_VERSION = 2


def _cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autoplan"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(cpu_cores: int, ram_bytes: int) -> str:
    """A digest of what the measured rates depend on: host, CPU model, cores (all, and those
    this process may use), RAM, torch's version and `MEASUREMENT_VERSION`."""
    import torch

    facts = (
        platform.node(),
        platform.machine(),
        _cpu_model(),
        os.cpu_count(),
        cpu_cores,
        ram_bytes,
        torch.__version__,
        MEASUREMENT_VERSION,
    )
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:12]


def measured_path(cpu_cores: int, ram_bytes: int) -> Path:
    """Where the first-use measurement of this machine is cached."""
    return _cache_folder() / f"local-measured-{machine_key(cpu_cores, ram_bytes)}.yaml"


def cluster_file(cpu_cores: int, ram_bytes: int, *, measure: bool = True) -> Path:
    """The cluster file that describes this CPU-only machine (see the module doc): the
    calibrated one, else the measured one, measured now if it is missing and ``measure`` (and
    the environment allows it). The returned file may not exist: the `local` preset then."""
    calibrated = calibrated_path()
    pinned = bool(os.environ.get("AUTOPLAN_LOCAL_CLUSTER"))
    skip = os.environ.get(MEASURE_ENV, "1").strip().lower() in ("0", "false", "no", "off")
    if calibrated.exists() or pinned or skip:
        return calibrated
    measured = measured_path(cpu_cores, ram_bytes)
    if measured.exists() or not measure:
        return measured if measured.exists() else calibrated
    # (imported here: it imports `hardware`, which imports this module)
    from cost_model import local_rates

    return measured if local_rates.ensure_measured(measured) else calibrated


def facts(*, measure: bool = True) -> MachineFacts:
    """This machine's devices, cores and memory, read now, and its cluster file
    (`cluster_file`; ``measure=False``: never measured here)."""
    # (imported here: torch takes seconds to import and `import cost_model` must stay fast;
    # only detecting CUDA needs it)
    import torch

    cuda = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cuda = CudaDevices(
            count=torch.cuda.device_count(), name=props.name, memory_bytes=props.total_memory
        )
    cores = len(os.sched_getaffinity(0))
    ram = psutil.virtual_memory().total
    return MachineFacts(
        cuda=cuda,
        cpu_cores=cores,
        ram_bytes=ram,
        calibrated_path=(
            calibrated_path() if cuda is not None else cluster_file(cores, ram, measure=measure)
        ),
    )
