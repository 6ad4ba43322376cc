"""Expert-parallel pass: shard the routed experts of MoE layers over an ep group, with
all-to-all dispatch and combine.

Expects the routed experts of MoE layers in the zoo's interface (autoplan/models/moe.py),
found by their attributes (passes never import the zoo): a module with ``num_experts`` and
parameters ``w_gate``, ``w_up`` (E, F, H) and ``w_down`` (E, H, F), called by its MoE layer as
``experts(x_sorted (N, H), num_tokens_per_expert (E,)) -> (N, H)`` with the rows grouped by
expert id in increasing order. Works on the eager model and on traced units (the zoo's tracer
keeps ``GroupedExperts`` a leaf module). The weights must be real and equal on every ep rank
(the same seed or checkpoint), or all meta (the slices stay meta for `materialize`).

Guarantees:
- each ``experts`` becomes an `ExpertParallelExperts` with the same call contract, holding this
  rank's ``E / ep`` consecutive experts (rank j: experts j E/ep .. (j+1) E/ep - 1) as DTensors
  ``Shard(0)`` over the ep mesh (``full_tensor()`` gives the full weights back; torchtitan's
  ExpertParallel shards them the same way, torchtitan/distributed/expert_parallel.py);
- forward: per-expert token counts are exchanged (``all_to_all_single`` of the counts), then
  the tokens (``all_to_all_single_autograd``, whose backward is the reverse all-to-all; it runs
  on gloo in torch 2.13), regrouped by local expert, run through the local experts (the same
  SwiGLU per row as GroupedExperts), put back in arrival order and returned by the reverse
  all-to-all: the output equals the unsharded module's (tests/test_expert_parallel.py);
- bad input (``num_experts % ep != 0``, no MoE layer with ep > 1, a non-1-D mesh) raises
  `PlanError` before any collective.

Expert tensor parallelism (`ExpertTensorParallel`, `Plan.etp_degree`; Megatron-Core's
``--expert-tensor-parallel-size``, its TEGroupedMLP / SequentialMLP with expert TP): each
local expert is split further over the etp ranks, ``w_gate``/``w_up`` by rows of F
(column-parallel: each rank computes F / etp of the hidden activations) and ``w_down`` by
columns of F (row-parallel: each rank's output is a partial sum), as DTensors ``Shard(1)`` and
``Shard(2)`` over the etp dim of the (ep, etp) mesh. After the ep dispatch (Megatron's order,
megatron/core/transformer/moe/token_dispatcher.py ``MoEAlltoAllTokenDispatcher``: all-to-all
over ep, then the expert-TP group), either

- the etp ranks hold different tokens (sequence parallelism: each TP rank routes its own
  sequence shard): the rows each received are gathered over etp, every rank runs its slice on
  all of them, and the partial outputs are summed back to the rank that owns each row (an
  all-gather and a reduce-scatter of uneven sizes, as two ``all_to_all_single_autograd``: the
  backward of each is the other), or
- they hold the same tokens (no sequence parallelism): every rank runs its slice on its rows
  and the partial outputs are all-reduced (DTensor ``Partial`` to ``Replicate``, whose
  backward passes the replicated gradient through, Megatron's
  ``reduce_from_tensor_model_parallel_region``), and so are the partial gradients of the rows
  in backward (``to_local(grad_placements=[Partial()])`` of a replicated DTensor, Megatron's
  ``copy_to_tensor_model_parallel_region``).

At etp = tp an expert's weight gradient on an etp rank therefore already holds every token of
its TP group: the etp ranks' expert gradients are never summed over tp (the router's and
shared expert's still are under sequence parallelism, `passes.moe_sequence_parallel`).

Below tp (1 < etp < tp; Megatron-Core folds the expert layer's parallelism over the dense
layers' ranks, etp x ep x edp = tp x cp x dp per pipeline stage, in its etp-ep-edp-pp order,
megatron/core/parallel_state.py ``initialize_model_parallel``'s expert rank generator) the
etp group is not the TP mesh axis but ``etp`` consecutive ranks of one TP group
(`Plan.etp_group_ranks`), and the expert layer runs on a mesh of its own over the stage's
ranks, (edp, ep, etp) (`passes.mesh`, ``ParallelMesh.expert_weights``). Nothing above changes:
with sequence parallelism each TP rank routes its own tokens, the ep dispatch runs among the
ranks at one etp place, and the etp group gathers its rows; only the TP group's other
tp / etp expert-TP groups hold the same slices of the same experts on other tokens. They are in
the expert-data group (`Plan.expert_data_group_ranks` of the folded layout,
``ParallelMesh.expert_dp``), so the rule below holds unchanged: sum over it, divide by
dp x cp. Without sequence parallelism those groups would be exact copies, whose sum over the
expert-data group double counts: autoplan's runtime refuses that case in one line (Megatron-LM
too requires sequence parallelism for MoE with tp > 1, megatron/training/arguments.py
``validate_args``), as it refuses ep > 1 inside dp below tp, whose groups are not
Megatron-Core's (`cost_model.frameworks.limits`).

Composition with data parallelism (Megatron-LM's expert-data-parallel groups,
megatron/core/parallel_state.py: ``_EXPERT_MODEL`` splits the experts over a group,
``_EXPERT_DATA`` replicates each expert over the ranks holding the same experts). Expert
parallelism borrows ranks from data parallelism: every ep rank has its own tokens, so the
dense parameters are replicated over the whole data-parallel world (dp_total = edp x ep ranks,
each a per-rank mean loss) and averaged over it; an expert's parameters live on the edp =
dp_total / ep ranks with the same ep rank, and their gradient already sums the contributions
of all ep ranks' tokens through the all-to-all backward, so it is summed over the edp group
and divided by dp_total, not by edp (Megatron-LM's
megatron/core/distributed/distributed_data_parallel.py: ``gradient_scaling_factor`` and
``expert_gradient_scaling_factor`` are both 1 / data-parallel size). `reduce_gradients` does
exactly this.

The ep mesh may also be folded (``ep_folding``, Megatron-Core's MoE parallel folding:
`passes.mesh` builds it from `Plan.ep_group_ranks`, ``ep_degree`` consecutive ranks of the
dp x cp x tp block); this pass only needs it 1-D. Each rank then routes its own tokens (cp
chunks, and under tensor parallelism its sequence shard: `passes.moe_sequence_parallel`), and
the same rule holds with the folded expert-data group (`Plan.expert_data_group_ranks`, which
spans tp ranks too): sum over it, divide by dp x cp. With ep inside dp and tensor parallelism
with sequence parallelism, the tp ranks of an expert's holders saw different tokens: their
gradients are summed over tp as well (`passes.moe_sequence_parallel.ReplicatedGradientSum`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoplan.contract.errors import PlanError

__all__ = [
    "ExpertParallelExperts",
    "ExpertParallelResult",
    "ExpertTensorParallel",
    "all_reduce_gradients",
    "apply_expert_parallel",
    "check_expert_parallel",
    "find_grouped_experts",
    "reduce_gradients",
]

logger = logging.getLogger(__name__)

_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
# the dim of F in each weight: gate and up (E, F, H) split by rows, down (E, H, F) by columns
_FFN_DIM = {"w_gate": 1, "w_up": 1, "w_down": 2}


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ExpertTensorParallel:
    """How each local expert is split over the etp ranks (module doc)."""

    mesh: DeviceMesh  # the 1-D etp mesh (the TP group at etp = tp; below tp a slice of it)
    # the experts' weights' mesh: 2-D (ep, etp), or (etp,) at ep = 1, from one root mesh
    weights: DeviceMesh
    own_tokens: bool  # the etp ranks route different tokens (sequence parallelism)

    @property
    def degree(self) -> int:
        return self.mesh.size()


def check_expert_parallel(num_experts: int, ep_degree: int) -> None:
    """Raise `PlanError` unless ``ep_degree`` divides ``num_experts``."""
    if ep_degree < 1:
        raise PlanError(f"ep_degree must be >= 1, got {ep_degree}")
    if num_experts % ep_degree:
        raise PlanError(
            f"expert parallelism: ep_degree {ep_degree} does not divide num_experts "
            f"{num_experts}; each ep rank holds num_experts / ep_degree whole experts: pick an "
            f"ep_degree among the divisors of {num_experts}"
        )


def _is_grouped_experts(module: nn.Module) -> bool:
    return (
        hasattr(module, "num_experts")
        and not isinstance(module, ExpertParallelExperts)
        and all(isinstance(getattr(module, name, None), nn.Parameter) for name in _EXPERT_WEIGHTS)
    )


def find_grouped_experts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every routed-experts module (``w_gate``/``w_up``/``w_down``
    parameters and ``num_experts``), in an eager model or in traced units, where the zoo's
    tracer keeps ``GroupedExperts`` a leaf but flattens the ``MoEFeedForward`` around it."""
    return [(path, sub) for path, sub in module.named_modules() if _is_grouped_experts(sub)]


