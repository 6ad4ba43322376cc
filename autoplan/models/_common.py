"""Helpers shared by the model zoo: config checks, weight init, build on meta and materialise.

Private to `autoplan.models`, apart from `ModelSpecError`, which it re-exports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import Tensor, nn

# The project-wide error type (an `InputError`, so a `ValueError`): one class, whichever of
# `autoplan.ModelSpecError` or `autoplan.models.ModelSpecError` a caller catches.
from autoplan.contract.errors import ModelSpecError as ModelSpecError
from cost_model.degrees import is_whole
from cost_model.messages import shown, shown_count

# ---------------------------------------------------------------------------------------------
# Config validation (called from the config dataclasses' __post_init__)
# ---------------------------------------------------------------------------------------------


# Bounds that refuse absurd sizes up front (tracing is linear in the layers: 4096 take about a
# minute on meta; the largest published models have ~130).
MAX_SIZE = {"num_layers": 4096, "hidden_size": 2**20, "seq_len": 2**24, "vocab_size": 2**24}


def check_positive_ints(owner: str, fields: Iterable[tuple[str, object]]) -> None:
    """Raise `ModelSpecError` unless every value is a positive int (bools rejected)."""
    for name, value in fields:
        if not is_whole(value, None):
            raise ModelSpecError(
                f"{owner}.{name} must be a positive int, got {shown(value)} "
                f"({type(value).__name__})"
            )
        if value <= 0:
            raise ModelSpecError(
                f"{owner}.{name} must be a positive int, got {shown_count(value)}; give it 1 or "
                f"more (e.g. --model NAME:{name}=...)"
            )
        if value > MAX_SIZE.get(name, 2**40):
            raise ModelSpecError(
                f"{owner}.{name} = {shown_count(value)} is more than the "
                f"{MAX_SIZE.get(name, 2**40):,} autoplan models; give a real size"
            )


def check_divisible(owner: str, name: str, value: int, by_name: str, by: int, why: str) -> None:
    """Raise `ModelSpecError` unless `by` divides `value`, suggesting the nearest valid values."""
    if value % by == 0:
        return
    lower = value // by * by
    options = [v for v in (lower, lower + by) if v > 0]
    raise ModelSpecError(
        f"{owner}: {name} ({value}) must be divisible by {by_name} ({by}) {why}; "
        f"set {name} to a multiple of {by} (e.g. {' or '.join(map(str, options))}) "
        f"or change {by_name} to a divisor of {value}"
    )


def check_positive_float(owner: str, name: str, value: float) -> None:
    """Raise `ModelSpecError` unless `value` is a finite float > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelSpecError(f"{owner}.{name} must be a positive number, got {shown(value)}")
    if value == float("inf"):
        raise ModelSpecError(f"{owner}.{name} must be finite, got {shown(value)}")


# ---------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------

# GPT-2 (Radford et al. 2019) and nanoGPT / Megatron: N(0, 0.02) for every weight matrix.
INIT_STD = 0.02


def residual_init_std(num_layers: int) -> float:
    """Std of the projections that write into the residual stream (o_proj, down_proj).

    GPT-2 scales them by 1/sqrt(N) with N = 2 * num_layers residual additions, so the variance
    of the residual stream does not grow with depth (Radford et al. 2019, section 2.3).
    """
    return INIT_STD / math.sqrt(2 * num_layers)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator seeded with `seed` on `device`, or None (use the global RNG; also on meta)."""
    if seed is None or device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def normal_(tensor: Tensor, std: float, generator: torch.Generator | None) -> None:
    """In-place N(0, std^2) fill from `generator`; works on plain tensors and DTensors."""
    tensor.normal_(mean=0.0, std=std, generator=generator)


@torch.no_grad()
def init_linear(linear: nn.Linear, std: float, generator: torch.Generator | None) -> None:
    """Weight ~ N(0, std^2), bias = 0."""
    normal_(linear.weight, std, generator)
    if linear.bias is not None:
        linear.bias.zero_()


# ---------------------------------------------------------------------------------------------
# Building on meta, then materialising
# ---------------------------------------------------------------------------------------------


class ZooModel(nn.Module):
    """Base of the zoo's models: they can (re)initialise every parameter and buffer in place."""

    def init_weights(self, seed: int | None = None) -> None:
        raise NotImplementedError


M = TypeVar("M", bound=ZooModel)


def build(factory: Callable[[], M], device: torch.device | str, dtype: torch.dtype) -> M:
    """Build `factory()` on meta, cast to `dtype` and, unless `device` is meta, allocate + init.

    Casting on meta is free, and `to_empty` + `init_weights` fills each tensor exactly once, so a
    CPU build draws the same random numbers as a meta build followed by
    `to_empty(device="cpu")` and `init_weights()` under the same global seed.
    """
    device = torch.device(device)
    if not dtype.is_floating_point:
        raise ModelSpecError(f"dtype must be a floating-point dtype, got {dtype}")
    with torch.device("meta"):
        model = factory()
    if dtype != torch.float32:
        model.to(dtype=dtype)
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model
