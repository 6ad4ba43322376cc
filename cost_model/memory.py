"""Bytes one device holds for one pipeline unit: weights, gradients, optimizer states, activations.

Expects a `UnitProfile` (per-sample activation figures at the traced dtype) and a `Strategy`.
Guarantees: parameter, gradient and optimizer bytes are exact for mixed-precision Adam under the
given ZeRO level; activation bytes never grow with more recompute, a higher ZeRO level never
holds more, and tensor/sequence parallelism only divide.

Mixed-precision Adam (Rajbhandari et al. 2020, ZeRO, section 3.1): with fp16/bf16 training each
parameter costs 2 bytes of weights, 2 of gradients and 12 of optimizer state (fp32 master
weights, momentum, variance); fp32 training keeps 4 + 4 + 8 (momentum and variance). ZeRO
(section 5, Figure 1): stage 1 shards the optimizer state over the data-parallel group, stage 2
also the gradients, stage 3 also the weights. A plan's precision policy (`PrecisionPolicy`:
master weights, gradient reduction and AdamW states in bf16 or fp32) sets each of those widths:
a bf16 master of a bf16 model is no copy (its K = 12 becomes 2 x 2 for bf16 moments).

Activations (Korthikanti et al. 2022, section 4.2): bytes saved inside the tensor-parallel
region divide by the TP degree (4.2.1); those outside it (norm inputs, dropout masks, residuals)
divide only with sequence parallelism (4.2.2). Selective recompute (section 5) drops the
cheap-to-recompute attention-core bytes; full recompute keeps only each unit's input (section 5:
2sbh per layer, divided by t when sequence parallelism shards it). Recompute applies to
transformer blocks only: Megatron-LM checkpoints its layers, not the embedding or the head.

The saved bytes are the traced model's (autograd's saved tensors, `autoplan.tracing`): a fused
SDPA kernel and no dropout. A stack that saves more or drops other bytes under selective
recompute says so in `StackActivations` (its `FrameworkProfile.saved_activations`): an unfused
attention core's s x s scores, dropout masks, and Megatron-LM's selective recompute, which
re-runs the submodules --recompute-modules names (the attention core by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cost_model.precision import PrecisionPolicy, precision_policy
from cost_model.strategy import DTYPE_BYTES, RECOMPUTED_UNIT_KINDS, DataParallelWrapper, Strategy
from cost_model.workload import UnitProfile

# Units that activation recomputation applies to (`decide`'s recompute policy).
RECOMPUTABLE_KINDS = RECOMPUTED_UNIT_KINDS


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamStateBytes:
    """Bytes per parameter for weights, gradients and optimizer state (unsharded)."""

    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int


def param_state_bytes(dtype: str, policy: PrecisionPolicy | None = None) -> ParamStateBytes:
    """Adam in mixed precision (2 + 2 + 12) or in fp32 (4 + 4 + 8), Rajbhandari et al. 2020;
    under a precision ``policy`` (None: the dtype's default) the weights and gradients in the
    compute dtype, and as optimizer state the master copy (none when the master is the working
    weights) and AdamW's two moments."""
    policy = policy or precision_policy(dtype)
    width = DTYPE_BYTES[dtype]
    master = policy.master_bytes if policy.master_copy else 0
    return ParamStateBytes(
        weight_bytes=width,
        grad_bytes=width,
        optimizer_bytes=master + 2 * policy.optimizer_state_bytes,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticBytes:
    """Bytes that live for the whole step on one device."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def local_num_params(
    unit: UnitProfile,
    tp_degree: int,
    *,
    count_shared: bool = True,
    shared_expert_whole: bool = False,
) -> float:
    """Parameters of ``unit`` one TP rank stores: TP-sharded ones divide, the rest replicate.

    ``count_shared=False`` leaves out parameters tied to an earlier unit (a head that shares the
    embedding matrix) when that unit lives on the same device, so they are stored once. With
    ``shared_expert_whole`` a mixture-of-experts unit's shared expert is whole on every TP rank
    (`MoELayerFacts.shared_expert_params`; `CostModel.shared_expert_whole`).
    """
    sharded = unit.num_params_tp_sharded
    if shared_expert_whole and tp_degree > 1 and unit.moe is not None:
        sharded -= unit.moe.shared_expert_params
    replicated = unit.num_params - sharded
    local = replicated + sharded / tp_degree
    if not count_shared and unit.num_params_shared:
        # Tied weights are vocab-sharded like the embedding they share.
        local -= unit.num_params_shared / tp_degree
    return local


def static_bytes(
    num_params: float,
    dtype: str,
    zero_stage: int,
    dp_degree: int,
    wrapper: DataParallelWrapper = "none",
    *,
    policy: PrecisionPolicy | None = None,
) -> StaticBytes:
    """Weights, gradients and optimizer state of ``num_params`` under ZeRO ``zero_stage``, as
    the data-parallel ``wrapper`` (`Strategy.dp_wrapper`) holds them, under the precision
    ``policy`` (None: the dtype's default, `cost_model.precision`).

    Without a wrapper or under DDP: Adam's bytes per parameter (`param_state_bytes`), divided
    per the ZeRO stage. Under FSDP2 (``fsdp``, and ``replicate``, which is FSDP2 with one
    shard) the parameters are shards in the master dtype (fp32 by default), which are Adam's
    master weights, with gradients in the same dtype (FSDP2 casts the reduced gradient to the
    sharded parameter's dtype, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
    foreach_reduce) and AdamW's two moments (in the parameters' dtype under torch's AdamW), all
    sharded; the step's unsharded weights, in the compute dtype (FSDP2's ``param_dtype``), are
    separate all-gather buffers that ZeRO-0 to ZeRO-2 keep from the forward until each
    group's backward (counted here with the weights) and ZeRO-3 frees after each unit
    (`memory_constants` counts those).
    """
    policy = policy or precision_policy(dtype)
    if wrapper in ("fsdp", "replicate"):
        shard = dp_degree if wrapper == "fsdp" else 1
        unsharded = num_params * DTYPE_BYTES[dtype] if zero_stage < 3 else 0.0
        master = num_params * policy.master_bytes / shard
        return StaticBytes(
            param_bytes=master + unsharded,
            grad_bytes=master,
            optimizer_bytes=num_params * 2 * policy.optimizer_state_bytes / shard,
        )
    per = param_state_bytes(dtype, policy)
    return StaticBytes(
        param_bytes=num_params * per.weight_bytes / (dp_degree if zero_stage >= 3 else 1),
        grad_bytes=num_params * per.grad_bytes / (dp_degree if zero_stage >= 2 else 1),
        optimizer_bytes=num_params * per.optimizer_bytes / (dp_degree if zero_stage >= 1 else 1),
    )


# What "selective" recompute drops: "traced-ops", the outputs of the cheap ops the trace saw
# (`cost_model.strategy.SELECTIVE_SAVED_KINDS`: autoplan's runtime); "modules", the submodules
# a Megatron stack checkpoints (`StackActivations.recompute_modules`).
SelectiveScope = Literal["traced-ops", "modules"]

# Megatron-Core's --recompute-modules the cost model prices (megatron/core/transformer/
# transformer_config.py, TransformerConfig.recompute_modules, default ["core_attn"]; read at
# NVIDIA/Megatron-LM d98e8a64dd): "core_attn" checkpoints the attention core (Korthikanti et al.
# 2022, section 5; with a fused kernel, whose saved Q, K, V and output the projections keep
# anyway, that drops nothing); "layernorm" the input and pre-MLP norms, discarding their outputs
# (transformer_layer.py, recompute_input_layernorm / recompute_pre_mlp_layernorm); "moe_act" the
# routed experts' activation function, discarding its output (moe/experts.py,
# activation_recompute); "moe" the whole MoE layer under tensor_parallel.checkpoint, which keeps
# its input only (moe/moe_layer.py, moe_layer_recompute). Not priced: "mlp", "shared_experts",
# "mla_up_proj" and the rest (no row uses them).
RecomputeModule = Literal["core_attn", "moe_act", "layernorm", "moe"]
RECOMPUTE_MODULES: tuple[RecomputeModule, ...] = ("core_attn", "moe_act", "layernorm", "moe")


@dataclass(frozen=True, kw_only=True, slots=True)
class StackActivations:
    """What a training stack saves for a block's backward beyond the traced model, whose
    attention is one fused SDPA kernel (no s x s scores kept) and which has no dropout.

    Korthikanti et al. 2022, section 4.1, per layer (s tokens, b samples, h hidden, a heads,
    16-bit activations): an unfused core keeps the softmax output (2as^2b) and, with attention
    dropout, its mask (as^2b, 1 byte an element) and output (2as^2b): the 5as^2b term; hidden
    dropout after the attention and the MLP keeps a 1-byte mask each (sbh + sbh).
    """

    # the attention core keeps its s x s scores (softmax output) for every head
    unfused_attention: bool = False
    # dropout runs (probability > 0): on an unfused core's scores, and after each row-parallel
    # linear (Megatron's bias-dropout-add after the attention and the MLP projections)
    dropout: bool = False
    selective: SelectiveScope = "traced-ops"
    # with selective "modules": the ones checkpointed (`RECOMPUTE_MODULES`)
    recompute_modules: tuple[RecomputeModule, ...] = ("core_attn",)


# the traced model's own accounting (autoplan's runtime)
TRACED_ACTIVATIONS = StackActivations()


def stack_saved_bytes(
    unit: UnitProfile, strategy: Strategy, stack: StackActivations, *, scores: bool
) -> float:
    """Bytes per micro-batch on one device that ``stack`` keeps beyond the trace's saved ones
    (`StackActivations`); ``scores``: whether an unfused core's scores are kept (not under
    selective recompute).

    Scores: heads x queries x keys of each traced attention op (its ``Q K^T`` GEMM; an unfused
    core computes the full square even under a causal mask), split by TP with the heads. Masks:
    one byte per output element of each row-parallel GEMM (the hidden size per token), outside
    the TP region, so split only by sequence parallelism.
    """
    if unit.kind not in RECOMPUTABLE_KINDS:
        return 0.0
    t = strategy.tp_degree
    replicated_div = t if strategy.sequence_parallel else 1
    width = strategy.dtype_bytes
    total = 0.0
    for op in unit.ops:
        if op.gemm is None:
            continue
        elements = float(op.gemm.m_per_sample * op.gemm.n * op.gemm.batch)
        if op.kind == "attention" and stack.unfused_attention and scores:
            # softmax output; with dropout its 1-byte mask and its output, which x V saves
            per_element = width + (1 + width if stack.dropout else 0)
            total += per_element * elements / t
        elif op.kind == "matmul" and op.tp == "row" and stack.dropout:
            total += elements / replicated_div
    return total * strategy.micro_batch_size


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleBytes:
    """Saved bytes per sample at the traced dtype, by TP bucket (`UnitProfile`)."""

    sharded: float = 0.0
    replicated: float = 0.0


def recomputed_module_bytes(
    unit: UnitProfile, modules: tuple[RecomputeModule, ...], traced_dtype_bytes: int
) -> ModuleBytes:
    """The saved bytes that Megatron-Core's selective recompute of ``modules`` drops from a
    block (`RECOMPUTE_MODULES`), per sample at the traced dtype.

    "layernorm": each hidden-stream norm's output (the QKV and MLP/router input), the block
    input's size (the norms: the block's parameter-reading reductions outside the TP region;
    their inputs stay, the checkpoint's own). "moe" (a MoE block): all the MoE layer saved but
    its input, as the trace counted it (`cost_model.workload.MoELayerFacts`: the traced
    SwiGLU ``GroupedExperts``): per token-expert assignment the expert input and the expert
    output the weighted combine keeps (2h), the gate and up outputs, the SiLU output and their
    product (4f; Megatron-Core's fused SwiGLU keeps 3f, megatron/core/fusions/
    fused_bias_swiglu.py, but the layer drops them all); per token the router's probabilities
    (E); a shared expert's four f-sized tensors (inside the TP region). "moe_act": the
    activation's output, the down projection's input (f per assignment). "core_attn" drops
    nothing here (a fused core saves nothing the projections do not; an unfused core's scores
    are `stack_saved_bytes`').
    """
    if unit.kind not in RECOMPUTABLE_KINDS:
        return ModuleBytes()
    sharded = replicated = 0.0
    if "layernorm" in modules:
        norms = sum(
            1
            for op in unit.ops
            if op.kind == "reduction" and op.tp == "replicated" and op.param_bytes_read > 0
        )
        replicated += norms * unit.input_bytes
    moe = unit.moe
    if moe is not None and ("moe" in modules or "moe_act" in modules):
        routed = float(moe.routed_tokens_per_sample)
        ffn = moe.expert_ffn_hidden_size
        if "moe" in modules:
            tokens = routed / moe.top_k
            per_routed = 2 * moe.hidden_size + 4 * ffn
            replicated += (routed * per_routed + tokens * moe.num_experts) * traced_dtype_bytes
            shared_ffn = moe.shared_expert_params / (moe.num_gemms * moe.hidden_size)
            sharded += tokens * 4 * shared_ffn * traced_dtype_bytes
        else:
            replicated += routed * ffn * traced_dtype_bytes
    return ModuleBytes(
        sharded=min(sharded, unit.saved_bytes_sharded),
        replicated=min(replicated, unit.saved_bytes_replicated),
    )


def activation_scale(strategy: Strategy, traced_dtype_bytes: int) -> float:
    """Factor from the profile's per-sample bytes to one micro-batch at the plan's dtype."""
    return strategy.micro_batch_size * strategy.dtype_bytes / traced_dtype_bytes


def activation_bytes(
    unit: UnitProfile,
    strategy: Strategy,
    recompute: str,
    traced_dtype_bytes: int,
    stack: StackActivations = TRACED_ACTIVATIONS,
) -> float:
    """Bytes ``unit`` keeps for backward, per in-flight micro-batch, on one device, as
    ``stack`` saves them (`StackActivations`; default: the traced model's own)."""
    t = strategy.tp_degree
    replicated_div = t if strategy.sequence_parallel else 1
    scale = activation_scale(strategy, traced_dtype_bytes)
    mode = recompute if unit.kind in RECOMPUTABLE_KINDS else "none"
    if mode == "full":
        # Only the unit's input survives (Korthikanti et al. 2022, section 4.3).
        return unit.input_bytes * scale / replicated_div
    sharded = unit.saved_bytes_sharded
    replicated = unit.saved_bytes_replicated
    scores = mode == "none"
    if mode == "selective" and stack.selective == "traced-ops":
        sharded -= unit.saved_bytes_selective_sharded
        replicated -= unit.saved_bytes_selective_replicated
    elif mode == "selective":
        dropped = recomputed_module_bytes(unit, stack.recompute_modules, traced_dtype_bytes)
        sharded -= dropped.sharded
        replicated -= dropped.replicated
        scores = "core_attn" not in stack.recompute_modules
    elif mode != "none":
        raise ValueError(f"unknown recompute mode {recompute!r}; use none, selective or full")
    extra = stack_saved_bytes(unit, strategy, stack, scores=scores)
    return (sharded / t + replicated / replicated_div) * scale + extra


def working_bytes(
    unit: UnitProfile,
    strategy: Strategy,
    traced_dtype_bytes: int,
    stack: StackActivations = TRACED_ACTIVATIONS,
) -> float:
    """Transient bytes while ``unit`` runs its backward: the gradients of its intermediates (or
    its recomputed activations), about one micro-batch of its un-recomputed activations."""
    return activation_bytes(unit, strategy, "none", traced_dtype_bytes, stack)


def weight_grad_input_bytes(
    unit: UnitProfile, strategy: Strategy, traced_dtype_bytes: int
) -> float:
    """Bytes a split backward keeps per micro-batch from its input half to its weight half,
    beyond the saved activations: the gradient flowing into every op with weights, which
    torch's ``stage_backward_input`` saves for ``stage_backward_weight`` (pipelining's
    ``_backward.py``). A GEMM's is its output; a norm's its input's size. Column-parallel
    outputs divide by the TP degree; a row-parallel GEMM's partial output is whole; norms
    outside the TP region divide only with sequence parallelism."""
    t = strategy.tp_degree
    total = 0.0
    for op in unit.ops:
        if not op.param_bytes_read or op.kind == "embedding":
            continue
        if op.gemm is not None:
            size = float(op.gemm.m_per_sample * op.gemm.n * op.gemm.batch * traced_dtype_bytes)
            div = t if op.tp in ("column", "vocab") else 1
        else:
            size = op.activation_bytes / 2  # read and written once each
            div = t if op.tp != "replicated" or strategy.sequence_parallel else 1
        total += size / div
    return total * activation_scale(strategy, traced_dtype_bytes)
