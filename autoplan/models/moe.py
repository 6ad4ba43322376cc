"""Mixture-of-experts decoder: Llama's attention with top-k routed SwiGLU experts (Mixtral,
DeepSeekMoE), an optional shared expert and optional leading dense layers.

Expects `input_ids` of shape (B, T) with T <= config.seq_len; returns logits (B, T, V), no loss.
Guarantees, relied on by the tracer, the cost model and the parallel passes:
- module names `tok_emb`, `blocks[i].{attn_norm, attn, mlp_norm, mlp}`, `norm`, `lm_head`;
  `attn` is llama's `Attention` and the RoPE tables are the model's buffers `rope_cos`/`rope_sin`,
  passed whole to every block, as in `Llama` (so the TP and CP passes apply unchanged);
- `blocks[i].mlp` is llama's `MLP` for i < num_dense_layers and a `MoEFeedForward` after, with
  `router` (a linear, H -> E), `experts` (`GroupedExperts`) and `shared_expert` (an `MLP` of
  num_shared_experts * moe_ffn_hidden_size, or None);
- routing: softmax over the router logits in float32, the top_k experts of each token, their
  probabilities renormalised to sum to 1 (Mixtral; `norm_topk_prob=False` keeps them as
  DeepSeekMoE does); tokens are sorted by expert id (stable) so that each expert's rows are
  contiguous, `experts(x_sorted, num_tokens_per_expert)` runs them, and the outputs are put back
  in token order and summed with the routing weights;
- the load-balancing loss (Switch Transformers, Fedus et al. 2022, section 2.2; the top-k form of
  DeepSeekMoE, Dai et al. 2024, section 3.3): coef * E * sum_e f_e * P_e, with f_e the fraction
  of the N * top_k token-expert assignments that go to expert e and P_e the mean router
  probability of e over the N tokens; 1 * coef under perfectly balanced routing. It is attached
  to the layer's output by an identity autograd function, so `forward` returns logits only and
  backward adds d(aux)/d(params) (weight 1) to whatever loss the logits feed. It is computed
  per forward call (per micro-batch, per data-parallel rank), as Megatron-LM does; a runtime
  that averages the main loss over n micro-batches sets each layer's `aux_loss_coef` to
  coef / n to keep the same objective. Sequence parallelism relies on its form (a product of
  the fractions of the counts the experts get and the mean router probability, attached by
  `attach_aux_loss`): passes/moe_sequence_parallel.py sums those counts over the TP ranks
  and divides each rank's loss by tp, which gives the loss over all tokens exactly;
- with no dense layer, no shared expert and `norm_topk_prob=True`, logits equal Hugging Face's
  MixtralForCausalLM's with the same weights (it packs w_gate and w_up as `gate_up_proj`);
- torch.fx: every op but the experts' is shape-static. `GroupedExperts` splits its rows by the
  values of `num_tokens_per_expert`, so the tracer keeps it a leaf module; on meta tensors, where
  there are no values, it assumes balanced routing (N / E rows per expert, the remainder spread
  over the first experts), which is what the planner costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoplan.models._common import (
    INIT_STD,
    ModelSpecError,
    build,
    check_divisible,
    check_positive_float,
    check_positive_ints,
    init_linear,
    normal_,
)
from autoplan.models.llama import (
    MLP,
    Attention,
    LlamaConfig,
    RopeDecoder,
    default_ffn_hidden_size,
    init_swiglu,
    resolve_head_dim,
)
from cost_model.degrees import is_whole

__all__ = [
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "MoEFeedForward",
    "attach_aux_loss",
    "balanced_counts",
    "load_balancing_loss",
    "moe",
    "num_params_closed_form",
]

# Switch Transformers (Fedus et al. 2022, section 2.2) use alpha = 10^-2 for the auxiliary loss.
DEFAULT_AUX_LOSS_COEF = 0.01


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """Architecture of a mixture-of-experts decoder; every size fully resolved (see `moe()`)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    seq_len: int  # longest sequence; length of the RoPE tables
    vocab_size: int
    ffn_hidden_size: int  # SwiGLU inner size of the dense layers
    num_experts: int  # routed experts per MoE layer
    top_k: int  # routed experts per token
    moe_ffn_hidden_size: int  # SwiGLU inner size of one expert
    num_shared_experts: int = 0  # 0: none; else one MLP of num_shared_experts * moe_ffn_hidden_size
    num_dense_layers: int = 0  # leading layers with a dense MLP (DeepSeekMoE's first layer)
    router_aux_loss_coef: float = DEFAULT_AUX_LOSS_COEF
    norm_topk_prob: bool = True  # renormalise the top-k probabilities (Mixtral) or not
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Size of one attention head; None (the default) resolves to hidden_size // num_heads at
    # construction, as `LlamaConfig.head_dim` (Qwen3-30B-A3B: hidden 2048, 32 heads of 128).
    head_dim: int = field(default=cast(int, None))

    def __post_init__(self) -> None:
        owner = "MoEConfig"
        check_positive_ints(
            owner,
            [
                ("num_layers", self.num_layers),
                ("hidden_size", self.hidden_size),
                ("num_heads", self.num_heads),
                ("num_kv_heads", self.num_kv_heads),
                ("seq_len", self.seq_len),
                ("vocab_size", self.vocab_size),
                ("ffn_hidden_size", self.ffn_hidden_size),
                ("num_experts", self.num_experts),
                ("top_k", self.top_k),
                ("moe_ffn_hidden_size", self.moe_ffn_hidden_size),
            ],
        )
        for name, value in (
            ("num_shared_experts", self.num_shared_experts),
            ("num_dense_layers", self.num_dense_layers),
        ):
            if not is_whole(value, 0):
                raise ModelSpecError(f"{owner}.{name} must be a whole number >= 0, got {value!r}")
        if self.top_k > self.num_experts:
            raise ModelSpecError(
                f"{owner}: top_k ({self.top_k}) must be <= num_experts ({self.num_experts}): "
                f"each token picks top_k distinct experts; set top_k to at most "
                f"{self.num_experts} or add experts"
            )
        if self.num_dense_layers >= self.num_layers:
            raise ModelSpecError(
                f"{owner}: num_dense_layers ({self.num_dense_layers}) must be < num_layers "
                f"({self.num_layers}) so that at least one layer has experts; lower it, or use "
                "the llama builder for a dense model"
            )
        resolve_head_dim(self, owner)
        check_divisible(
            owner,
            "num_heads",
            self.num_heads,
            "num_kv_heads",
            self.num_kv_heads,
            "so that each kv head serves the same number of query heads (GQA)",
        )
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < 1e3:
            raise ModelSpecError(
                f"{owner}.router_aux_loss_coef must be a number in [0, 1000), got {coef!r} "
                "(0 turns the load-balancing loss off; Switch Transformers use 0.01)"
            )
        check_positive_float(owner, "rope_theta", self.rope_theta)
        check_positive_float(owner, "norm_eps", self.norm_eps)
        for name, flag in (
            ("tie_embeddings", self.tie_embeddings),
            ("norm_topk_prob", self.norm_topk_prob),
        ):
            if not isinstance(flag, bool):
                raise ModelSpecError(f"{owner}.{name} must be a bool, got {flag!r}")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def shared_ffn_hidden_size(self) -> int:
        """Inner size of the shared expert (DeepSeekMoE fuses its shared experts into one MLP)."""
        return self.num_shared_experts * self.moe_ffn_hidden_size

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.num_dense_layers

    def llama_view(self, ffn_hidden_size: int | None = None) -> LlamaConfig:
        """The Llama config of the same attention (and of an MLP of ``ffn_hidden_size``, by
        default the dense layers'): what llama's `Attention` and `MLP` are built from."""
        return LlamaConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            ffn_hidden_size=self.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings,
            head_dim=self.head_dim,
        )


