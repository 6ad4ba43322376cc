"""Analytic ModelProfiles for cost-model tests: a GPT-like model built by formula, not traced.

Per sample (s tokens, hidden h, a heads, FFN f, element size e bytes), following Korthikanti
et al. 2022, section 4.1 (their 2-byte counts scaled by e/2):
- activations saved inside the TP region: 12 s h e + 2.5 a s^2 e (24 sbh + 5 a s^2 b at e = 2),
  of which 2.5 a s^2 e is the attention core that selective recompute drops;
- outside it: 5 s h e (10 sbh at e = 2);
- a block's input and output: s h e.
FLOPs: 2 s h (3h) for q/k/v, 4 s^2 h for the attention core, 2 s h h for the output projection,
2 * 2 s h f for the MLP; backward = 2x forward for GEMMs and attention.
"""

from __future__ import annotations

import dataclasses

from cost_model.calibration import Calibration
from cost_model.hardware import Cluster, DeviceSpec, LinkSpec
from cost_model.workload import (
    GemmShape,
    ModelProfile,
    MoELayerFacts,
    OpProfile,
    TpLinear,
    TpStructure,
    UnitProfile,
)


def _linear(name: str, tp: str, s: int, n: int, k: int, e: int, bias: bool = True) -> OpProfile:
    flops = 2.0 * s * n * k
    return OpProfile(
        name=name,
        kind="matmul",
        tp=tp,  # type: ignore[arg-type]
        forward_flops=flops,
        backward_flops=2 * flops,
        activation_bytes=float((s * k + s * n) * e),
        param_bytes_read=float((n * k + (n if bias else 0)) * e),
        gemm=GemmShape(m_per_sample=s, n=n, k=k),
    )


def _elementwise(name: str, tp: str, nbytes: float, flops: float = 0.0) -> OpProfile:
    return OpProfile(
        name=name,
        kind="elementwise",
        tp=tp,  # type: ignore[arg-type]
        forward_flops=flops,
        backward_flops=flops,
        activation_bytes=nbytes,
    )


def gpt_block(idx: int, *, s: int, h: int, a: int, f: int, e: int = 4) -> UnitProfile:
    ops = (
        _elementwise("ln_1", "replicated", 2.0 * s * h * e, 5.0 * s * h),
        _linear("q_proj", "column", s, h, h, e),
        _linear("k_proj", "column", s, h, h, e),
        _linear("v_proj", "column", s, h, h, e),
        OpProfile(
            name="attn",
            kind="attention",
            tp="sharded",
            forward_flops=4.0 * s * s * h,
            backward_flops=8.0 * s * s * h,
            activation_bytes=4.0 * s * h * e,
        ),
        _linear("o_proj", "row", s, h, h, e),
        _elementwise("add_1", "replicated", 3.0 * s * h * e, 1.0 * s * h),
        _elementwise("ln_2", "replicated", 2.0 * s * h * e, 5.0 * s * h),
        _linear("up_proj", "column", s, f, h, e),
        _elementwise("gelu", "sharded", 2.0 * s * f * e, 8.0 * s * f),
        _linear("down_proj", "row", s, h, f, e),
        _elementwise("add_2", "replicated", 3.0 * s * h * e, 1.0 * s * h),
    )
    sharded_params = 4 * h * h + 3 * h + 2 * h * f + f  # q/k/v/o weights + q/k/v biases, MLP
    replicated_params = 4 * h + h + h  # two LayerNorms, o_proj and down_proj biases
    return UnitProfile(
        name=f"blocks.{idx}",
        kind="block",
        ops=ops,
        num_params=sharded_params + replicated_params,
        num_params_tp_sharded=sharded_params,
        param_bytes=(sharded_params + replicated_params) * e,
        saved_bytes_sharded=12.0 * s * h * e + 2.5 * a * s * s * e,
        saved_bytes_replicated=5.0 * s * h * e,
        saved_bytes_selective_sharded=2.5 * a * s * s * e,
        input_bytes=float(s * h * e),
        output_bytes=float(s * h * e),
        tp=TpStructure(
            linears=(
                TpLinear(path="attn.q_proj", style="column"),
                TpLinear(path="attn.k_proj", style="column"),
                TpLinear(path="attn.v_proj", style="column"),
                TpLinear(path="attn.o_proj", style="row"),
                TpLinear(path="mlp.up_proj", style="column"),
                TpLinear(path="mlp.down_proj", style="row"),
            ),
            num_heads=a,
            ffn_hidden_size=f,
        ),
    )


