"""GPT-2 / GPT-3 decoder: learned token + position embeddings, pre-LayerNorm blocks, GeLU MLP.

Expects `input_ids` of shape (B, T) with T <= config.seq_len; returns logits (B, T, V), no loss.
Guarantees, relied on by the tracer, the cost model and the tensor-parallel passes:
- module names `tok_emb`, `pos_emb`, `drop` (only if dropout > 0), `blocks[i].{ln_1, attn, ln_2,
  mlp}`, `attn.{q,k,v,o}_proj`, `mlp.{up_proj, act, down_proj}`, `ln_f`, `lm_head`;
- separate q/k/v linears and reshapes with `-1` heads, so column-sharded q/k/v (fewer local
  heads) and row-sharded o_proj/down_proj work unchanged;
- no Python control flow on tensor values: `torch.fx.symbolic_trace` and `torch.export` work;
- the parameter count equals Narayanan et al. 2021 (SC'21), section 5.1,
  P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)), plus 2h for the final LayerNorm, which that
  formula leaves out (`num_params_closed_form`); this is also GPT-2's own count (124,439,808 for
  gpt2-small, as Hugging Face's GPT2LMHeadModel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoplan.models._common import (
    INIT_STD,
    ModelSpecError,
    ZooModel,
    build,
    check_divisible,
    check_positive_ints,
    init_linear,
    make_generator,
    normal_,
    residual_init_std,
)

__all__ = ["GPT", "GPTConfig", "gpt", "num_params_closed_form"]

# GPT-2's layer_norm_epsilon (Hugging Face GPT2Config default).
LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Architecture of a GPT-2/GPT-3 model; every size fully resolved (see `gpt()` for defaults)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int  # number of learned positions (max context)
    vocab_size: int
    ffn_hidden_size: int  # 4 * hidden_size in GPT-2/GPT-3
    dropout: float = 0.0  # embedding, attention-probability and residual dropout
    tie_embeddings: bool = True  # lm_head shares tok_emb.weight (as GPT-2/GPT-3)

    def __post_init__(self) -> None:
        check_positive_ints(
            "GPTConfig",
            [
                ("num_layers", self.num_layers),
                ("hidden_size", self.hidden_size),
                ("num_heads", self.num_heads),
                ("seq_len", self.seq_len),
                ("vocab_size", self.vocab_size),
                ("ffn_hidden_size", self.ffn_hidden_size),
            ],
        )
        check_divisible(
            "GPTConfig",
            "hidden_size",
            self.hidden_size,
            "num_heads",
            self.num_heads,
            "so that every head has the same head_dim",
        )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise ModelSpecError(f"GPTConfig.dropout must be a float, got {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelSpecError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.tie_embeddings, bool):
            raise ModelSpecError(
                f"GPTConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def num_params_closed_form(config: GPTConfig) -> int:
    """Parameter count in closed form, which the model matches exactly.

    Per block: q/k/v/o weights 4h^2 and biases 4h, MLP weights 2hf and biases f + h, two
    LayerNorms 4h; with f = 4h that is 12h^2 + 13h, the per-layer term of Narayanan et al. 2021,
    section 5.1. Embeddings: (V + s) h, plus V h for an untied head. The final LayerNorm adds 2h,
    which the paper's formula omits.
    """
    h, f, l = config.hidden_size, config.ffn_hidden_size, config.num_layers  # noqa: E741
    per_block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    embeddings = (config.vocab_size + config.seq_len) * h
    head = 0 if config.tie_embeddings else config.vocab_size * h
    return l * per_block + embeddings + head + 2 * h


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/o projections (all with biases)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.head_dim = config.head_dim  # invariant under head sharding; the head count is not
        self.dropout_p = config.dropout
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)

    def forward(self, x: Tensor) -> Tensor:
        B, T = x.size(0), x.size(1)
        # `-1` is the local head count: all heads, or num_heads / tp_degree under column sharding.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        dropout_p = self.dropout_p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        y = self.o_proj(y)  # (B, T, H)
        if self.dropout_p > 0.0:
            y = F.dropout(y, self.dropout_p, self.training)
        return y


class MLP(nn.Module):
    """up_proj (H -> F), tanh-approximated GeLU (GPT-2's `gelu_new`), down_proj (F -> H)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.dropout_p = config.dropout
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.act = nn.GELU(approximate="tanh")
        self.down_proj = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.down_proj(self.act(self.up_proj(x)))  # (B, T, H)
        if self.dropout_p > 0.0:
            y = F.dropout(y, self.dropout_p, self.training)
        return y


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, H)
        x = x + self.mlp(self.ln_2(x))  # (B, T, H)
        return x


class GPT(ZooModel):
    """GPT-2/GPT-3 language model; see the module docstring for the guarantees.

    Build it with `gpt()` or `preset()`: they construct on the meta device and materialise once.
    Constructing `GPT(config)` directly builds on the current default device and initialises.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden_size)
        self.drop = nn.Dropout(config.dropout) if config.dropout > 0.0 else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)  # (T,)
        x = self.tok_emb(input_ids) + self.pos_emb(positions)  # (B, T, H)
        if self.drop is not None:
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)  # (B, T, H)
        logits: Tensor = self.lm_head(self.ln_f(x))  # (B, T, V)
        return logits

    def tie_weights(self) -> None:
        """Share tok_emb.weight with lm_head if configured (`to_empty` unties them)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter in place, deterministically for a given `seed`.

        N(0, 0.02) for embeddings and linears, N(0, 0.02 / sqrt(2 num_layers)) for o_proj and
        down_proj (GPT-2), zero biases, LayerNorm weight 1 and bias 0. `seed=None` draws from the
        global RNG. Works after `to_empty()`, and re-ties the embeddings that `to_empty` unties.
        """
        self.tie_weights()
        if self.tok_emb.weight.is_meta:
            return  # nothing to fill; meta fills also cost ~1 ms each in Python decompositions
        gen = make_generator(seed, self.tok_emb.weight.device)
        out_std = residual_init_std(self.config.num_layers)
        normal_(self.tok_emb.weight, INIT_STD, gen)
        normal_(self.pos_emb.weight, INIT_STD, gen)
        for block in self.blocks:
            assert isinstance(block, Block)
            block.ln_1.reset_parameters()
            block.ln_2.reset_parameters()
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                init_linear(proj, INIT_STD, gen)
            init_linear(block.attn.o_proj, out_std, gen)
            init_linear(block.mlp.up_proj, INIT_STD, gen)
            init_linear(block.mlp.down_proj, out_std, gen)
        self.ln_f.reset_parameters()
        if not self.config.tie_embeddings:
            normal_(self.lm_head.weight, INIT_STD, gen)


def gpt(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int,
    *,
    ffn_hidden_size: int | None = None,
    dropout: float = 0.0,
    tie_embeddings: bool = True,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
) -> GPT:
    """Build a GPT on `device` (meta by default: no memory); on a real device it is initialised.

    `ffn_hidden_size` defaults to 4 * hidden_size (GPT-2, GPT-3).
    """
    config = GPTConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        seq_len=seq_len,
        vocab_size=vocab_size,
        ffn_hidden_size=4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size,
        dropout=dropout,
        tie_embeddings=tie_embeddings,
    )
    return build(lambda: GPT(config), device, dtype)