def num_params_closed_form(config: MoEConfig) -> int:
    """Parameter count in closed form, which the model matches exactly.

    Every block: q and o 2 h (heads * head_dim) (2h^2 when head_dim = h / heads), k and v
    2 h (kv_heads * head_dim), two RMSNorms 2h. A dense
    block adds its SwiGLU 3 h f; a MoE block the router h E, E experts of 3 h f_e each and the
    shared expert 3 h (S f_e). Embedding V h, untied head V h, final RMSNorm h. No biases.
    """
    h = config.hidden_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    attention = 2 * h * q_dim + 2 * h * kv_dim + 2 * h
    dense = attention + 3 * h * config.ffn_hidden_size
    moe_block = (
        attention
        + h * config.num_experts
        + config.num_experts * 3 * h * config.moe_ffn_hidden_size
        + 3 * h * config.shared_ffn_hidden_size
    )
    head = 0 if config.tie_embeddings else config.vocab_size * h
    blocks = config.num_dense_layers * dense + config.num_moe_layers * moe_block
    return blocks + config.vocab_size * h + head + h


# ---------------------------------------------------------------------------------------------
# Routing helpers
# ---------------------------------------------------------------------------------------------


def balanced_counts(num_rows: int, num_experts: int) -> list[int]:
    """Rows per expert under perfectly balanced routing: N // E each, the remainder N % E spread
    one each over the first experts (so the counts sum to N)."""
    base, extra = divmod(num_rows, num_experts)
    return [base + (1 if e < extra else 0) for e in range(num_experts)]


