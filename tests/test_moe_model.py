"""Tests for the mixture-of-experts decoder `autoplan.models.moe`.

Parameter counts against the closed form and the published totals, routing against a naive
per-token loop with the same weights, the load-balancing loss against numbers worked by hand
and its gradient against autograd of the same formula, deterministic initialisation, the fx
graph (experts kept a leaf) run on real tensors, config validation, specs, and the long-context
Llama presets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from autoplan.models import (
    Llama,
    LlamaConfig,
    ModelSpecError,
    MoE,
    MoEConfig,
    MoEFeedForward,
    llama,
    moe,
    preset,
    preset_config,
)
from autoplan.models.moe import (
    GroupedExperts,
    attach_aux_loss,
    balanced_counts,
    load_balancing_loss,
    num_params_closed_form,
)
from autoplan.models.spec import build_model, parse_model_spec, spec_of
from autoplan.tracing.tracer import _Tracer

VOCAB = 97  # prime, so no dimension coincides with the vocabulary by accident
SEQ_LEN = 16


def tiny_moe(device: str = "cpu", **kw: Any) -> MoE:
    args: dict[str, Any] = dict(
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        seq_len=SEQ_LEN,
        vocab_size=VOCAB,
        num_experts=4,
        top_k=2,
        moe_ffn_hidden_size=24,
        num_kv_heads=2,
        ffn_hidden_size=48,
        num_shared_experts=1,
        num_dense_layers=1,
    )
    args.update(kw)
    return moe(device=device, **args)


def tokens(batch_size: int = 2, seq_len: int = SEQ_LEN, seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, seq_len), generator=gen)  # (B, T)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Structure and parameter counts
# ---------------------------------------------------------------------------------------------


def test_shapes_and_module_names() -> None:
    model = tiny_moe()
    logits = model(tokens())
    assert logits.shape == (2, SEQ_LEN, VOCAB)
    assert isinstance(model.blocks[0].mlp, nn.Module) and not isinstance(
        model.blocks[0].mlp, MoEFeedForward
    )
    layer = model.blocks[1].mlp
    assert isinstance(layer, MoEFeedForward)
    assert layer.num_experts == 4 and layer.top_k == 2
    assert isinstance(layer.router, nn.Linear) and layer.router.weight.shape == (4, 32)
    assert isinstance(layer.experts, GroupedExperts) and layer.experts.num_experts == 4
    assert layer.experts.w_gate.shape == (4, 24, 32) == layer.experts.w_up.shape
    assert layer.experts.w_down.shape == (4, 32, 24)
    assert layer.shared_expert is not None and layer.shared_expert.gate_proj.out_features == 24
    names = {name for name, _ in model.named_modules()}
    for name in ("tok_emb", "blocks.1.attn.q_proj", "blocks.1.attn_norm", "blocks.1.mlp_norm"):
        assert name in names
    assert {"norm", "lm_head", "blocks.2.mlp.experts", "blocks.2.mlp.router"} <= names


def test_preset_counts_match_the_closed_form_exactly() -> None:
    # Hand-checked: Mixtral per layer 2*4096^2 + 2*4096*1024 (attention) + 2*4096 (norms) +
    # 4096*8 (router) + 8*3*4096*14336 (experts) = 1,451,270,144; x32 + 2*32000*4096 + 4096.
    assert num_params(preset("mixtral-8x7b")) == 46_702_792_704
    assert num_params_closed_form(preset_config("mixtral-8x7b")) == 46_702_792_704  # type: ignore[arg-type]
    # DeepSeekMoE 16B: a dense first layer (3*2048*10944 FFN), 27 MoE layers of 64 experts of
    # 3*2048*1408 plus a shared expert of 3*2048*2816 and a router of 2048*64.
    assert num_params(preset("deepseek-moe-16b")) == 16_375_728_128
    config = preset_config("deepseek-moe-16b")
    assert isinstance(config, MoEConfig) and num_params_closed_form(config) == 16_375_728_128


@settings(max_examples=20, deadline=None)
@given(
    num_layers=st.integers(1, 3),
    dense=st.integers(0, 2),
    num_kv_heads=st.integers(1, 2),
    group=st.integers(1, 2),
    head_dim=st.sampled_from([2, 4]),
    num_experts=st.integers(1, 5),
    top_k=st.integers(1, 5),
    shared=st.integers(0, 2),
    tie=st.booleans(),
)
def test_closed_form_holds_off_the_presets(
    num_layers: int,
    dense: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_experts: int,
    top_k: int,
    shared: int,
    tie: bool,
) -> None:
    heads = num_kv_heads * group
    model = moe(
        num_layers + dense, heads * head_dim, heads, 7, VOCAB, num_experts,
        min(top_k, num_experts), 5,
        num_kv_heads=num_kv_heads, ffn_hidden_size=9, num_shared_experts=shared,
        num_dense_layers=dense, tie_embeddings=tie,
    )  # fmt: skip
    assert num_params(model) == num_params_closed_form(model.config)


def test_rope_tables_are_llamas() -> None:
    m = tiny_moe()
    ref = llama(3, 32, 4, SEQ_LEN, VOCAB, num_kv_heads=2, ffn_hidden_size=48, device="cpu")
    assert isinstance(ref, Llama)
    torch.testing.assert_close(m.rope_cos, ref.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(m.rope_sin, ref.rope_sin, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Routing against a naive per-token reference
# ---------------------------------------------------------------------------------------------


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """x (H,), gate/up (F, H), down (H, F) -> (H,)."""
    return down @ (F.silu(gate @ x) * (up @ x))


def naive_moe(layer: MoEFeedForward, x: Tensor) -> Tensor:
    """One token at a time: softmax of the router, the top-k experts by probability, their
    (renormalised) probabilities as weights, plus the shared expert."""
    out = torch.zeros_like(x)
    experts = layer.experts
    flat, flat_out = x.reshape(-1, x.size(-1)), out.view(-1, x.size(-1))
    for t in range(flat.size(0)):
        probs = F.softmax((layer.router.weight @ flat[t]).float(), dim=-1)
        chosen = sorted(range(layer.num_experts), key=lambda e: -float(probs[e]))[: layer.top_k]
        weights = torch.stack([probs[e] for e in chosen])
        if layer.norm_topk_prob:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights, strict=True):
            y = swiglu(flat[t], experts.w_gate[e], experts.w_up[e], experts.w_down[e])
            flat_out[t] += w * y
        if layer.shared_expert is not None:
            flat_out[t] += layer.shared_expert(flat[t])
    return out


@pytest.mark.parametrize(
    ("top_k", "shared", "norm"), [(2, 1, True), (1, 0, True), (3, 2, False), (4, 0, False)]
)
def test_top_k_routing_matches_a_per_token_loop(top_k: int, shared: int, norm: bool) -> None:
    model = tiny_moe(top_k=top_k, num_shared_experts=shared, norm_topk_prob=norm)
    model.init_weights(seed=1)
    layer = model.blocks[1].mlp
    assert isinstance(layer, MoEFeedForward)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = layer(x)
        expected = naive_moe(layer, x)
    # Same float32 products, summed in a different order: a few ulps of the outputs.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_grouped_experts_run_each_block_of_rows_through_its_expert() -> None:
    experts = GroupedExperts(3, 8, 6)
    gen = torch.Generator().manual_seed(0)
    for p in experts.parameters():
        with torch.no_grad():
            p.normal_(generator=gen)
    x = torch.randn(7, 8, generator=gen)
    counts = torch.tensor([2, 0, 5])  # expert 1 gets no rows
    y = experts(x, counts)
    owner = [0, 0, 2, 2, 2, 2, 2]
    for row, e in enumerate(owner):
        ref = swiglu(x[row], experts.w_gate[e], experts.w_up[e], experts.w_down[e])
        torch.testing.assert_close(y[row], ref, rtol=1e-5, atol=1e-5)


def test_balanced_counts_on_meta() -> None:
    assert balanced_counts(24, 4) == [6, 6, 6, 6]
    assert balanced_counts(10, 4) == [3, 3, 2, 2] and sum(balanced_counts(10, 4)) == 10
    experts = GroupedExperts(4, 8, 6).to("meta")
    y = experts(torch.empty(10, 8, device="meta"), torch.empty(4, dtype=torch.long, device="meta"))
    assert y.shape == (10, 8) and y.is_meta


# ---------------------------------------------------------------------------------------------
# Load-balancing loss
# ---------------------------------------------------------------------------------------------


def test_aux_loss_value_by_hand() -> None:
    # 4 tokens, 2 experts, top-1: counts (3, 1) -> f = (0.75, 0.25); mean probs P = (0.6, 0.4).
    # coef * E * sum f P = 0.01 * 2 * (0.45 + 0.1) = 0.011.
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]])
    counts = torch.tensor([3, 1])
    assert load_balancing_loss(probs, counts, 0.01).item() == pytest.approx(0.011, rel=1e-6)
    # Perfect balance gives exactly coef (f = P = 1 / E).
    uniform = torch.full((6, 3), 1 / 3)
    assert load_balancing_loss(uniform, torch.tensor([4, 4, 4]), 0.02).item() == pytest.approx(
        0.02, rel=1e-6
    )


def test_aux_loss_gradient_reaches_the_router() -> None:
    """Backward of (output).sum() with the aux loss attached equals, on the router weight, the
    gradient without it plus autograd's gradient of the same formula."""
    coef = 0.5  # large, so the term is far above rounding
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))

    def router_grad(aux_coef: float) -> Tensor:
        model = tiny_moe(router_aux_loss_coef=aux_coef)
        model.init_weights(seed=4)
        layer = model.blocks[1].mlp
        assert isinstance(layer, MoEFeedForward)
        layer(x).sum().backward()
        assert layer.router.weight.grad is not None
        return layer.router.weight.grad

    with_aux, without = router_grad(coef), router_grad(0.0)
    model = tiny_moe(router_aux_loss_coef=coef)
    model.init_weights(seed=4)
    layer = model.blocks[1].mlp
    assert isinstance(layer, MoEFeedForward)
    probs = F.softmax(layer.router(x.reshape(-1, 32)).float(), dim=-1)
    ids = probs.topk(layer.top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=layer.num_experts)
    (aux_grad,) = torch.autograd.grad(load_balancing_loss(probs, counts, coef), layer.router.weight)
    assert aux_grad.abs().sum() > 0
    torch.testing.assert_close(with_aux - without, aux_grad, rtol=1e-4, atol=1e-6)


