"""Llama 2 / Llama 3 decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, no biases.

Expects `input_ids` of shape (B, T) with T <= config.seq_len; returns logits (B, T, V), no loss.
Guarantees, relied on by the tracer, the cost model and the tensor-parallel passes:
- module names `tok_emb`, `blocks[i].{attn_norm, attn, mlp_norm, mlp}`, `attn.{q,k,v,o}_proj`,
  `mlp.{gate_proj, up_proj, down_proj}`, `norm`, `lm_head`;
- reshapes use `-1` heads and the GQA repeat factor comes from the local shapes
  (q heads / kv heads), so column-sharded q/k/v work unchanged as long as each rank keeps whole
  kv heads;
- no Python control flow on tensor values: `torch.fx.symbolic_trace` and `torch.export` work;
- RoPE in the "rotate half" layout of Hugging Face's LlamaForCausalLM (Meta's checkpoints
  interleave pairs instead; HF's conversion permutes q/k rows), so logits match
  LlamaForCausalLM with the same weights. Llama 3.1's long-context RoPE scaling is not modelled:
  it changes no shape, parameter or FLOP count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoplan.models._common import (
    INIT_STD,
    ModelSpecError,
    ZooModel,
    build,
    check_divisible,
    check_positive_float,
    check_positive_ints,
    init_linear,
    make_generator,
    normal_,
    residual_init_std,
)

__all__ = [
    "Attention",
    "Llama",
    "LlamaConfig",
    "causal_attention",
    "default_ffn_hidden_size",
    "llama",
    "num_params_closed_form",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    """Architecture of a Llama model; every size fully resolved (see `llama()` for defaults)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # = num_heads for multi-head attention, fewer for GQA
    seq_len: int  # longest sequence; length of the RoPE tables
    vocab_size: int
    ffn_hidden_size: int  # SwiGLU inner size
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Size of one attention head. None (the default) resolves to hidden_size // num_heads at
    # construction, so a built config always holds an int; set it when a model's heads are not
    # hidden / num_heads wide (Qwen3-30B-A3B: hidden 2048, 32 heads of 128, see `resolve_head_dim`).
    head_dim: int = field(default=cast(int, None))

    def __post_init__(self) -> None:
        check_positive_ints(
            "LlamaConfig",
            [
                ("num_layers", self.num_layers),
                ("hidden_size", self.hidden_size),
                ("num_heads", self.num_heads),
                ("num_kv_heads", self.num_kv_heads),
                ("seq_len", self.seq_len),
                ("vocab_size", self.vocab_size),
                ("ffn_hidden_size", self.ffn_hidden_size),
            ],
        )
        resolve_head_dim(self, "LlamaConfig")
        check_divisible(
            "LlamaConfig",
            "num_heads",
            self.num_heads,
            "num_kv_heads",
            self.num_kv_heads,
            "so that each kv head serves the same number of query heads (GQA)",
        )
        check_positive_float("LlamaConfig", "rope_theta", self.rope_theta)
        check_positive_float("LlamaConfig", "norm_eps", self.norm_eps)
        if not isinstance(self.tie_embeddings, bool):
            raise ModelSpecError(
                f"LlamaConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}"
            )