def load_balancing_loss(probs: Tensor, num_tokens_per_expert: Tensor, coef: float) -> Tensor:
    """coef * E * sum_e f_e * P_e (see the module docstring).

    ``probs`` (N, E): router probabilities of every token (float32); ``num_tokens_per_expert``
    (E,): how many of the N * top_k assignments each expert got. f carries no gradient (it is
    a count); the gradient reaches the router through P.
    """
    num_experts = probs.size(-1)
    counts = num_tokens_per_expert.to(probs.dtype)
    fraction = counts / counts.sum()  # (E,) f_e
    mean_prob = probs.mean(dim=0)  # (E,) P_e
    return coef * num_experts * (fraction * mean_prob).sum()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also gives ``aux_loss`` the gradient 1: the auxiliary
    loss joins the training objective without being returned (Megatron-LM's
    MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, aux_loss: Tensor) -> Tensor:
        ctx.aux_dtype = aux_loss.dtype  # type: ignore[attr-defined]
        ctx.aux_shape = aux_loss.shape  # type: ignore[attr-defined]
        return x

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor
    ) -> tuple[Tensor, Tensor]:
        grad_aux = torch.ones(
            ctx.aux_shape,  # type: ignore[attr-defined]
            dtype=ctx.aux_dtype,  # type: ignore[attr-defined]
            device=grad_output.device,
        )
        return grad_output, grad_aux


def attach_aux_loss(x: Tensor, aux_loss: Tensor) -> Tensor:
    """``x``, with ``aux_loss`` added to the objective in backward (gradient weight 1)."""
    out: Tensor = _AttachAuxLoss.apply(x, aux_loss)  # type: ignore[no-untyped-call]
    return out


# fx records the call as one node (it cannot trace into an autograd.Function); the profiler runs
# it on meta tensors like any other function.
torch.fx.wrap("attach_aux_loss")


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: w_gate, w_up (E, F, H) and w_down (E, H, F).

    forward(x_sorted (N, H), num_tokens_per_expert (E,)) -> (N, H): rows are grouped by expert
    (expert 0's first, then expert 1's, ...), and expert e runs
    down_e(silu(gate_e(x)) * up_e(x)) on its block of rows. On meta tensors the counts have no
    values and the rows are split as `balanced_counts` says.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.w_up = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        if x.is_meta or num_tokens_per_expert.is_meta:
            counts = balanced_counts(x.size(0), self.num_experts)
        else:
            counts = [int(c) for c in num_tokens_per_expert.tolist()]
        outputs = []
        for e, x_e in enumerate(torch.split(x, counts, dim=0)):  # x_e (n_e, H)
            hidden = F.silu(x_e @ self.w_gate[e].t()) * (x_e @ self.w_up[e].t())  # (n_e, F)
            outputs.append(hidden @ self.w_down[e].t())  # (n_e, H)
        return torch.cat(outputs, dim=0)  # (N, H)