def _grouped_swiglu(
    x: Tensor, counts: list[int], w_gate: Tensor, w_up: Tensor, w_down: Tensor
) -> Tensor:
    """Expert e's SwiGLU down_e(silu(gate_e x) * up_e x) on its block of rows (counts[e] rows)."""
    outputs = []
    for e, x_e in enumerate(torch.split(x, counts, dim=0)):  # x_e (n_e, H)
        hidden = F.silu(x_e @ w_gate[e].t()) * (x_e @ w_up[e].t())  # (n_e, F)
        outputs.append(hidden @ w_down[e].t())  # (n_e, H)
    return torch.cat(outputs, dim=0)  # (N, H)


def _gathered_swiglu(
    x: Tensor,
    counts: list[int],
    weights: tuple[Tensor, Tensor, Tensor],
    group: dist.ProcessGroup,
    etp: int,
) -> Tensor:
    """The etp ranks' rows (each its own ``x`` (M, H), grouped by local expert) through this
    rank's slices of the experts, each rank's rows returned summed over the slices (module
    doc: an uneven all-gather and reduce-scatter over the etp ``group``)."""
    local_e = len(counts)
    mine = torch.tensor(counts, dtype=torch.int64, device=x.device)
    # counts_all[s, l]: etp rank s's rows for local expert l (a functional all-gather)
    counts_all = funcol.wait_tensor(  # type: ignore[no-untyped-call]
        funcol.all_gather_tensor(mine, 0, group)
    ).view(etp, local_e)
    rows = counts_all.sum(1).tolist()  # every etp rank's row count
    # all-gather of uneven blocks: every rank sends its rows to each etp rank
    x_all = all_to_all_single_autograd(x.repeat(etp, 1), rows, [x.size(0)] * etp, group)
    # arrival order is (source s, expert l); the experts want (l, s)
    expert_of_row = torch.repeat_interleave(
        torch.arange(local_e, device=x.device).repeat(etp), counts_all.flatten().to(x.device)
    )  # (sum rows,)
    order = torch.argsort(expert_of_row, stable=True)
    partial = _grouped_swiglu(x_all.index_select(0, order), counts_all.sum(0).tolist(), *weights)
    partial = partial.index_select(0, torch.argsort(order))  # (sum rows, H), arrival order
    # reduce-scatter of uneven blocks: each source's rows back to it, one partial per slice
    back = all_to_all_single_autograd(partial, [x.size(0)] * etp, rows, group)  # (etp M, H)
    return back.view(etp, x.size(0), x.size(1)).sum(0)  # (M, H)


