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

**Precision policy** (`PrecisionPolicy`): beside the compute dtype a plan states, in three fields
left out at their defaults, the dtype of the weights the optimizer updates (``master_dtype``),
of gradient accumulation and reduction (``grad_reduce_dtype``) and of AdamW's two moments
(``optimizer_state_dtype``). The defaults are the behaviour above: fp32 master weights and
states, gradients reduced in fp32 (in fp16 under ``fp16``, Megatron-LM's default there). The
names are not FSDP2's: its ``param_dtype`` is the compute dtype of the gathered weights (the
plan's ``dtype``), its ``reduce_dtype`` the plan's ``grad_reduce_dtype``, and the sharded
parameters it keeps are the master weights. The stacks' own names for the same choices:

- FSDP2 ``MixedPrecisionPolicy(param_dtype=<dtype>, reduce_dtype=<grad_reduce_dtype>)``, the
  module's parameters in ``master_dtype`` (torch's AdamW keeps its moments in the parameters'
  dtype, so there ``optimizer_state_dtype`` is ``master_dtype``);
- torchtitan: ``training.mixed_precision_param`` (the compute dtype),
  ``training.mixed_precision_reduce`` (float32 only in torchtitan 0.3) and ``training.dtype``
  (bfloat16: parameters, gradients and optimizer states in bf16, no fp32 copy;
  torchtitan/config/configs.py, TrainingConfig);
- Megatron-LM: ``--accumulate-allreduce-grads-in-fp32`` (set by itself for ``--bf16``) or
  ``--grad-reduce-in-bf16``; ``--use-precision-aware-optimizer`` with ``--exp-avg-dtype`` and
  ``--exp-avg-sq-dtype`` (and ``--main-params-dtype``, fp32 or fp16 only) through Transformer
  Engine's FusedAdam, which needs the distributed optimizer; Megatron-FSDP's
  ``--megatron-fsdp-main-params-dtype`` and ``--megatron-fsdp-main-grads-dtype``
  (megatron/training/arguments.py, validate_args and _add_mixed_precision_args);
- DeepSpeed: ``bf16.bf16_master_weights_and_grads`` and ``bf16.bf16_optimizer_states`` (ZeRO
  1-3), ``data_types.grad_accum_dtype`` and ``communication_data_type``
  (deepspeed/runtime/precision_config.py, config.py).

Which combinations are valid (`precision_problem`): fp32 training keeps everything in fp32 (its
weights are the master); fp16 training needs fp32 master weights (fp16's 10-bit mantissa and
narrow range lose small updates: Micikevicius et al. 2018, "Mixed Precision Training",
section 3.1) and reduces in fp16 or fp32; bf16 training (and the fp8 recipes, which train in
bf16) keeps its master weights and states in fp32 or bf16 and reduces in fp32 or bf16. A 16-bit
format other than the compute one (bf16 reduction of fp16 gradients, or the reverse) is refused.
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


# The precision policy's dtypes (module doc): the master weights', gradient accumulation and
# reduction's, and AdamW's moments'.
MasterDtype = Literal["fp32", "bf16"]
GradReduceDtype = Literal["fp32", "bf16", "fp16"]
OptimizerStateDtype = Literal["fp32", "bf16"]
MASTER_DTYPES: tuple[MasterDtype, ...] = ("fp32", "bf16")
GRAD_REDUCE_DTYPES: tuple[GradReduceDtype, ...] = ("fp32", "bf16", "fp16")
OPTIMIZER_STATE_DTYPES: tuple[OptimizerStateDtype, ...] = ("fp32", "bf16")
# The policy's defaults: fp32 master weights and AdamW states (Rajbhandari et al. 2020, ZeRO,
# section 3.1: 12 bytes of optimizer state a parameter in mixed precision).
DEFAULT_MASTER_DTYPE: MasterDtype = "fp32"
DEFAULT_OPTIMIZER_STATE_DTYPE: OptimizerStateDtype = "fp32"
# The plan fields, as a plan file names them
POLICY_FIELDS: tuple[str, ...] = ("master_dtype", "grad_reduce_dtype", "optimizer_state_dtype")
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def default_grad_reduce_dtype(dtype: str) -> GradReduceDtype:
    """The gradient reduction a plan of ``dtype`` gets unless it states one: fp32, or fp16
    under fp16 (Megatron-LM reduces fp16 gradients in fp16 unless
    --accumulate-allreduce-grads-in-fp32; for bf16 it sets that flag itself, validate_args in
    megatron/training/arguments.py; torchtitan's mixed_precision_reduce is float32)."""
    return "fp16" if dtype == "fp16" else "fp32"


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionPolicy:
    """What a training step keeps in which dtype: the compute dtype (activations, the working
    weights GEMMs read, local gradients; bf16 under an fp8 recipe), the master weights the
    optimizer updates, gradient accumulation over micro-batches and reduction over
    data-parallel ranks, and AdamW's two moments."""

    compute: str
    master: str
    grad_reduce: str
    optimizer_state: str

    @property
    def compute_bytes(self) -> int:
        return _BYTES[self.compute]

    @property
    def master_bytes(self) -> int:
        return _BYTES[self.master]

    @property
    def grad_reduce_bytes(self) -> int:
        return _BYTES[self.grad_reduce]

    @property
    def optimizer_state_bytes(self) -> int:
        """Of one moment (AdamW keeps two)."""
        return _BYTES[self.optimizer_state]

    @property
    def master_copy(self) -> bool:
        """Whether the master weights are a copy beside the working weights (fp32 master of a
        16-bit model); a bf16 master of a bf16 model is the working weights themselves."""
        return self.master != self.compute


