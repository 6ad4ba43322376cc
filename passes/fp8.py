"""fp8 pass: turn a stage's linears into torchao's float8 training linears, as the plan says.

Expects a plan whose ``dtype`` is an fp8 recipe autoplan's runtime runs (`cost_model.precision`:
``fp8`` is torchao's "tensorwise" recipe, ``fp8-rowwise`` its "rowwise" one), its
``fp8_exclude`` and ``fp8_all_gather``, and torchao >= 0.18 (the ``fp8`` extra). In order:

- `select_fp8_linears` (on the model, meta or real, and its trace; before anything is
  allocated): every ``nn.Linear`` of the model is converted except those ``fp8_exclude`` names:
  ``"head"`` is the linears of the traced unit of kind ``head`` (the output projection),
  ``"router"`` the MoE layers' routers (the linears of a traced MoE layer with one output per
  expert), any other entry a module name or a prefix of one (an entry that names no linear is
  refused: a typo would otherwise convert what the user meant to keep). A converted linear
  whose in or out features on a TP rank are not multiples of 16 (``torch._scaled_mm``'s
  alignment, torchao/float8/float8_linear_utils.py ``_auto_filter_for_tensorwise``) is refused
  in one line naming the layer, its shape and the fix (`PlanError`; `Plan.validate` refuses
  it first, from the trace). The selection is the set the cost model prices
  (`cost_model.parts.fp8.is_converted`; tests/test_fp8.py checks they agree);
- `convert_to_fp8` on each stage right after the split, before tensor and data parallelism
  (torchao converts first, then TP, then FSDP2: torchao/float8/fsdp_utils.py, "How Tensor
  Parallel (TP) and FSDP2 work"): each selected linear of the stage becomes a ``Float8Linear``
  (``convert_to_float8_training``), counted; its weight and bias stay the module's own
  parameters (a tie to an embedding survives), and under ``fp8_all_gather`` the weight is
  torchao's ``WeightWithDynamicFloat8CastTensor``, which FSDP2 all-gathers in fp8;
- the tensor-parallel pass gives converted linears of the tensor-wise recipe torchao's
  ``Float8ColwiseParallel``/``Float8RowwiseParallel`` (`float8_parallel_styles`: the input
  is cast to fp8 before its redistribution, the output gradient in the backward); row-wise
  linears keep DTensor's own styles, as torchtitan does (torchtitan/models/llama3/infra/
  parallelize.py: ``enable_float8_tensorwise_tp`` only for the tensor-wise recipe);
- `checkpoint_tensor` hands DCP the plain tensor inside torchao's fp8 all-gather weight;
- `Fp8ScalePrecompute`, under ``fp8_all_gather``, runs torchao's
  ``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step and every load (one
  all-reduce of the weights' amaxes per mesh), as torchao's fsdp_utils docstring prescribes.

The plan's compute dtype is bf16 (`cost_model.precision.compute_dtype`): the data-parallel
pass wraps every stage in FSDP2's mixed-precision policy (bf16 parameters, fp32 gradient
reduction and master weights), so activations are bf16 and only the converted GEMMs run in
fp8 (``torch._scaled_mm``; on a CPU torch computes it in software). Importing torchao is
deferred to the first fp8 plan (about 1.5 s; no other plan needs it); the lines it logs on a
machine without its CUDA kernels are dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autoplan.contract.errors import PlanError
from autoplan.contract.graph import ModelGraph
from autoplan.contract.plan import Plan
from cost_model.precision import FP8_EXCLUDE_ROLES, FP8_GEMM_MULTIPLE, Fp8Recipe, fp8_recipe
from passes.split import StageModule, original_fqn

__all__ = [
    "FP8_EXTRA",
    "Fp8Result",
    "Fp8ScalePrecompute",
    "Fp8Selection",
    "checkpoint_tensor",
    "convert_to_fp8",
    "float8_parallel_styles",
    "is_float8_linear",
    "select_fp8_linears",
    "torchao_float8",
]

logger = logging.getLogger(__name__)

# The pip extra that installs torchao (pyproject.toml); the distribution is torch-autoplan.
FP8_EXTRA = "torch-autoplan[fp8]"

# What importing torchao 0.18 logs on a machine without its CUDA kernels: its compiled
# extensions fail to load (torchao/__init__.py, logger "torchao") and it registers an Enum as a
# pytree constant, which torch 2.13 deprecates (torch/utils/_pytree.py). Neither concerns a run.
_IMPORT_NOISE: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("is an Enum subclass",),
}


# what the pass uses besides the package's own names: Float8Linear, the float8 TP styles, the
# fp8 all-gather weight
_SUBMODULES = ("float8_linear", "float8_tensor_parallel", "fsdp_utils")


class _DropMessages(logging.Filter):
    def __init__(self, parts: tuple[str, ...]) -> None:
        super().__init__()
        self._parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self._parts)


@functools.cache
def torchao_float8() -> ModuleType:
    """``torchao.float8`` (with its linear and tensor-parallel modules loaded), imported once;
    `PlanError` in one line naming the extra when torchao is missing."""
    filters = [
        (logging.getLogger(name), _DropMessages(parts)) for name, parts in _IMPORT_NOISE.items()
    ]
    for log, drop in filters:
        log.addFilter(drop)
    try:
        # deferred: torchao takes about 1.5 s to import and only fp8 plans need it
        float8 = importlib.import_module("torchao.float8")
        for part in _SUBMODULES:
            importlib.import_module(f"torchao.float8.{part}")
    except ImportError as error:
        raise PlanError(
            f"fp8 plans run torchao's float8 training, and torchao cannot be imported "
            f"({error}); install it with: pip install '{FP8_EXTRA}'"
        ) from None
    finally:
        for log, drop in filters:
            log.removeFilter(drop)
    return float8


# ----------------------------------------------------------------------------- selection


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Selection:
    """The linears an fp8 plan converts, by the model's own module names."""

    recipe: Fp8Recipe
    converted: frozenset[str]
    excluded: tuple[str, ...]  # kept in bf16 (sorted)
    all_gather: bool  # FSDP2 gathers the converted weights in fp8

    @property
    def tensorwise(self) -> bool:
        return self.recipe.granularity == "tensorwise"


