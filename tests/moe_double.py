"""A private test double of the zoo's MoE interface (autoplan/models/moe.py, being written in
parallel): ``MoEFeedForward`` with ``router``, ``experts`` (``GroupedExperts`` with w_gate,
w_up (E, F, H), w_down (E, H, F)), ``shared_expert``, ``num_experts``, ``top_k``, and a tiny
decoder-free language model around it (embedding, pre-norm residual FFN blocks, head). The
expert-parallel tests only need the FFN interface; attention is irrelevant to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 64
HIDDEN = 16
FFN = 24
NUM_EXPERTS = 4
TOP_K = 2


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.randn(num_experts, ffn, hidden) * 0.2)
        self.w_up = nn.Parameter(torch.randn(num_experts, ffn, hidden) * 0.2)
        self.w_down = nn.Parameter(torch.randn(num_experts, hidden, ffn) * 0.2)

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        outputs = []
        counts = [int(c) for c in num_tokens_per_expert.tolist()]
        for e, x_e in enumerate(torch.split(x, counts, dim=0)):
            hidden = F.silu(x_e @ self.w_gate[e].t()) * (x_e @ self.w_up[e].t())
            outputs.append(hidden @ self.w_down[e].t())
        return torch.cat(outputs, dim=0)


class MoEFeedForward(nn.Module):
    def __init__(self, *, shared: bool) -> None:
        super().__init__()
        self.hidden_size = HIDDEN
        self.num_experts = NUM_EXPERTS
        self.top_k = TOP_K
        self.router = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)
        self.experts = GroupedExperts(NUM_EXPERTS, HIDDEN, FFN)
        self.shared_expert = SwiGLU(HIDDEN, FFN) if shared else None

    def forward(self, x: Tensor) -> Tensor:
        k = self.top_k
        x_flat = x.reshape(-1, self.hidden_size)  # (N, H)
        probs = F.softmax(self.router(x_flat).float(), dim=-1)  # (N, E)
        top = torch.topk(probs, k, dim=-1)
        top_probs, top_ids = top[0], top[1]  # (indexing, not unpacking: fx-traceable)
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)  # Mixtral renormalises
        flat_ids = top_ids.reshape(-1)  # (N k,)
        counts = flat_ids.new_zeros(self.num_experts).scatter_add_(
            0, flat_ids, torch.ones_like(flat_ids)
        )
        order = torch.argsort(flat_ids, stable=True)
        x_sorted = x_flat.index_select(0, order // k)
        y_sorted = self.experts(x_sorted, counts)
        y_assigned = y_sorted.index_select(0, torch.argsort(order))
        y = (y_assigned.view(-1, k, self.hidden_size) * top_probs.unsqueeze(-1)).sum(dim=1)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x_flat)
        return y.view_as(x)


class Block(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp_norm = nn.RMSNorm(HIDDEN)
        self.mlp = mlp

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class TinyMoE(nn.Module):
    """Block 0 dense (as DeepSeek's leading dense layers), 1 MoE + shared expert, 2 MoE."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(
            [
                Block(SwiGLU(HIDDEN, FFN)),
                Block(MoEFeedForward(shared=True)),
                Block(MoEFeedForward(shared=False)),
            ]
        )
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.tok_emb(input_ids)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.lm_head(self.norm(x))
        return logits


def tiny_moe() -> TinyMoE:
    torch.manual_seed(0)
    return TinyMoE()