def test_the_model_returns_logits_only_and_trains() -> None:
    model = tiny_moe()
    model.init_weights(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = tokens()
    losses = []
    for _ in range(3):
        logits = model(ids)
        assert isinstance(logits, Tensor)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------------------------
# Initialisation, tracing, validation, specs
# ---------------------------------------------------------------------------------------------


def test_init_is_deterministic_per_seed_and_matches_meta_then_materialise() -> None:
    a, b = tiny_moe(), tiny_moe()
    a.init_weights(seed=7)
    b.init_weights(seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    b.init_weights(seed=8)
    assert not torch.equal(a.blocks[1].mlp.experts.w_gate, b.blocks[1].mlp.experts.w_gate)
    meta = tiny_moe(device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights(seed=7)
    for pa, pm in zip(a.parameters(), meta.parameters(), strict=True):
        torch.testing.assert_close(pa, pm, rtol=0, atol=0)
    torch.testing.assert_close(a.rope_cos, meta.rope_cos, rtol=0, atol=0)
    # The experts' output projection gets GPT-2's scaled residual std, like down_proj.
    std = a.blocks[1].mlp.experts.w_down.std().item()
    assert std == pytest.approx(0.02 / (2 * 3) ** 0.5, rel=0.2)


def test_fx_graph_with_experts_as_a_leaf_runs_like_the_model() -> None:
    model = tiny_moe()
    model.init_weights(seed=5)
    graph = _Tracer(frozenset(), (GroupedExperts,)).trace(model)
    gm = torch.fx.GraphModule(model, graph)
    ids = tokens(seed=6)
    torch.testing.assert_close(gm(ids), model(ids), rtol=0, atol=0)
    targets = [n.target for n in graph.nodes if n.op == "call_module"]
    assert "blocks.1.mlp.experts" in targets and "blocks.2.mlp.experts" in targets
    # The aux loss is one call in the graph, and backward through the graph adds its gradient
    # exactly as the eager model does (the passes run this graph, split into stages).
    assert [n.target for n in graph.nodes if n.op == "call_function"].count(attach_aux_loss) == 2
    gm(ids).sum().backward()
    graph_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    model(ids).sum().backward()
    eager_grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(graph_grads) == len(eager_grads) == len(list(model.parameters()))
    for got, expected in zip(graph_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"top_k": 5}, "top_k (5) must be <= num_experts (4)"),
        ({"num_dense_layers": 3}, "num_dense_layers (3) must be < num_layers (3)"),
        ({"num_shared_experts": -1}, "num_shared_experts must be a whole number >= 0"),
        ({"num_experts": 0}, "num_experts must be a positive int"),
        ({"moe_ffn_hidden_size": 0}, "moe_ffn_hidden_size must be a positive int"),
        ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef must be a number in [0, 1000)"),
        ({"norm_topk_prob": 1}, "norm_topk_prob must be a bool"),
        ({"num_kv_heads": 3}, "divisible by num_kv_heads"),
    ],
)
def test_bad_configs_raise_model_spec_error(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ModelSpecError) as caught:
        tiny_moe(device="meta", **overrides)
    assert fragment in str(caught.value)