class _HasHeads(Protocol):
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def resolve_head_dim(config: _HasHeads, owner: str) -> None:
    """Set ``config.head_dim`` (a frozen dataclass, in its ``__post_init__``) to
    hidden_size // num_heads when it is None, after checking that the heads divide the hidden
    size; check an explicit one is a positive int. Either way it must be even (RoPE)."""
    if config.head_dim is None:
        check_divisible(
            owner,
            "hidden_size",
            config.hidden_size,
            "num_heads",
            config.num_heads,
            "so that every head has the same head_dim (or set head_dim explicitly)",
        )
        object.__setattr__(config, "head_dim", config.hidden_size // config.num_heads)
        what = f"head_dim = hidden_size / num_heads = {config.head_dim}"
        fix = "change hidden_size or num_heads, or set head_dim"
    else:
        check_positive_ints(owner, [("head_dim", config.head_dim)])
        what, fix = f"head_dim = {config.head_dim}", "use an even head_dim"
    if config.head_dim % 2:
        raise ModelSpecError(
            f"{owner}: {what} must be even for RoPE (it rotates pairs of dims); {fix}"
        )


def default_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """SwiGLU size of Meta's reference code: 2/3 of 4h (same FLOPs as a GeLU MLP of 4h),
    rounded up to a multiple of 256. Gives 11008 for h = 4096 (Llama 2 7B)."""
    ffn = int(2 * 4 * hidden_size / 3)
    return multiple_of * -(-ffn // multiple_of)


def num_params_closed_form(config: LlamaConfig) -> int:
    """Parameter count in closed form, which the model matches exactly.

    Per block: q and o 2 h (heads * head_dim) (2h^2 when head_dim = h / heads), k and v
    2 h (kv_heads * head_dim), SwiGLU 3 h f, two RMSNorms 2h. Embedding V h, untied head V h,
    final RMSNorm h. No biases anywhere.
    """
    h, f = config.hidden_size, config.ffn_hidden_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    per_block = 2 * h * q_dim + 2 * h * kv_dim + 3 * h * f + 2 * h
    head = 0 if config.tie_embeddings else config.vocab_size * h
    return config.num_layers * per_block + config.vocab_size * h + head + h


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """RoPE's cos and sin tables (seq_len, head_dim) in float32, in the "rotate half" layout of
    HF's LlamaRotaryEmbedding."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # (hd / 2,)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (seq_len, hd / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (seq_len, hd)
    return angles.cos(), angles.sin()


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the last dim, split in halves (HF's RoPE layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, nh, T, hd) by position: x * cos + rotate_half(x) * sin, cos/sin (T, hd)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal SDPA with grouped-query heads: q (B, nh, T, hd), k and v (B, nkv, T, hd).

    The default `Attention.attention_core`. Query head i uses kv head i // n_rep, n_rep from
    the local shapes (q heads / kv heads), not the config, so column-sharded heads work.
    """
    n_rep = q.size(1) // k.size(1)
    k = k.repeat_interleave(n_rep, dim=1)  # (B, nh, T, hd)
    v = v.repeat_interleave(n_rep, dim=1)  # (B, nh, T, hd)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; separate q/k/v/o projections, no biases.

    `attention_core(q, k, v)` is a hook: `causal_attention` by default (a plain function, so a
    trace inlines it and nothing changes); the context-parallel pass replaces it with ring
    attention over the cp group (passes/context_parallel.py), which receives the kv heads
    before the GQA repeat and so sends only those around the ring.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.head_dim = hd  # invariant under head sharding; the head counts are not
        self.q_proj = nn.Linear(h, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, h, bias=False)
        self.attention_core: Callable[[Tensor, Tensor, Tensor], Tensor] = causal_attention

    def forward(self, x: Tensor, rope_cos: Tensor, rope_sin: Tensor) -> Tensor:
        B, T = x.size(0), x.size(1)
        # narrow, not [:T]: under fx, T is a Proxy, which a slice cannot take.
        cos = rope_cos.narrow(0, 0, T)  # (T, hd)
        sin = rope_sin.narrow(0, 0, T)  # (T, hd)
        # `-1` is the local head count: all heads, or a 1/tp_degree share under column sharding.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attention_core(q, k, v)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        out: Tensor = self.o_proj(y)  # (B, T, H)
        return out


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), H -> F -> H, no biases."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, H)
        return y


class Block(nn.Module):
    """Pre-RMSNorm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, rope_cos: Tensor, rope_sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope_cos, rope_sin)  # (B, T, H)
        x = x + self.mlp(self.mlp_norm(x))  # (B, T, H)
        return x


class DecoderConfig(Protocol):
    """What `RopeDecoder` reads of a config (`LlamaConfig`, `MoEConfig`)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def tie_embeddings(self) -> bool: ...


class RopeDecoder(ZooModel):
    """What Llama and the MoE decoder share: token embedding, blocks that take the RoPE tables,
    a final RMSNorm and the LM head; the tables as non-persistent buffers; weight tying; and
    the initialisation of everything but the blocks' attention and MLPs (`init_block`)."""

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, config: DecoderConfig, blocks: Iterable[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Non-persistent: derived from the config, never checkpointed; rebuilt by init_weights.
        cos, sin = self.rope_tables(self.tok_emb.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)  # (seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (seq_len, hd)
        self.init_weights()

    def rope_tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin tables (seq_len, head_dim) in float32, as HF's LlamaRotaryEmbedding."""
        config = self.config
        return rope_tables(config.seq_len, config.head_dim, config.rope_theta, device)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.tok_emb(input_ids)  # (B, T, H)
        for block in self.blocks:
            # The whole tables go to every block, which narrows them to T itself: a graph cut
            # between blocks (pipeline stage, checkpoint unit) then carries only x.
            x = block(x, self.rope_cos, self.rope_sin)  # (B, T, H)
        logits: Tensor = self.lm_head(self.norm(x))  # (B, T, V)
        return logits

    def tie_weights(self) -> None:
        """Share tok_emb.weight with lm_head if configured (`to_empty` unties them)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter and buffer in place, deterministically for a `seed`.

        N(0, 0.02) for the embedding, the head and the blocks' input projections,
        N(0, 0.02 / sqrt(2 num_layers)) for what writes into the residual stream (GPT-2's scaled
        init; `init_block`), RMSNorm weights 1, RoPE tables recomputed. `seed=None` draws from
        the global RNG. Works after `to_empty()` and re-ties tied embeddings.
        """
        self.tie_weights()
        if not self.rope_cos.is_meta:  # (real buffers beside meta parameters: see passes)
            cos, sin = self.rope_tables(self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        if self.tok_emb.weight.is_meta:
            return  # nothing to fill; meta fills also cost ~1 ms each in Python decompositions
        gen = make_generator(seed, self.tok_emb.weight.device)
        out_std = residual_init_std(self.config.num_layers)
        normal_(self.tok_emb.weight, INIT_STD, gen)
        for block in self.blocks:
            attn, mlp = block.get_submodule("attn"), block.get_submodule("mlp")
            assert isinstance(attn, Attention), type(attn)
            for name in ("attn_norm", "mlp_norm"):
                norm = block.get_submodule(name)
                assert isinstance(norm, nn.RMSNorm), type(norm)
                norm.reset_parameters()
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                init_linear(proj, INIT_STD, gen)
            init_linear(attn.o_proj, out_std, gen)
            self.init_mlp(mlp, gen, out_std)
        self.norm.reset_parameters()
        if not self.config.tie_embeddings:
            normal_(self.lm_head.weight, INIT_STD, gen)

    def init_mlp(self, mlp: nn.Module, gen: torch.Generator | None, out_std: float) -> None:
        """Initialise one block's MLP (SwiGLU: `init_swiglu`)."""
        assert isinstance(mlp, MLP), type(mlp)
        init_swiglu(mlp, gen, out_std)


def init_swiglu(mlp: MLP, gen: torch.Generator | None, out_std: float) -> None:
    """gate and up N(0, 0.02), down N(0, out_std)."""
    init_linear(mlp.gate_proj, INIT_STD, gen)
    init_linear(mlp.up_proj, INIT_STD, gen)
    init_linear(mlp.down_proj, out_std, gen)


class Llama(RopeDecoder):
    """Llama language model; see the module docstring for the guarantees.

    Build it with `llama()` or `preset()`: they construct on the meta device and materialise
    once. Constructing `Llama(config)` directly builds on the current default device.
    """

    config: LlamaConfig

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config, (Block(config) for _ in range(config.num_layers)))


def llama(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int,
    *,
    num_kv_heads: int | None = None,
    ffn_hidden_size: int | None = None,
    rope_theta: float = 10000.0,
    norm_eps: float = 1e-5,
    tie_embeddings: bool = False,
    head_dim: int | None = None,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
) -> Llama:
    """Build a Llama on `device` (meta by default: no memory); on a real device it is initialised.

    `num_kv_heads` defaults to `num_heads` (no GQA); `ffn_hidden_size` to
    `default_ffn_hidden_size(hidden_size)` (Meta's 2/3 * 4h rounded up to a multiple of 256);
    `head_dim` to hidden_size / num_heads.
    """
    config = LlamaConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
        seq_len=seq_len,
        vocab_size=vocab_size,
        ffn_hidden_size=(
            default_ffn_hidden_size(hidden_size) if ffn_hidden_size is None else ffn_hidden_size
        ),
        rope_theta=rope_theta,
        norm_eps=norm_eps,
        tie_embeddings=tie_embeddings,
        head_dim=cast(int, head_dim),  # None: resolved by LlamaConfig
    )
    return build(lambda: Llama(config), device, dtype)
