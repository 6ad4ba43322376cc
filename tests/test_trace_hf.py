"""`autoplan.trace` on Hugging Face models (torch.export front end): tiny GPT2LMHeadModel and
LlamaForCausalLM built from configs on meta (no downloads) give the same units, FLOPs and TP
structure as the zoo's equivalents."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autoplan.models import gpt, llama
from autoplan.tracing import ModelGraph, trace

transformers = pytest.importorskip("transformers")

S, H, HEADS, V = 32, 64, 4, 128


def _hf_gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=H, n_head=HEADS, vocab_size=V, n_positions=S,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def _hf_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2,
        intermediate_size=256, vocab_size=V, max_position_embeddings=S,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _attention(unit: Any, direction: str) -> float:
    return sum(getattr(op, f"{direction}_flops") for op in unit.ops if op.kind == "attention")


def _same_costs(hf: ModelGraph, zoo: ModelGraph) -> None:
    """Equal costs, but for attention: the exported graph carries Hugging Face's causal mask
    as a tensor, which a masked kernel applies to the whole square (what autoplan's runtime
    runs from that graph), where the zoo's ``is_causal`` kernel computes s (s + 1) / 2 of the
    s^2 scores (autoplan.tracing.op_flops.causal_fraction)."""
    assert hf.front_end == "export" and zoo.front_end == "fx"
    assert [u.kind for u in hf.profile.units] == [u.kind for u in zoo.profile.units]
    square = 2 * S / (S + 1)
    for ours, theirs in zip(hf.profile.units, zoo.profile.units, strict=True):
        for direction in ("forward", "backward"):
            a_ours, a_theirs = _attention(ours, direction), _attention(theirs, direction)
            assert a_ours == pytest.approx(a_theirs * square, rel=1e-6)
            rest_ours = getattr(ours, f"{direction}_flops") - a_ours
            rest_theirs = getattr(theirs, f"{direction}_flops") - a_theirs
            assert rest_ours == pytest.approx(rest_theirs, rel=0.02)
        assert ours.num_params == theirs.num_params
        assert ours.num_params_tp_sharded == theirs.num_params_tp_sharded
        assert ours.tp.divisible_counts() == theirs.tp.divisible_counts()
    assert hf.profile.num_params == zoo.profile.num_params
    assert hf.profile.fingerprint != ""


def test_hf_gpt2_matches_zoo_gpt() -> None:
    hf = trace(_hf_gpt2(), seq_len=S)
    zoo = trace(gpt(num_layers=2, hidden_size=H, num_heads=HEADS, seq_len=S, vocab_size=V))
    _same_costs(hf, zoo)
    assert [u.name for u in hf.profile.units] == [
        "embedding",
        "transformer.h.0",
        "transformer.h.1",
        "head",
    ]
    block = hf.profile.units[1]
    # GPT-2's fused Conv1D projections: c_attn packs q, k and v along its output features.
    assert [(t.path, t.style, t.fused) for t in block.tp.linears] == [
        ("attn.c_attn", "column", 3),
        ("attn.c_proj", "row", 1),
        ("mlp.c_fc", "column", 1),
        ("mlp.c_proj", "row", 1),
    ]
    assert (block.tp.num_heads, block.tp.num_kv_heads, block.tp.ffn_hidden_size) == (4, 4, 256)
    head = hf.profile.units[-1]
    assert head.num_params_shared == V * H  # lm_head is tied to wte
    assert hf.unit_modules[0] == ("transformer.wte", "transformer.wpe")
    # Every node of the exported graph has a unit, and units run in order.
    for node in hf.graph_module.graph.nodes:
        for arg in node.all_input_nodes:
            assert hf.unit_of(arg) <= hf.unit_of(node) or node.op == "output"


def test_hf_llama_matches_zoo_llama() -> None:
    hf = trace(_hf_llama(), seq_len=S)
    zoo = trace(
        llama(num_layers=2, hidden_size=H, num_heads=HEADS, num_kv_heads=2, seq_len=S,
              vocab_size=V, ffn_hidden_size=256)
    )  # fmt: skip
    _same_costs(hf, zoo)
    block = hf.profile.units[1]
    assert [(t.path, t.style) for t in block.tp.linears] == [
        ("self_attn.q_proj", "column"),
        ("self_attn.k_proj", "column"),
        ("self_attn.v_proj", "column"),
        ("self_attn.o_proj", "row"),
        ("mlp.gate_proj", "column"),
        ("mlp.up_proj", "column"),
        ("mlp.down_proj", "row"),
    ]
    assert (hf.profile.num_heads, hf.profile.num_kv_heads) == (4, 2)
    # Hugging Face computes RoPE cos/sin once, before the blocks: they cross every cut between
    # blocks, on top of the hidden states (the zoo reads its tables as buffers in each block).
    hidden = S * H * 4
    assert zoo.profile.units[1].output_bytes == hidden
    assert hf.profile.units[1].output_bytes > hidden
    # Saved activations agree within 10% (the cos/sin tables are saved by every block).
    for ours, theirs in zip(hf.profile.units, zoo.profile.units, strict=True):
        assert ours.saved_bytes == pytest.approx(theirs.saved_bytes, rel=0.10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_mixture_of_experts_counts_its_experts(dtype: torch.dtype) -> None:
    """Hugging Face's MoE blocks run the experts as one grouped GEMM (aten._grouped_mm, or
    transformers' own grouped_mm_fallback op in fp32): a Mixtral block costs a Mistral block of
    the same sizes plus top_k - 1 more SwiGLU FFNs and the router, forward and backward (both
    gradients of each grouped GEMM, the weight's through its transpose)."""
    sizes = dict(
        num_hidden_layers=1, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2,
        intermediate_size=128, vocab_size=V, max_position_embeddings=S,
    )  # fmt: skip
    experts, top_k = 4, 2
    with torch.device("meta"):
        moe = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                num_local_experts=experts, num_experts_per_tok=top_k, **sizes
            )
        ).to(dtype)
        dense = transformers.MistralForCausalLM(transformers.MistralConfig(**sizes)).to(dtype)
    block_moe = trace(moe, seq_len=S).profile.units[1]
    block_dense = trace(dense, seq_len=S).profile.units[1]
    ffn = 3 * 2 * S * H * 128  # gate, up and down projections of one token each
    router = 2 * S * H * experts
    extra = block_moe.forward_flops - block_dense.forward_flops
    assert extra == pytest.approx((top_k - 1) * ffn + router, rel=1e-6)
    # backward: a data and a weight gradient per GEMM (the router's input gradient and the
    # routing's element-wise work aside: within 1%)
    extra_backward = block_moe.backward_flops - block_dense.backward_flops
    assert extra_backward == pytest.approx(2 * ((top_k - 1) * ffn + router), rel=0.01)
    assert (
        block_moe.num_params == block_dense.num_params + (experts - 1) * 3 * H * 128 + H * experts
    )


def test_a_sequence_past_the_learned_positions_is_refused() -> None:
    """GPT-2 looks positions up in its wpe table: a longer sequence would index past it."""
    from autoplan.contract.errors import TraceError

    with pytest.raises(TraceError, match=rf"sequence length {2 * S} exceeds the {S} learned "
                       r"positions of GPT2LMHeadModel \(transformer.wpe"):  # fmt: skip
        trace(_hf_gpt2(), seq_len=2 * S)
    assert trace(_hf_gpt2(), seq_len=S).profile.units


def test_an_encoder_decoder_model_is_refused_by_name() -> None:
    from autoplan.contract.errors import TraceError

    config = transformers.T5Config(num_layers=1, d_model=H, num_heads=HEADS, d_ff=128, vocab_size=V)
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(TraceError, match=r"T5ForConditionalGeneration is an encoder-decoder"):
        trace(model, seq_len=S)
