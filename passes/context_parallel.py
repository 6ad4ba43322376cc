"""Context-parallel pass: split the sequence over a cp group and run ring attention.

Expects a model whose attention sites are either
- eager modules with an ``attention_core(q, k, v)`` attribute (the zoo's llama-style
  ``Attention``, also used by the MoE model): q (B, nh, T, hd), k and v (B, nkv, T, hd) after
  RoPE and before the grouped-query repeat; or
- ``fx.GraphModule`` units (from `split_stages`) that call causal
  ``F.scaled_dot_product_attention`` (its k/v inputs may be ``repeat_interleave`` calls: the GQA
  repeat, which the pass moves inside the ring so only kv heads travel);
and RoPE tables as buffers named ``rope_cos``/``rope_sin`` of shape (max_seq_len, hd) that the
attention narrows to the local length (``narrow(0, 0, T)``).

Guarantees:
- the sequence layout is torch's load-balanced causal sharding (head-tail): the global sequence
  of ``seq_len`` tokens is cut into ``2 * cp`` chunks and cp rank r keeps chunks r and
  ``2 cp - 1 - r`` (torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py,
  ``_HeadTailLoadBalancer._generate_indices``; tests compare the layouts). `shard_sequence`
  applies it to ids and labels, `unshard_sequence` inverts it;
- each RoPE table is replaced by this rank's rows of that layout (``seq_len / cp`` rows), so
  the unchanged ``narrow(0, 0, T)`` in the model takes the rank's global positions; the rows
  are a non-persistent buffer (as the zoo's tables are): a state dict, hence a checkpoint,
  never holds one rank's rows for every rank to load;
- every attention site runs `RingAttention`: exact causal attention of the local queries
  against the whole sequence (online-softmax / log-sum-exp merge), K/V blocks passed around
  the cp ring with ``batch_isend_irecv`` while the current block is computed (checked against
  a single process: loss and every gradient, tests/test_context_parallel.py);
- on CUDA (``backend="torch"``, the default there) the attention core is instead wrapped with
  torch's own ``_ContextParallel`` style (ring attention over the CUDA SDPA kernels), as
  torchtitan's ``apply_cp`` does; that path needs CUDA SDPA kernels and is not testable on
  this CPU-only machine (see /work/shared/notes/torch-2.13-distributed-on-cpu.md);
- bad input (``seq_len % (2 cp) != 0``, a RoPE table shorter than ``seq_len``, no attention
  site) raises `PlanError` before any collective.

Loss and gradients: each cp rank computes the mean loss over its ``seq_len / cp`` tokens; as
every rank has the same number of tokens, the mean over cp ranks of these losses is the global
mean, and the mean of their gradients is its gradient. The cp group therefore behaves like a
data-parallel group for weight gradients: either call `average_gradients` over the cp group
after backward (what the tests do), or fold cp into the data-parallel / FSDP mesh as
torchtitan does (its ``dp_shard_cp`` flattened mesh dim: FSDP's reduce-scatter then averages
over dp x cp). Pick one, never both.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import _attention as torch_cp
from torch.distributed.tensor.parallel import parallelize_module

from autoplan.contract.errors import PlanError

__all__ = [
    "ContextParallelResult",
    "RingAttention",
    "TorchContextParallelCore",
    "apply_context_parallel",
    "average_gradients",
    "check_context_parallel",
    "load_balanced_positions",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
]

logger = logging.getLogger(__name__)

CpBackend = Literal["ring", "torch"]
_ROPE_BUFFERS = ("rope_cos", "rope_sin")
_SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


# ---------------------------------------------------------------------------------------------
# Sequence layout


def check_context_parallel(seq_len: int, cp_degree: int) -> None:
    """Raise `PlanError` unless ``seq_len`` splits into ``2 * cp_degree`` equal chunks."""
    if cp_degree < 1:
        raise PlanError(f"cp_degree must be >= 1, got {cp_degree}")
    if seq_len % (2 * cp_degree):
        raise PlanError(
            f"context parallelism: seq_len {seq_len} is not divisible by 2 * cp_degree = "
            f"{2 * cp_degree}; load-balanced causal sharding cuts the sequence into 2 * cp "
            "chunks and gives cp rank r chunks r and 2 cp - 1 - r (torch's "
            "_HeadTailLoadBalancer): pick a cp_degree that divides seq_len / 2, or pad the "
            "sequence to a multiple of 2 * cp_degree"
        )


def load_balanced_positions(seq_len: int, cp_degree: int, cp_rank: int) -> Tensor:
    """Global positions (seq_len / cp,) int64 held by ``cp_rank``: chunk r, then chunk 2cp-1-r."""
    check_context_parallel(seq_len, cp_degree)
    if not 0 <= cp_rank < cp_degree:
        raise PlanError(f"cp_rank {cp_rank} is outside [0, {cp_degree})")
    chunk = seq_len // (2 * cp_degree)
    tail = 2 * cp_degree - 1 - cp_rank
    return torch.cat(
        (
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
            torch.arange(tail * chunk, (tail + 1) * chunk),
        )
    )


def shard_sequence(x: Tensor, cp_degree: int, cp_rank: int, *, seq_dim: int = 1) -> Tensor:
    """This cp rank's tokens of ``x`` along ``seq_dim`` (input ids, labels, position rows)."""
    positions = load_balanced_positions(x.size(seq_dim), cp_degree, cp_rank).to(x.device)
    return x.index_select(seq_dim, positions)


