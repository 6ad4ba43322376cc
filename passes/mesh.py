"""One device mesh for a plan: ``init_device_mesh(device_type, shape, mesh_dim_names=dims)``.

Expects: an initialised default process group whose world size is ``plan.num_devices``.
Guarantees: the mesh axes are the plan's ``rank_layout`` (``pp``, ``dp``, ``tp``, and ``cp``
when the layout places it), outermost first, with one exception: under expert parallelism
(``ep_degree > 1``) the ``dp`` axis is split into ``edp`` (outer) and ``ep`` (inner: an ep group
is ``ep_degree`` consecutive data-parallel ranks, `Plan.ep_group_ranks`), and ``dp`` becomes
their flattened sub-mesh. The data-parallel meshes of the weights are flattened sub-meshes too:
``dense_dp`` (dp x cp: every rank holding the same dense weights, torchtitan's
``dp_shard_cp``) and ``expert_dp`` (edp x cp: the ranks holding the same experts,
`Plan.expert_data_group_ranks`). A plan with cp = ep = 1 gets the mesh it always had
(``dense_dp`` is then the ``dp`` axis itself). Under HSDP (``dp_shard_degree``) the ``dp`` axis
is split likewise into ``dp_replicate`` (outer) and ``dp_shard`` (inner: a shard group is
``dp_shard_degree`` consecutive data-parallel ranks, `Plan.shard_group_ranks`), ``dp`` becomes
their flattened sub-mesh, and ``fsdp_mesh`` is the 2-D (dp_replicate, dp_shard) sub-mesh that
FSDP2 shards over the second dim of and replicates over the first (cp = 1: autoplan's runtime
runs HSDP without context parallelism, `Capabilities.hsdp_context_parallel`).
Under folded expert parallelism (``ep_folding``: an ep group is ``ep_degree`` consecutive ranks
of the dp x cp x tp block of one pipeline rank, Megatron-Core's MoE parallel folding) ``dp`` is
not split; a second mesh over the same world, of shape (pp, edp, ep) and built from the plan's
groups (``expert_mesh``), gives the ``ep`` and ``edp`` sub-meshes instead (both from one root
mesh, as FSDP2 needs for the experts' DTensors).
Under expert tensor parallelism (``etp_degree > 1``: the ``etp`` group is ``etp_degree``
consecutive ranks of the TP group, `Plan.etp_group_ranks`) the routed experts' weights are
DTensors over the 2-D (ep, etp) mesh (`ParallelMesh.expert_weights`). At etp = tp these are the
root mesh's (``ep``, ``tp``) axes, or its ``tp`` axis at ep = 1; folded, or at 1 < etp < tp,
the expert mesh gains an inner ``etp`` axis, (pp, edp, ep, etp), Megatron-Core's etp-ep-edp-pp
order over each pipeline rank's dp x cp x tp block (etp x ep x edp = tp x cp x dp). Below tp
the expert layer is its own mesh over the stage's ranks: ``edp`` holds the ranks at one ep
and etp place, the other expert-TP groups of each TP group among them (each routes its own
tokens under sequence parallelism), so the experts' gradients reduce over it
(`Plan.expert_data_group_ranks` of the folded layout; at ep = 1 the folded and the unfolded
ep groups coincide, and autoplan's runtime refuses ep > 1 inside dp below tp,
`cost_model.frameworks.limits`).
The ranks of every group are exactly the plan's
(`Plan.group_ranks` and the ep helpers; checked before returning); every sub-group, flattened
ones included, has the default group's timeout (``new_group`` would give gloo's 30 minutes: a
stopped peer would hang the job instead of failing it; checked too); the 1-D sub-meshes and
this rank's coordinates come with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import MeshAxis, Plan
from passes.progress import default_group_timeout

__all__ = ["MeshGroup", "ParallelMesh", "build_mesh", "mesh_dims"]

# Sub-meshes beyond the plan's axes: the two pieces of dp under expert parallelism and the
# flattened data-parallel groups of the dense and the expert weights (module docstring).
MeshGroup = Literal["ep", "edp", "etp", "dp_cp", "edp_cp", "dp_replicate", "dp_shard"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ParallelMesh:
    """The job's device mesh, its named 1-D sub-meshes and this rank's place in them."""

    mesh: DeviceMesh
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    cp_rank: int = 0
    cp_degree: int = 1
    ep_degree: int = 1
    etp_degree: int = 1
    # flattened sub-meshes by name (``dp`` under ep, ``dp_cp``, ``edp_cp``), kept here: torch
    # deprecates slicing them back out of the root mesh
    flattened: Mapping[str, DeviceMesh] = field(default_factory=dict)
    # under ep_folding: the (pp, edp, ep) mesh of the folded expert groups, (pp, edp, ep,
    # etp) under expert tensor parallelism; also at 1 < etp < tp (module doc)
    expert_mesh: DeviceMesh | None = None

    def sub(self, axis: MeshAxis | MeshGroup) -> DeviceMesh:
        """The 1-D sub-mesh along ``axis`` that contains this rank: a mesh axis, ``dp`` (also
        when expert parallelism splits it), ``ep`` or ``edp``, or a flattened data-parallel
        group (``dp_cp``, ``edp_cp``)."""
        if axis in self.flattened:
            return self.flattened[axis]
        if self.expert_mesh is not None and axis in ("ep", "edp", "etp"):
            return self.expert_mesh[axis]
        if axis == "etp":
            return self.mesh["tp"]  # etp = tp (below tp the expert mesh has its etp axis)
        return self.mesh[axis]

    @property
    def expert_weights(self) -> DeviceMesh:
        """The mesh the routed experts' weights are DTensors over: ``ep`` (experts whole), or
        under expert tensor parallelism the 2-D (ep, etp) mesh, or ``etp`` alone at ep = 1
        (module doc); always a slice of the root mesh the experts' data parallelism uses."""
        if self.etp_degree == 1:
            return self.sub("ep")
        if self.expert_mesh is not None:
            return self.expert_mesh["ep", "etp"] if self.ep_degree > 1 else self.expert_mesh["etp"]
        return self.mesh["ep", "tp"] if self.ep_degree > 1 else self.mesh["tp"]

    @property
    def experts_apart(self) -> bool:
        """Whether the routed experts have a data-parallel mesh of their own (`expert_dp`),
        which data parallelism wraps them over apart from the dense weights: under expert
        parallelism, or on the expert mesh of 1 < etp < tp (module doc)."""
        return self.ep_degree > 1 or self.expert_mesh is not None

    @property
    def dense_dp(self) -> DeviceMesh:
        """The data-parallel mesh of the dense weights: dp x cp ranks (each cp rank's loss is
        the mean over its own tokens, so the cp ranks average gradients like replicas)."""
        return self.sub("dp_cp" if self.cp_degree > 1 else "dp")

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 and ``replicate`` wrap the dense weights over: `dense_dp`, or under
        HSDP the 2-D (dp_replicate, dp_shard) mesh (FSDP2 replicates over its first dim and
        shards over its second)."""
        names = self.mesh.mesh_dim_names or ()
        if "dp_shard" in names:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.dense_dp

    @property
    def expert_dp(self) -> DeviceMesh:
        """The data-parallel mesh of the routed experts under expert parallelism: edp x cp
        ranks, those holding the same experts (`Plan.expert_data_group_ranks`)."""
        if self.expert_mesh is not None:
            # folded, or 1 < etp < tp: the block's ranks at one ep (and etp) place
            return self.sub("edp")
        if self.ep_degree == 1:
            return self.dense_dp
        return self.sub("edp_cp" if self.cp_degree > 1 else "edp")

    @property
    def device_type(self) -> str:
        return self.mesh.device_type


def mesh_dims(plan: Plan) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mesh's dimension names and sizes, outermost first: the plan's ``rank_layout`` with
    ``dp`` split into ``edp`` x ``ep`` when ``ep_degree > 1`` (not folded), or into
    ``dp_replicate`` x ``dp_shard`` under HSDP."""
    names: list[str] = []
    sizes: list[int] = []
    for axis in plan.rank_layout:
        if axis == "dp" and plan.ep_degree > 1 and not plan.ep_folding:
            names += ["edp", "ep"]
            sizes += [plan.dp_degree // plan.ep_degree, plan.ep_degree]
        elif axis == "dp" and plan.dp_shard_degree is not None:
            names += ["dp_replicate", "dp_shard"]
            sizes += [plan.dp_degree // plan.dp_shard_degree, plan.dp_shard_degree]
        else:
            names.append(axis)
            sizes.append(plan.degree(axis))
    return tuple(names), tuple(sizes)


def build_mesh(plan: Plan, device_type: str) -> ParallelMesh:
    """Create the plan's mesh (a collective: every rank must call it, in the same order)."""
    world = dist.get_world_size()
    if world != plan.num_devices:
        raise PlanError(
            f"the plan needs dp x tp x pp = {plan.dp_degree} x {plan.tp_degree} x "
            f"{plan.pp_degree} = {plan.num_devices} processes but the job has {world}; "
            f"launch {plan.num_devices} processes or make a plan for {world}"
        )
    names, sizes = mesh_dims(plan)
    options = _options_with_default_timeout(device_type)
    mesh = init_device_mesh(
        device_type,
        sizes,
        mesh_dim_names=names,
        backend_override=None if options is None else dict.fromkeys(names, options),
    )
    flattened = {
        name: mesh[pieces]._flatten(name, backend_override=options)
        for name, pieces in _flatten_groups(plan, names).items()
    }
    groups = {**{name: mesh[name] for name in names}, **flattened}
    expert_mesh = None
    experts = _expert_layout(plan)  # whose ep helpers give the expert mesh's groups
    if experts is not None:
        expert_mesh = (
            _folded_expert_tp_mesh(experts, device_type, options)
            if plan.etp_degree > 1
            else _folded_expert_mesh(experts, device_type, options)
        )
        groups["ep"], groups["edp"] = expert_mesh["ep"], expert_mesh["edp"]
        if plan.etp_degree > 1:
            groups["etp"] = expert_mesh["etp"]
    rank = dist.get_rank()
    for sub in groups.values():
        _check_timeout(sub.get_group(), device_type)
    coords: dict[str, int] = {
        axis: (rank // plan.axis_stride(axis)) % plan.degree(axis) for axis in plan.rank_layout
    }
    for name, sub in groups.items():
        got = tuple(int(r) for r in sub.mesh.flatten().tolist())
        expert_group = experts is not None and name in ("ep", "edp", "etp")
        want = _plan_group(experts if experts is not None and expert_group else plan, name, rank)
        # Internal invariant: init_device_mesh lays ranks out row-major like the plan's groups.
        assert sorted(got) == sorted(want), (
            f"{name} group of rank {rank}: mesh has {got}, plan says {want}"
        )
        # ep: the order gives experts; dp_shard: the order gives the shards
        if name in plan.rank_layout or name in ("dp", "ep", "etp", "dp_shard", "dp_replicate"):
            assert got == want, f"{name} group of rank {rank}: mesh has {got}, plan says {want}"
            assert sub.get_local_rank() == want.index(rank), (name, coords)
    return ParallelMesh(
        mesh=mesh,
        rank=rank,
        pp_rank=coords["pp"],
        dp_rank=coords["dp"],
        tp_rank=coords["tp"],
        cp_rank=coords.get("cp", 0),
        cp_degree=plan.cp_degree,
        ep_degree=plan.ep_degree,
        etp_degree=plan.etp_degree,
        flattened=flattened,
        expert_mesh=expert_mesh,
    )


def _expert_layout(plan: Plan) -> Plan | None:
    """The plan whose expert groups the second (pp, edp, ep[, etp]) mesh is built from, or
    None where the root mesh has them: a folded plan itself; at 1 < etp < tp with ep = 1 the
    folded spelling of the same plan (the same ep and etp groups; its expert-data groups hold
    the other expert-TP groups of each TP group too, Megatron-Core's generator, which the
    cost model prices: ``Strategy.expert_dp_degree``)."""
    if plan.ep_folding and plan.ep_degree > 1:
        return plan
    if 1 < plan.etp_degree < plan.tp_degree and plan.ep_degree == 1:
        return replace(plan, ep_folding=True)
    return None


def _folded_expert_mesh(plan: Plan, device_type: str, options: Any) -> DeviceMesh:
    """The (pp, edp, ep) mesh of folded expert parallelism: entry [p, g, i] is rank i of the
    g-th ep group of pipeline rank p (`Plan.ep_group_ranks`), so ``edp`` holds the ranks at one
    ep position (`Plan.expert_data_group_ranks`). A collective (it creates the groups)."""
    ep = plan.ep_degree
    num_groups = plan.num_devices // (plan.pp_degree * ep)
    table = torch.empty((plan.pp_degree, num_groups, ep), dtype=torch.int64)
    filled = [0] * plan.pp_degree
    done: set[tuple[int, ...]] = set()
    pp_stride = plan.axis_stride("pp")
    for rank in range(plan.num_devices):
        group = plan.ep_group_ranks(rank)
        if group in done:
            continue
        done.add(group)
        pp = (rank // pp_stride) % plan.pp_degree
        table[pp, filled[pp]] = torch.tensor(group)
        filled[pp] += 1
    assert filled == [num_groups] * plan.pp_degree, (filled, num_groups)
    names = ("pp", "edp", "ep")
    return DeviceMesh(
        device_type,
        table,
        mesh_dim_names=names,
        backend_override=None if options is None else ((None, options),) * len(names),
    )


def _folded_expert_tp_mesh(plan: Plan, device_type: str, options: Any) -> DeviceMesh:
    """The (pp, edp, ep, etp) mesh of folded expert parallelism with expert tensor
    parallelism: entry [p, g, i, e] is the rank at place e of its expert-TP group, i of its ep
    group and g of its expert-data group (`Plan.etp_group_ranks`, `Plan.ep_group_ranks`,
    `Plan.expert_data_group_ranks`), on pipeline rank p. A collective (it creates the groups)."""
    ep, etp = plan.ep_degree, plan.etp_degree
    num_groups = plan.num_devices // (plan.pp_degree * ep * etp)
    table = torch.full((plan.pp_degree, num_groups, ep, etp), -1, dtype=torch.int64)
    pp_stride = plan.axis_stride("pp")
    for rank in range(plan.num_devices):
        place = (
            (rank // pp_stride) % plan.pp_degree,
            plan.expert_data_group_ranks(rank).index(rank),
            plan.ep_group_ranks(rank).index(rank),
            plan.etp_group_ranks(rank).index(rank),
        )
        assert int(table[place]) == -1, (place, rank)
        table[place] = rank
    names = ("pp", "edp", "ep", "etp")
    return DeviceMesh(
        device_type,
        table,
        mesh_dim_names=names,
        backend_override=None if options is None else ((None, options),) * len(names),
    )


def _flatten_groups(plan: Plan, names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Flattened sub-meshes to create: name -> the mesh dims they span, in mesh order."""
    groups: dict[str, tuple[str, ...]] = {}
    if plan.ep_degree > 1 and not plan.ep_folding:
        groups["dp"] = ("edp", "ep")
        if plan.cp_degree > 1:
            groups["edp_cp"] = tuple(n for n in names if n in ("edp", "cp"))
    if plan.dp_shard_degree is not None:
        groups["dp"] = ("dp_replicate", "dp_shard")
    if plan.cp_degree > 1:
        pieces = ("edp", "ep", "dp", "dp_replicate", "dp_shard", "cp")
        groups["dp_cp"] = tuple(n for n in names if n in pieces)
    return groups


def _plan_group(plan: Plan, name: str, rank: int) -> tuple[int, ...]:
    """The plan's ranks of group ``name`` containing ``rank`` (the order of the plan's helper;
    flattened groups in increasing rank order)."""
    if name in ("pp", "dp", "cp", "tp"):
        return plan.group_ranks(name, rank)  # type: ignore[arg-type]
    if name == "ep":
        return plan.ep_group_ranks(rank)
    if name == "etp":
        return plan.etp_group_ranks(rank)
    if name == "dp_shard":
        return plan.shard_group_ranks(rank)
    if name == "dp_replicate":
        return plan.replicate_group_ranks(rank)
    if name in ("edp", "edp_cp"):
        edp = plan.expert_data_group_ranks(rank)
        if name == "edp" and not plan.ep_folding:  # the same cp coordinate as rank
            cp_stride = plan.axis_stride("cp")
            mine = (rank // cp_stride) % plan.cp_degree
            edp = tuple(r for r in edp if (r // cp_stride) % plan.cp_degree == mine)
        return edp
    assert name == "dp_cp", name
    return tuple(
        sorted(
            {
                d + c
                for d in plan.group_ranks("dp", rank)
                for c in (r - rank for r in plan.group_ranks("cp", rank))
            }
        )
    )


def _options_with_default_timeout(device_type: str) -> Any:
    """Backend options carrying the default group's timeout (None: the default group has none
    to copy)."""
    timeout = default_group_timeout()
    if timeout is None:
        return None
    options: Any = (
        dist.ProcessGroupNCCL.Options()
        if device_type == "cuda"
        else dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    )
    options._timeout = timeout
    return options


def _check_timeout(group: dist.ProcessGroup, device_type: str) -> None:
    """Internal invariant: a sub-group waits on a peer as long as the default group does."""
    expected = default_group_timeout()
    if expected is None:
        return
    device = torch.device("cuda" if device_type == "cuda" else "cpu")
    got = group._get_backend(device).options._timeout
    assert got == expected, f"mesh group timeout {got}, default group's {expected}"