def _weight(experts: nn.Module, name: str) -> Tensor:
    weight = getattr(experts, name)
    assert isinstance(weight, Tensor), f"{name} of {type(experts).__name__} is not a tensor"
    return weight


class ExpertParallelExperts(nn.Module):
    """This rank's experts of one MoE layer, with all-to-all dispatch and combine.

    Same call contract as GroupedExperts: ``forward(x_sorted (N, H), num_tokens_per_expert
    (E,)) -> (N, H)``, rows grouped by global expert id; ``num_experts`` is the global E.
    """

    w_gate: DTensor  # (E / ep, F / etp, H) local, Shard(0) over ep (and Shard(1) over etp)
    w_up: DTensor  # (E / ep, F / etp, H)
    w_down: DTensor  # (E / ep, H, F / etp), Shard(2) over etp

    def __init__(
        self, full: nn.Module, ep_mesh: DeviceMesh | None, etp: ExpertTensorParallel | None = None
    ) -> None:
        """``ep_mesh`` None: ep = 1 (expert tensor parallelism alone, ``etp`` given)."""
        super().__init__()
        assert ep_mesh is not None or etp is not None, "neither expert nor expert-TP parallel"
        ep_degree = 1 if ep_mesh is None else ep_mesh.size()
        ep_rank = 0 if ep_mesh is None else ep_mesh.get_local_rank()
        self.num_experts: int = _weight(full, "w_gate").size(0)
        self.num_local_experts = self.num_experts // ep_degree
        self.ep_degree, self.ep_rank = ep_degree, ep_rank
        self.group = None if ep_mesh is None else ep_mesh.get_group()
        self.etp = etp
        first = ep_rank * self.num_local_experts
        for name in _EXPERT_WEIGHTS:
            weight = _weight(full, name)
            local = weight.detach()[first : first + self.num_local_experts]
            mesh, placements = ep_mesh, [Shard(0)]
            if etp is not None:
                dim, rank = _FFN_DIM[name], etp.mesh.get_local_rank()
                width = local.size(dim) // etp.degree
                local = local.narrow(dim, rank * width, width)
                mesh = etp.weights
                placements = [Shard(0), Shard(dim)] if mesh.ndim == 2 else [Shard(dim)]
            assert mesh is not None
            dtensor = DTensor.from_local(local.clone(), mesh, placements, run_check=False)
            self.register_parameter(name, nn.Parameter(dtensor, requires_grad=weight.requires_grad))

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        if self.ep_degree == 1:  # expert tensor parallelism alone: no dispatch
            return self._local_experts(x, num_tokens_per_expert.to(torch.int64).tolist())
        ep, local_e, group = self.ep_degree, self.num_local_experts, self.group
        assert group is not None
        counts = num_tokens_per_expert.to(torch.int64)
        # counts_out[j, l]: my tokens for expert l of ep rank j; counts_in[i, l]: rank i's tokens
        # for my expert l (one small all-to-all; the splits must be known on the host).
        counts_out = counts.view(ep, local_e)
        # A functional collective (a new tensor, not c10d's in-place op): selective recompute
        # keeps collective outputs (passes/recompute.py), and a re-run in-place exchange left
        # the buffer it fills unfilled (garbage split sizes under recompute "selective").
        counts_in = funcol.wait_tensor(  # type: ignore[no-untyped-call]
            funcol.all_to_all_single(counts_out.flatten(), None, None, group)
        ).view(ep, local_e)
        send_splits = counts_out.sum(1).tolist()
        recv_splits = counts_in.sum(1).tolist()
        # Dispatch: rows for ep rank j are contiguous (rows are sorted by global expert id).
        x_in = all_to_all_single_autograd(x, recv_splits, send_splits, group)  # (M, H)
        # Arrival order is (source rank i, local expert l); the experts want (l, i).
        expert_of_row = torch.repeat_interleave(
            torch.arange(local_e, device=x.device).repeat(ep), counts_in.flatten().to(x.device)
        )  # (M,)
        order = torch.argsort(expert_of_row, stable=True)
        y_local = self._local_experts(
            x_in.index_select(0, order), counts_in.sum(0).tolist()
        )  # (M, H), grouped by local expert
        y_in = y_local.index_select(0, torch.argsort(order))  # (M, H), arrival order
        # Combine: the reverse all-to-all brings every row back to the rank it came from.
        y: Tensor = all_to_all_single_autograd(y_in, send_splits, recv_splits, group)
        return y  # (N, H)

    def _local_experts(self, x: Tensor, counts: list[int]) -> Tensor:
        """This rank's experts on ``x`` (M, H), rows grouped by local expert (``counts[l]``
        rows for expert l); under expert tensor parallelism the module doc's two ways."""
        weights = (self.w_gate.to_local(), self.w_up.to_local(), self.w_down.to_local())
        etp = self.etp
        if etp is None:
            return _grouped_swiglu(x, counts, *weights)
        if not etp.own_tokens:
            # Megatron's f and g around a column- then row-parallel pair: the input's gradient
            # is each slice's partial sum, all-reduced in backward; the output likewise forward
            same = DTensor.from_local(x, etp.mesh, [Replicate()], run_check=False)
            partial = _grouped_swiglu(
                same.to_local(grad_placements=[Partial()]), counts, *weights
            )  # (M, H): this rank's F slice's share of the sum
            reduced = DTensor.from_local(partial, etp.mesh, [Partial()], run_check=False)
            out: Tensor = reduced.redistribute(etp.mesh, [Replicate()]).to_local()
            return out
        return _gathered_swiglu(x, counts, weights, etp.mesh.get_group(), etp.degree)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local experts {self.ep_rank * self.num_local_experts}"
            f"..{(self.ep_rank + 1) * self.num_local_experts - 1} of ep {self.ep_degree}"
            + ("" if self.etp is None else f", each split over etp {self.etp.degree}")
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertParallelResult:
    """What `apply_expert_parallel` changed."""

    ep_degree: int
    ep_rank: int
    expert_modules: tuple[str, ...]  # paths of the routed-experts modules now sharded
    expert_parameters: tuple[str, ...]  # names of the sharded (DTensor) expert weights

    def is_expert_parameter(self, name: str) -> bool:
        return name in self.expert_parameters


