"""What the cost model knows about a model: pipeline units and their operators, as plain data.

`autoplan.trace` produces a `ModelProfile`; the cost model reads nothing else about the model.
All per-sample quantities are for ONE sample (one sequence of ``seq_len`` tokens) at the traced
dtype; the cost model scales them by the micro-batch size and the plan's dtype. Bytes of weights
read by an operator do not scale with the batch and are kept apart (``param_bytes_read``).

Tensor-parallel roles (`TpRole`) say how Megatron-style tensor parallelism splits an operator:

- ``column``: a linear whose output features are split (q/k/v, MLP up/gate, vocab-parallel head):
  GEMM ``n`` divides by the TP degree.
- ``row``: a linear whose input features are split (attention out, MLP down): ``k`` divides;
  its output needs the all-reduce (or reduce-scatter with sequence parallelism).
- ``sharded``: work between a column and a row linear (attention core, activation functions):
  divides by the TP degree.
- ``replicated``: work outside the TP region (norms, residual adds, dropout): every TP rank does
  all of it, unless sequence parallelism splits it along the sequence.
- ``vocab``: the embedding lookup, split over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OpKind = Literal["matmul", "attention", "elementwise", "reduction", "embedding", "other"]
TpRole = Literal["column", "row", "sharded", "replicated", "vocab"]
UnitKind = Literal["embedding", "block", "head", "other"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GemmShape:
    """A (batched) GEMM ``(batch, m, k) @ (k, n)``; ``m`` is per sample (it scales with batch)."""

    m_per_sample: int
    n: int
    k: int
    batch: int = 1  # independent GEMMs, e.g. attention heads in ``Q @ K^T``


@dataclass(frozen=True, kw_only=True, slots=True)
class OpProfile:
    """One operator of a unit's forward pass (an fx node), per sample."""

    name: str
    kind: OpKind
    tp: TpRole
    forward_flops: float
    backward_flops: float
    activation_bytes: float  # activation bytes read + written per sample
    param_bytes_read: float = 0.0  # weight bytes read once per micro-batch
    gemm: GemmShape | None = None
    # Under torch.compile (`cost_model.parts.fusion`): the op's fusion group among its unit's
    # ops (-1: inductor does not fuse it), and its share of the group's traffic, activation
    # bytes per sample: the inputs it reads from outside the group (each once a group) and its
    # output if something outside the group reads it. None: the trace recorded no dataflow
    # (a profile built by hand), and the op is priced as eager.
    fusion_group: int = -1
    fused_bytes: float | None = None

    def __post_init__(self) -> None:
        if self.forward_flops < 0 or self.backward_flops < 0 or self.activation_bytes < 0:
            raise ValueError(f"op {self.name!r}: FLOPs and bytes must be >= 0")
        if self.fused_bytes is not None and self.fused_bytes < 0:
            raise ValueError(f"op {self.name!r}: fused_bytes must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class TpLinear:
    """A linear layer (or embedding) that tensor parallelism splits, by module path."""

    path: str  # relative to the unit's module, e.g. "attn.q_proj"
    style: Literal["column", "row", "vocab_embedding", "vocab_head"]
    # Outputs packed along a column linear's output features (3 for a fused q/k/v projection
    # such as GPT-2's c_attn, 2 for a fused gate/up): TP must split each part, not the whole.
    fused: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class TpStructure:
    """How tensor parallelism can split a unit; degrees must divide every count here."""

    linears: tuple[TpLinear, ...] = ()
    num_heads: int | None = None
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int | None = None

    def divisible_counts(self) -> dict[str, int]:
        """Counts a TP degree must divide, by name (only those present)."""
        counts = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "ffn_hidden_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
        }
        return {name: value for name, value in counts.items() if value is not None}