def test_bad_moe_spec_names_the_rule() -> None:
    with pytest.raises(ModelSpecError, match=r"top_k \(9\) must be <= num_experts \(8\)"):
        build_model("mixtral-8x7b:top_k=9")


def test_specs_round_trip() -> None:
    assert spec_of(preset("deepseek-moe-16b")) == "deepseek-moe-16b"
    model = build_model("mixtral-8x7b:num_layers=2,seq_len=1024")
    assert isinstance(model, MoE) and len(model.blocks) == 2
    assert spec_of(model) == "mixtral-8x7b:num_layers=2,seq_len=1024"
    tiny = tiny_moe(device="meta")
    spec = spec_of(tiny)
    assert spec is not None and spec.startswith("moe:")
    rebuilt = build_model(spec)
    assert isinstance(rebuilt, MoE) and rebuilt.config == tiny.config
    parsed = parse_model_spec(
        "moe:num_layers=2,hidden_size=32,num_heads=4,seq_len=8,"
        "vocab_size=16,num_experts=4,top_k=2,moe_ffn_hidden_size=8"
    )
    assert parsed.is_builder
    with pytest.raises(ModelSpecError, match="missing: num_experts, top_k, moe_ffn_hidden_size"):
        build_model("moe:num_layers=2,hidden_size=32,num_heads=4,seq_len=8,vocab_size=16")


