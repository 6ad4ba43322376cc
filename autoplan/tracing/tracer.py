"""Front ends: an ``nn.Module`` to an fx graph, with `torch.fx` first and `torch.export` second.

Expects a model and example inputs (on the model's device; meta for a meta model). Guarantees a
`TracedModel` whose graph carries module ownership on every compute node (``call_module``
targets, ``nn_module_stack``), or a `TraceError` naming the module and source line where
tracing failed and what to try.

torch.fx: repeated blocks are traced once per distinct structure and inlined for the others
(`symbolic_trace` of a 126-block model otherwise spends most of its time re-tracing identical
blocks). The result has the same nodes and ``nn_module_stack`` as a plain trace, apart from
node names of inlined copies and one shared ``get_attr`` per buffer passed to the blocks. Any
block the fast path cannot handle (non-tensor arguments, defaults left unset) falls back to a
plain `symbolic_trace` of the whole model.

torch.export (``strict=False``) takes over when fx cannot trace (Hugging Face transformers 5.x
models, shape-dependent Python control flow); ``use_cache=False`` is passed when ``forward``
accepts it (a training trace needs no KV cache).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import os
import traceback
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from autoplan.contract.errors import TraceError
from autoplan.contract.graph import FrontEnd, keep_non_persistent_buffers
from autoplan.tracing.units import module_structure

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["TEMPLATE_META", "LeafSpec", "TracedModel", "trace_model"]

logger = logging.getLogger(__name__)

LeafSpec = str | type[nn.Module]
# node.meta key: index of the traced block graph an inlined node was copied from. Two units made
# only of copies of one template, fed inputs of equal shapes, measure the same.
TEMPLATE_META = "autoplan_template"
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True, slots=True)
class TracedModel:
    """A traced graph and how to feed it: user inputs and lifted model state by placeholder."""

    graph_module: fx.GraphModule
    front_end: FrontEnd
    input_values: dict[str, Any]  # user-input placeholder name -> value
    fqn_of_placeholder: dict[str, str]  # export: lifted parameter/buffer placeholder -> FQN
    state_placeholders: frozenset[str]  # export: placeholders holding model state or constants
    exported_program: ExportedProgram | None = None


class _Tracer(fx.Tracer):
    """fx Tracer with extra leaf modules that remembers the module it failed in."""

    def __init__(self, leaf_paths: frozenset[str], leaf_types: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        self.leaf_paths = leaf_paths
        self.leaf_types = leaf_types
        self.module_stack_paths: list[tuple[str, str]] = []
        self.failed_in: tuple[str, str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths or isinstance(m, self.leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(
        self,
        m: nn.Module,
        forward: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        try:
            path = self.path_of_module(m)
        except NameError:
            path = "?"
        self.module_stack_paths.append((path, type(m).__qualname__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.module_stack_paths[-1]
            raise
        finally:
            self.module_stack_paths.pop()


def _split_leaves(
    leaf_modules: Sequence[LeafSpec],
) -> tuple[frozenset[str], tuple[type[nn.Module], ...]]:
    paths = frozenset(x for x in leaf_modules if isinstance(x, str))
    types = tuple(x for x in leaf_modules if not isinstance(x, str))
    return paths, types


def _bind_inputs(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values of the given forward arguments, defaults of the others) by parameter name."""
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TraceError(
            f"example inputs do not match {type(model).__name__}.forward{signature}: {error}; "
            "pass example_inputs as a tuple of positional arguments or a dict of keyword ones"
        ) from None
    defaults = {
        name: p.default
        for name, p in signature.parameters.items()
        if name not in bound.arguments
        and p.default is not inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    return dict(bound.arguments), defaults


# --------------------------------------------------------------------------------------------
# torch.fx
# --------------------------------------------------------------------------------------------


def _graph_module(root: nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """A GraphModule that generates its Python code on first use: for a 7000-node graph the
    code generation alone takes about 0.5 s, and tracing never needs it. Its buffers are as
    persistent as the model's (fx registers every copied buffer as persistent): derived tables
    such as RoPE's stay out of state dicts and checkpoints, as ``torch.export`` keeps them."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - older torch
        gm = fx.GraphModule(root, graph, class_name)
    else:
        gm = _LazyGraphModule(root, graph, class_name)
    keep_non_persistent_buffers(root, gm)
    return gm


class _FxFailure(Exception):
    """torch.fx could not trace the model: where (module, source line) and why."""

    def __init__(self, where: str, error: BaseException) -> None:
        super().__init__(f"{where}: {error}")
        self.where = where
        self.error = error


class _FastPathUnsupported(Exception):
    """This model needs a plain trace (a block called with non-tensor arguments, ...)."""


def _trace_fx(
    model: nn.Module,
    defaults: dict[str, Any],
    *,
    blocks: Sequence[str],
    leaf_modules: Sequence[LeafSpec],
) -> fx.GraphModule:
    leaf_paths, leaf_types = _split_leaves(leaf_modules)
    concrete = defaults or None
    if blocks:
        try:
            return _trace_fx_fast(model, concrete, blocks, leaf_paths, leaf_types)
        except Exception as error:  # any surprise: the plain trace is the reference
            logger.debug("fast fx trace of repeated blocks not used: %s", error)
    tracer = _Tracer(leaf_paths, leaf_types)
    try:
        graph = tracer.trace(model, concrete_args=concrete)
    except Exception as error:
        raise _FxFailure(_fx_diagnosis(model, tracer, error), error) from error
    return _graph_module(tracer.root, graph, type(model).__name__)


def _trace_fx_fast(
    model: nn.Module,
    concrete: dict[str, Any] | None,
    blocks: Sequence[str],
    leaf_paths: frozenset[str],
    leaf_types: tuple[type[nn.Module], ...],
) -> fx.GraphModule:
    block_set = frozenset(blocks)
    top = _Tracer(leaf_paths | block_set, leaf_types).trace(model, concrete_args=concrete)
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    templates: dict[Hashable, _Template] = {}
    signatures: dict[Callable[..., Any], inspect.Signature] = {}
    for node in top.nodes:
        if (
            node.op == "call_module"
            and node.target in block_set
            and node.target not in leaf_paths
            and not isinstance(model.get_submodule(str(node.target)), leaf_types)
        ):
            assert isinstance(node.target, str)
            env[node] = _inline_block(
                graph,
                node,
                model.get_submodule(node.target),
                env,
                templates,
                signatures,
                leaf_paths,
                leaf_types,
            )
        elif (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
            and isinstance(env.get(node.args[0]), (tuple, list, dict))
        ):
            env[node] = env[node.args[0]][node.args[1]]
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return _graph_module(model, graph, type(model).__name__)


@dataclass(frozen=True, slots=True)
class _Template:
    """A block's traced graph, and its place among a trace's templates (`TEMPLATE_META`)."""

    index: int
    graph: fx.Graph


def _forward_signature(
    block: nn.Module, signatures: dict[Callable[..., Any], inspect.Signature]
) -> inspect.Signature:
    """``inspect.signature(block.forward)``, computed once per ``forward`` function."""
    forward = block.forward
    function = getattr(forward, "__func__", None)
    if function is None or getattr(forward, "__self__", None) is not block:
        return inspect.signature(forward)
    if function not in signatures:
        signatures[function] = inspect.signature(forward)
    return signatures[function]


def _inline_block(
    graph: fx.Graph,
    call: fx.Node,
    block: nn.Module,
    env: dict[fx.Node, Any],
    templates: dict[Hashable, _Template],
    signatures: dict[Callable[..., Any], inspect.Signature],
    leaf_paths: frozenset[str],
    leaf_types: tuple[type[nn.Module], ...],
) -> Any:
    path = str(call.target)
    signature = _forward_signature(block, signatures)
    bound = signature.bind(*call.args, **call.kwargs)
    if len(bound.arguments) != len(signature.parameters) or not all(
        isinstance(value, fx.Node) for value in bound.arguments.values()
    ):
        raise _FastPathUnsupported(f"block {path!r} is called with non-tensor or default args")
    inner_leaves = frozenset(p[len(path) + 1 :] for p in leaf_paths if p.startswith(path + "."))
    key = (module_structure(block, with_attributes=True), tuple(bound.arguments), inner_leaves)
    template = templates.get(key)
    if template is None:
        template = _Template(len(templates), _Tracer(inner_leaves, leaf_types).trace(block))
        templates[key] = template
    base_stack = dict(call.meta.get("nn_module_stack", {}))
    local: dict[fx.Node, Any] = {}
    for node in template.graph.nodes:
        if node.op == "placeholder":
            local[node] = env[bound.arguments[str(node.target)]]
            continue
        if node.op == "output":
            return fx.node.map_arg(node.args[0], local.__getitem__)
        target = node.target
        name = node.name
        if node.op in ("call_module", "get_attr"):
            target = f"{path}.{node.target}"
            name = target.replace(".", "_")
        # Arguments are set on the new node, not passed to create_node: it would walk them for
        # symbolic ints (the template's nodes passed that check when fx traced the block), which
        # costs more than the rest of the copy.
        new = graph.create_node(node.op, target, name=name, type_expr=node.type)
        if node.args:
            new.args = fx.node.map_arg(node.args, local.__getitem__)
        if node.kwargs:
            new.kwargs = fx.node.map_arg(node.kwargs, local.__getitem__)
        stack = dict(base_stack)
        for inner, (inner_path, inner_type) in node.meta.get("nn_module_stack", {}).items():
            stack[f"{path}.{inner}"] = (f"{path}.{inner_path}", inner_type)
        # In place: a new node's meta is empty, and assigning it re-indexes the node in its graph.
        new.meta.update(node.meta)
        new.meta["nn_module_stack"] = stack
        new.meta[TEMPLATE_META] = template.index
        local[node] = new
    raise _FastPathUnsupported(f"block {path!r} graph has no output")


def _user_frame(error: BaseException) -> str | None:
    """``file:line `code``` of the innermost frame outside torch and autoplan.tracing."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith((_TORCH_DIR, _THIS_DIR))
    ]
    if not frames:
        return None
    frame = frames[-1]
    code = f" `{frame.line.strip()}`" if frame.line else ""
    return f"{os.path.basename(frame.filename)}:{frame.lineno}{code}"


def _fx_diagnosis(model: nn.Module, tracer: _Tracer, error: BaseException) -> str:
    path, kind = tracer.failed_in or ("", type(model).__qualname__)
    where = f"module {path!r} ({kind})" if path else f"the root module ({kind})"
    frame = _user_frame(error)
    at = f" at {frame}" if frame else ""
    return f"in {where}{at}"


def _first_line(error: BaseException, limit: int = 240) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# torch.export
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Hold back torch's warnings and prints while export is tried: a failure that we report
    ourselves would otherwise dump the partial graph on stderr."""
    import torch._dynamo  # noqa: F401  (its first import resets torch's log levels)

    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    try:
        # export prints the partial graph of a failed trace on sys.stderr.
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        torch_logger.setLevel(level)


def _trace_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TracedModel:
    kwargs = dict(kwargs)
    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    with _quiet_torch_logs():
        program = torch.export.export(model, args, kwargs, strict=False)
    signature = program.graph_signature
    fqns: dict[str, str] = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    state = frozenset(fqns) | frozenset(signature.inputs_to_lifted_tensor_constants)
    gm = program.graph_module
    inputs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name not in state:
            inputs[node.name] = node.meta.get("val")
    return TracedModel(
        graph_module=gm,
        front_end="export",
        input_values=inputs,
        fqn_of_placeholder=fqns,
        state_placeholders=state,
        exported_program=program,
    )


def trace_model(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    blocks: Sequence[str] = (),
    leaf_modules: Sequence[LeafSpec] = (),
) -> TracedModel:
    """Trace ``model`` called as ``model(*args, **kwargs)``: fx first, export if fx fails."""
    given, defaults = _bind_inputs(model, args, dict(kwargs))
    try:
        gm = _trace_fx(model, defaults, blocks=blocks, leaf_modules=leaf_modules)
    except _FxFailure as fx_failure:
        fx_error = fx_failure.error
        logger.info(
            "torch.fx cannot trace %s (%s); trying torch.export",
            type(model).__name__,
            _first_line(fx_error),
        )
        try:
            return _trace_export(model, args, dict(kwargs))
        except Exception as export_error:
            raise TraceError(
                f"cannot trace {type(model).__name__}: torch.fx failed {fx_failure.where} "
                f"({_first_line(fx_error)}), and torch.export failed too "
                f"({_first_line(export_error)}). Try: mark that module a leaf "
                "(autoplan.trace(model, leaf_modules=[...]); it then runs as one op on meta "
                "tensors), pass example_inputs that match forward(), or make shapes and control "
                "flow static (no Python `if` on tensor values: use torch.where or torch.cond)"
            ) from export_error
    inputs = {name: value for name, value in given.items()}
    for name, value in defaults.items():
        inputs.setdefault(name, value)
    return TracedModel(
        graph_module=gm,
        front_end="fx",
        input_values=inputs,
        fqn_of_placeholder={},
        state_placeholders=frozenset(),
    )
