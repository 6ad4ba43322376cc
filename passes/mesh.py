"""One device mesh for a plan: ``init_device_mesh(device_type, plan.mesh_shape,
mesh_dim_names=plan.rank_layout)``.

Expects: an initialised default process group whose world size is ``plan.num_devices``.
Guarantees: the mesh axes are named ``pp``, ``dp``, ``tp`` and laid out in ``plan.rank_layout``
order (outermost first), so the ranks of every group are exactly ``plan.group_ranks(axis, rank)``
(checked before returning); the 1-D sub-meshes and this rank's coordinates come with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.errors import PlanError
from autoplan.plan import MeshAxis, Plan

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
    mesh = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=tuple(plan.rank_layout))
    rank = dist.get_rank()
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