def gpt_profile(
    *,
    num_layers: int = 4,
    s: int = 128,
    h: int = 256,
    a: int = 8,
    vocab: int = 1024,
    f: int | None = None,
    e: int = 4,
    tied: bool = True,
) -> ModelProfile:
    """Embedding + ``num_layers`` blocks + head (final norm + vocab-parallel linear)."""
    f = 4 * h if f is None else f
    embedding = UnitProfile(
        name="embedding",
        kind="embedding",
        ops=(
            OpProfile(
                name="tok_emb",
                kind="embedding",
                tp="vocab",
                forward_flops=0.0,
                backward_flops=0.0,
                activation_bytes=float(s * h * e),
            ),
        ),
        num_params=vocab * h + s * h,
        num_params_tp_sharded=vocab * h,
        param_bytes=(vocab * h + s * h) * e,
        saved_bytes_sharded=0.0,
        saved_bytes_replicated=0.0,
        input_bytes=float(s * 8),
        output_bytes=float(s * h * e),
        tp=TpStructure(
            linears=(TpLinear(path="tok_emb", style="vocab_embedding"),), vocab_size=vocab
        ),
    )
    head = UnitProfile(
        name="head",
        kind="head",
        ops=(
            _elementwise("ln_f", "replicated", 2.0 * s * h * e, 5.0 * s * h),
            _linear("lm_head", "column", s, vocab, h, e, bias=False),
        ),
        num_params=2 * h + vocab * h,
        num_params_tp_sharded=vocab * h,
        num_params_shared=vocab * h if tied else 0,
        param_bytes=(2 * h + vocab * h) * e,
        saved_bytes_sharded=float(s * vocab * e),  # logits
        saved_bytes_replicated=float(2 * s * h * e),
        input_bytes=float(s * h * e),
        output_bytes=float(s * vocab * e),
        tp=TpStructure(linears=(TpLinear(path="lm_head", style="vocab_head"),), vocab_size=vocab),
    )
    blocks = tuple(gpt_block(i, s=s, h=h, a=a, f=f, e=e) for i in range(num_layers))
    return ModelProfile(
        name=f"gpt-analytic-{num_layers}x{h}",
        units=(embedding, *blocks, head),
        seq_len=s,
        hidden_size=h,
        vocab_size=vocab,
        num_heads=a,
        traced_dtype_bytes=e,
    )


def round_cluster(
    *,
    num_nodes: int = 1,
    devices_per_node: int = 8,
    memory_bytes: int = 80 * 2**30,
    calibration: Calibration | None = None,
) -> Cluster:
    """A cluster with round numbers for hand-worked examples.

    Device: 100 TFLOP/s bf16, 10 TFLOP/s fp32, 1 TB/s memory. Links per device per direction:
    intra-node 100 GB/s and 10 us, inter-node 10 GB/s and 20 us. Calibration: GEMM and
    attention 0.5 (no size penalty), memory 0.5, links 0.5, no kernel overhead.
    """
    return Cluster(
        name="round",
        num_nodes=num_nodes,
        devices_per_node=devices_per_node,
        device=DeviceSpec(
            name="round-gpu",
            memory_bytes=memory_bytes,
            peak_flops={"bf16": 100e12, "fp32": 10e12, "fp8": 200e12},
            memory_bandwidth_bytes_per_s=1e12,
        ),
        intra_node=LinkSpec(bandwidth_bytes_per_s=100e9, latency_s=10e-6),
        inter_node=LinkSpec(bandwidth_bytes_per_s=10e9, latency_s=20e-6),
        calibration=calibration
        or Calibration(
            gemm_efficiency=0.5,
            gemm_half_efficiency_flops=0.0,
            attention_efficiency=0.5,
            memory_efficiency=0.5,
            intra_node_comm_efficiency=0.5,
            inter_node_comm_efficiency=0.5,
            kernel_overhead_s=0.0,
        ),
    )


def with_routed_experts(
    profile: ModelProfile,
    *,
    num_experts: int,
    top_k: int,
    expert_ffn: int,
    name: str | None = None,
) -> ModelProfile:
    """``profile`` with a routed-experts op added to every block, as the trace records a
    mixture-of-experts block (`cost_model.workload.MoELayerFacts`): one ``experts`` op of
    ``seq_len x top_k`` assignments through SwiGLU experts of width ``expert_ffn`` (3 GEMMs,
    ``6 h F`` forward FLOPs per assignment), its parameters in ``num_params`` (not TP-sharded)
    and its saved input and intermediates, ``(h + 3F)`` elements per assignment, in the
    replicated saved bytes. The block's own MLP stays (as a shared expert)."""
    e = profile.traced_dtype_bytes
    h, s = profile.hidden_size, profile.seq_len
    per_expert = 3 * h * expert_ffn
    assignments = s * top_k
    flops = 6.0 * h * expert_ffn
    units = []
    for unit in profile.units:
        if unit.kind != "block":
            units.append(unit)
            continue
        experts = OpProfile(
            name="experts",
            kind="matmul",
            tp="replicated",
            forward_flops=assignments * flops,
            backward_flops=2.0 * assignments * flops,
            activation_bytes=float(assignments * (2 * h + 3 * expert_ffn) * e),
            param_bytes_read=float(num_experts * per_expert * e),
        )
        router = _linear("router", "replicated", s, num_experts, h, e, bias=False)
        units.append(
            dataclasses.replace(
                unit,
                ops=(*unit.ops, router, experts),
                num_params=unit.num_params + num_experts * per_expert + h * num_experts,
                param_bytes=unit.param_bytes + (num_experts * per_expert + h * num_experts) * e,
                saved_bytes_replicated=unit.saved_bytes_replicated
                + assignments * (h + 3 * expert_ffn) * e,
                moe=MoELayerFacts(
                    experts_op="experts",
                    num_experts=num_experts,
                    top_k=top_k,
                    hidden_size=h,
                    expert_ffn_hidden_size=expert_ffn,
                    params_per_expert=per_expert,
                    flops_per_routed_token=flops,
                    routed_tokens_per_sample=assignments,
                ),
            )
        )
    return dataclasses.replace(
        profile,
        name=name or f"{profile.name}-moe{num_experts}x{top_k}",
        units=tuple(units),
        fingerprint="",
    )
