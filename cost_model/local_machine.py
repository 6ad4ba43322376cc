"""Describe the machine this process runs on as a `Cluster` (`detect`, the same as
`Cluster.local`).

With CUDA (ROCm GPUs too, which torch shows as cuda devices): the visible GPUs, matched by name
to a shipped preset's device (`cost_model.hardware.gpu_preset`: A100, H100, H200, B200, GB200,
MI300X, V100) with the device's own memory, else the A100 preset's rates, said in the
description, until ``autoplan calibrate`` measures them. Without: one worker per CPU core
(or ``num_devices`` workers sharing them), RAM divided among them, and the `local` preset's
rates, or the measured ones that ``autoplan calibrate`` saved (see `calibrated_path`); with more
workers than cores, the cluster records the cores they share (``shared_cores_per_node``) and the
cost model stretches the work that runs concurrently (processor sharing; see
`cost_model.parts.core_sharing`); the rates stay those of one worker on its own core.

The facts come from `cost_model.this_machine`, the description from
`cost_model.hardware.local_cluster`; this module joins the two (it imports `hardware`, which
does not import it).
"""

from __future__ import annotations

from cost_model import this_machine
from cost_model.hardware import Cluster, local_cluster
from cost_model.this_machine import calibrated_path

__all__ = ["calibrated_path", "detect"]


def detect(num_devices: int | None = None) -> Cluster:
    """The local machine as a one-node cluster of ``num_devices`` (default: all) devices."""
    return local_cluster(this_machine.facts(), num_devices)
