"""Activation memory against the published derivations, per framework profile, on the papers'
own settings.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Table 2; section 4.1 itemises it) count one GPT layer's saved activations in bytes, for
sequence s, micro-batch b, hidden h, heads a, TP degree t, 16-bit activations, dropout 0.1
and Megatron-LM's unfused attention core:

    no parallelism                     sbh (34 + 5as/h)
    tensor parallel                    sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel         sbh/t (34 + 5as/h)
    tensor parallel + selective        sbh (10 + 24/t)
    tensor + sequence + selective      34 sbh / t
    full recompute                     2 sbh (the layer input; / t with sequence parallelism)

The 34 sbh: attention 11 (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1),
MLP 19 (fc1 input 2, GELU input 8, fc2 input 8, dropout mask 1), two LayerNorm inputs 4; the
5as^2b: softmax output 2, its dropout mask 1, the dropout output 2 per score element. The
cost model's per-layer bytes are the traced block's (`cost_model.memory.activation_bytes`)
under each profile's `saved_activations`. Where a stack differs from the paper's the test
says why, with its source, and asserts the stack's own figure. Measured peaks: the Zero Bubble
paper's 1F1B rows (Qi et al. 2024) and torchtitan's published ones, through the validation
bench's own plans (bench/validate_published.py).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.models import preset
from cost_model.frameworks import FRAMEWORKS, framework_profile
from cost_model.memory import StackActivations, activation_bytes
from cost_model.strategy import Strategy
from cost_model.workload import ModelProfile, UnitProfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import validate_published

GIB = 2.0**30
# GPT-3 175B (Korthikanti et al. 2022, Table 3): s 2048, h 12288, a 96, t 8.
S, H, A, T = 2048, 12288, 96, 8
SBH = S * H  # b = 1


@cache
def _gpt3_175b() -> ModelProfile:
    # two layers: every block's figures are the same, and the trace is a second on meta
    graph = autoplan.trace(preset("gpt3-175b", num_layers=2), name="gpt3-175b")
    profile: ModelProfile = graph.profile
    return profile


def _block(profile: ModelProfile) -> UnitProfile:
    return next(u for u in profile.units if u.kind == "block")


def _layer_bytes(
    stack: StackActivations, *, tp: int, sp: bool, recompute: str, micro_batch: int = 1
) -> float:
    """The cost model's bytes for one GPT-3 175B layer, bf16, on one device."""
    profile = _gpt3_175b()
    strategy = Strategy(
        tp_degree=tp, sequence_parallel=sp, micro_batch_size=micro_batch, dtype="bf16"
    )
    return activation_bytes(_block(profile), strategy, recompute, profile.traced_dtype_bytes, stack)


def _scores(t: int) -> float:
    """Korthikanti's 5as^2b term per device, in units of sbh: 5as/(ht)."""
    return 5 * A * S / (H * t)


# (tp, sp, recompute) -> Table 2's bytes per layer, in units of sbh
KORTHIKANTI_TABLE_2 = {
    (1, False, "none"): 34 + _scores(1),
    (T, False, "none"): 10 + 24 / T + _scores(T),
    (T, True, "none"): (34 + _scores(1)) / T,
    (T, False, "selective"): 10 + 24 / T,
    (T, True, "selective"): 34 / T,
    (T, False, "full"): 2.0,
    (T, True, "full"): 2.0 / T,
}


@pytest.mark.parametrize("setting", sorted(KORTHIKANTI_TABLE_2, key=str))
def test_megatron_2021_matches_korthikanti_table_2(setting: tuple[int, bool, str]) -> None:
    """megatron-lm-2021 is the paper's own stack (unfused core, dropout 0.1): every row of
    Table 2 within 1% (the traced block's saved bytes are exactly the paper's items, but the
    LayerNorm statistics and the softmax's log-sum-exp, a few bytes per token)."""
    tp, sp, recompute = setting
    stack = FRAMEWORKS["megatron-lm-2021"].saved_activations
    model = _layer_bytes(stack, tp=tp, sp=sp, recompute=recompute)
    assert model / SBH == pytest.approx(KORTHIKANTI_TABLE_2[setting], rel=0.01)