def test_presets_are_the_sourced_numbers() -> None:
    mixtral = preset_config("mixtral-8x7b")
    assert isinstance(mixtral, MoEConfig)
    assert (mixtral.num_experts, mixtral.top_k, mixtral.num_shared_experts) == (8, 2, 0)
    assert (mixtral.moe_ffn_hidden_size, mixtral.seq_len, mixtral.num_kv_heads) == (14336, 32768, 8)
    deepseek = preset_config("deepseek-moe-16b")
    assert isinstance(deepseek, MoEConfig)
    assert (deepseek.num_experts, deepseek.top_k, deepseek.num_shared_experts) == (64, 6, 2)
    assert (deepseek.num_dense_layers, deepseek.moe_ffn_hidden_size) == (1, 1408)
    assert deepseek.shared_ffn_hidden_size == 2816 and not deepseek.norm_topk_prob


@pytest.mark.parametrize(
    ("name", "base", "seq_len"),
    [
        ("llama3-8b-32k", "llama3-8b", 32768),
        ("llama3-8b-64k", "llama3-8b", 65536),
        ("llama3-8b-128k", "llama3-8b", 131072),
        ("llama3-70b-128k", "llama3-70b", 131072),
        ("llama3-405b-128k", "llama3-405b", 131072),
    ],
)
def test_long_context_presets_build_on_meta(name: str, base: str, seq_len: int) -> None:
    config = preset_config(name)
    assert isinstance(config, LlamaConfig) and config.seq_len == seq_len
    assert dataclasses.replace(config, seq_len=8192) == preset_config(base)
    model = preset(name, num_layers=1)  # one block: the RoPE tables are what grows
    assert isinstance(model, Llama) and model.rope_cos.shape == (seq_len, config.head_dim)
    assert all(p.is_meta for p in model.parameters())
    assert spec_of(preset(name, num_layers=1)) == f"{name}:num_layers=1"