@dataclass(frozen=True, kw_only=True, slots=True)
class MoELayerFacts:
    """The routed experts of one mixture-of-experts layer, as the cost model prices them.

    Contract with the trace (a unit's ``moe``; `autoplan.contract.graph.MoELayerProfile` has
    the same facts): the unit's ``ops`` include the routed experts as ONE op named
    ``experts_op`` (the traced ``GroupedExperts`` call, at balanced routing), and its
    ``num_params`` include the ``num_experts * params_per_expert`` expert parameters, none of
    them in ``num_params_tp_sharded`` (experts split by expert parallelism, not by TP). The
    router, any shared expert, attention and norms are ordinary ops. The cost model prices
    the experts op itself (`cost_model.parts.expert_parallel`: its GEMMs at the per-expert token
    count, the all-to-alls, the routing imbalance) and leaves it out of the unit's own compute;
    its saved activations stay in the unit's saved bytes (balanced routing).
    ``routed_tokens_per_sample`` counts token-expert assignments, ``seq_len * top_k``.
    """

    experts_op: str
    num_experts: int
    top_k: int
    hidden_size: int
    expert_ffn_hidden_size: int
    params_per_expert: int
    flops_per_routed_token: float  # forward FLOPs of one assignment (one token, one expert)
    routed_tokens_per_sample: int  # token-expert assignments per sample: seq_len * top_k
    num_gemms: int = 3  # GEMMs per expert (SwiGLU: gate, up, down)
    # Parameters of the layer's shared expert(s), part of the unit's TP-sharded ones (one
    # column...row region). Under sequence parallelism autoplan's runtime runs them whole on
    # each TP rank's own tokens (passes/moe_sequence_parallel.py): not sharded, no collective.
    shared_expert_params: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_experts",
            "top_k",
            "params_per_expert",
            "hidden_size",
            "expert_ffn_hidden_size",
            "routed_tokens_per_sample",
            "num_gemms",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"MoELayerFacts.{name} = {getattr(self, name)} must be >= 1")
        # (top_k > num_experts is a plan-validation error naming the fix: `Plan.validate`)

    @property
    def expert_params(self) -> int:
        return self.num_experts * self.params_per_expert


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitProfile:
    """A pipeline unit (embedding, one block, or final norm + head): the smallest thing a stage
    boundary can fall between. Activation figures are per sample at the traced dtype."""

    name: str  # module path, e.g. "blocks.3"
    kind: UnitKind
    ops: tuple[OpProfile, ...]
    num_params: int
    num_params_tp_sharded: int  # parameters that tensor parallelism splits
    param_bytes: int
    # Parameters tied to an earlier unit's (a head sharing the embedding matrix): a stage holding
    # this unit stores them, but the model's total counts them once.
    num_params_shared: int = 0
    # Bytes autograd saves for backward, split by how TP/SP and recompute treat them:
    saved_bytes_sharded: float  # inside the TP region: divided by the TP degree
    saved_bytes_replicated: float  # outside it: divided only with sequence parallelism
    # Of the two above, bytes that cheap ops (element-wise, softmax, norms) produce: selective
    # recompute drops them and re-runs those ops (Korthikanti et al. 2022, section 4.2).
    saved_bytes_selective_sharded: float = 0.0
    saved_bytes_selective_replicated: float = 0.0
    input_bytes: float  # the unit's input: all that full recompute keeps
    output_bytes: float  # what crosses a pipeline cut placed after this unit
    tp: TpStructure = TpStructure()
    # Trailing ops a full recompute never re-runs when it stops as soon as every saved tensor
    # is back (torch's non-reentrant checkpoint): those after the last tensor autograd saves,
    # e.g. a pre-LN block's last GEMM and residual add.
    recompute_skip_ops: int = 0
    # The routed experts of a mixture-of-experts block (None: a dense unit).
    moe: MoELayerFacts | None = None

    def __post_init__(self) -> None:
        if self.num_params_tp_sharded > self.num_params:
            raise ValueError(f"unit {self.name!r}: more TP-sharded params than params")
        if not 0 <= self.recompute_skip_ops <= len(self.ops):
            raise ValueError(
                f"unit {self.name!r}: recompute_skip_ops = {self.recompute_skip_ops} is not in "
                f"0..{len(self.ops)} (its op count)"
            )

    @property
    def forward_flops(self) -> float:
        return sum(op.forward_flops for op in self.ops)

    @property
    def backward_flops(self) -> float:
        return sum(op.backward_flops for op in self.ops)

    @property
    def saved_bytes(self) -> float:
        return self.saved_bytes_sharded + self.saved_bytes_replicated


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """A traced model: its units in execution order and the dimensions plans depend on."""

    name: str
    units: tuple[UnitProfile, ...]
    seq_len: int
    hidden_size: int
    vocab_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    traced_dtype_bytes: int = 4  # element size of the traced floating-point activations/params
    fingerprint: str = ""  # stable hash of the structure: a plan records which model it fits
    # What autoplan's own runtime can do with it (`runtime_refusal`): a torch.export graph pins
    # its traced dtype and inlines its norms; context parallelism splits RoPE tables.
    exported: bool = False
    rope_tables: bool = True

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError(f"model {self.name!r} has no pipeline units")
        if self.seq_len < 1:
            raise ValueError(f"model {self.name!r}: seq_len = {self.seq_len} must be >= 1")

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def num_params(self) -> int:
        return sum(unit.num_params - unit.num_params_shared for unit in self.units)

    @property
    def forward_flops_per_sample(self) -> float:
        return sum(unit.forward_flops for unit in self.units)

    @property
    def attention_op(self) -> OpProfile | None:
        """The first traced attention op with its ``Q K^T`` shape (None: the model has none)."""
        for unit in self.units:
            for op in unit.ops:
                if op.kind == "attention" and op.gemm is not None:
                    return op
        return None

    @property
    def head_dim(self) -> float:
        """The attention head size: the traced attention's ``Q K^T`` depth (models with
        ``head_dim != hidden / heads``, e.g. Qwen3's 128 at hidden 4096 and 64 heads), else
        ``hidden / heads``."""
        op = self.attention_op
        if op is not None and op.gemm is not None:
            return float(op.gemm.k)
        return self.hidden_size / (self.num_heads or 1)

    @property
    def score_fraction(self) -> float:
        """The share of the full query x key score square the traced attention FLOPs count:
        about 1/2 for causal flash attention (the trace's ``causal_fraction``), 1 for a full or
        masked one, and 1 without a traced attention op."""
        op = self.attention_op
        if op is None or op.gemm is None or op.forward_flops <= 0:
            return 1.0
        g = op.gemm
        return min(1.0, op.forward_flops / (4.0 * g.m_per_sample * g.n * g.k * g.batch))

    @property
    def moe_layers(self) -> tuple[MoELayerFacts, ...]:
        """The routed-expert facts of every mixture-of-experts unit (empty: a dense model)."""
        return tuple(unit.moe for unit in self.units if unit.moe is not None)

    @property
    def has_experts(self) -> bool:
        """Whether any unit is a mixture-of-experts layer."""
        return any(unit.moe is not None for unit in self.units)

    def tp_divisible_counts(self) -> dict[str, int]:
        """Every count that a tensor-parallel degree must divide, over all units."""
        counts: dict[str, int] = {}
        for unit in self.units:
            counts.update(unit.tp.divisible_counts())
        return counts
