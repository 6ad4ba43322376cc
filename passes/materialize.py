"""Materialise pass: give a model built on the meta device real, initialised shards.

Expects this rank's stage modules after the tensor-parallel and data-parallel passes (so every
parameter already has its final, sharded layout, still on meta) and the values of the model's
buffers (`meta_buffer_values`, computed before the passes), or stage modules whose tensors are
all real (then the pass only checks).

Guarantees:

- ``to_empty`` allocates only this rank's shards; parameters are then initialised one at a time
  from a seed, so no rank ever holds the whole model (transiently: one full parameter);
- the initial weights do not depend on the plan: parameter ``name`` is drawn from a generator
  seeded with ``(seed, name)``, and each rank keeps its own slice of it (``distribute_tensor``
  without communication). Replicas agree, tensor-parallel shards are slices of one tensor, and
  `init_full_model_` gives a single-process model the very same values;
- the rule is GPT-2's (Radford et al. 2019), which the zoo's GPT and Llama use: N(0, 0.02) for
  embeddings and linear weights, N(0, 0.02 / sqrt(2 * num_blocks)) for the projections that
  write into the residual stream (the row-parallel linears of the blocks), zero biases, norm
  weights one and biases zero; other parameters: N(0, 0.02) if 2-D or more, else zero;
- copies of a tied parameter get identical values, and parameters shared inside a stage stay
  shared;
- afterwards no parameter or buffer of the stages is on meta (checked).
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autoplan.contract.errors import PlanError
from passes.split import SplitModel, StageModule, original_fqn
from passes.tensor_parallel import is_norm

__all__ = [
    "INIT_STD",
    "InitRule",
    "has_meta_tensors",
    "init_full_model_",
    "init_rule",
    "materialize",
    "meta_buffer_values",
    "norm_parameter_names",
]

INIT_STD = 0.02  # GPT-2, nanoGPT, Megatron-LM


@dataclass(frozen=True, kw_only=True, slots=True)
class InitRule:
    """How to fill one parameter: a normal distribution, or a constant."""

    kind: Literal["normal", "zeros", "ones"]
    std: float = 0.0


def init_rule(
    name: str,
    module: nn.Module,
    param_name: str,
    *,
    residual: bool,
    num_blocks: int,
    norm: bool | None = None,
) -> InitRule:
    """GPT-2's initialisation of parameter ``param_name`` of ``module`` (named ``name``);
    ``norm``: whether it belongs to a norm, if known from the original model (an exported
    graph keeps the parameters but not the norm modules that own them)."""
    if is_norm(module) if norm is None else norm:
        return InitRule(kind="ones" if param_name == "weight" else "zeros")
    if param_name == "bias":
        return InitRule(kind="zeros")
    if isinstance(module, nn.Embedding | nn.Linear) or len(_shape_of(module, param_name)) >= 2:
        std = INIT_STD / math.sqrt(2 * num_blocks) if residual else INIT_STD
        return InitRule(kind="normal", std=std)
    return InitRule(kind="zeros")


def norm_parameter_names(model: nn.Module) -> frozenset[str]:
    """Names of the parameters of ``model``'s norm modules (every name of a shared one)."""
    return frozenset(
        f"{path}.{pname}" if path else pname
        for path, module in model.named_modules(remove_duplicate=False)
        if is_norm(module)
        for pname, _ in module.named_parameters(recurse=False)
    )


def _shape_of(module: nn.Module, param_name: str) -> torch.Size:
    return getattr(module, param_name).shape  # type: ignore[no-any-return]


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _full_value(
    rule: InitRule, shape: torch.Size, dtype: torch.dtype, seed: int, name: str
) -> torch.Tensor:
    if rule.kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if rule.kind == "ones":
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(_seed_for(seed, name))
    value = torch.empty(shape, dtype=torch.float32)
    value.normal_(0.0, rule.std, generator=generator)
    return value.to(dtype)


def has_meta_tensors(modules: Iterable[nn.Module]) -> bool:
    return any(t.is_meta for m in modules for t in [*m.parameters(), *m.buffers()])