def select_fp8_linears(model: nn.Module, graph: ModelGraph, plan: Plan) -> Fp8Selection | None:
    """The linears ``plan`` converts (None: the plan's dtype is not an fp8 recipe); `PlanError`
    for an exclusion that names nothing, a shape the fp8 GEMM cannot take, or a tied weight
    that fp8 all-gather would untie. Reads module attributes only: meta models cost nothing."""
    recipe = fp8_recipe(plan.dtype)
    if recipe is None:
        return None
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    excluded: set[str] = set()
    for entry in plan.fp8_exclude:
        matched = _excluded_by(entry, linears, graph)
        if not matched and entry not in FP8_EXCLUDE_ROLES:
            raise PlanError(
                f"fp8_exclude names {entry!r}, which is no linear layer of the model nor a "
                f"prefix of one (it has {_some(sorted(linears))}); use a module name, a prefix "
                f"of one, or a role ({', '.join(FP8_EXCLUDE_ROLES)})"
            )
        excluded |= matched
    converted = frozenset(linears) - excluded
    _check_shapes(
        {name: linears[name] for name in sorted(converted)},
        _tp_styles(graph, linears),
        plan.tp_degree,
        plan.dtype,
    )
    if plan.fp8_all_gather:
        _check_untied(model, converted)
    return Fp8Selection(
        recipe=recipe,
        converted=converted,
        excluded=tuple(sorted(excluded)),
        all_gather=plan.fp8_all_gather,
    )


def _excluded_by(entry: str, linears: dict[str, nn.Linear], graph: ModelGraph) -> set[str]:
    if entry == "head":
        return {
            path
            for unit, paths in zip(graph.profile.units, graph.unit_modules, strict=True)
            if unit.kind == "head"
            for path in paths
            if path in linears
        }
    if entry == "router":
        # a MoE layer's router: its linear with one output per expert (the zoo's `router`,
        # Mixtral's `gate`); its experts are no nn.Linear
        return {
            name
            for layer in graph.moe_layers
            for name, linear in linears.items()
            if name.startswith(layer.path + ".")
            and not name.startswith(layer.experts_path + ".")
            and linear.out_features == layer.num_experts
        }
    return {name for name in linears if name == entry or name.startswith(entry + ".")}


