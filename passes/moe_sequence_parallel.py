"""Mixture-of-experts layers under tensor parallelism with sequence parallelism.

Expects a traced unit (an ``fx.GraphModule`` from `split_stages`) holding MoE layers in the
zoo's interface (autoplan/models/moe.py, found by their routed experts: `find_grouped_experts`),
the 1-D ``tp`` mesh, and a residual stream split along the sequence (dim 1) between the TP
regions, as the tensor-parallel pass makes it under ``sequence_parallel``. The MoE layer's
input is one norm module's output; its load-balancing loss, when the model has one, is a
product of the per-expert token fractions (from the counts the experts receive) and the mean
router probability over the layer's tokens, attached to the output by ``attach_aux_loss``.

Guarantees (Megatron-LM with expert tensor parallel size 1: each TP rank routes its own
sequence shard; `cost_model.parts.expert_parallel.rank_assignments` prices exactly that):

- the MoE layer's input norm keeps ``SequenceParallel`` but hands the layer this rank's
  sequence shard as a plain tensor (``use_local_output=True``) instead of all-gathering it: the
  router, the routed experts and the shared expert run on ``B x T / tp`` tokens, and their
  output joins the (local) residual stream with no collective;
- the layer's parameters (router, shared expert, routed experts) are therefore replicated over
  tp, not tensor-parallel (the tensor-parallel pass leaves the shared expert's column/row rules
  to this pass and counts them), and each TP rank's gradient holds its own tokens' share:
  `ReplicatedGradientSum` (run after every backward) sums them over the tp group, after which
  the data-parallel average applies as usual; expert weights that a folded ep group already
  reduces over the tp ranks (``ep_folding``) are left to that reduction;
- the load-balancing loss is the single-process one, exactly: the per-expert counts it reads
  are summed over tp (a functional all-reduce inserted before its use; the experts still get
  this rank's counts), and the attached loss is divided by tp, so that the tp ranks' losses
  add up to coef * E * sum_e f_e * P_e over all the layer's tokens (P_e is a mean over equal
  shards: the mean of the shards' means), and so do their router gradients;
- a layer whose input is not one norm's output, or whose norm feeds other modules, raises
  `PlanError` (nothing is changed silently).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from autoplan.contract.errors import PlanError
from passes.expert_parallel import all_reduce_gradients, find_grouped_experts

__all__ = [
    "MoESequenceParallelLayer",
    "ReplicatedGradientSum",
    "SumOverGroup",
    "moe_layer_paths",
    "sequence_parallel_moe",
]

logger = logging.getLogger(__name__)

_AUX_LOSS_FN = "attach_aux_loss"  # the zoo's autograd hook for the load-balancing loss


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESequenceParallelLayer:
    """One MoE layer made sequence-parallel (paths relative to the unit module)."""

    path: str  # the MoE layer, e.g. "blocks.1.mlp"
    input_norm: str  # its input norm, e.g. "blocks.1.mlp_norm"
    replicated_parameters: tuple[str, ...]  # router and shared expert
    expert_parameters: tuple[str, ...]  # the routed experts' weights
    aux_loss_sites: int  # load-balancing losses rewritten (0 without one)


def moe_layer_paths(module: nn.Module) -> list[str]:
    """Paths of the MoE layers of ``module``: the owners of its routed-experts modules."""
    return [path.rpartition(".")[0] for path, _ in find_grouped_experts(module)]


class SumOverGroup(nn.Module):
    """``x`` summed over a process group: a functional all-reduce (a new tensor; selective
    recompute keeps collective outputs, passes/recompute.py). For values without gradient,
    such as token counts."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        summed: torch.Tensor = funcol.wait_tensor(  # type: ignore[no-untyped-call]
            funcol.all_reduce(x, "sum", self.group)
        )
        return summed


def _call_nodes(graph: fx.Graph, prefix: str) -> list[fx.Node]:
    return [
        node
        for node in graph.nodes
        if node.op == "call_module" and str(node.target).startswith(prefix + ".")
    ]


def _input_norms(
    module: fx.GraphModule, layer: str, is_norm: Callable[[nn.Module], bool]
) -> set[str]:
    """The norm modules the layer's calls read from, walking back through everything but norms."""
    found: set[str] = set()
    seen: set[fx.Node] = set()
    todo = deque(_call_nodes(module.graph, layer))
    inside = set(todo)
    while todo:
        node = todo.popleft()
        for source in node.all_input_nodes:
            if source in seen or source in inside:
                continue
            seen.add(source)
            if source.op == "call_module" and is_norm(module.get_submodule(str(source.target))):
                found.add(str(source.target))
                continue
            if source.op == "placeholder":
                raise PlanError(
                    f"sequence_parallel: MoE layer {layer!r} reads the unit's input "
                    f"{source.name!r} without a norm in between; sequence parallelism hands a MoE "
                    "layer its norm's sequence shard: turn sequence_parallel off for this model"
                )
            todo.append(source)
    return found


def _ancestors(node: fx.Node) -> set[fx.Node]:
    out: set[fx.Node] = set()
    todo = [node]
    while todo:
        for source in todo.pop().all_input_nodes:
            if source not in out:
                out.add(source)
                todo.append(source)
    return out