@pytest.mark.parametrize("setting", sorted(KORTHIKANTI_TABLE_2, key=str))
def test_megatron_core_is_table_2_without_the_scores(setting: tuple[int, bool, str]) -> None:
    """megatron-lm (Megatron-Core with Transformer Engine's fused attention) keeps no s x s
    scores: a flash kernel recomputes them from Q, K, V and the log-sum-exp in its backward
    (Dao et al. 2022, FlashAttention, section 3.1), so the 5as/h term is gone and selective
    recompute (core attention only) keeps what no recompute keeps. The rest is Table 2 within
    1%. At 175B the scores are 5as/h = 80 sbh of 114: without them a layer is 70% smaller (43%
    with TP alone, where the replicated 10 sbh stay whole)."""
    tp, sp, recompute = setting
    stack = FRAMEWORKS["megatron-lm"].saved_activations
    model = _layer_bytes(stack, tp=tp, sp=sp, recompute=recompute)
    scores = _scores(tp) if recompute == "none" else 0.0
    assert model / SBH == pytest.approx(KORTHIKANTI_TABLE_2[setting] - scores, rel=0.01)
    # the explained difference is above 10% wherever the paper keeps the scores
    if scores:
        assert 1 - model / (KORTHIKANTI_TABLE_2[setting] * SBH) > 0.4


def test_megatron_core_without_dropout_drops_two_masks() -> None:
    """Recipes that set --hidden-dropout 0 (option dropout=0) keep no masks: 32 sbh / t with
    sequence parallelism and selective recompute, 6% under the paper's 34 (its two 1-byte
    masks, sbh each)."""
    stack = framework_profile("megatron-lm:dropout=0").saved_activations
    model = _layer_bytes(stack, tp=T, sp=True, recompute="selective")
    assert model / SBH == pytest.approx(32 / T, rel=0.01)
    assert 1 - model / (34 / T * SBH) == pytest.approx(2 / 34, abs=0.005)


@pytest.mark.parametrize("name", ["megatron-lm-2019", "megatron-deepspeed"])
def test_unfused_stacks_without_sp_or_selective(name: str) -> None:
    """Megatron-LM 2019 and Megatron-DeepSpeed have the same unfused core with dropout 0.1 but
    only none and full recompute, no sequence parallelism: Table 2's TP and full rows."""
    stack = FRAMEWORKS[name].saved_activations
    for setting in ((1, False, "none"), (T, False, "none"), (T, False, "full")):
        tp, sp, recompute = setting
        model = _layer_bytes(stack, tp=tp, sp=sp, recompute=recompute)
        assert model / SBH == pytest.approx(KORTHIKANTI_TABLE_2[setting], rel=0.01), setting


# Profiles that save what the traced model saves: one fused SDPA kernel, no dropout.
TRACED_STACKS = sorted(
    name for name, profile in FRAMEWORKS.items() if profile.saved_activations == StackActivations()
)


def test_which_profiles_keep_the_traced_accounting() -> None:
    """Every profile is either one of the Megatron stacks checked against Table 2 above or
    keeps the trace's own accounting (checked below); a new profile must join one side."""
    assert set(FRAMEWORKS) - set(TRACED_STACKS) == {
        "megatron-lm",
        "megatron-lm-2021",
        "megatron-lm-2019",
        "megatron-deepspeed",
    }
    assert "autoplan" in TRACED_STACKS and "torchtitan" in TRACED_STACKS