def meta_buffer_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Values of ``model``'s buffers, computed without allocating its parameters.

    Runs the model's own ``init_weights()`` (Hugging Face: ``initialize_weights()``) on a copy
    whose parameters stay on meta and whose buffers are real CPU tensors: buffers derived from
    the config (RoPE tables) come out right, weight fills touch nothing. Call it on the pristine
    meta model, before any pass.
    """
    buffers = dict(model.named_buffers())
    if not any(b.is_meta for b in buffers.values()):
        return {name: b.detach().cpu() for name, b in buffers.items()}
    if not callable(_init_method(model)):
        raise PlanError(
            f"{type(model).__name__} is on the meta device and has buffers "
            f"({', '.join(buffers)}) whose values autoplan cannot compute: give the model an "
            "init_weights() method that recomputes them, or build it on a real device"
        )
    shadow = copy.deepcopy(model)
    for module in shadow.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype)
    try:
        _init_method(shadow)()
    except Exception as error:
        raise PlanError(
            f"could not compute the buffers of meta model {type(model).__name__} by running its "
            f"init_weights() on a parameter-free copy ({type(error).__name__}: {error}); build "
            "the model on a real device instead"
        ) from error
    return {name: b.detach().clone() for name, b in shadow.named_buffers()}


def _init_method(model: nn.Module) -> Any:
    """The model's own initialiser: Hugging Face's ``initialize_weights``, else
    ``init_weights`` (None if it has neither)."""
    for name in ("initialize_weights", "init_weights"):
        method = getattr(model, name, None)
        if callable(method):
            return method
    return None


def _row_paths(stage: StageModule) -> set[str]:
    """Original paths of the residual-stream projections (row-parallel linears of blocks)."""
    rows: set[str] = set()
    for unit in stage.units:
        if unit.profile.kind != "block":
            continue
        for linear in unit.profile.tp.linears:
            if linear.style == "row":
                rows.add(f"{unit.profile.name}.{linear.path}")
                rows.add(linear.path)
    return rows


def materialize(
    split: SplitModel,
    device: torch.device,
    *,
    seed: int,
    num_blocks: int,
    buffers: Mapping[str, torch.Tensor],
    norms: frozenset[str] | None = None,
) -> int:
    """Allocate and initialise this rank's meta stages in place; returns the tensors filled.
    ``norms``: the original model's norm parameters (`norm_parameter_names`); without them a
    parameter counts as a norm's when the module holding it in the stage is a norm."""
    modules = [stage.module for stage in split.stages]
    if not has_meta_tensors(modules):
        return 0
    tied_names = {copy_.stage_fqn: tied.name for tied in split.tied for copy_ in tied.copies}
    filled = 0
    for stage in split.stages:
        stage.module.to_empty(device=device)
        # to_empty gives each module a new tensor, which unties plain parameters that several
        # units of the stage share (a tied embedding and head): share them again.
        for names in split.shared_in_stage.get(stage.stage_idx, ()):
            keep = stage.module.get_parameter(names[0])
            for name in names[1:]:
                if stage.module.get_parameter(name) is not keep:
                    owner_path, _, pname = name.rpartition(".")
                    setattr(stage.module.get_submodule(owner_path), pname, keep)
        rows = _row_paths(stage)
        with torch.no_grad():
            for stage_fqn, param in stage.module.named_parameters():
                name = tied_names.get(stage_fqn, original_fqn(stage_fqn))
                owner_path, _, pname = stage_fqn.rpartition(".")
                owner = stage.module.get_submodule(owner_path)
                rule = init_rule(
                    name,
                    owner,
                    pname,
                    residual=original_fqn(owner_path) in rows,
                    num_blocks=num_blocks,
                    norm=None if norms is None else name in norms,
                )
                _fill(param, rule, seed, name)
                filled += 1
            for stage_fqn, buf in stage.module.named_buffers():
                name = original_fqn(stage_fqn)
                if name not in buffers:
                    raise PlanError(
                        f"no value for buffer {name!r} of the meta model; build the model on a "
                        "real device"
                    )
                buf.copy_(buffers[name].to(device=buf.device, dtype=buf.dtype))
                filled += 1
    assert not has_meta_tensors(modules), "tensors left on meta after materialize"
    return filled


def _fill(param: torch.Tensor, rule: InitRule, seed: int, name: str) -> None:
    if isinstance(param, DTensor):
        full = _full_value(rule, param.shape, param.dtype, seed, name)
        # src_data_rank=None: every rank slices its own shard of the same tensor, no collective.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(_full_value(rule, param.shape, param.dtype, seed, name))


@torch.no_grad()
def init_full_model_(
    model: nn.Module, *, seed: int, row_paths: Iterable[str], num_blocks: int
) -> None:
    """Initialise a whole single-process ``model`` exactly as `materialize` initialises shards.

    ``row_paths``: module paths of the residual-stream projections (e.g. ``blocks.0.attn.o_proj``).
    Tied parameters are filled once, under their first name.
    """
    rows = set(row_paths)
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        owner_path, _, pname = name.rpartition(".")
        owner = model.get_submodule(owner_path)
        rule = init_rule(name, owner, pname, residual=owner_path in rows, num_blocks=num_blocks)
        param.copy_(_full_value(rule, param.shape, param.dtype, seed, name))