def _rewrite_aux_loss(module: fx.GraphModule, layer: str, experts: str, tp_mesh: DeviceMesh) -> int:
    """Make the layer's load-balancing loss the one over all the tp ranks' tokens (module doc);
    returns how many losses were rewritten."""
    graph = module.graph
    experts_node = next(
        node for node in graph.nodes if node.op == "call_module" and node.target == experts
    )
    counts = experts_node.args[1]
    assert isinstance(counts, fx.Node), f"{experts}: num_tokens_per_expert is not a graph value"
    sites = [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and getattr(node.target, "__name__", "") == _AUX_LOSS_FN
        and counts in _ancestors(node.args[1])
    ]
    readers = [user for user in counts.users if user is not experts_node]
    if not sites:
        return 0
    if not readers:
        raise PlanError(
            f"sequence_parallel: the load-balancing loss of MoE layer {layer!r} does not read "
            "the per-expert counts the experts get; it cannot be made the loss over all TP "
            "ranks' tokens: turn sequence_parallel off, or set the aux-loss coefficient to 0"
        )
    name = f"{layer}.tp_token_counts"
    module.add_submodule(name, SumOverGroup(tp_mesh.get_group()))
    with graph.inserting_after(counts):
        summed = graph.call_module(name, (counts,))
    for reader in readers:
        reader.replace_input_with(counts, summed)
    degree = tp_mesh.size()
    for site in sites:
        aux = site.args[1]
        assert isinstance(aux, fx.Node)
        with graph.inserting_before(site):
            share = graph.call_function(torch.div, (aux, float(degree)))
        site.replace_input_with(aux, share)
    return len(sites)


def sequence_parallel_moe(
    module: nn.Module,
    layer: str,
    tp_mesh: DeviceMesh,
    *,
    is_norm: Callable[[nn.Module], bool],
) -> MoESequenceParallelLayer:
    """Make MoE layer ``layer`` of the traced unit ``module`` route this TP rank's sequence
    shard (module doc). Call it before the other norms get their sequence-parallel styles; the
    returned ``input_norm`` is styled here."""
    if not isinstance(module, fx.GraphModule):
        raise PlanError(
            f"sequence_parallel: MoE layer {layer!r} is inside an untraced module "
            f"{type(module).__name__}; the pass rewrites the traced graph: trace the model"
        )
    norms = _input_norms(module, layer, is_norm)
    if len(norms) != 1:
        raise PlanError(
            f"sequence_parallel: MoE layer {layer!r} reads {len(norms)} norm outputs "
            f"({', '.join(sorted(norms)) or 'none'}), not one; sequence parallelism hands a "
            "MoE layer its input norm's sequence shard: turn sequence_parallel off"
        )
    norm = norms.pop()
    norm_node = next(
        node for node in module.graph.nodes if node.op == "call_module" and node.target == norm
    )
    outside = [
        str(user.target)
        for user in norm_node.users
        if user.op == "call_module" and not str(user.target).startswith(layer + ".")
    ]
    if outside:
        raise PlanError(
            f"sequence_parallel: norm {norm!r} feeds MoE layer {layer!r} and also "
            f"{', '.join(outside)}, which need the whole sequence; turn sequence_parallel off"
        )
    experts = next(path for path, _ in find_grouped_experts(module.get_submodule(layer)))
    experts_path = f"{layer}.{experts}"
    sites = _rewrite_aux_loss(module, layer, experts_path, tp_mesh)
    module.graph.lint()
    module.recompile()
    # This rank's sequence shard, normalised, as a plain (B, T / tp, H) tensor; the weight stays
    # a replicated DTensor whose gradient DTensor reduces over tp.
    parallelize_module(module.get_submodule(norm), tp_mesh, SequenceParallel(use_local_output=True))
    owner = module.get_submodule(layer)
    expert_names = tuple(
        f"{experts_path}.{name}" for name, _ in owner.get_submodule(experts).named_parameters()
    )
    replicated = tuple(
        f"{layer}.{name}"
        for name, _ in owner.named_parameters()
        if f"{layer}.{name}" not in expert_names
    )
    logger.debug(
        "MoE layer %s: routes this TP rank's tokens (norm %s, %d aux losses)", layer, norm, sites
    )
    return MoESequenceParallelLayer(
        path=layer,
        input_norm=norm,
        replicated_parameters=replicated,
        expert_parameters=expert_names,
        aux_loss_sites=sites,
    )


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ReplicatedGradientSum:
    """Sum over ``group`` the gradients of parameters replicated over it whose ranks saw
    different tokens (the MoE layers under sequence parallelism), after every backward.

    ``names`` are looked up in ``module`` at each call: the data-parallel wrapper replaces the
    parameter objects after this is built. Works on plain and DTensor gradients alike (a
    DTensor's local shard: every rank of ``group`` holds the same shard of it). One
    all-reduce of the flattened gradients.
    """

    module: nn.Module
    names: tuple[str, ...]
    group: dist.ProcessGroup

    def __call__(self) -> None:
        grads = [self.module.get_parameter(name).grad for name in self.names]
        all_reduce_gradients([g for g in grads if g is not None], self.group)