def unshard_sequence(shards: Sequence[Tensor], *, seq_dim: int = 1) -> Tensor:
    """Inverse of `shard_sequence`: every rank's shard, in cp-rank order -> the full tensor."""
    cp_degree = len(shards)
    seq_len = sum(shard.size(seq_dim) for shard in shards)
    order = torch.cat([load_balanced_positions(seq_len, cp_degree, r) for r in range(cp_degree)])
    stacked = torch.cat(list(shards), dim=seq_dim)  # layout order
    inverse = torch.argsort(order).to(stacked.device)
    return stacked.index_select(seq_dim, inverse)


# ---------------------------------------------------------------------------------------------
# Ring attention


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Ring:
    """A cp group seen from one rank: its place and its two ring neighbours (global ranks)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    next_peer: int
    prev_peer: int

    @staticmethod
    def of(group: dist.ProcessGroup) -> _Ring:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return _Ring(
            group=group,
            rank=rank,
            size=size,
            next_peer=dist.get_global_rank(group, (rank + 1) % size),
            prev_peer=dist.get_global_rank(group, (rank - 1) % size),
        )

    def start_shift(self, send: Tensor) -> tuple[Tensor, list[Any]]:
        """Send ``send`` to the next rank and receive the previous rank's (same shape)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next_peer, self.group),
            dist.P2POp(dist.irecv, recv, self.prev_peer, self.group),
        ]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _expand_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, nkv, S, hd) -> (B, nkv * n_rep, S, hd): GQA, query head i uses kv head i // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _fold_kv(x: Tensor, n_rep: int) -> Tensor:
    """Gradient of `_expand_kv`: sum each kv head's n_rep query-head copies."""
    if n_rep == 1:
        return x
    b, nh, s, hd = x.shape
    return x.view(b, nh // n_rep, n_rep, s, hd).sum(2)


def _causal_mask(size: int, device: torch.device) -> Tensor:
    """True where key j is in the future of query i (masked), for a diagonal block."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(1)


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor]:
    """Attention of q (B, nh, Sq, hd) on one K/V block; (out (B, nh, Sq, hd), lse (B, nh, Sq))."""
    n_rep = q.size(1) // k.size(1)
    scores = q @ _expand_kv(k, n_rep).transpose(-2, -1) * scale  # (B, nh, Sq, Sk)
    if causal:
        scores = scores.masked_fill(_causal_mask(q.size(2), q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, nh, Sq)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ _expand_kv(v, n_rep)
    return out, lse


def _block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of one block, recomputing its probabilities from the merged lse.

    FlashAttention-2's backward (Dao 2023, Algorithm 2): P = exp(S - lse), dV = P^T dO,
    dP = dO V^T, dS = P * (dP - delta) with delta = rowsum(dO * O), dQ = dS K, dK = dS^T Q
    (times the softmax scale).
    """
    n_rep = q.size(1) // k.size(1)
    k_e, v_e = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    scores = q @ k_e.transpose(-2, -1) * scale  # (B, nh, Sq, Sk)
    if causal:
        scores = scores.masked_fill(_causal_mask(q.size(2), q.device), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = probs.transpose(-2, -1) @ dout  # (B, nh, Sk, hd)
    dprobs = dout @ v_e.transpose(-2, -1)
    dscores = probs * (dprobs - delta.unsqueeze(-1))
    dq = dscores @ k_e * scale
    dk = dscores.transpose(-2, -1) @ q * scale
    return dq, _fold_kv(dk, n_rep), _fold_kv(dv, n_rep)


def _step_blocks(ring_rank: int, step: int, chunk: int) -> tuple[slice, slice, bool]:
    """Which local queries attend which part of the K/V block held at ``step``.

    At step i the block came from cp rank s = (r - i) mod cp. Under the head-tail layout rank r
    holds chunks (r, 2cp-1-r), the block chunks (s, 2cp-1-s). Per (query chunk, key chunk) pair:
    i = 0: the local block, causal on the whole (the two chunks are in increasing order);
    s < r (i <= r): both query chunks see key chunk s whole, key chunk 2cp-1-s is in the future
    of both; s > r: query chunk r sees neither key chunk, query chunk 2cp-1-r sees both whole.
    The same three cases as torch's ``_templated_ring_attention``.
    """
    everything = slice(None)
    if step == 0:
        return everything, everything, True
    if step <= ring_rank:
        return everything, slice(0, chunk), False
    return slice(chunk, None), everything, False


class _RingAttentionFunction(torch.autograd.Function):
    """Causal ring attention over a cp group; see `ring_attention`."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: _Ring) -> Tensor:
        dtype = q.dtype
        q, k, v = q.float(), k.float().contiguous(), v.float().contiguous()
        chunk = q.size(2) // 2
        scale = 1.0 / math.sqrt(q.size(-1))
        kv = torch.cat((k.flatten(), v.flatten()))
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        for step in range(ring.size):
            works: list[Any] = []
            if step < ring.size - 1:
                next_kv, works = ring.start_shift(kv)  # overlapped with this block's compute
            k_blk, v_blk = kv[: k.numel()].view_as(k), kv[k.numel() :].view_as(v)
            rows, cols, causal = _step_blocks(ring.rank, step, chunk)
            blk_out, blk_lse = _block_forward(
                q[:, :, rows], k_blk[:, :, cols], v_blk[:, :, cols], scale, causal
            )
            # Log-sum-exp merge of two partial softmaxes (online softmax, Milakov & Gimelshein
            # 2018): lse = log(e^a + e^b), out = out_a e^(a - lse) + out_b e^(b - lse).
            old_out, old_lse = out[:, :, rows], lse[:, :, rows]
            new_lse = torch.logaddexp(old_lse, blk_lse)
            out[:, :, rows] = old_out * torch.exp(old_lse - new_lse).unsqueeze(-1) + (
                blk_out * torch.exp(blk_lse - new_lse).unsqueeze(-1)
            )
            lse[:, :, rows] = new_lse
            if works:
                _wait(works)
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.dtype = dtype
        return out.to(dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        dout = dout.float()
        chunk = q.size(2) // 2
        scale = 1.0 / math.sqrt(q.size(-1))
        delta = (dout * out).sum(-1)  # (B, nh, S)
        dq = torch.zeros_like(q)
        kv = torch.cat((k.flatten(), v.flatten()))
        # The gradient of the K/V block held at each step travels with it around the ring and
        # collects every rank's contribution; after cp shifts it is back on its owner. The
        # probabilities are recomputed per block from the merged lse (nothing per block saved).
        dkv = torch.zeros_like(kv)
        for step in range(ring.size):
            kv_works: list[Any] = []
            if step < ring.size - 1:
                next_kv, kv_works = ring.start_shift(kv)
            k_blk, v_blk = kv[: k.numel()].view_as(k), kv[k.numel() :].view_as(v)
            rows, cols, causal = _step_blocks(ring.rank, step, chunk)
            dq_blk, dk_blk, dv_blk = _block_backward(
                q[:, :, rows],
                k_blk[:, :, cols],
                v_blk[:, :, cols],
                dout[:, :, rows],
                lse[:, :, rows],
                delta[:, :, rows],
                scale,
                causal,
            )
            dq[:, :, rows] += dq_blk
            dk_acc, dv_acc = dkv[: k.numel()].view_as(k), dkv[k.numel() :].view_as(v)
            dk_acc[:, :, cols] += dk_blk
            dv_acc[:, :, cols] += dv_blk
            if kv_works:
                _wait(kv_works)
                kv = next_kv
            if ring.size > 1:  # after the K/V shift completed: the two never share the wire
                dkv, dkv_works = ring.start_shift(dkv)
                _wait(dkv_works)
        dk, dv = dkv[: k.numel()].view_as(k), dkv[k.numel() :].view_as(v)
        return dq.to(ctx.dtype), dk.to(ctx.dtype), dv.to(ctx.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence held by ``group``.

    q (B, nh, S, hd), k and v (B, nkv, S, hd) with nkv dividing nh (GQA), all in the
    load-balanced layout (`shard_sequence`), S = seq_len / cp even. Returns (B, nh, S, hd),
    equal to the matching rows of ``F.scaled_dot_product_attention(..., is_causal=True)`` on
    the full sequence. Computes in fp32 (the block scores, the lse merge and the gradient
    accumulators), returns the input dtype. Forward: cp - 1 shifts of K/V; backward: cp - 1
    shifts of K/V (probabilities recomputed) and cp shifts of their gradients.
    """
    return _RingAttentionFunction.apply(q, k, v, _Ring.of(group))  # type: ignore[no-untyped-call,no-any-return]


class RingAttention(nn.Module):
    """`ring_attention` as a module: what the pass puts in place of an attention core."""

    def __init__(self, group: dist.ProcessGroup, local_seq_len: int) -> None:
        super().__init__()
        self.group = group
        self.local_seq_len = local_seq_len

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if q.size(2) != self.local_seq_len:
            raise PlanError(
                f"context parallelism was applied for {self.local_seq_len} tokens a rank, but "
                f"attention got {q.size(2)}: shard the batch with shard_sequence() for the "
                "seq_len given to apply_context_parallel, or apply it again for this length"
            )
        return ring_attention(q, k, v, self.group)

    def extra_repr(self) -> str:
        return f"cp_degree={dist.get_world_size(self.group)}, local_seq_len={self.local_seq_len}"


class _CausalSDPA(nn.Module):
    """Causal SDPA on equal head counts: the module torch's ``_ContextParallel`` wraps."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class TorchContextParallelCore(nn.Module):
    """The CUDA attention core: GQA repeat on local tensors, then torch's ring attention.

    torchtitan's apply_cp (torchtitan/distributed/context_parallel.py): enable torch's CP
    dispatcher and wrap the SDPA module with ``_ContextParallel(seq_dim=2, SDPA)``, which turns
    q/k/v into DTensors ``Shard(2)`` over the cp mesh and dispatches SDPA to ring attention over
    the CUDA flash / efficient / cuDNN kernels. Load balancing on, as ``_context_parallel_shard``
    with a ``_HeadTailLoadBalancer`` sets it (the layout of `shard_sequence`). Not testable on
    this CPU-only machine: the CPU SDPA kernel has no DTensor sharding strategy in torch 2.13
    (/work/shared/notes/torch-2.13-distributed-on-cpu.md); only its construction is tested.
    """

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        torch_cp._enable_context_parallel_dispatcher()
        torch_cp._cp_options.enable_load_balance = True
        style = torch_cp._ContextParallel(
            seq_dim=2, attention_type=torch_cp._ContextParallel.AttentionType.SDPA
        )
        self.sdpa = parallelize_module(_CausalSDPA(), cp_mesh, style)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n_rep = q.size(1) // k.size(1)
        out: Tensor = self.sdpa(q, _expand_kv(k, n_rep), _expand_kv(v, n_rep))
        return out


# ---------------------------------------------------------------------------------------------
# The pass


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextParallelResult:
    """What `apply_context_parallel` changed."""

    cp_degree: int
    cp_rank: int
    seq_len: int  # global sequence length the layout and the RoPE rows are for
    backend: CpBackend
    attention_sites: tuple[str, ...]  # module paths (eager) or "graph path:node" (fx)
    position_buffers: tuple[str, ...]  # RoPE tables replaced by this rank's rows

    def shard(self, x: Tensor, *, seq_dim: int = 1) -> Tensor:
        """This rank's tokens of ``x`` (ids, labels): `shard_sequence` for this layout."""
        if x.size(seq_dim) != self.seq_len:
            raise PlanError(
                f"context parallelism was applied for seq_len {self.seq_len}, the batch has "
                f"{x.size(seq_dim)} tokens along dim {seq_dim}"
            )
        return shard_sequence(x, self.cp_degree, self.cp_rank, seq_dim=seq_dim)

    def shard_buffer_values(self, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``values`` (buffer name -> full value, as `meta_buffer_values` returns them) with
        the RoPE tables the pass replaced cut to this rank's rows: what `materialize` must copy
        into the buffers when the pass ran on a meta model."""
        leaves = {path.rpartition(".")[2] for path in self.position_buffers}
        if self.cp_degree == 1 or not leaves:
            return dict(values)
        positions = load_balanced_positions(self.seq_len, self.cp_degree, self.cp_rank)
        return {
            name: (
                value.index_select(0, positions.to(value.device))
                if name.rpartition(".")[2] in leaves
                else value
            )
            for name, value in values.items()
        }


def _as_group(cp: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    if isinstance(cp, DeviceMesh):
        if cp.ndim != 1:
            raise PlanError(f"context parallelism needs a 1-D cp mesh, got {cp.ndim} dims")
        return cp.get_group()
    return cp


def _graph_attention_nodes(graph_module: fx.GraphModule) -> list[fx.Node]:
    nodes = [
        node
        for node in graph_module.graph.nodes
        if node.op == "call_function" and node.target in _SDPA_TARGETS
    ]
    for node in nodes:
        kwargs = dict(node.kwargs)
        extra = {k: v for k, v in kwargs.items() if k != "is_causal" and v not in (None, 0.0)}
        if kwargs.get("is_causal") is not True or len(node.args) > 3 or extra:
            raise PlanError(
                f"context parallelism supports causal attention without mask or dropout; "
                f"{node.name} calls scaled_dot_product_attention with args {node.args[3:]}, "
                f"kwargs {kwargs}: use cp_degree 1 for this model"
            )
    return nodes


def _unrepeat(node: Any) -> Any:
    """The kv tensor before the GQA repeat (``x.repeat_interleave(n, dim=1)``), if it is one."""
    if (
        isinstance(node, fx.Node)
        and node.op == "call_method"
        and node.target == "repeat_interleave"
        and node.kwargs.get("dim") == 1
    ):
        return node.args[0]
    return node


def _rewrite_graph(graph_module: fx.GraphModule, path: str, make_core: Any) -> list[str]:
    """Replace each causal SDPA call of ``graph_module`` by a call of a new core submodule."""
    sites = []
    for idx, node in enumerate(_graph_attention_nodes(graph_module)):
        name = f"context_parallel_attention_{idx}"
        graph_module.add_submodule(name, make_core())
        q, k, v = node.args[:3]
        with graph_module.graph.inserting_before(node):
            core = graph_module.graph.call_module(name, (q, _unrepeat(k), _unrepeat(v)))
        node.replace_all_uses_with(core)
        graph_module.graph.erase_node(node)
        sites.append(f"{path}:{node.name}")
    if sites:
        graph_module.graph.eliminate_dead_code()
        graph_module.graph.lint()
        graph_module.recompile()
    return sites


def _shard_position_buffers(
    module: nn.Module, names: Sequence[str], positions: Tensor
) -> tuple[str, ...]:
    """Replace every buffer called one of ``names`` by its rows ``positions`` (all checked
    first, so a failure changes nothing); a buffer shared by several owners stays shared."""
    found = [
        (path, owner, name, buffer)
        for path, owner in module.named_modules(remove_duplicate=False)
        for name, buffer in owner._buffers.items()
        if name in names and buffer is not None
    ]
    needed = int(positions.max()) + 1
    for path, _, name, buffer in found:
        if buffer.size(0) < needed:
            raise PlanError(
                f"context parallelism: RoPE table {path + '.' if path else ''}{name} has "
                f"{buffer.size(0)} rows, fewer than the sequence length {needed}: build the "
                "model with seq_len >= the training sequence length"
            )
    replaced: dict[int, Tensor] = {}
    for _, owner, name, buffer in found:
        if id(buffer) not in replaced:
            replaced[id(buffer)] = buffer.index_select(0, positions.to(buffer.device))
        owner._buffers[name] = replaced[id(buffer)]
        # this rank's rows are not the model's table: state dicts (checkpoints) leave them out
        owner._non_persistent_buffers_set.add(name)
    return tuple(f"{path}.{name}" if path else name for path, _, name, _ in found)


def apply_context_parallel(
    module: nn.Module,
    cp: DeviceMesh | dist.ProcessGroup,
    *,
    seq_len: int,
    backend: CpBackend | None = None,
    position_buffers: Sequence[str] = _ROPE_BUFFERS,
) -> ContextParallelResult:
    """Make ``module`` compute its share of a ``seq_len``-token sequence over the cp group.

    ``cp``: the 1-D cp sub-mesh (or its process group). ``backend``: "ring" (this module's
    P2P ring attention, any device), "torch" (torch's ``_ContextParallel``, CUDA only, needs a
    DeviceMesh); default "torch" when CUDA is available and ``cp`` is a mesh, else "ring".
    Run it after tensor parallelism (the ring sees the local heads). It replaces the RoPE
    buffers by their local rows, so on a meta model give `materialize` the values
    ``result.shard_buffer_values(buffers)``; an ``init_weights`` afterwards would rebuild full
    tables (and fail on the shapes). A no-op on a 1-rank group. Feed the model `shard_sequence`d
    ids and compute the loss against `shard_sequence`d labels.
    """
    group = _as_group(cp)
    cp_degree, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    check_context_parallel(seq_len, cp_degree)
    if backend is None:
        backend = "torch" if torch.cuda.is_available() and isinstance(cp, DeviceMesh) else "ring"
    if backend == "torch" and not (torch.cuda.is_available() and isinstance(cp, DeviceMesh)):
        raise PlanError(
            "context parallelism backend 'torch' (torch's _ContextParallel over the CUDA SDPA "
            "kernels) needs CUDA and a DeviceMesh; use backend 'ring' on CPU"
        )
    eager = [
        (path, sub)
        for path, sub in module.named_modules()
        if hasattr(sub, "attention_core") and not isinstance(sub, fx.GraphModule)
    ]
    graphs = [
        (path, sub) for path, sub in module.named_modules() if isinstance(sub, fx.GraphModule)
    ]
    done = [
        path
        for path, sub in module.named_modules()
        if isinstance(sub, RingAttention | TorchContextParallelCore)
    ]
    if done:
        raise PlanError(
            f"context parallelism is already applied to {type(module).__name__} ({done[0]}); "
            "applying it twice would shard the sequence and the RoPE tables twice"
        )
    if not eager and not any(_graph_attention_nodes(g) for _, g in graphs):
        raise PlanError(
            f"context parallelism found no attention in {type(module).__name__}: it needs "
            "modules with an attention_core(q, k, v) hook (the zoo's llama-style Attention) or "
            "a traced graph calling causal scaled_dot_product_attention; use cp_degree 1"
        )
    if not any(
        name in position_buffers for _, sub in module.named_modules() for name in sub._buffers
    ):
        raise PlanError(
            f"context parallelism found no RoPE table named {list(position_buffers)} in "
            f"{type(module).__name__}; positions would restart at 0 on every cp rank. Models "
            "with learned position embeddings (GPT) are not supported: use cp_degree 1"
        )
    positions = load_balanced_positions(seq_len, cp_degree, cp_rank)
    if cp_degree == 1:
        return ContextParallelResult(
            cp_degree=1,
            cp_rank=0,
            seq_len=seq_len,
            backend=backend,
            attention_sites=(),
            position_buffers=(),
        )
    local = seq_len // cp_degree

    def make_core() -> nn.Module:
        if backend == "torch":
            assert isinstance(cp, DeviceMesh)
            return TorchContextParallelCore(cp)
        return RingAttention(group, local)

    rope = _shard_position_buffers(module, position_buffers, positions)
    sites: list[str] = []
    for path, sub in eager:
        sub.attention_core = make_core()
        sites.append(path)
    for path, graph_module in graphs:
        sites.extend(_rewrite_graph(graph_module, path, make_core))
    logger.debug(
        "context parallel %d: %d attention sites, %d tables", cp_degree, len(sites), len(rope)
    )
    return ContextParallelResult(
        cp_degree=cp_degree,
        cp_rank=cp_rank,
        seq_len=seq_len,
        backend=backend,
        attention_sites=tuple(sites),
        position_buffers=rope,
    )


def average_gradients(module: nn.Module, group: dist.ProcessGroup) -> int:
    """All-reduce every gradient of ``module`` over ``group`` and divide by its size.

    For the cp group (each rank's loss is the mean over its own tokens) or any replica group
    without a data-parallel wrapper. A DTensor gradient is reduced through its local shard
    (tensor parallelism shards the same way on every cp rank). Returns the number reduced.
    """
    size = dist.get_world_size(group)
    count = 0
    with torch.no_grad():
        for param in module.parameters():
            if param.grad is None:
                continue
            # under no_grad, to_local() is the DTensor's own local tensor: reduced in place
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=group)
            grad.div_(size)
            count += 1
    return count
