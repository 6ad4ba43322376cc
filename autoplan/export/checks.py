"""What `autoplan validate` checks, before an export launches a plan: the cluster, the model and
memory.

Expects a plan, the model it is exported with, traced (a `ModelProfile` or `ModelGraph`: the
caller traces it, `autoplan.tracing` being above this package), and the cluster it runs on.
Guarantees, with `autoplan validate`'s messages: `check_devices` (no model needed) finds the
plan's devices to be the cluster's (a count that is not whole nodes of it, or another count,
is refused naming both and the ``--cluster`` to pass); `check_model` adds `Plan.validate`
against the model and the cluster (the model's fingerprint, so a plan made for another model
with as many pipeline units is refused; the units; TP degrees; TP groups inside a node);
`check_memory` is the one memory check (`autoplan validate` calls it too),
`Estimate.require_fits` on the plan's estimate for that cluster (priced for the plan's own
framework, as `validate` and `explain` price it).
``allow_over_memory`` turns the memory failure into a warning (`MemoryCheck.fits` False), as
``autoplan validate --allow-over-memory`` does. `autoplan.export.export_plan` runs the model
check, then the framework's, then memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan._format import fmt_headroom
from autoplan.contract.errors import InputError
from autoplan.contract.plan import HasProfile, Plan
from cost_model.estimate import estimate
from cost_model.hardware import Cluster
from cost_model.workload import ModelProfile

_GIB = 2.0**30


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryCheck:
    """The plan's predicted per-device peak against the device's memory on one cluster."""

    cluster: str
    num_devices: int
    peak_memory_bytes: float
    capacity_bytes: float
    fits: bool
    problem: str  # `Estimate.memory_problem`: "" when it fits
    # the headroom checked, and the largest peak that fits with it (`cost_model.headroom`)
    memory_headroom: float = 0.0
    usable_bytes: float = 0.0

    def __str__(self) -> str:
        if not self.fits:
            return self.problem
        return (
            f"peak memory {self.peak_memory_bytes / _GIB:.1f} GiB of "
            f"{self.capacity_bytes / _GIB:.1f} GiB per device on {self.cluster} "
            f"({self.num_devices} devices), "
            + fmt_headroom(
                self.peak_memory_bytes, self.capacity_bytes, self.memory_headroom, self.usable_bytes
            )
        )


def check_model(
    plan: Plan,
    graph: HasProfile | ModelProfile,
    cluster: Cluster,
    *,
    allow_cross_node_tp: bool = False,
) -> ModelProfile:
    """Check ``plan`` against ``cluster`` and the traced model ``graph`` as `autoplan validate`
    does (`Plan.validate`); returns the model's profile. Raises `InputError` (`PlanError`)
    naming the first problem."""
    check_devices(plan, cluster)
    profile = graph if isinstance(graph, ModelProfile) else graph.profile
    plan.validate(profile, cluster, allow_cross_node_tp=allow_cross_node_tp)
    return profile


def check_memory(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    *,
    allow_over_memory: bool = False,
    memory_headroom: float | None = None,
) -> MemoryCheck:
    """The one memory check (`Estimate.require_fits`) of the plan's estimate on ``cluster``,
    with ``memory_headroom`` (None: the plan's recorded one, else the default); raises
    `MemoryCapacityError` unless ``allow_over_memory`` (then `MemoryCheck.fits` says)."""
    result = estimate(profile, cluster, plan, memory_headroom=memory_headroom)
    if not allow_over_memory:
        result.require_fits()
    return MemoryCheck(
        cluster=cluster.name,
        num_devices=cluster.num_devices,
        peak_memory_bytes=result.peak_memory_bytes,
        capacity_bytes=result.memory_capacity_bytes,
        fits=result.fits,
        problem=result.memory_problem(),
        memory_headroom=result.memory_headroom,
        usable_bytes=result.usable_memory_bytes,
    )


def check_devices(plan: Plan, cluster: Cluster) -> None:
    """The plan's device count must be the cluster's, as `Plan.validate` requires; said in an
    export's terms (the cluster is the one to fix, unless the count is not whole nodes)."""
    num, per_node = plan.num_devices, cluster.devices_per_node
    if num == cluster.num_devices:
        return
    has = (
        f"cluster {cluster.name!r} has {cluster.num_devices} ({cluster.num_nodes} node(s) x "
        f"{per_node})"
    )
    if num > per_node and num % per_node:
        nodes = num // per_node
        raise InputError(
            f"the plan runs on {num} devices, which are not whole nodes of {per_node} devices "
            f"({has}; a launcher starts the same number of processes on every node): make the "
            f"plan for {nodes * per_node} or {(nodes + 1) * per_node} devices (autoplan plan ... "
            f"--cluster {cluster.name}:nodes=N), or fewer than {per_node} for one partial node"
        )
    fix = (
        f"{cluster.name}:nodes={num // per_node}"
        if num >= per_node
        else f"{cluster.name}:devices_per_node={num}"
    )
    raise InputError(
        f"the plan runs on {num} devices, but {has}; pass the cluster it runs on, e.g. "
        f"--cluster {fix}, or make a plan for this one (autoplan plan ... --cluster "
        f"{cluster.name})"
    )
