"""Tensor-parallel pass: shard a stage's linears with DTensor ``parallelize_module`` styles.

Expects a `StageModule` from `split_stages` (unit modules keep the model's module paths), the
1-D ``tp`` device mesh, and the TP structure the trace found in each unit
(``UnitProfile.tp.linears``: column, row, vocab_embedding, vocab_head).

Guarantees (Megatron-LM layout, Shoeybi et al. 2019, section 3):

- ``column`` linears (attention q/k/v, MLP up/gate) -> ``ColwiseParallel``; ``row`` linears
  (attention out, MLP down) -> ``RowwiseParallel``: one all-reduce per attention and per MLP;
- ``vocab_embedding`` -> ``RowwiseParallel(input_layouts=Replicate())`` (vocab-parallel
  embedding: rows split, partial lookups all-reduced); ``vocab_head`` ->
  ``ColwiseParallel(output_layouts=Replicate())``: logits gathered, so any ``loss_fn`` works;
- with ``sequence_parallel`` (Korthikanti et al. 2022, section 4.2.2): the residual stream
  between TP regions is split along the sequence (dim 1); norms in blocks and the head get
  ``SequenceParallel`` and hand a replicated DTensor to the column linears (one all-gather per
  norm); row linears reduce-scatter (``output_layouts=Shard(1)``); the embedding unit's output
  is split along the sequence (a local slice);
- mixture-of-experts layers (routed experts in the zoo's interface): without sequence
  parallelism every TP rank routes the same tokens, router and experts computed redundantly
  (their gradients equal on every TP rank), the shared expert tensor-parallel by its rules;
  with it each TP rank routes its own sequence shard (Megatron-LM, expert tensor parallel size
  1): the layer's input norm hands it the local shard, its shared-expert rules are left
  replicated (``replicated_linears``, counted) and `passes.moe_sequence_parallel` lists the
  parameters whose gradients the runtime sums over tp (``moe_layers``);
- graphs from ``torch.export`` (Hugging Face models) work the same way: the split pass has
  restored their ``nn.Linear``/``nn.Embedding`` calls (`passes.module_calls`), and the sizes
  they bake in (head counts in reshapes) are made local first (`passes.local_shapes`); sequence
  parallelism needs norm modules, which such graphs inline (refused);
- every rule matches exactly one module of the right type, counted: a rule that matches nothing
  (or a module that is not an ``nn.Linear``/``nn.Embedding``, e.g. Hugging Face GPT-2's fused
  ``Conv1D``, which would need an interleaved q/k/v column split) raises `PlanError`, never a
  silent no-op;
- parameters that several units of the stage share (a tied embedding and head) stay shared;
- linears converted to fp8 by the tensor-wise recipe (passes/fp8.py) get torchao's
  ``Float8ColwiseParallel``/``Float8RowwiseParallel`` (the same sharding; fp8 casts before the
  redistributions), except where gloo would have to move fp8 tensors (`_float8_collectives_ok`);
  row-wise fp8 linears keep DTensor's styles (torchtitan's choice).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autoplan.contract.errors import PlanError
from passes.fp8 import float8_parallel_styles, is_float8_linear
from passes.local_shapes import localize_shapes
from passes.moe_sequence_parallel import (
    MoESequenceParallelLayer,
    moe_layer_paths,
    sequence_parallel_moe,
)
from passes.split import StageModule, UnitModule

__all__ = ["TensorParallelResult", "apply_tensor_parallel", "is_norm"]

logger = logging.getLogger(__name__)

_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm)


def is_norm(module: nn.Module) -> bool:
    """LayerNorm/RMSNorm, or a model's own norm class (``LlamaRMSNorm``...)."""
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelResult:
    """What the pass sharded on one stage (original module paths)."""

    stage_idx: int
    linears: tuple[str, ...]  # modules given a Colwise/Rowwise style
    sequence_parallel_norms: tuple[str, ...]
    # MoE layers routing this rank's sequence shard (stage-module paths), their rules' linears
    # left replicated over tp (passes/moe_sequence_parallel.py)
    moe_layers: tuple[MoESequenceParallelLayer, ...] = ()
    replicated_linears: tuple[str, ...] = ()

    @property
    def num_matched(self) -> int:
        return len(self.linears)


def _resolve(unit: UnitModule, module: nn.Module, rel_path: str) -> str:
    """The unit module's path for a TP rule, which the trace gives relative to the unit.

    Split modules keep the model's paths, so ``attn.q_proj`` of unit ``blocks.3`` is
    ``blocks.3.attn.q_proj`` (inside a leaf block too: the block keeps its children).
    """
    for path in (f"{unit.profile.name}.{rel_path}", rel_path):
        try:
            module.get_submodule(path)
        except AttributeError:
            continue
        return path
    raise PlanError(
        f"tensor-parallel rule {rel_path!r} of unit {unit.unit_idx} ({unit.profile.name!r}) "
        f"matches none of the modules the unit calls ({', '.join(unit.module_paths) or 'none'}); "
        "the traced TP structure and the graph disagree: re-trace the model, or plan tp_degree 1"
    )