def _as_mesh(ep: DeviceMesh | dist.ProcessGroup, device_type: str) -> DeviceMesh:
    if isinstance(ep, DeviceMesh):
        if ep.ndim != 1:
            raise PlanError(f"expert parallelism needs a 1-D ep mesh, got {ep.ndim} dims")
        return ep
    return DeviceMesh.from_group(ep, device_type)


def apply_expert_parallel(
    module: nn.Module,
    ep: DeviceMesh | dist.ProcessGroup | None,
    *,
    etp: ExpertTensorParallel | None = None,
    device_type: str = "cpu",
) -> ExpertParallelResult:
    """Shard every MoE layer's experts of ``module`` over ``ep`` (the 1-D ep sub-mesh or its
    group; None: ep = 1) in place, each split over ``etp`` too when given (module doc). Run it
    before data parallelism wraps the model; afterwards reduce gradients with
    `reduce_gradients` (or give the expert weights to FSDP over the edp mesh, as torchtitan
    does). A no-op on a 1-rank group without ``etp``, but the checks still run."""
    if isinstance(ep, DeviceMesh):
        if ep.ndim != 1:
            raise PlanError(f"expert parallelism needs a 1-D ep mesh, got {ep.ndim} dims")
        ep_degree = ep.size()
    else:
        ep_degree = 1 if ep is None else dist.get_world_size(ep)
    if etp is not None and etp.degree == 1:
        etp = None
    done = [path for path, sub in module.named_modules() if isinstance(sub, ExpertParallelExperts)]
    if done:
        raise PlanError(
            f"expert parallelism is already applied to {type(module).__name__} ({done[0]}); "
            "apply it once, on the unsharded model"
        )
    found = find_grouped_experts(module)
    if not found and ep_degree > 1:
        raise PlanError(
            f"expert parallelism (ep_degree {ep_degree}) on {type(module).__name__}, which has "
            "no routed experts (a module with num_experts and w_gate/w_up/w_down parameters, "
            "as the zoo's GroupedExperts): a MoE plan for a dense model; use ep_degree 1"
        )
    if etp is not None:
        for path, experts in found:
            width = _weight(experts, "w_gate").size(1)
            if width % etp.degree:
                raise PlanError(
                    f"{path}: etp_degree {etp.degree} does not divide the experts' ffn hidden "
                    f"size {width}; each etp rank holds F / etp of every expert's columns: use "
                    "an etp_degree that divides it"
                )
    for path, experts in found:
        num_experts = _weight(experts, "w_gate").size(0)
        if num_experts != experts.num_experts:
            raise PlanError(
                f"{path}: num_experts {experts.num_experts} but w_gate holds {num_experts} experts"
            )
        check_expert_parallel(num_experts, ep_degree)
    if ep_degree == 1 and etp is None:
        return ExpertParallelResult(ep_degree=1, ep_rank=0, expert_modules=(), expert_parameters=())
    mesh = None if ep is None or ep_degree == 1 else _as_mesh(ep, device_type)
    for path, experts in found:
        parent_path, _, attr = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        setattr(parent, attr, ExpertParallelExperts(experts, mesh, etp))
    names = tuple(f"{path}.{name}" for path, _ in found for name in _EXPERT_WEIGHTS)
    logger.debug(
        "expert parallel %d, etp %d: %d expert modules",
        ep_degree,
        1 if etp is None else etp.degree,
        len(found),
    )
    return ExpertParallelResult(
        ep_degree=ep_degree,
        ep_rank=0 if mesh is None else mesh.get_local_rank(),
        expert_modules=tuple(path for path, _ in found),
        expert_parameters=names,
    )


