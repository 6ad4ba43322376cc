"""`autoplan.trace` on the zoo models: units, FLOPs against closed forms, TP structure, saved
activations against worked numbers and against autograd in a real CPU run, reuse of identical
blocks, cut bytes, fingerprints, and the fx graph's fitness for `split_module`."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import networkx as nx
import pytest
import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from autoplan.models import gpt, llama, moe, preset, preset_config
from autoplan.tracing import ModelGraph, trace
from autoplan.tracing import api as trace_api
from autoplan.tracing import meter as trace_meter
from autoplan.tracing import node_runner as trace_node_runner
from autoplan.tracing import profiler as trace_profiler
from autoplan.tracing.fingerprint import fingerprint
from autoplan.tracing.tracer import _Tracer, trace_model
from cost_model.workload import TpLinear

# A small GPT and Llama: s = 32 tokens, h = 64, 4 heads (head_dim 16), vocab 128.
S, H, HEADS, V = 32, 64, 4, 128


def small_gpt(num_layers: int = 2, device: str = "meta") -> nn.Module:
    return gpt(
        num_layers=num_layers,
        hidden_size=H,
        num_heads=HEADS,
        seq_len=S,
        vocab_size=V,
        device=device,
    )


def small_llama(num_layers: int = 2, device: str = "meta") -> nn.Module:
    return llama(
        num_layers=num_layers,
        hidden_size=H,
        num_heads=HEADS,
        num_kv_heads=2,
        seq_len=S,
        vocab_size=V,
        ffn_hidden_size=256,
        device=device,
    )


@pytest.fixture(scope="module")
def gpt_graph() -> ModelGraph:
    return trace(small_gpt())


@pytest.fixture(scope="module")
def llama_graph() -> ModelGraph:
    return trace(small_llama())


# ----------------------------------------------------------------------------- units


def test_units_of_gpt_and_llama(gpt_graph: ModelGraph, llama_graph: ModelGraph) -> None:
    for graph in (gpt_graph, llama_graph):
        units = graph.profile.units
        assert [u.name for u in units] == ["embedding", "blocks.0", "blocks.1", "head"]
        assert [u.kind for u in units] == ["embedding", "block", "block", "head"]
        assert graph.front_end == "fx"
    assert gpt_graph.unit_modules == (
        ("tok_emb", "pos_emb"),
        ("blocks.0",),
        ("blocks.1",),
        ("ln_f", "lm_head"),
    )
    # A one-layer model still has an embedding, a block and a head.
    one = trace(small_gpt(num_layers=1)).profile.units
    assert [(u.name, u.kind) for u in one] == [
        ("embedding", "embedding"),
        ("blocks.0", "block"),
        ("head", "head"),
    ]


def test_every_node_has_a_unit_and_units_run_in_order(llama_graph: ModelGraph) -> None:
    nodes = list(llama_graph.graph_module.graph.nodes)
    assert {n.name for n in nodes} == set(llama_graph.node_units)
    for node in nodes:
        if node.op in ("call_module", "call_function", "call_method"):
            for arg in node.all_input_nodes:
                assert llama_graph.unit_of(arg) <= llama_graph.unit_of(node), (arg, node)
    # Module ownership decides the unit: all of blocks.1's leaf modules are in unit 2.
    for node in nodes:
        if node.op == "call_module" and str(node.target).startswith("blocks.1."):
            assert llama_graph.unit_of(node) == 2


# ----------------------------------------------------------------------------- FLOPs


def causal_attention_flops(s: int, h: int) -> float:
    # Q K^T and A V over the scores a causal kernel computes: query i sees i + 1 keys, so
    # s (s + 1) / 2 of the s^2 (4 s^2 h for the whole square, Narayanan et al. 2021, eq. 3).
    return 4 * h * s * (s + 1) / 2


def gpt_layer_flops(s: int, h: int) -> float:
    # Narayanan et al. 2021, eq. 3 per layer and sample: 24 s h^2 (q/k/v/o + MLP with f = 4h),
    # plus the causal attention.
    return 24 * s * h * h + causal_attention_flops(s, h)


def llama_layer_flops(s: int, h: int, kv_dim: int, f: int) -> float:
    # q and o: 2 s h h each; k and v: 2 s h kv_dim each; SwiGLU: 3 x 2 s h f; causal attention.
    return 4 * s * h * h + 4 * s * h * kv_dim + 6 * s * h * f + causal_attention_flops(s, h)


def test_small_gpt_flops_exact(gpt_graph: ModelGraph) -> None:
    embedding, block0, block1, head = gpt_graph.profile.units
    assert embedding.forward_flops == 0
    assert block0.forward_flops == block1.forward_flops == gpt_layer_flops(S, H)
    assert head.forward_flops == 2 * S * H * V
    # Backward is measured: matmuls 2x forward, flash attention 2.5x (it recomputes Q K^T).
    attention = causal_attention_flops(S, H)
    assert block0.backward_flops == 2 * (gpt_layer_flops(S, H) - attention) + 2.5 * attention
    assert head.backward_flops == 2 * head.forward_flops


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-8b"])
def test_preset_forward_flops_match_closed_form(name: str) -> None:
    config = preset_config(name)
    graph = trace(preset(name))
    s, h, v, layers = config.seq_len, config.hidden_size, config.vocab_size, config.num_layers
    if name.startswith("gpt"):
        per_layer = gpt_layer_flops(s, h)
    else:
        kv_dim = config.num_kv_heads * (h // config.num_heads)
        per_layer = llama_layer_flops(s, h, kv_dim, config.ffn_hidden_size)
    expected = layers * per_layer + 2 * s * h * v
    assert graph.profile.forward_flops_per_sample == pytest.approx(expected, rel=0.02)
    assert graph.profile.num_units == layers + 2
    assert graph.profile.num_params == sum(p.numel() for p in preset(name).parameters())


def test_gpt2_small_parameter_count() -> None:
    # GPT-2 small: 124,439,808 parameters (Hugging Face's GPT2LMHeadModel, tied head).
    graph = trace(preset("gpt2-small", num_layers=12))
    assert graph.profile.num_params == 124_439_808
    head = graph.profile.units[-1]
    assert head.num_params_shared == 50257 * 768


def test_gemm_shapes_are_per_sample(gpt_graph: ModelGraph) -> None:
    block = gpt_graph.profile.units[1]
    by_name = {op.name: op for op in block.ops}
    q = by_name["blocks_0_attn_q_proj"]
    assert q.gemm is not None
    assert (q.gemm.m_per_sample, q.gemm.k, q.gemm.n, q.gemm.batch) == (S, H, H, 1)
    attention = next(op for op in block.ops if op.kind == "attention")
    assert attention.gemm is not None
    assert (attention.gemm.m_per_sample, attention.gemm.n, attention.gemm.k) == (S, S, H // HEADS)
    assert attention.gemm.batch == HEADS
    # Traced at batch 3, the per-sample figures are the same.
    graph3 = trace(small_gpt(), batch_size=3)
    assert graph3.batch_size == 3
    block3 = graph3.profile.units[1]
    assert block3.forward_flops == block.forward_flops
    assert [op.gemm for op in block3.ops] == [op.gemm for op in block.ops]
    assert block3.saved_bytes == pytest.approx(block.saved_bytes)


# ----------------------------------------------------------------------------- TP structure


def test_gpt_tp_structure(gpt_graph: ModelGraph) -> None:
    embedding, block, _, head = gpt_graph.profile.units
    assert block.tp.linears == (
        TpLinear(path="attn.q_proj", style="column"),
        TpLinear(path="attn.k_proj", style="column"),
        TpLinear(path="attn.v_proj", style="column"),
        TpLinear(path="attn.o_proj", style="row"),
        TpLinear(path="mlp.up_proj", style="column"),
        TpLinear(path="mlp.down_proj", style="row"),
    )
    assert (block.tp.num_heads, block.tp.num_kv_heads, block.tp.ffn_hidden_size) == (4, 4, 256)
    assert embedding.tp.linears == (TpLinear(path="tok_emb", style="vocab_embedding"),)
    assert head.tp.linears == (TpLinear(path="lm_head", style="vocab_head"),)
    assert embedding.tp.vocab_size == head.tp.vocab_size == V
    # q/k/v/up: weight + bias; o/down: weight only (their bias is added after the all-reduce).
    assert block.num_params_tp_sharded == 3 * (H * H + H) + H * H + (H * 4 * H + 4 * H) + 4 * H * H
    roles = {op.name: op.tp for op in block.ops}
    assert roles["blocks_0_attn_q_proj"] == "column"
    assert roles["blocks_0_attn_o_proj"] == "row"
    assert roles["scaled_dot_product_attention"] == "sharded"
    assert roles["blocks_0_mlp_act"] == "sharded"
    assert roles["blocks_0_ln_1"] == roles["add_1"] == "replicated"
    assert {op.tp for op in embedding.ops if op.kind == "embedding"} == {"vocab", "replicated"}


def test_llama_tp_structure_with_gqa(llama_graph: ModelGraph) -> None:
    block = llama_graph.profile.units[1]
    assert [(t.path, t.style) for t in block.tp.linears] == [
        ("attn.q_proj", "column"),
        ("attn.k_proj", "column"),
        ("attn.v_proj", "column"),
        ("attn.o_proj", "row"),
        ("mlp.gate_proj", "column"),
        ("mlp.up_proj", "column"),
        ("mlp.down_proj", "row"),
    ]
    assert (block.tp.num_heads, block.tp.num_kv_heads, block.tp.ffn_hidden_size) == (4, 2, 256)
    profile = llama_graph.profile
    assert (profile.num_heads, profile.num_kv_heads, profile.vocab_size) == (4, 2, V)
    assert profile.tp_divisible_counts() == {
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_hidden_size": 256,
        "vocab_size": V,
    }
    assert block.num_params_tp_sharded == block.num_params - 2 * H  # all but the two RMSNorms


# ----------------------------------------------------------------------------- activations


def test_gpt_block_saved_bytes_worked_by_hand(gpt_graph: ModelGraph) -> None:
    # fp32, per sample, fused (flash) attention; s = 32, h = 64, a = 4 heads:
    # TP region: q, k, v (3sh), attention output (sh) and logsumexp (a s), GeLU input (4sh)
    # and output (4sh). Replicated: block input (sh), ln_1 and ln_2 outputs (2sh), residual
    # sum (sh), two (mean, rstd) pairs (4s). Selective recompute drops what cheap ops made:
    # GeLU output (4sh); layer-norm outputs and stats and the residual sum (3sh + 4s).
    s, h, a, f32 = S, H, HEADS, 4
    block = gpt_graph.profile.units[1]
    assert block.saved_bytes_sharded == f32 * (12 * s * h + a * s)
    assert block.saved_bytes_replicated == f32 * (4 * s * h + 4 * s)
    assert block.saved_bytes_selective_sharded == f32 * 4 * s * h
    assert block.saved_bytes_selective_replicated == f32 * (3 * s * h + 4 * s)
    assert block.input_bytes == block.output_bytes == f32 * s * h


@pytest.mark.parametrize("builder", [small_gpt, small_llama])
def test_profile_matches_a_real_cpu_run(builder: object) -> None:
    torch.manual_seed(0)
    model = builder(num_layers=3, device="cpu")  # type: ignore[operator]
    ids = torch.randint(0, V, (2, 16))
    graph = trace(model, (ids,))
    profile = graph.profile

    # Parameter bytes, exactly: each unit holds its modules' parameters.
    nbytes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    assert sum(u.param_bytes for u in profile.units) - sum(
        u.num_params_shared * 4 for u in profile.units
    ) == sum(nbytes.values())
    for unit, modules in zip(profile.units, graph.unit_modules, strict=True):
        own = {id(p): p for m in modules for p in model.get_submodule(m).parameters()}
        assert unit.param_bytes == sum(p.numel() * p.element_size() for p in own.values())

    # Saved activations: what autograd keeps in a real forward, deduplicated by storage,
    # parameters and buffers excluded. Within 10% (the task's bound); exact in practice.
    state = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage()._cdata
        if key not in state:
            saved.setdefault(key, tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
    measured = sum(saved.values())
    predicted = graph.batch_size * sum(u.saved_bytes for u in profile.units)
    assert predicted == pytest.approx(measured, rel=0.10)
    # The cut after the last block carries the hidden states, the head returns the logits.
    assert profile.units[-2].output_bytes == 16 * H * 4  # per sample
    assert profile.units[-1].output_bytes * 2 == logits.numel() * 4


def test_trace_allocates_nothing_for_a_real_model() -> None:
    model = small_gpt(device="cpu")
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    graph = trace(model, (torch.zeros(1, S, dtype=torch.long),))
    assert all(p.grad is None for p in model.parameters())
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before
    assert graph.profile.units[1].forward_flops == gpt_layer_flops(S, H)


# ----------------------------------------------------------------------------- reuse, speed


def test_identical_blocks_are_profiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = trace_api.profile_unit

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(len(args[0]))  # type: ignore[arg-type]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(trace_api, "profile_unit", counting)
    graph = trace(small_llama(num_layers=6))
    assert len(calls) == 3  # embedding, one block, head
    units = graph.profile.units
    assert all(u.forward_flops == units[1].forward_flops for u in units[1:-1])
    assert all(u.saved_bytes == units[1].saved_bytes for u in units[1:-1])
    # Node profiles of the copies carry their own names, units and modules.
    q5 = graph.node_profiles["blocks_5_attn_q_proj"]
    q0 = graph.node_profiles["blocks_0_attn_q_proj"]
    assert (q5.unit, q5.module_path) == (6, "blocks.5.attn.q_proj")
    assert (q5.forward_flops, q5.gemm, q5.tp) == (q0.forward_flops, q0.gemm, q0.tp)
    assert [op.name for op in units[6].ops][:1] == ["blocks_5_attn_norm"]


def test_remembered_meta_work_changes_no_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    # Meta kernels answered from memory and backward FLOPs reused by equal node calls give the
    # figures of running every kernel and every backward.
    def build() -> list[nn.Module]:
        tiny_moe = moe(2, H, HEADS, S, V, 4, 2, 32, num_shared_experts=1, num_dense_layers=1)
        return [small_gpt(num_layers=3), small_llama(num_layers=3), tiny_moe]

    runs: list[str] = []
    real = trace_profiler._run_backward

    def counting(node: fx.Node, *args: Any) -> bool:
        runs.append(node.name)
        return real(node, *args)

    monkeypatch.setattr(trace_profiler, "_run_backward", counting)
    remembered = [trace(model) for model in build()]
    reused = len(runs)
    monkeypatch.setattr(
        trace_meter.MetaKernels, "run", lambda self, func, info, a, kw: func(*a, **kw)
    )
    monkeypatch.setattr(trace_node_runner.NodeRunner, "call_key", lambda self, *args: None)
    runs.clear()
    plain = [trace(model) for model in build()]
    assert reused < len(runs)  # some backward runs were saved
    for ours, theirs in zip(remembered, plain, strict=True):
        assert ours.profile == theirs.profile
        assert dict(ours.node_profiles) == dict(theirs.node_profiles)


def test_fast_fx_trace_equals_plain_symbolic_trace() -> None:
    for model in (small_gpt(num_layers=3), small_llama(num_layers=3)):
        fast = trace_model(
            model,
            (torch.zeros(1, S, dtype=torch.long),),
            {},
            blocks=("blocks.0", "blocks.1", "blocks.2"),
        ).graph_module
        plain = fx.GraphModule(model, _Tracer(frozenset(), ()).trace(model))

        def calls(gm: fx.GraphModule) -> list[tuple[str, object, list[str]]]:
            return [
                (n.op, n.target, list(n.meta.get("nn_module_stack", {})))
                for n in gm.graph.nodes
                if n.op in ("call_module", "call_function", "call_method")
            ]

        assert calls(fast) == calls(plain)


def test_leaf_block_stays_one_call() -> None:
    graph = trace(small_gpt(num_layers=3), leaf_modules=["blocks.1"])
    calls = [n.target for n in graph.graph_module.graph.nodes if n.op == "call_module"]
    assert "blocks.1" in calls and "blocks.0.attn.q_proj" in calls
    assert not any(str(c).startswith("blocks.1.") for c in calls)
    units = graph.profile.units
    assert units[2].forward_flops == units[1].forward_flops == gpt_layer_flops(S, H)
    assert units[2].saved_bytes == pytest.approx(units[1].saved_bytes)
    assert units[2].tp.linears == ()  # a leaf is opaque: no TP structure inside it


def test_large_preset_traces_quickly() -> None:
    # 96 identical blocks: traced and profiled once each, not 96 times (bench/trace.py has the
    # precise figure; this bound only catches a regression to per-block work).
    import time

    model = preset("gpt3-175b")
    start = time.perf_counter()
    graph = trace(model)
    assert time.perf_counter() - start < 10
    assert graph.profile.num_units == 98


# ----------------------------------------------------------------------------- graph views


def test_unit_graph_and_cuts(llama_graph: ModelGraph) -> None:
    units = llama_graph.unit_graph()
    assert nx.is_directed_acyclic_graph(units)
    assert sorted(units.nodes) == [0, 1, 2, 3]
    assert all(src < dst for src, dst in units.edges)
    # The RoPE tables are buffers (get_attr): only the hidden states cross each cut.
    assert sorted(units.edges) == [(0, 1), (1, 2), (2, 3)]
    for src, dst in units.edges:
        assert units.edges[src, dst]["bytes"] == S * H * 4
        assert llama_graph.cut_bytes(src) == S * H * 4
    assert units.nodes[1]["forward_flops"] == llama_graph.profile.units[1].forward_flops


def test_split_module_by_unit_runs_like_the_model() -> None:
    torch.manual_seed(0)
    model = small_llama(device="cpu")
    ids = torch.randint(0, V, (2, S))
    graph = trace(model, (ids,))
    split = split_module(graph.graph_module, model, graph.unit_of)
    assert len([n for n in split.graph.nodes if n.op == "call_module"]) == 4
    expected = model(ids)
    torch.testing.assert_close(graph.graph_module(ids), expected)  # exact same ops
    torch.testing.assert_close(split(ids), expected)


def test_fingerprint_is_stable_and_structural() -> None:
    # A fixed input hashes to a fixed string on every machine and in every process.
    assert fingerprint([("block", [(4, 4), (4,)])], seq_len=8) == "ff477bd635a81268"
    base = trace(small_gpt()).profile.fingerprint
    assert trace(small_gpt(), batch_size=4).profile.fingerprint == base
    assert trace(small_gpt(), seq_len=16).profile.fingerprint != base
    assert trace(small_gpt(num_layers=3)).profile.fingerprint != base
    assert trace(small_llama()).profile.fingerprint != base


def test_op_kinds_cover_the_block(gpt_graph: ModelGraph) -> None:
    kinds = Counter(op.kind for op in gpt_graph.profile.units[1].ops)
    assert kinds["matmul"] == 6
    assert kinds["attention"] == 1
    assert kinds["reduction"] == 2  # the two LayerNorms
    assert kinds["elementwise"] >= 3  # GeLU and two residual adds
    for op in gpt_graph.profile.units[1].ops:
        assert op.activation_bytes > 0 or op.forward_flops > 0
        if op.kind == "matmul":
            assert op.param_bytes_read > 0
    assert math.isclose(
        sum(p.forward_flops for p in gpt_graph.node_profiles.values()),
        gpt_graph.profile.forward_flops_per_sample,
    )


def test_causal_attention_counts_the_scores_it_computes() -> None:
    from autoplan.tracing.op_flops import causal_fraction

    assert causal_fraction(4, 4) == pytest.approx(10 / 16)  # 1 + 2 + 3 + 4 of 16
    assert causal_fraction(1, 8) == 1.0  # the last query sees every key
    assert causal_fraction(2, 6) == pytest.approx((5 + 6) / 12)
    # the zoo's causal attention counts s (s + 1) / 2 of the s^2 scores
    graph = trace(llama(1, 64, 4, 32, 100))
    block = graph.profile.units[1]
    (attention,) = [op for op in block.ops if op.kind == "attention"]
    g = attention.gemm
    assert g is not None
    full = 4 * g.m_per_sample * g.n * g.k * g.batch
    assert attention.forward_flops == pytest.approx(full * 33 / 64)