def _style_for(
    style: str, module: nn.Module, path: str, sequence_parallel: bool, *, float8: bool = False
) -> ParallelStyle:
    """The DTensor style of a ``style`` layer; ``float8``: a tensor-wise fp8 linear, which gets
    torchao's float8 styles (they cast its input to fp8 before redistributing it and its output
    gradient in the backward; same sharding, passes/fp8.py)."""
    wanted: type[nn.Module] = nn.Embedding if style == "vocab_embedding" else nn.Linear
    if not isinstance(module, wanted):
        raise PlanError(
            f"{path!r} is a {type(module).__name__}, but tensor parallelism of a {style!r} layer "
            f"needs an nn.{wanted.__name__} (DTensor's ColwiseParallel/RowwiseParallel support "
            "only those; Hugging Face GPT-2's fused Conv1D c_attn is not supported): "
            "use tp_degree 1 for this model"
        )
    colwise, rowwise = float8_parallel_styles() if float8 else (ColwiseParallel, RowwiseParallel)
    if style == "column":
        return colwise()
    if style == "row":
        return rowwise(output_layouts=Shard(1) if sequence_parallel else Replicate())
    if style == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate())
    if style == "vocab_head":
        return colwise(output_layouts=Replicate())
    raise PlanError(f"unknown tensor-parallel style {style!r} for {path!r}")


def _float8_collectives_ok(style: str, sequence_parallel: bool, tp_mesh: DeviceMesh) -> bool:
    """Whether a float8 style of a ``style`` layer can run on ``tp_mesh``'s backend.

    Under sequence parallelism torchao's ``Float8RowwiseParallel`` casts the output gradient
    (sequence-sharded) to fp8 before the all-gather that replicates it, and gloo has no float8
    collectives ("Invalid scalar type", torch 2.13): on gloo such a layer keeps DTensor's
    ``RowwiseParallel``, which gathers that gradient in bf16 and lets the linear cast it with
    the same tensor-wise scale (the amax of the whole tensor either way). The other styles move
    no fp8 tensor: their inputs and gradients are replicated or local before the cast.
    """
    if style != "row" or not sequence_parallel:
        return True
    return dist.get_backend(tp_mesh.get_group()) != "gloo"


def apply_tensor_parallel(
    stage: StageModule,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    shared: tuple[tuple[str, ...], ...] = (),
    float8_tensorwise: bool = False,
) -> TensorParallelResult:
    """Shard ``stage``'s units over ``tp_mesh`` in place (a no-op for a 1-rank mesh);
    ``float8_tensorwise``: the stage's fp8 linears (`passes.fp8`) scale per tensor and get
    torchao's float8 styles."""
    if tp_mesh.size() == 1:
        return TensorParallelResult(
            stage_idx=stage.stage_idx, linears=(), sequence_parallel_norms=()
        )
    sharded: list[str] = []
    replicated: list[str] = []
    norms: list[str] = []
    moe_layers: list[MoESequenceParallelLayer] = []
    expected = 0
    for unit in stage.units:
        module = stage.unit_module(unit)
        if unit.profile.tp.linears and not unit.module_paths:
            raise PlanError(
                f"unit {unit.profile.name!r} calls no nn.Linear or nn.Embedding module, but "
                f"its TP structure lists {[t.path for t in unit.profile.tp.linears]}: its layers "
                "are of another type (Hugging Face GPT-2 fuses q/k/v into one transposed "
                "Conv1D, c_attn, which needs an interleaved column sharding DTensor's "
                "ColwiseParallel does not do); use tp_degree 1 for this model"
            )
        plan: dict[str, ParallelStyle] = {}
        styles: dict[str, str] = {}
        # Under sequence parallelism a MoE layer routes this rank's tokens, its shared expert
        # replicated over tp like its router and experts (passes/moe_sequence_parallel.py).
        moe_paths = moe_layer_paths(module) if sequence_parallel else []
        for linear in unit.profile.tp.linears:
            expected += 1
            path = _resolve(unit, module, linear.path)
            if any(path.startswith(layer + ".") for layer in moe_paths):
                replicated.append(f"{unit.attr}.{path}")
                continue
            styles[path] = linear.style
            target = module.get_submodule(path)
            plan[path] = _style_for(
                linear.style,
                target,
                path,
                sequence_parallel,
                float8=float8_tensorwise
                and is_float8_linear(target)
                and _float8_collectives_ok(linear.style, sequence_parallel, tp_mesh),
            )
        if plan:
            if isinstance(module, fx.GraphModule):
                # An exported graph bakes in global head counts: make them local first.
                localize_shapes(module, styles, tp_mesh.size(), unit_name=unit.profile.name)
            parallelize_module(module, tp_mesh, plan)
            sharded.extend(plan)
        if sequence_parallel:
            local_norms = []
            for layer in moe_paths:
                done = sequence_parallel_moe(module, layer, tp_mesh, is_norm=is_norm)
                moe_layers.append(_in_stage(done, unit.attr))
                local_norms.append(done.input_norm)
                norms.append(done.input_norm)
            norms.extend(_sequence_parallel(unit, module, tp_mesh, skip=local_norms))
    _retie(stage, shared)
    _check(stage, sharded, expected - len(replicated))
    logger.debug(
        "stage %d: TP on %d linears, SP on %d norms, %d MoE layers on sequence shards",
        stage.stage_idx,
        len(sharded),
        len(norms),
        len(moe_layers),
    )
    return TensorParallelResult(
        stage_idx=stage.stage_idx,
        linears=tuple(sharded),
        sequence_parallel_norms=tuple(norms),
        moe_layers=tuple(moe_layers),
        replicated_linears=tuple(replicated),
    )