# ---------------------------------------------------------------------------------------------
# Parity with Hugging Face's Mixtral (built from a config, nothing downloaded)
# ---------------------------------------------------------------------------------------------


def test_matches_hf_mixtral_logits_gradients_and_aux_loss() -> None:
    transformers = pytest.importorskip("transformers")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    torch.manual_seed(0)
    # No aux loss in our backward: HF adds its own (pooled over layers) only to a labelled loss.
    zoo = tiny_moe(
        num_layers=2, num_shared_experts=0, num_dense_layers=0, rope_theta=1e6, top_k=2,
        router_aux_loss_coef=0.0,
    ).eval()  # fmt: skip
    zoo.init_weights(seed=0)
    config = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=24, vocab_size=VOCAB, max_position_embeddings=SEQ_LEN,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    hf = transformers.MixtralForCausalLM(config).eval()
    assert num_params(zoo) == num_params(hf)
    names = {  # ours -> theirs
        "tok_emb": "model.embed_tokens", "norm": "model.norm", "blocks": "model.layers",
        "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
        "attn": "self_attn", "router": "gate",
    }  # fmt: skip
    state: dict[str, Tensor] = {}
    for key, value in zoo.state_dict().items():
        if key.endswith("experts.w_gate") or key.endswith("experts.w_up"):
            continue
        if key.endswith("experts.w_down"):
            prefix = ".".join(names.get(p, p) for p in key.split(".")[:-1])
            experts = zoo.get_submodule(key.rpartition(".")[0])
            assert isinstance(experts, GroupedExperts)
            # HF packs gate and up along the output features, gate first: (E, 2F, H).
            state[f"{prefix}.gate_up_proj"] = torch.cat((experts.w_gate, experts.w_up), dim=1)
            state[f"{prefix}.down_proj"] = value
            continue
        state[".".join(names.get(part, part) for part in key.split("."))] = value
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    x = tokens()
    ours = zoo(x)
    out = hf(x, output_router_logits=True)
    # Same float32 ops up to summation order: default float32 tolerances of assert_close.
    torch.testing.assert_close(ours, out.logits)
    # HF's aux loss pools every layer's router outputs: E * sum_e (count_e / N) P_e over all
    # layers' N tokens, which is top_k times ours without the coefficient (ours counts the
    # fraction of the N * top_k assignments) on the same pooled probabilities and counts.
    hf_aux = mixtral.load_balancing_loss_func(out.router_logits, 4, 2)
    pooled_probs, pooled_counts = [], []
    hidden = zoo.tok_emb(x)
    with torch.no_grad():
        for block in zoo.blocks:
            hidden = hidden + block.attn(block.attn_norm(hidden), zoo.rope_cos, zoo.rope_sin)
            layer = block.mlp
            assert isinstance(layer, MoEFeedForward)
            probs = F.softmax(layer.router(block.mlp_norm(hidden).reshape(-1, 32)).float(), -1)
            ids = probs.topk(2, dim=-1).indices.reshape(-1)
            pooled_probs.append(probs)
            pooled_counts.append(torch.bincount(ids, minlength=4))
            hidden = hidden + layer(block.mlp_norm(hidden))
    ours_aux = load_balancing_loss(torch.cat(pooled_probs), sum(pooled_counts), 1.0)
    torch.testing.assert_close(2 * ours_aux, hf_aux)
    ours.square().mean().backward()
    out.logits.square().mean().backward()
    torch.testing.assert_close(zoo.tok_emb.weight.grad, hf.model.embed_tokens.weight.grad)
    for ours_block, hf_layer in zip(zoo.blocks, hf.model.layers, strict=True):
        layer = ours_block.mlp
        assert isinstance(layer, MoEFeedForward) and layer.router.weight.grad is not None
        torch.testing.assert_close(layer.router.weight.grad, hf_layer.mlp.gate.weight.grad)
        torch.testing.assert_close(layer.experts.w_down.grad, hf_layer.mlp.experts.down_proj.grad)