def _some(names: list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "none"


def _tp_styles(graph: ModelGraph, linears: dict[str, nn.Linear]) -> dict[str, str]:
    """Each linear's tensor-parallel style from the trace (module name -> column, row, ...)."""
    styles: dict[str, str] = {}
    for unit in graph.profile.units:
        for linear in unit.tp.linears:
            for path in (f"{unit.name}.{linear.path}", linear.path):
                if path in linears:
                    styles[path] = linear.style
                    break
    return styles


def _local_shape(layer: nn.Linear, style: str | None, tp_degree: int) -> tuple[float, float]:
    """(in, out) features of the GEMM one TP rank runs: a row-parallel linear splits its input
    features, a column-parallel one (or the vocabulary head) its output features."""
    features_in, features_out = float(layer.in_features), float(layer.out_features)
    if style == "row":
        features_in /= tp_degree
    elif style in ("column", "vocab_head"):
        features_out /= tp_degree
    return features_in, features_out


def _check_shapes(
    linears: dict[str, nn.Linear], styles: dict[str, str], tp_degree: int, dtype: str
) -> None:
    """torch._scaled_mm takes operands whose dims are multiples of 16 (on each TP rank): refuse
    the others. `Plan.validate` refuses them first from the trace
    (`cost_model.parts.fp8.fp8_shape_problem`); this is the conversion's own precondition."""
    bad = []
    for name, layer in linears.items():
        local = _local_shape(layer, styles.get(name), tp_degree)
        if all(size % FP8_GEMM_MULTIPLE == 0 for size in local):
            continue
        split = f"; {local[0]:g} x {local[1]:g} on each of {tp_degree} TP ranks"
        bad.append(
            f"{name} (in_features {layer.in_features}, out_features {layer.out_features}"
            f"{split if local != (layer.in_features, layer.out_features) else ''})"
        )
    if bad:
        names = [entry.split(" ", 1)[0] for entry in bad]
        raise PlanError(
            f"dtype {dtype} converts {_some(bad)} to fp8, but torchao's fp8 GEMM "
            f"(torch._scaled_mm) needs in and out features divisible by {FP8_GEMM_MULTIPLE}; "
            f"keep {'it' if len(bad) == 1 else 'them'} in bf16 (add "
            f"{', '.join(repr(n) for n in names[:3])}{' ...' if len(names) > 3 else ''} to "
            "fp8_exclude) or use dtype bf16"
        )


def _check_untied(model: nn.Module, converted: frozenset[str]) -> None:
    """fp8 all-gather replaces a converted weight by torchao's wrapper parameter, which would
    untie a weight another module shares (a head tied to the embedding)."""
    users: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        users.setdefault(id(param), []).append(name)
    for name in sorted(converted):
        weight = model.get_submodule(name).weight
        names = users.get(id(weight), [])
        if len(names) > 1:
            raise PlanError(
                f"fp8_all_gather = true would untie {name}.weight from {_some(names)} (torchao "
                "gathers a converted weight through a parameter of its own); keep "
                f"{name!r} in bf16 (add it to fp8_exclude) or set fp8_all_gather false"
            )


# ----------------------------------------------------------------------------- conversion


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Result:
    """What the pass converted on one stage (stage-module paths)."""

    stage_idx: int
    converted: tuple[str, ...]
    tensorwise: bool  # the tensor-parallel pass gives these torchao's float8 styles


def convert_to_fp8(stage: StageModule, selection: Fp8Selection) -> Fp8Result:
    """Swap ``stage``'s selected linears for torchao ``Float8Linear`` in place; checked: every
    linear of the stage whose model name is selected is converted, and no other."""
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(selection.recipe.torchao_recipe)
    if selection.all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    wanted = [
        path
        for path, module in stage.module.named_modules()
        if isinstance(module, nn.Linear) and original_fqn(path) in selection.converted
    ]
    float8.convert_to_float8_training(
        stage.module,
        config=config,
        module_filter_fn=lambda _, path: original_fqn(path) in selection.converted,
    )
    converted = [path for path, module in stage.module.named_modules() if is_float8_linear(module)]
    assert converted == wanted, f"stage {stage.stage_idx}: converted {converted}, wanted {wanted}"
    logger.debug("stage %d: %d linears to fp8", stage.stage_idx, len(converted))
    return Fp8Result(
        stage_idx=stage.stage_idx, converted=tuple(converted), tensorwise=selection.tensorwise
    )


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (False whenever torchao is not loaded:
    nothing can have been converted then)."""
    return torchao_float8.cache_info().currsize > 0 and isinstance(
        module, torchao_float8().float8_linear.Float8Linear
    )


def checkpoint_tensor(value: Any) -> Any:
    """``value``, or for an fp8-gathered weight (a DTensor over torchao's
    ``WeightWithDynamicFloat8CastTensor``) a DTensor over the tensor it wraps: the same storage,
    so a load into it writes the parameter. DCP writes a tensor's bytes through its storage,
    which a wrapper subclass has none of (torch 2.13 saved uninitialised memory for it)."""
    if not isinstance(value, DTensor) or torchao_float8.cache_info().currsize == 0:
        return value
    local = value._local_tensor
    wrapper = torchao_float8().fsdp_utils.WeightWithDynamicFloat8CastTensor
    if not isinstance(local, wrapper):
        return value
    return DTensor.from_local(
        local._tensor,
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def float8_parallel_styles() -> tuple[type[Any], type[Any]]:
    """torchao's ``Float8ColwiseParallel`` and ``Float8RowwiseParallel`` (tensor-wise only)."""
    styles = torchao_float8().float8_tensor_parallel
    return styles.Float8ColwiseParallel, styles.Float8RowwiseParallel


class Fp8ScalePrecompute:
    """After an optimizer step (and a load): each fp8-gathered weight's scale for the next
    all-gather, from the new weights (torchao's ``precompute_float8_dynamic_scale_for_fsdp``),
    one call per device mesh: torchao stacks the amaxes of one mesh's weights into one
    all-reduce, and a stage may hold weights sharded over dp alone and over dp x tp."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._modules = modules

    def _by_mesh(self) -> Iterator[list[nn.Module]]:
        groups: dict[DeviceMesh, list[nn.Module]] = {}
        for root in self._modules:
            for module in root.modules():
                weight = getattr(module, "weight", None)
                if is_float8_linear(module) and isinstance(weight, DTensor):
                    groups.setdefault(weight.device_mesh, []).append(module)
        yield from groups.values()

    def __call__(self) -> None:
        precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp
        for group in self._by_mesh():
            precompute(nn.ModuleList(group))