def _in_stage(layer: MoESequenceParallelLayer, attr: str) -> MoESequenceParallelLayer:
    """``layer`` with stage-module paths (the unit module is the stage's ``attr``)."""
    return MoESequenceParallelLayer(
        path=f"{attr}.{layer.path}",
        input_norm=f"{attr}.{layer.input_norm}",
        replicated_parameters=tuple(f"{attr}.{name}" for name in layer.replicated_parameters),
        expert_parameters=tuple(f"{attr}.{name}" for name in layer.expert_parameters),
        aux_loss_sites=layer.aux_loss_sites,
    )


def _sequence_parallel(
    unit: UnitModule, module: nn.Module, tp_mesh: DeviceMesh, *, skip: list[str]
) -> list[str]:
    """Split the residual stream along the sequence between the TP regions of ``unit``."""
    kind = unit.profile.kind
    if kind == "embedding":
        # The embedding's (replicated) output enters the sequence-parallel region: keep this
        # rank's slice of the sequence; backward all-gathers the gradient.
        parallelize_module(
            module,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
            ),
        )
        return []
    found = [path for path, sub in module.named_modules() if path and is_norm(sub)]
    norms = [path for path in found if path not in skip]
    for path in norms:
        norm = module.get_submodule(path)
        # Normalise this rank's slice of the sequence; then one all-gather hands the full
        # sequence to the column linears as a replicated DTensor (kept a DTensor, so their
        # input gradients arrive as partial sums and are reduce-scattered, not dropped).
        parallelize_module(norm, tp_mesh, SequenceParallel())
        parallelize_module(
            norm,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False
            ),
        )
    if kind == "block" and not found:
        raise PlanError(
            f"sequence_parallel: unit {unit.profile.name!r} calls no norm module "
            f"({', '.join(unit.module_paths)}); sequence parallelism splits the norms' work and "
            "needs them as modules (a graph from torch.export, as of a Hugging Face model, "
            "inlines them): turn sequence_parallel off for this model"
        )
    return norms


def _param_owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, name = fqn.rpartition(".")
    return (root.get_submodule(path) if path else root), name


def _retie(stage: StageModule, shared: tuple[tuple[str, ...], ...]) -> None:
    """``parallelize_module`` gives every module its own DTensor parameter: share them again."""
    for names in shared:
        first_owner, first_name = _param_owner(stage.module, names[0])
        keep = getattr(first_owner, first_name)
        for fqn in names[1:]:
            owner, name = _param_owner(stage.module, fqn)
            other = getattr(owner, name)
            if other is keep:
                continue
            same_layout = (
                isinstance(keep, DTensor) == isinstance(other, DTensor)
                and (not isinstance(keep, DTensor) or keep.placements == other.placements)
                and keep.shape == other.shape
            )
            if not same_layout:
                raise PlanError(
                    f"{names[0]!r} and {fqn!r} share one parameter but tensor parallelism "
                    "shards them differently; untie them in the model or use tp_degree 1"
                )
            setattr(owner, name, keep)


def _check(stage: StageModule, sharded: list[str], expected: int) -> None:
    if len(sharded) != expected or len(set(sharded)) != len(sharded):
        raise PlanError(
            f"stage {stage.stage_idx}: tensor parallelism matched {len(set(sharded))} modules, "
            f"the traced structure lists {expected}; every rule must match exactly one module"
        )
    dtensor_weights = {
        name.removesuffix(".weight")
        for name, p in stage.module.named_parameters(remove_duplicate=False)
        if name.endswith(".weight") and isinstance(p, DTensor)
    }
    unsharded = [p for p in sharded if not any(w.endswith(p) for w in dtensor_weights)]
    assert not unsharded, f"stage {stage.stage_idx}: not sharded: {unsharded}"
