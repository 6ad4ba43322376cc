"""Training dtypes and fp8 recipes: what each plan ``dtype`` computes in, and what it needs.

A plan's ``dtype`` is either a plain training dtype (``fp32``, ``bf16``, ``fp16``: activations,
weights and gradients in it, fp32 master weights and AdamW states beside the 16-bit ones) or an
**fp8 recipe**: bf16 training in which the linear layers' GEMMs take fp8 inputs, cast just
before each GEMM with a scale per tensor, row or block. The recipes, as the sources define them:

``fp8``
    Dynamic tensor-wise scaling: one scale per tensor from its current amax, e4m3 for inputs
    and weights, e5m2 for output gradients (torchao ``Float8LinearConfig`` recipe
    ``tensorwise``; Transformer Engine's ``Float8CurrentScaling``, Megatron-LM's
    ``--fp8-recipe tensorwise``; torchtitan's ``float8`` converter by default). Micikevicius et
    al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433, define the two formats.
``fp8-rowwise``
    A scale per row of each GEMM operand (per token of the activations, per output feature of
    the weights), e4m3 throughout (torchao recipe ``rowwise``, torchtitan's
    ``float8.recipe_name = "rowwise"``).
``mxfp8``
    OCP Microscaling: e4m3 elements in blocks of 32 along the reduction dimension, each block
    with an 8-bit power-of-two scale (OCP "Microscaling Formats (MX) v1.0", 2023), run by
    Blackwell's block-scaled tensor cores (Megatron-LM's ``--fp8-recipe mxfp8``, torchtitan's
    ``mx`` converter).

Guarantees: under every recipe, master weights, gradients and optimizer states are as under
bf16 (fp32 master weights and AdamW moments; bf16 working weights and gradients, reduced in the
stack's reduction dtype), activations are bf16, and only the converted linears' GEMMs run in
fp8. The output head stays in bf16 by default (`DEFAULT_FP8_EXCLUDE`), as torchtitan
(``filter_fqns = ["output"]``) and Transformer Engine (Megatron-LM builds its output layer
outside TE's fp8 autocast) do; an embedding is a lookup with no GEMM to convert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Fp8RecipeName = Literal["fp8", "fp8-rowwise", "mxfp8"]
Granularity = Literal["tensorwise", "rowwise", "mx"]
# The plain training dtypes (`cost_model.degrees.DTYPE_NAMES` adds the recipes).
PLAIN_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
# What an fp8 recipe's non-GEMM work, activations, weights and gradients are in.
FP8_COMPUTE_DTYPE = "bf16"
# Layers kept in bf16 under an fp8 recipe by default: the output projection.
DEFAULT_FP8_EXCLUDE: tuple[str, ...] = ("head",)
# Roles `Plan.fp8_exclude` may name besides module names: the model's output projection and a
# mixture-of-experts layer's router (torchtitan leaves ``router.gate`` out: its output width,
# the expert count, is too narrow for an fp8 GEMM to pay).
FP8_EXCLUDE_ROLES: tuple[str, ...] = ("head", "router")
# torchao's float8 GEMM (``torch._scaled_mm``) needs both dimensions of each operand divisible
# by 16 (torchao/float8/float8_linear.py, Float8Linear.from_float; cuBLASLt's fp8 alignment).
FP8_GEMM_MULTIPLE = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Recipe:
    """One fp8 recipe: its scaling and what a device and a stack need to run it."""

    name: Fp8RecipeName
    granularity: Granularity
    # The device's `DeviceSpec.peak_flops` key that says it has the tensor cores: "fp8" for
    # Hopper-class e4m3/e5m2 GEMMs, "mxfp8" for Blackwell's block-scaled ones.
    device_rate: str
    # Whether a TP- or FSDP-sharded tensor's scale needs an amax all-reduce over its shards:
    # one scale per whole tensor (tensor-wise) does; per-row and per-block scales are local.
    syncs_scales: bool
    # Whether FSDP2 can all-gather the weights in fp8 (torchao's
    # ``enable_fsdp_float8_all_gather``: tensor-wise only, torchtitan's float8 docs).
    fp8_all_gather: bool
    # torchao's name for the recipe (`Float8LinearConfig.from_recipe_name`); None: MX.
    torchao_recipe: str | None
    summary: str


FP8_RECIPES: dict[str, Fp8Recipe] = {
    "fp8": Fp8Recipe(
        name="fp8",
        granularity="tensorwise",
        device_rate="fp8",
        syncs_scales=True,
        fp8_all_gather=True,
        torchao_recipe="tensorwise",
        summary="dynamic tensor-wise scaling, e4m3 forward, e5m2 gradients",
    ),
    "fp8-rowwise": Fp8Recipe(
        name="fp8-rowwise",
        granularity="rowwise",
        device_rate="fp8",
        syncs_scales=False,
        fp8_all_gather=False,
        torchao_recipe="rowwise",
        summary="dynamic row-wise scaling, e4m3",
    ),
    "mxfp8": Fp8Recipe(
        name="mxfp8",
        granularity="mx",
        device_rate="mxfp8",
        syncs_scales=False,
        fp8_all_gather=False,
        torchao_recipe=None,
        summary="MX block scaling (32 elements, power-of-two scales), e4m3",
    ),
}
FP8_RECIPE_NAMES: tuple[str, ...] = tuple(FP8_RECIPES)


def fp8_recipe(dtype: str) -> Fp8Recipe | None:
    """The fp8 recipe ``dtype`` names, or None for a plain training dtype."""
    return FP8_RECIPES.get(dtype)


def compute_dtype(dtype: str) -> str:
    """The dtype a plan's activations, weights, gradients and non-GEMM kernels are in."""
    return FP8_COMPUTE_DTYPE if dtype in FP8_RECIPES else dtype