def precision_policy(
    dtype: str,
    master_dtype: str = DEFAULT_MASTER_DTYPE,
    grad_reduce_dtype: str | None = None,
    optimizer_state_dtype: str = DEFAULT_OPTIMIZER_STATE_DTYPE,
) -> PrecisionPolicy:
    """The policy of a plan with these fields (``grad_reduce_dtype`` None: the dtype's
    default, `default_grad_reduce_dtype`); `precision_problem` says whether it is valid."""
    # (tf32 is fp32 storage with tensor-core GEMMs: an fp32 policy)
    compute = "fp32" if dtype == "tf32" else compute_dtype(dtype)
    return PrecisionPolicy(
        compute=compute,
        master=master_dtype,
        grad_reduce=grad_reduce_dtype or default_grad_reduce_dtype(compute),
        optimizer_state=optimizer_state_dtype,
    )


def precision_problem(
    dtype: str, master_dtype: object, grad_reduce_dtype: object, optimizer_state_dtype: object
) -> str | None:
    """Why these policy fields cannot go with ``dtype`` (a valid plan dtype), in one line
    naming the value, the rule and the fix; None when they can (module doc)."""
    for name, value, allowed in (
        ("master_dtype", master_dtype, MASTER_DTYPES),
        ("grad_reduce_dtype", grad_reduce_dtype, (None, *GRAD_REDUCE_DTYPES)),
        ("optimizer_state_dtype", optimizer_state_dtype, OPTIMIZER_STATE_DTYPES),
    ):
        if value not in allowed:
            named = ", ".join(a for a in allowed if a is not None)
            return f"{name} = {value!r} must be one of {named}"
    policy = precision_policy(
        dtype,
        str(master_dtype),
        None if grad_reduce_dtype is None else str(grad_reduce_dtype),
        str(optimizer_state_dtype),
    )
    compute = policy.compute
    if compute == "fp32":
        stated = [
            f"{name} = {value}"
            for name, value in zip(
                POLICY_FIELDS,
                (policy.master, policy.grad_reduce, policy.optimizer_state),
                strict=True,
            )
            if value != "fp32"
        ]
        if stated:
            return (
                f"{stated[0]} with dtype fp32: fp32 training keeps its weights (the master), "
                "gradients and AdamW states in fp32; use dtype bf16 for 16-bit ones, or set it "
                "to fp32"
            )
        return None
    if compute == "fp16" and policy.master != "fp32":
        return (
            f"master_dtype = {policy.master} with dtype fp16: fp16 training needs fp32 master "
            "weights (fp16's 10-bit mantissa and narrow range lose small updates; Micikevicius "
            "et al. 2018, section 3.1); set master_dtype fp32, or use dtype bf16"
        )
    if policy.grad_reduce not in ("fp32", compute):
        return (
            f"grad_reduce_dtype = {policy.grad_reduce} with dtype {dtype}: gradients computed in "
            f"{compute} reduce in {compute} or fp32, not in another 16-bit format; set "
            f"grad_reduce_dtype {compute} or fp32"
        )
    return None


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


def policy_text(policy: PrecisionPolicy) -> str:
    """What a policy keeps in which dtype: ``fp32 master weights, gradient reduction and
    AdamW states`` (the default), ``bf16 master weights (no fp32 copy), gradient reduction in
    fp32, bf16 AdamW states``."""
    if policy.master == policy.grad_reduce == policy.optimizer_state:
        return f"{policy.master} master weights, gradient reduction and AdamW states"
    master = f"{policy.master} master weights"
    if not policy.master_copy and policy.compute != "fp32":
        master += " (no fp32 copy)"
    return (
        f"{master}, gradient reduction in {policy.grad_reduce}, "
        f"{policy.optimizer_state} AdamW states"
    )


def precision_text(
    dtype: str,
    exclude: tuple[str, ...],
    all_gather: bool,
    policy: PrecisionPolicy | None = None,
) -> str | None:
    """What a plan keeps in which dtype, in one phrase; None for a plain dtype at the default
    policy. An fp8 plan: ``fp8 (dynamic tensor-wise scaling, ...) in every linear but head;
    bf16 activations and working weights, fp32 master weights, gradient reduction and AdamW
    states``; a plain dtype: ``bf16 activations and working weights, bf16 master weights (no
    fp32 copy), ...``."""
    policy = policy or precision_policy(dtype)
    recipe = fp8_recipe(dtype)
    if recipe is None:
        if policy == precision_policy(dtype):
            return None
        return f"{policy.compute} activations and working weights, {policy_text(policy)}"
    kept = f" but {', '.join(exclude)}" if exclude else ""
    gather = "; weights all-gathered in fp8" if all_gather else ""
    return (
        f"{dtype} ({recipe.summary}) in every linear{kept}; bf16 activations and working "
        f"weights, {policy_text(policy)}{gather}"
    )
