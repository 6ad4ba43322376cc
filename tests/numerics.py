"""Shared pieces of the distributed numerics tests: tiny models, plans, a training worker that
reports every gradient, a single-process reference, and the comparison.

A worker trains the model with `autoplan.parallelize` for a few optimizer steps and returns,
per step, the loss it saw and the full gradient of every parameter it holds (``full_tensor()``
for DTensors; each pipeline rank reports its own stages, so the parent has them all). The
reference trains a deep copy of the same initial weights on the same global batch with the same
optimizer in one process. ``assert_matches`` compares the loss on every rank and every gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from autoplan.contract.plan import Plan, Recompute, Schedule, even_stages

VOCAB = 64
SEQ = 16
HIDDEN = 32
HEADS = 4
NUM_BLOCKS = 2  # units: embedding, 2 blocks, head -> pp2 x 2 virtual stages fits
LR = 1e-2
STEPS = 3

# Tolerances. Everything runs in fp32 (eps 1.2e-7). Parallel runs sum the same terms in another
# order (data-parallel averaging, tensor-parallel partial sums, micro-batch accumulation), so a
# sum of n terms may differ by about n * eps * max|term|: measured up to 8e-7 absolute on
# gradients of magnitude up to ~0.3, after AdamW steps that carry step-0 differences into the
# weights. A real bug (a missing all-reduce, a gradient scaled by the micro-batch count, an
# untied copy drifting) changes gradients by 10% or more, far outside these bounds.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_model(name: str, *, device: str = "cpu", num_blocks: int = NUM_BLOCKS) -> nn.Module:
    """The tiny model ``name`` (``num_blocks`` blocks), its weights drawn from torch's global
    RNG seeded with 0."""
    torch.manual_seed(0)
    if name == "gpt":
        from autoplan.models import gpt

        return gpt(num_blocks, HIDDEN, HEADS, SEQ, VOCAB, device=device)
    if name == "gpt-untied":
        from autoplan.models import gpt

        return gpt(num_blocks, HIDDEN, HEADS, SEQ, VOCAB, device=device, tie_embeddings=False)
    if name == "llama":
        from autoplan.models import llama

        return llama(
            num_blocks, HIDDEN, HEADS, SEQ, VOCAB, num_kv_heads=2, ffn_hidden_size=64, device=device
        )
    if name in ("moe", "moe-noaux", "moe-mha"):
        from autoplan.models import moe

        # 1 dense layer then 2 MoE layers (4 experts, top-2, a shared expert), GQA attention;
        # "moe-noaux" without the load-balancing loss (it is a per-rank statistic: under
        # context parallelism no single-process run computes the same one); "moe-mha" with a
        # key/value head per query head (tp 4 divides them).
        return moe(
            num_blocks + 1,
            HIDDEN,
            HEADS,
            SEQ,
            VOCAB,
            num_experts=4,
            top_k=2,
            moe_ffn_hidden_size=24,
            num_kv_heads=HEADS if name == "moe-mha" else 2,
            ffn_hidden_size=64,
            num_shared_experts=1,
            num_dense_layers=1,
            router_aux_loss_coef=0.01 if name == "moe" else 0.0,
            device=device,
        )
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=num_blocks,
            n_embd=HIDDEN,
            n_head=HEADS,
            n_positions=SEQ,
            vocab_size=VOCAB,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
        )
        with torch.device(device):
            return GPT2LMHeadModel(config)
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        llama_config = LlamaConfig(
            num_hidden_layers=num_blocks,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            vocab_size=VOCAB,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        with torch.device(device):
            return LlamaForCausalLM(llama_config)
    raise ValueError(f"unknown test model {name!r}")


def row_paths(model: nn.Module) -> tuple[list[str], int]:
    """Residual-stream projections (row-parallel linears of blocks) and the block count, as
    `passes.init_full_model_` needs them, from the model's trace."""
    from autoplan.tracing import trace

    units = trace(model).profile.units
    rows = [
        f"{unit.name}.{linear.path}"
        for unit in units
        if unit.kind == "block"
        for linear in unit.tp.linears
        if linear.style == "row"
    ]
    return rows, sum(unit.kind == "block" for unit in units)


def logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    return out.logits if hasattr(out, "logits") else out  # type: ignore[no-any-return]