def reduce_gradients(
    module: nn.Module,
    *,
    dp_group: dist.ProcessGroup | None,
    expert_dp_group: dist.ProcessGroup | None,
    dp_world_size: int,
) -> None:
    """Average gradients of per-rank mean losses over the data-parallel world (module docs).

    Dense gradients: all-reduce over ``dp_group`` (every rank holding the same dense weights:
    ep and edp ranks together), divide by ``dp_world_size``. Expert gradients (the
    `ExpertParallelExperts` DTensors): all-reduce over ``expert_dp_group`` (ranks holding the
    same experts; None if there is one), divide by ``dp_world_size`` too.
    """
    expert_ids = {
        id(p)
        for sub in module.modules()
        if isinstance(sub, ExpertParallelExperts)
        for p in sub.parameters()
    }
    params = [p for p in module.parameters() if p.grad is not None]
    for group, wanted in ((dp_group, False), (expert_dp_group, True)):
        grads = [p.grad for p in params if (id(p) in expert_ids) == wanted]
        all_reduce_gradients(grads, group, divisor=dp_world_size)  # type: ignore[arg-type]


@torch.no_grad()
def all_reduce_gradients(
    grads: list[Tensor], group: dist.ProcessGroup | None, *, divisor: float = 1
) -> None:
    """Sum ``grads`` over ``group`` in place (no collective when it is None or has one rank),
    then divide them by ``divisor``: one all-reduce per dtype of the flattened gradients.
    DTensor gradients are reduced through their local shards (every rank of ``group`` holds
    the same shard)."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if group is not None and dist.get_world_size(group) > 1:
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for grad in local:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for same in by_dtype.values():
            flat = torch.cat([grad.reshape(-1) for grad in same])
            dist.all_reduce(flat, group=group)
            offset = 0
            for grad in same:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
    if divisor != 1:
        for grad in local:
            grad.div_(divisor)