@pytest.mark.parametrize("name", TRACED_STACKS)
def test_traced_stacks_against_the_derivation(name: str) -> None:
    """autoplan, torchtitan, nanotron, llm-foundry, flash-attn-training and DeepSpeed (the
    model's own attention) run a fused attention kernel and the zoo model has no dropout
    (llm-foundry's MPT configs set attn_pdrop and resid_pdrop to 0; torchtitan's and
    nanotron's Llama have no dropout layer): no recompute keeps 32 sbh a layer, Table 2's 34
    without the two masks and the scores (6% under the 34).

    Their selective recompute (autoplan's runtime: torch's selective checkpoint keeping GEMM and
    attention outputs, `cost_model.strategy.SELECTIVE_SAVED_KINDS`) re-runs more than the
    paper's: the two LayerNorm outputs (the QKV and fc1 inputs, 2 + 2), the GELU output (the
    fc2 input, 8) and the residual sum (the second LayerNorm's input, 2) are recomputed, so it
    keeps 32 - 14 = 18 sbh, 47% under the paper's 34 (an intended difference: the policy, not
    an error). Full recompute: the layer input, 2 sbh."""
    stack = FRAMEWORKS[name].saved_activations
    assert _layer_bytes(stack, tp=1, sp=False, recompute="none") / SBH == pytest.approx(
        32, rel=0.01
    )
    assert _layer_bytes(stack, tp=T, sp=True, recompute="none") / SBH == pytest.approx(
        32 / T, rel=0.01
    )
    assert _layer_bytes(stack, tp=T, sp=True, recompute="selective") / SBH == pytest.approx(
        18 / T, rel=0.01
    )
    assert _layer_bytes(stack, tp=T, sp=True, recompute="full") / SBH == pytest.approx(
        2 / T, rel=0.01
    )


def test_the_issue_175b_case() -> None:
    """Issue 38: GPT-3 175B for Megatron-LM at tp 8, pp 1, sequence parallel, selective
    recompute held 5.08 GiB of activations at micro-batch 1 where Table 2 gives 96 x 34 sbh / t
    = 9.56 GiB, and was said to fit at 70.9 GiB at micro-batch 4 (38 GiB of activations by
    Table 2). Megatron's selective recompute re-runs the attention core only; the model had
    priced autoplan's policy (which also re-runs the norms and the GELU). Now within 3% of the
    formula (the embedding's and head's saved bytes and the loss's logits on top), and
    micro-batch 4 does not fit on 80 GiB."""
    graph = autoplan.trace(preset("gpt3-175b"), name="gpt3-175b")
    cluster = "dgx-a100-80g:nodes=128"
    table_2 = 96 * 34 * SBH / T
    for micro_batch in (1, 4):
        plan = autoplan.manual_plan(
            graph,
            cluster,
            tp=T,
            micro_batch=micro_batch,
            global_batch=1536,
            recompute="selective",
            sequence_parallel=True,
            zero=1,
            framework="megatron-lm",
        )
        est = autoplan.estimate(graph, cluster, plan)
        held = est.ranks[0].memory.activation_bytes
        assert held == pytest.approx(micro_batch * table_2, rel=0.03), micro_batch
        assert est.fits == (micro_batch == 1)


# --------------------------------------------------------------------------- measured peaks


@cache
def _bench_rows() -> dict[str, validate_published.Result]:
    runs, assumptions = validate_published.load()
    results: dict[str, validate_published.Result] = {}
    for row in runs:
        if not row["id"].startswith(("zerobubble-iclr-t9-", "torchtitan-docs-t")):
            continue
        case = validate_published.build_case(row, assumptions)
        if isinstance(case, validate_published.Case) and case.status in ("fit", "held_out"):
            results[row["id"]] = validate_published.predict(case)
    return results


def _printed_gib(run_id: str) -> float:
    runs, _ = validate_published.load()
    measured = next(r for r in runs if r["id"] == run_id)["measured"]
    return float(measured.get("peak_memory_gib") or measured["memory_gb_printed"])


ZERO_BUBBLE_1F1B = [
    "zerobubble-iclr-t9-1.5b-m2-1f1b",
    "zerobubble-iclr-t9-1.5b-m4-1f1b",
    "zerobubble-iclr-t9-1.5b-m8-1f1b",
    "zerobubble-iclr-t9-6.2b-m2-1f1b",
    "zerobubble-iclr-t9-6.2b-m4-1f1b",
    "zerobubble-iclr-t9-6.2b-m8-1f1b",
]


