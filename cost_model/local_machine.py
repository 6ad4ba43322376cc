"""Describe the machine this process runs on as a `Cluster`.

With CUDA: the visible GPUs, matched by name to a shipped preset's device (A100, H100, V100),
else the device's own memory with the generic GPU figures. Without: one worker per CPU core
(or ``num_devices`` workers sharing them), RAM divided among them, and the `local` preset's
rates, or the measured ones that ``autoplan calibrate`` saved (see `calibrated_path`); with more
workers than cores, the cluster records the cores they share (``shared_cores_per_node``) and the
cost model stretches the work that runs concurrently (processor sharing; see
`cost_model.estimate.oversubscription_factors`); the rates stay those of one worker on its own
core.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import psutil

from cost_model.hardware import Cluster

logger = logging.getLogger(__name__)

# GPU name fragment -> preset whose device describes it.
_GPU_PRESETS: tuple[tuple[str, str], ...] = (
    ("H100", "dgx-h100-80g"),
    ("A100-SXM4-80GB", "dgx-a100-80g"),
    ("A100 80GB", "dgx-a100-80g"),
    ("A100", "dgx-a100-40g"),
    ("V100-SXM3", "dgx2-v100-32g"),
    ("V100", "p3.16xlarge"),
)


def calibrated_path() -> Path:
    """Where `autoplan calibrate` saves this machine's measured cluster file."""
    override = os.environ.get("AUTOPLAN_LOCAL_CLUSTER")
    if override:
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "autoplan" / "local-cluster.yaml"


def detect(num_devices: int | None = None) -> Cluster:
    """The local machine as a one-node cluster of ``num_devices`` (default: all) devices."""
    import torch

    if torch.cuda.is_available():
        return _detect_cuda(torch.cuda.device_count() if num_devices is None else num_devices)
    cores = len(os.sched_getaffinity(0))
    workers = num_devices if num_devices is not None else cores
    base = _cpu_base()
    memory = psutil.virtual_memory().total // max(workers, 1)
    device = dataclasses.replace(base.device, memory_bytes=memory)
    return dataclasses.replace(
        base,
        name="local",
        devices_per_node=workers,
        device=device,
        shared_cores_per_node=cores if workers > cores else None,
    )


def _cpu_base() -> Cluster:
    path = calibrated_path()
    if path.exists():
        logger.info("using the calibrated local cluster in %s", path)
        return Cluster.from_yaml(path)
    return Cluster.preset_file("local")


def _detect_cuda(count: int) -> Cluster:
    import torch

    props = torch.cuda.get_device_properties(0)
    preset = next((p for frag, p in _GPU_PRESETS if frag in props.name), None)
    base = Cluster.preset_file(preset or "dgx-a100-80g")
    device = dataclasses.replace(base.device, name=props.name, memory_bytes=props.total_memory)
    if preset is None:
        logger.warning(
            "no preset matches GPU %r; using A100 peak rates: run `autoplan calibrate`", props.name
        )
    return dataclasses.replace(base, name="local", devices_per_node=count, device=device)