def fp8_device_problem(
    dtype: str, device_name: str, device_kind: str, rates: frozenset[str]
) -> str | None:
    """Why a device whose `DeviceSpec.peak_flops` states ``rates`` cannot run ``dtype``'s fp8
    GEMMs, in one line naming the device and the fix; None when it can (or ``dtype`` is not a
    recipe)."""
    recipe = fp8_recipe(dtype)
    if recipe is None or recipe.device_rate in rates:
        return None
    if recipe.device_rate == "mxfp8":
        has = "fp8 tensor cores but no MX block-scaled ones (Blackwell has them)"
        fix = "use dtype fp8 or fp8-rowwise" if "fp8" in rates else "use dtype bf16"
        return (
            f"dtype mxfp8 needs MX block-scaled fp8 tensor cores: {device_name} has "
            f"{has if 'fp8' in rates else 'no fp8 tensor cores'}; {fix}, or state "
            "device.peak_flops.mxfp8 for a device that has them"
        )
    what = (
        "a CPU has no fp8 tensor cores (torch emulates fp8 GEMMs on it)"
        if device_kind == "cpu"
        else f"{device_name} has no fp8 tensor cores (Hopper, Ada and Blackwell GPUs have them)"
    )
    return (
        f"dtype {dtype} needs fp8 tensor cores: {what}; use dtype bf16, or state "
        "device.peak_flops.fp8 in the cluster file"
    )


def fp8_field_problem(
    dtype: str, all_gather: object, exclude: object, zero_stage: int, *, check_zero: bool = True
) -> str | None:
    """Why a plan's ``fp8_all_gather`` or ``fp8_exclude`` cannot go with its dtype and ZeRO
    stage, in one line naming the value and the fix; None when they can (``check_zero``
    False: not the ZeRO stage, for the planner's one-device views of a plan's units)."""
    if not isinstance(all_gather, bool):
        return f"fp8_all_gather = {all_gather!r} must be true or false"
    if not isinstance(exclude, tuple) or not all(
        isinstance(name, str) and name.strip() for name in exclude
    ):
        return (
            f"fp8_exclude = {exclude!r} must be a list of names: 'head', 'router', or module "
            "names such as blocks.0.mlp.gate_proj"
        )
    if not all_gather:
        return None
    recipe = fp8_recipe(dtype)
    if recipe is None:
        return f"fp8_all_gather = true needs an fp8 dtype, not {dtype}; set it false"
    if not recipe.fp8_all_gather:
        return (
            f"fp8_all_gather = true needs tensor-wise scaling (dtype fp8), not {dtype} (torchao "
            "gathers only tensor-wise fp8 weights); set it false or use dtype fp8"
        )
    if zero_stage < 1 and check_zero:
        return (
            "fp8_all_gather = true needs sharded weights to gather (zero_stage >= 1), not "
            "zero_stage 0; set it false or raise zero_stage"
        )
    return None


def precision_text(dtype: str, exclude: tuple[str, ...], all_gather: bool) -> str | None:
    """What an fp8 plan keeps in which dtype, in one phrase (None for a plain dtype): ``fp8
    (dynamic tensor-wise scaling, ...) in every linear but head; bf16 activations and working
    weights, fp32 master weights, gradient reduction and AdamW states``."""
    recipe = fp8_recipe(dtype)
    if recipe is None:
        return None
    kept = f" but {', '.join(exclude)}" if exclude else ""
    gather = "; weights all-gathered in fp8" if all_gather else ""
    return (
        f"{dtype} ({recipe.summary}) in every linear{kept}; bf16 activations and working "
        f"weights, fp32 master weights, gradient reduction and AdamW states{gather}"
    )