class MoEFeedForward(nn.Module):
    """Router, top-k dispatch to `GroupedExperts`, weighted combine, plus a shared expert."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.hidden_size = h
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_loss_coef = float(config.router_aux_loss_coef)
        self.router = nn.Linear(h, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, h, config.moe_ffn_hidden_size)
        self.shared_expert: MLP | None = (
            MLP(config.llama_view(config.shared_ffn_hidden_size))
            if config.num_shared_experts
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        k = self.top_k
        x_flat = x.reshape(-1, self.hidden_size)  # (N, H), N = B * T
        logits = self.router(x_flat)  # (N, E)
        probs = F.softmax(logits.float(), dim=-1)  # (N, E), float32
        top = torch.topk(probs, k, dim=-1)
        top_probs, top_ids = top[0], top[1]  # (N, k) each
        if self.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        flat_ids = top_ids.reshape(-1)  # (N k,): token n's choices at rows n k .. n k + k - 1
        num_tokens_per_expert = flat_ids.new_zeros(self.num_experts).scatter_add_(
            0, flat_ids, torch.ones_like(flat_ids)
        )  # (E,) int64
        order = torch.argsort(flat_ids, stable=True)  # (N k,): assignment rows sorted by expert
        x_sorted = x_flat.index_select(0, order // k)  # (N k, H)
        y_sorted = self.experts(x_sorted, num_tokens_per_expert)  # (N k, H)
        y_assigned = y_sorted.index_select(0, torch.argsort(order))  # (N k, H), token order
        weights = top_probs.to(y_assigned.dtype).unsqueeze(-1)  # (N, k, 1)
        y = (y_assigned.view(-1, k, self.hidden_size) * weights).sum(dim=1)  # (N, H)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x_flat)  # (N, H)
        if self.aux_loss_coef > 0:
            aux = load_balancing_loss(probs, num_tokens_per_expert, self.aux_loss_coef)
            y = attach_aux_loss(y, aux)
        out: Tensor = y.view_as(x)  # (B, T, H)
        return out


class MoEBlock(nn.Module):
    """Pre-RMSNorm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)); `mlp` is a dense
    `MLP` or a `MoEFeedForward`."""

    def __init__(self, config: MoEConfig, *, moe_layer: bool) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = Attention(config.llama_view())
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp: MLP | MoEFeedForward = (
            MoEFeedForward(config) if moe_layer else MLP(config.llama_view())
        )

    def forward(self, x: Tensor, rope_cos: Tensor, rope_sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope_cos, rope_sin)  # (B, T, H)
        x = x + self.mlp(self.mlp_norm(x))  # (B, T, H)
        return x


class MoE(RopeDecoder):
    """Mixture-of-experts language model; see the module docstring for the guarantees.

    Build it with `moe()` or `preset()`: they construct on the meta device and materialise once.
    Embedding, RoPE tables, forward, weight tying and most of the initialisation are Llama's
    (`RopeDecoder`); the MoE layers' router and experts are initialised as `init_mlp` says.
    """

    config: MoEConfig

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(
            config,
            (MoEBlock(config, moe_layer=config.is_moe_layer(i)) for i in range(config.num_layers)),
        )

    def init_mlp(self, mlp: nn.Module, gen: torch.Generator | None, out_std: float) -> None:
        """A dense layer's SwiGLU as Llama's; a MoE layer's router and experts' gate/up
        N(0, 0.02), the experts' w_down N(0, out_std) (it writes into the residual stream), and
        the shared expert as a SwiGLU."""
        if isinstance(mlp, MLP):
            init_swiglu(mlp, gen, out_std)
            return
        assert isinstance(mlp, MoEFeedForward), type(mlp)
        init_linear(mlp.router, INIT_STD, gen)
        normal_(mlp.experts.w_gate, INIT_STD, gen)
        normal_(mlp.experts.w_up, INIT_STD, gen)
        normal_(mlp.experts.w_down, out_std, gen)
        if mlp.shared_expert is not None:
            init_swiglu(mlp.shared_expert, gen, out_std)


def moe(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int,
    num_experts: int,
    top_k: int,
    moe_ffn_hidden_size: int,
    *,
    num_kv_heads: int | None = None,
    ffn_hidden_size: int | None = None,
    num_shared_experts: int = 0,
    num_dense_layers: int = 0,
    router_aux_loss_coef: float = DEFAULT_AUX_LOSS_COEF,
    norm_topk_prob: bool = True,
    rope_theta: float = 10000.0,
    norm_eps: float = 1e-5,
    tie_embeddings: bool = False,
    head_dim: int | None = None,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
) -> MoE:
    """Build a MoE on `device` (meta by default: no memory); on a real device it is initialised.

    `num_kv_heads` defaults to `num_heads`; `ffn_hidden_size` (the dense layers') to
    `default_ffn_hidden_size(hidden_size)`, as `llama()`; `head_dim` to hidden_size / num_heads.
    """
    config = MoEConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
        seq_len=seq_len,
        vocab_size=vocab_size,
        ffn_hidden_size=(
            default_ffn_hidden_size(hidden_size) if ffn_hidden_size is None else ffn_hidden_size
        ),
        num_experts=num_experts,
        top_k=top_k,
        moe_ffn_hidden_size=moe_ffn_hidden_size,
        num_shared_experts=num_shared_experts,
        num_dense_layers=num_dense_layers,
        router_aux_loss_coef=router_aux_loss_coef,
        norm_topk_prob=norm_topk_prob,
        rope_theta=rope_theta,
        norm_eps=norm_eps,
        tie_embeddings=tie_embeddings,
        head_dim=cast(int, head_dim),  # None: resolved by MoEConfig
    )
    return build(lambda: MoE(config), device, dtype)
