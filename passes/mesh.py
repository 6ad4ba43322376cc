"""One device mesh for a plan: ``init_device_mesh(device_type, plan.mesh_shape,
mesh_dim_names=plan.rank_layout)``.

Expects: an initialised default process group whose world size is ``plan.num_devices``.
Guarantees: the mesh axes are named ``pp``, ``dp``, ``tp`` and laid out in ``plan.rank_layout``
order (outermost first), so the ranks of every group are exactly ``plan.group_ranks(axis, rank)``
(checked before returning); every sub-group has the default group's timeout (``new_group``
would give gloo's 30 minutes: a stopped peer would hang the job instead of failing it; checked
too); the 1-D sub-meshes and this rank's coordinates come with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import MeshAxis, Plan
from passes.progress import default_group_timeout

__all__ = ["ParallelMesh", "build_mesh"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ParallelMesh:
    """The job's device mesh, its named 1-D sub-meshes and this rank's place in them."""

    mesh: DeviceMesh
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int

    def sub(self, axis: MeshAxis) -> DeviceMesh:
        """The 1-D sub-mesh along ``axis`` that contains this rank."""
        return self.mesh[axis]

    @property
    def device_type(self) -> str:
        return self.mesh.device_type


def build_mesh(plan: Plan, device_type: str) -> ParallelMesh:
    """Create the plan's mesh (a collective: every rank must call it, in the same order)."""
    world = dist.get_world_size()
    if world != plan.num_devices:
        raise PlanError(
            f"the plan needs dp x tp x pp = {plan.dp_degree} x {plan.tp_degree} x "
            f"{plan.pp_degree} = {plan.num_devices} processes but the job has {world}; "
            f"launch {plan.num_devices} processes or make a plan for {world}"
        )
    mesh = init_device_mesh(
        device_type,
        plan.mesh_shape,
        mesh_dim_names=tuple(plan.rank_layout),
        backend_override=_with_default_timeout(plan, device_type),
    )
    rank = dist.get_rank()
    for axis in plan.rank_layout:
        _check_timeout(mesh[axis].get_group(), device_type)
    coords = {axis: mesh.get_local_rank(axis) for axis in plan.rank_layout}
    for axis in plan.rank_layout:
        got = tuple(int(r) for r in mesh[axis].mesh.flatten().tolist())
        want = plan.group_ranks(axis, rank)
        # Internal invariant: init_device_mesh lays ranks out row-major like Plan.group_ranks.
        assert got == want, f"{axis} group of rank {rank}: mesh has {got}, plan says {want}"
    return ParallelMesh(
        mesh=mesh,
        rank=rank,
        pp_rank=coords["pp"],
        dp_rank=coords["dp"],
        tp_rank=coords["tp"],
    )


def _with_default_timeout(plan: Plan, device_type: str) -> dict[str | int, Any] | None:
    """Backend options carrying the default group's timeout, for every mesh axis."""
    timeout = default_group_timeout()
    if timeout is None:
        return None
    options: Any = (
        dist.ProcessGroupNCCL.Options()
        if device_type == "cuda"
        else dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    )
    options._timeout = timeout
    return {axis: options for axis in plan.rank_layout}


def _check_timeout(group: dist.ProcessGroup, device_type: str) -> None:
    """Internal invariant: a sub-group waits on a peer as long as the default group does."""
    expected = default_group_timeout()
    if expected is None:
        return
    device = torch.device("cuda" if device_type == "cuda" else "cpu")
    got = group._get_backend(device).options._timeout
    assert got == expected, f"mesh group timeout {got}, default group's {expected}"