def batch(global_batch: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch of token ids and next-token targets (different per step)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_plan(
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    micro_batch: int = 1,
    num_micro_batches: int = 2,
    schedule: Schedule = "1f1b",
    virtual_stages: int = 1,
    recompute: Recompute = "none",
    zero: int = 0,
    sequence_parallel: bool = False,
    num_units: int = NUM_BLOCKS + 2,
    **overrides: Any,
) -> Plan:
    """A hand-written plan (no model reference, fp32): passes must accept one."""
    plan = Plan(
        dp_degree=dp,
        tp_degree=tp,
        pp_degree=pp,
        virtual_stages=virtual_stages,
        stages=even_stages(num_units, pp * virtual_stages, recompute),
        micro_batch_size=micro_batch,
        num_micro_batches=num_micro_batches,
        global_batch_size=micro_batch * num_micro_batches * dp,
        schedule=schedule,
        zero_stage=zero,
        sequence_parallel=sequence_parallel,
        dtype="fp32",
    )
    return dataclasses.replace(plan, **overrides) if overrides else plan


def optimizer_factory() -> Callable[..., torch.optim.Optimizer]:
    """AdamW with eps 1e-6 (default 1e-8). Adam's step m / (sqrt(v) + eps) is about +-lr for any
    |g| >> eps, so an element whose gradient is pure rounding noise (1e-9, an exact cancellation)
    would take a full step one way in one run and the other way in the other: with eps 1e-6 such
    elements stay in Adam's linear regime and reduction-order noise stays noise."""
    return functools.partial(torch.optim.AdamW, lr=LR, eps=1e-6)


def full_grads(named: Any) -> dict[str, torch.Tensor]:
    """Full gradients by name; a collective over each DTensor's mesh (all its ranks call it)."""
    grads = {}
    for name, param in named:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        grads[name] = grad.detach().clone()
    return grads


def train_worker(
    rank: int,
    world_size: int,
    model_name: str,
    plan_data: dict[str, Any],
    steps: int = STEPS,
    num_blocks: int = NUM_BLOCKS,
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Train with autoplan for ``steps`` steps; per step: the loss and this rank's gradients."""
    from autoplan.runtime.parallelizer import parallelize

    plan = Plan.from_data(plan_data)
    model = build_model(model_name, num_blocks=num_blocks)
    dist_model = parallelize(model, plan=plan, loss_fn=loss_fn, optimizer=optimizer_factory())
    records = []
    for step in range(steps):
        inputs, targets = batch(plan.global_batch_size, step)
        loss = dist_model.train_step(inputs, targets)
        records.append((float(loss), full_grads(dist_model.named_parameters())))
    return records


class Reference(NamedTuple):
    records: list[tuple[float, dict[str, torch.Tensor]]]  # per step: loss, grads by name
    aliases: list[set[str]]  # the names of each parameter (several if tied)


def refused_plan_worker(rank: int, world_size: int, plan_data: dict[str, Any]) -> dict[str, Any]:
    """`parallelize` of a meta llama under ``plan_data``, which must refuse it: the message, and
    whether the model was left on meta (the refusal came before anything was built)."""
    import pytest

    from autoplan.contract.errors import PlanError
    from autoplan.runtime.parallelizer import parallelize
    from passes import has_meta_tensors

    model = build_model("llama", device="meta")
    with pytest.raises(PlanError) as refused:
        parallelize(model, plan=Plan.from_data(plan_data), loss_fn=loss_fn)
    return {"message": str(refused.value), "meta": has_meta_tensors([model])}


def reference(
    model_name: str, global_batch: int, steps: int = STEPS, model: nn.Module | None = None
) -> Reference:
    """The same training in one process: per step the loss and every gradient, under every
    name a parameter has (a tied parameter appears under each of its names)."""
    model = model if model is not None else build_model(model_name)
    names_of: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), set()).add(name)
    optimizer = optimizer_factory()(model.parameters())
    records = []
    for step in range(steps):
        inputs, targets = batch(global_batch, step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(logits(model, inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        grads = {
            name: p.grad.detach().clone()
            for name, p in model.named_parameters(remove_duplicate=False)
            if p.grad is not None
        }
        records.append((loss.item(), grads))
        optimizer.step()
    return Reference(records=records, aliases=list(names_of.values()))


def _message(where: str, detail: str) -> str:
    return f"{where}: {detail}"


def assert_matches(
    results: list[list[tuple[float, dict[str, torch.Tensor]]]], expected: Reference
) -> None:
    """Every rank's loss and every gradient any rank reports equal the reference's, each step;
    every parameter of the reference is reported by some rank."""
    for step, (ref_loss, ref_grads) in enumerate(expected.records):
        seen: set[str] = set()
        for rank, records in enumerate(results):
            loss, grads = records[step]
            torch.testing.assert_close(
                torch.tensor(loss),
                torch.tensor(ref_loss),
                rtol=LOSS_RTOL,
                atol=LOSS_ATOL,
                msg=functools.partial(_message, f"loss, rank {rank}, step {step}"),
            )
            for name, grad in grads.items():
                assert name in ref_grads, f"rank {rank} reports unknown parameter {name!r}"
                torch.testing.assert_close(
                    grad,
                    ref_grads[name],
                    rtol=GRAD_RTOL,
                    atol=GRAD_ATOL,
                    msg=functools.partial(_message, f"grad of {name}, rank {rank}, step {step}"),
                )
                seen.add(name)
        # A tied parameter has several names; a report under any of them covers it.
        missing = [names for names in expected.aliases if not names & seen]
        assert not missing, f"step {step}: no rank reported gradients of {missing}"