@pytest.mark.parametrize("run_id", ZERO_BUBBLE_1F1B)
def test_zero_bubble_1f1b_peaks(run_id: str) -> None:
    """Qi et al. 2024 (ICLR, Table 9: 8 A100 80GB, pure pipeline, 1F1B, 2-8 micro-batches in
    flight) print each run's memory in GB; the fork is Megatron-LM 2023 without flash
    attention and with dropout 0.1 (bench/data/validation_assumptions_pipeline.yaml), so its
    peaks hold the s x s scores. What the figure measures is not stated; the predicted tensors
    (the peak without the allocator's margin and the reserve, i.e. what
    torch.cuda.max_memory_allocated counts) match it read as GiB within 12%: the 1.5B at 2
    micro-batches 11% over (its peak rank is the last, with 2.2 GiB of the loss's logits), the
    others within 3% (the allocator-level peak is about 2 GiB above each). Without the scores and masks the model
    held 8.9 GiB of activations for the 1.5B at 8 micro-batches (29 printed in all): a peak
    45% under."""
    memory = _bench_rows()[run_id].estimate.peak_rank.memory
    tensors = memory.total_bytes - memory.reserve_bytes
    assert tensors / GIB == pytest.approx(_printed_gib(run_id), rel=0.12)


def test_zero_bubble_growth_per_micro_batch() -> None:
    """The printed peak grows by the activations of the added micro-batches alone (the
    weights are the same): the model's growth from 2 to 8 micro-batches within 15% of the
    printed one, for both sizes. Before the scores were counted it was under by 2.4x."""
    rows = _bench_rows()
    for size in ("1.5b", "6.2b"):
        low, high = (f"zerobubble-iclr-t9-{size}-m{m}-1f1b" for m in (2, 8))
        printed = _printed_gib(high) - _printed_gib(low)
        predicted = rows[high].estimate.peak_memory_bytes - rows[low].estimate.peak_memory_bytes
        assert predicted / GIB == pytest.approx(printed, rel=0.15), size


def test_torchtitan_published_peaks() -> None:
    """torchtitan's docs print max_reserved for Llama-3 8B (FSDP, selective op-level
    checkpointing, 8 and 128 H100): the scored rows within 5%. torchtitan's "op" policy keeps
    every GEMM output but every second one (torchtitan parallelize.py, _custom_policy) where
    autoplan's prices its own runtime's (every GEMM output backward reads): at Llama-3 8B
    about 3 sbh of a layer's 18.5 (16% of the layer's activations) more; the total peak
    (weights, FSDP buffers, the loss's fp32 logits) is within 5% all the same, so it is left.
    Their compiled siblings (scored since issue 43) are priced as eager (docs/cost-model.md,
    torch.compile: the partitioner saves less than eager), so high: within 12% above (7.8% and
    10.1% today)."""
    rows = {k: v for k, v in _bench_rows().items() if k.startswith("torchtitan")}
    assert len(rows) == 4
    for run_id, result in rows.items():
        predicted = validate_published.allocator_peak_bytes(result) / GIB
        printed = _printed_gib(run_id)
        if run_id.endswith("-compile"):
            assert printed <= predicted <= 1.12 * printed, run_id
        else:
            assert predicted == pytest.approx(printed, rel=0.05), run_id


# ----------------------------------------------------- Megatron-Core's --recompute-modules

# Qwen3-235B-A22B's layer (the Megatron-Core MoE model zoo's Qwen3-235B-A22B.yaml): hidden 4096,
# 64 query heads and 4 KV groups of 128, 128 SwiGLU experts of 1536, top 8. One layer, 4k tokens.
Q3_S, Q3_H, Q3_K, Q3_F, Q3_E = 4096, 4096, 8, 1536, 128


@cache
def _qwen3_block() -> tuple[UnitProfile, int]:
    from autoplan.models.moe import MoE, MoEConfig

    config = MoEConfig(
        num_layers=1,
        hidden_size=Q3_H,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        seq_len=Q3_S,
        vocab_size=151936,
        ffn_hidden_size=12288,
        num_experts=Q3_E,
        top_k=Q3_K,
        moe_ffn_hidden_size=Q3_F,
    )
    with torch.device("meta"):
        model = MoE(config)
    profile: ModelProfile = autoplan.trace(model, name="qwen3-layer").profile
    return _block(profile), profile.traced_dtype_bytes