# ---------------------------------------------------------------------------------------------
# Explicit head_dim (Qwen3-MoE)
# ---------------------------------------------------------------------------------------------


def test_explicit_head_dim_shapes_params_trace_and_spec() -> None:
    # Qwen3-30B-A3B's shape at small scale: 8 heads of 8 over hidden 32 (q 32 -> 64, o 64 -> 32)
    model = tiny_moe(num_heads=8, num_kv_heads=2, head_dim=8)
    config = model.config
    assert config.head_dim == 8 and config.llama_view().head_dim == 8
    for block in model.blocks:
        attn = block.attn
        assert attn.q_proj.weight.shape == (64, 32) and attn.o_proj.weight.shape == (32, 64)
        assert attn.k_proj.weight.shape == (16, 32) == attn.v_proj.weight.shape
    assert model.rope_cos.shape == (SEQ_LEN, 8)
    assert num_params(model) == num_params_closed_form(config)
    logits = model(tokens())
    assert logits.shape == (2, SEQ_LEN, VOCAB) and torch.isfinite(logits).all()
    spec = spec_of(model)
    assert spec is not None and "head_dim=8" in spec
    rebuilt = build_model(spec)
    assert isinstance(rebuilt, MoE) and rebuilt.config == config
    # the trace sees the q/o projections' real widths (2 x 32 x 64 FLOPs per token each)
    from autoplan.tracing import trace

    meta = tiny_moe(device="meta", num_heads=8, num_kv_heads=2, head_dim=8)
    profile = trace(meta).profile
    assert profile.num_params == num_params_closed_form(config)
    default = trace(tiny_moe(device="meta", num_heads=8, num_kv_heads=2)).profile
    blocks = [u for u in profile.units if u.kind == "block"]
    blocks_default = [u for u in default.units if u.kind == "block"]
    assert profile.num_heads == 8 and profile.num_kv_heads == 2
    # wider heads: more projection and attention-core FLOPs than the default head_dim 4
    delta = blocks[0].forward_flops - blocks_default[0].forward_flops
    assert delta > 0


def test_qwen3_30b_a3b_closed_form() -> None:
    # Qwen3-30B-A3B (NVIDIA/NeMo qwen3.py Qwen3Config30B_A3B: 48 layers, hidden 2048, 32 heads of
    # kv_channels 128, 4 query groups, 128 experts top-8 of 768, vocab 151936): per layer
    # q/o 2*2048*4096 + k/v 2*2048*512 + norms 2*2048 + router 2048*128 + experts
    # 128*3*2048*768; untied embeddings 2*151936*2048, final norm 2048 (Qwen3's q/k norms,
    # 2 x 128 weights per layer, are not modelled).
    model = moe(48, 2048, 32, 4096, 151936, 128, 8, 768, num_kv_heads=4, head_dim=128)
    assert num_params(model) == num_params_closed_form(model.config) == 30_532_110_336
