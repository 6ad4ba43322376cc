"""Module-call pass: turn an exported graph's inlined linears and embeddings back into module calls.

Expects an ``fx.GraphModule`` from ``torch.export`` (``ExportedProgram.module()``): parameters
are ``get_attr`` nodes of the model's own ``Parameter`` objects, every op carries
``meta["nn_module_stack"]`` (the module path and class of each enclosing module), and the
model's ``nn.Linear``/``nn.Embedding`` layers appear inlined as ``aten.linear`` /
``aten.embedding`` calls on those parameters.

Guarantees, checked before returning:

- each ``aten.linear(x, weight[, bias])`` whose innermost module is an ``nn.Linear`` at
  ``<path>``, with ``weight`` and ``bias`` read by ``get_attr``, becomes ``call_module
  <path>(x)``; each ``aten.embedding(weight, indices, padding_idx)`` inside an ``nn.Embedding``
  becomes ``call_module <path>(indices)``. The node keeps its name and metadata (the trace's
  unit labels and profiles refer to names);
- ``<path>`` in the graph module is an ``nn.Linear``/``nn.Embedding`` holding the very same
  ``Parameter`` objects (so a weight tied between an embedding and a head stays one parameter,
  and the split pass unties it across stages as before); any other tensors the old container
  at ``<path>`` held stay attributes of the new module;
- the numbers are unchanged: ``nn.Linear.forward`` and ``nn.Embedding.forward`` call the same
  ATen ops with the same arguments;
- every restored path is called exactly once (a module the graph calls twice would be sharded
  and hooked once per call site: refused with `PlanError`), and ``graph.lint()`` passes.

Tensor parallelism (DTensor ``parallelize_module``), FSDP2 and checkpointing then see the
model's own module paths, as on an fx trace.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx, nn

from autoplan.contract.errors import PlanError

__all__ = ["ModuleCallsResult", "restore_module_calls"]

logger = logging.getLogger(__name__)

_LINEAR = f"{nn.Linear.__module__}.{nn.Linear.__qualname__}"
_EMBEDDING = f"{nn.Embedding.__module__}.{nn.Embedding.__qualname__}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleCallsResult:
    """The module paths whose inlined calls became ``call_module`` nodes, in graph order."""

    linears: tuple[str, ...]
    embeddings: tuple[str, ...]


def restore_module_calls(gm: fx.GraphModule) -> ModuleCallsResult:
    """Rewrite ``gm`` in place (see the module docstring); returns what was restored."""
    linears: list[str] = []
    embeddings: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.linear.default:
            path = _innermost(node, _LINEAR)
            if path is not None and _restore_linear(gm, node, path):
                linears.append(path)
        elif node.target is torch.ops.aten.embedding.default:
            path = _innermost(node, _EMBEDDING)
            if path is not None and _restore_embedding(gm, node, path):
                embeddings.append(path)
    restored = linears + embeddings
    twice = sorted({p for p in restored if restored.count(p) > 1})
    if twice:
        raise PlanError(
            f"the exported graph calls {', '.join(twice)} more than once; a module called from "
            "several places cannot be given one sharding or one set of hooks: call each layer "
            "once per forward, or plan tp_degree 1"
        )
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    logger.debug("restored %d nn.Linear and %d nn.Embedding calls", len(linears), len(embeddings))
    return ModuleCallsResult(linears=tuple(linears), embeddings=tuple(embeddings))


def _innermost(node: fx.Node, class_name: str) -> str | None:
    """The path of the node's innermost enclosing module if that module is a ``class_name``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, module_type = list(stack.values())[-1]
    type_name = module_type if isinstance(module_type, str) else _qualname(module_type)
    return str(path) if path and type_name == class_name else None


def _qualname(cls: object) -> str:
    return f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}"


def _parameter(gm: fx.GraphModule, arg: object) -> nn.Parameter | None:
    """The parameter a ``get_attr`` node reads; None for any other argument."""
    if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
        return None
    try:
        return gm.get_parameter(str(arg.target))
    except AttributeError:
        return None  # a buffer or a constant


def _install(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    """Put ``module`` at ``path``, keeping the tensors the old container there held."""
    try:
        old = gm.get_submodule(path)
    except AttributeError:
        old = None
    if old is not None:
        if isinstance(old, (nn.Linear, nn.Embedding)):
            raise PlanError(f"{path!r} is already a module call in the exported graph")
        for name, child in old.named_children():
            module.add_module(name, child)
        for name, param in old.named_parameters(recurse=False):
            if name not in dict(module.named_parameters(recurse=False)):
                module.register_parameter(name, param)
        for name, buffer in old.named_buffers(recurse=False):
            module.register_buffer(name, buffer)
    gm.set_submodule(path, module)


def _restore_linear(gm: fx.GraphModule, node: fx.Node, path: str) -> bool:
    x, weight_node, *rest = node.args
    bias_node = rest[0] if rest else node.kwargs.get("bias")
    weight = _parameter(gm, weight_node)
    bias = _parameter(gm, bias_node) if bias_node is not None else None
    if weight is None or (bias_node is not None and bias is None) or weight.dim() != 2:
        logger.debug("linear %s in %s reads computed weights: left inlined", node.name, path)
        return False
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = weight
    if bias is not None:
        linear.bias = bias
    _install(gm, path, linear)
    node.op, node.target, node.args, node.kwargs = "call_module", path, (x,), {}
    return True


def _restore_embedding(gm: fx.GraphModule, node: fx.Node, path: str) -> bool:
    weight_node, indices, *rest = node.args
    padding_idx, scale_grad_by_freq, sparse = (list(rest) + [-1, False, False][len(rest) :])[:3]
    weight = _parameter(gm, weight_node)
    if weight is None or weight.dim() != 2 or node.kwargs:
        logger.debug("embedding %s in %s reads computed weights: left inlined", node.name, path)
        return False
    num_embeddings, embedding_dim = weight.shape
    assert isinstance(padding_idx, int)
    embedding = nn.Embedding(
        num_embeddings,
        embedding_dim,
        # aten.embedding takes -1 for "none"; nn.Embedding stores None, or a non-negative index.
        padding_idx=None if padding_idx == -1 else padding_idx,
        scale_grad_by_freq=bool(scale_grad_by_freq),
        sparse=bool(sparse),
        device="meta",
    )
    embedding.weight = weight
    _install(gm, path, embedding)
    node.op, node.target, node.args, node.kwargs = "call_module", path, (indices,), {}
    return True