def _qwen3_kept(modules: str, *, tp: int = 1) -> tuple[float, float]:
    """One Qwen3 layer's bytes under megatron-lm's selective recompute of ``modules``, in units
    of sbh (bf16, micro-batch 1), and the same with no recompute."""
    block, traced = _qwen3_block()
    stack = framework_profile(f"megatron-lm:dropout=0,recompute_modules={modules}")
    strategy = Strategy(tp_degree=tp, sequence_parallel=tp > 1, micro_batch_size=1, dtype="bf16")
    sbh = Q3_S * Q3_H * 2
    kept = activation_bytes(block, strategy, "selective", traced, stack.saved_activations)
    none = activation_bytes(block, strategy, "none", traced, stack.saved_activations)
    return kept / sbh, none / sbh


def test_recompute_modules_drop_the_modules_bytes() -> None:
    """megatron-lm:recompute_modules=... (Megatron-Core's --recompute-modules,
    transformer_config.py) drops what each module's recompute frees, in units of sbh per layer:
    core_attn nothing with a fused kernel (the default: selective keeps what no recompute
    keeps); layernorm the two norms' outputs (2); moe_act the experts' activation output
    (k f / h = 3); moe the whole MoE layer but its input (k (2h + 4f) / h + E / h = 28.03: the
    expert inputs and the combine's expert outputs, the gate, up, SiLU and product tensors, the
    router's probabilities). With layernorm + moe what is left outside the TP region is the two
    norms' inputs and their normalized copies (4 sbh): the MoE bytes are exactly the trace's."""
    attention, none = _qwen3_kept("core_attn")
    assert attention == pytest.approx(none, rel=1e-9)
    moe_layer = Q3_K * (2 * Q3_H + 4 * Q3_F) / Q3_H + Q3_E / Q3_H
    assert none - _qwen3_kept("layernorm")[0] == pytest.approx(2.0, rel=1e-6)
    assert none - _qwen3_kept("moe_act")[0] == pytest.approx(Q3_K * Q3_F / Q3_H, rel=1e-6)
    assert none - _qwen3_kept("moe")[0] == pytest.approx(moe_layer, rel=1e-6)
    both, _ = _qwen3_kept("layernorm+moe")
    assert none - both == pytest.approx(2.0 + moe_layer, rel=1e-6)
    assert both == pytest.approx(_qwen3_kept("core_attn+layernorm+moe")[0], rel=1e-9)
    # moe already drops the activation output: moe_act adds nothing to it
    assert _qwen3_kept("moe_act+moe")[0] == pytest.approx(_qwen3_kept("moe")[0], rel=1e-9)
    block, traced = _qwen3_block()
    sharded = block.saved_bytes_sharded / traced / (Q3_S * Q3_H)
    assert both - sharded == pytest.approx(4.0, rel=0.02)
    # with sequence parallelism every dropped byte is outside the TP region: divided by t
    sp_none = _qwen3_kept("core_attn", tp=4)[0]
    assert sp_none - _qwen3_kept("layernorm+moe", tp=4)[0] == pytest.approx(
        (2.0 + moe_layer) / 4, rel=1e-6
    )


def test_recompute_modules_option_rejects_other_orders() -> None:
    """The option takes the modules in Megatron's order, joined by '+'; another spelling is a
    one-line error listing the values."""
    with pytest.raises(Exception, match="has no option"):
        framework_profile("megatron-lm:recompute_modules=mlp")
    assert framework_profile("megatron-lm:recompute_modules=moe_act+layernorm").name.endswith(
        "recompute_modules=moe_act+layernorm"
    )


def test_moe_zoo_long_context_rows_fit() -> None:
    """The Megatron-Core MoE model zoo's Qwen3-235B long-context rows ran on 80 GB H100s with
    --recompute-modules layernorm moe (bench/data/validation_assumptions_moe.yaml): priced so,
    they fit (72 GiB; 183 GiB with the attention core alone, which frees nothing there)."""
    runs, assumptions = validate_published.load()
    row = next(r for r in runs if r["id"] == "mcore-moezoo-h100-qwen3-235b-256g-s16k-cp1")
    case = validate_published.build_case(row, assumptions)
    assert isinstance(case, validate_published.Case)
    assert "recompute_modules=layernorm+moe" in case.plan_args["framework"]
    estimate = validate_published.predict(case).estimate
    # under the device's 80 GiB (the bench's check; the plan's safety headroom is another one)
    assert 60 < estimate.peak_memory_bytes / GIB < 80
