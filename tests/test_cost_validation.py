"""The published-run benchmark on a few held-out rows: the calibration still predicts them."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import validate_published
from validate_published import Case, source_contradictions

from cost_model.frameworks import FRAMEWORKS


@pytest.mark.slow
def test_held_out_published_runs_within_15_percent(capsys: pytest.CaptureFixture[str]) -> None:
    """Narayanan et al. 2021 Table 1 (1.7B, data parallel only) and Korthikanti et al. 2022
    Table 5 (22B, TP 8, full recompute) are held out; the fitted 22B selective row must stay
    on its fit. About 10 s: traces a 24-layer and a 48-layer model on meta."""
    validate_published.main(["--only", "megatron-sc21-t1-1.7b,korthikanti-t5-22b", "--json"])
    rows = {row["id"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {
        "megatron-sc21-t1-1.7b",
        "korthikanti-t5-22b-full-recompute",
        "korthikanti-t5-22b-selective-sp",
    }
    for row in rows.values():
        assert abs(row["error"]) < 0.15, row
        assert row["fits"], row
    assert abs(rows["korthikanti-t5-22b-selective-sp"]["error"]) < 0.02


# Not marked slow (that mark is for multi-process jobs): one process for about a minute, which
# the suite's parallel phase absorbs.
def test_held_out_published_runs_stay_where_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark's scored rows (about a minute), as a regression guard on what it shows today
    (docs/cost-model.md): the held-out median within 4.5%, that of the rows from other sources
    than llm-foundry within 5%; the rows beyond 25% are the known ones (nanotron's 8.9B on
    DP 4 x PP 2 and its 1.3B on TP 2 x PP 2 at micro-batch 2, three llm-foundry rows, one of
    which contradicts its own table, five of BigScience's fp16 topology search, and six rows
    scored since issue 43 priced compile and TP overlap: torchtitan's compiled row-wise fp8
    and two GB200 405B fp8 rows). nanotron's
    tensor-parallel runs at micro-batch 1 are within 25% under its profile's host floor
    (`Calibration.tp_block_host_floor_s`). The H100-80GB rows run at the dgx-h100-80g preset's
    GEMM rate, as the product prices them.
    The BLOOM rows carry the inter-node rate measured on their cluster
    (bench/data/validation_assumptions.yaml)."""
    validate_published.main(["--json", "--scored"])
    out = json.loads(capsys.readouterr().out)
    rows = [r for r in out["rows"] if r["status"] == "held_out"]
    # The published rows that contradict their own table (docs/cost-model.md).
    assert {c["slower"] for c in out["contradictions"]} == {
        # 2.7x slower than its p4 x d2 sibling; fewer stages allow at most 8% + 0.14 s
        "nanotron-usp-1node-8.9b-d4t1p2-mb1-ga64-z1",
        "llmfoundry-a100-40g-mpt-1b-s2048-g32-mb10",
        "llmfoundry-a100-80g-mpt-760m-s512-g8-mb96",
        "llmfoundry-a100-80g-mpt-760m-s1024-g8-mb48",
        "llmfoundry-h100-80g-mpt-760m-s2048-g8-mb24",
    }
    others = sorted(abs(r["error"]) for r in rows if not r["id"].startswith("llmfoundry-"))
    every = sorted(abs(r["error"]) for r in rows)
    assert len(others) >= 250 and len(every) >= 420
    # 4.1% today (5.2% until nanotron's host floor, the preset's H100 GEMM rate and the
    # megatron-lm-2019 profile)
    assert others[len(others) // 2] <= 0.05
    assert every[len(every) // 2] <= 0.045  # 3.9% today
    beyond = {r["id"] for r in rows if abs(r["error"]) > 0.25}
    known_llmfoundry = {
        "llmfoundry-a100-80g-mpt-760m-s512-g8-mb96",
        "llmfoundry-a100-40g-mpt-70b-s2048-g64-mb2",
        # its 2023 stack's H100 GEMMs, slower than the preset's rate, at 8192 tokens and full
        # recompute (the most GEMM work per step of its H100 rows)
        "llmfoundry-h100-80g-mpt-30b-s8192-g8-mb1",
    }
    # BigScience's fp16 topology search (docs/cost-model.md): hidden 13824 with 128 heads (head
    # size 108; its 64- and 96-head siblings are within 5.4%) and micro-batch 1 at TP 4, which
    # took 148 s where its micro-batch-2 sibling took 104 s.
    known_bigscience = {
        "bigscience-prequel-fp16-h13824-l78-nh128-d8t8p6-mb4-gbs2048-0223",
        "bigscience-prequel-fp16-h13824-l78-nh128-d8t8p6-mb4-gbs2048-0226",
        "bigscience-prequel-fp16-h13824-l78-nh128-d8t4p12-mb2-gbs2048-0226",
        "bigscience-prequel-fp16-h13824-l78-nh128-d8t4p12-mb4-gbs2048-0226",
        "bigscience-prequel-fp16-h13824-l78-nh64-d8t4p12-mb1-gbs2048-0226",
    }
    # nanotron's 8.9B on DP 4, PP 2, ZeRO-1 at micro-batch 1: 2752 tok/s/GPU at 71.5 GB, where
    # every other single-node 8.9B run with PP or DP made 5883-7503 at 31-65 GB (the source
    # says nothing more; the model predicts +160%).
    # Its 1.3B on TP 2 x PP 2 at micro-batch 2 and ZeRO-1 took 5.5 s, where the same at
    # micro-batch 1 took 5.6-6.3 s and at 4-8 took 3.7 s (+30%; docs/cost-model.md).
    known_nanotron = {
        "nanotron-usp-1node-8.9b-d4t1p2-mb1-ga64-z1",
        "nanotron-usp-1node-1.3b-d2t2p2-mb2-ga64-z1",
    }
    # (Megatron-Bridge's Llama 3 8B FP8-CS on 8 B200 and 8 GB200 were here at -31% and -28%
    # until the megatron-lm profile stated cuDNN's attention rate on Blackwell, from the
    # FlashAttention-4 paper's comparison, not from these rows)
    # Scored since issue 43 (torch.compile and TP overlap priced): torchtitan's async-TP
    # benchmark's row-wise fp8 rows, which ran no faster than bf16 (27.3 s vs 27.4 s a step at
    # 70B) where compiled row-wise fp8 is priced 1.3-1.4x faster (+38% to +63%; priced eager,
    # -1% to -10%: `validate_published.py --techniques`), and Llama 3.1 405B fp8 on 256 and
    # 512 GB200 with Transformer Engine's TP overlap (+25.4%, +25.6%; +12% priced without it).
    known_techniques = {
        "torchtitan-asynctp2506-70b-256g-fp8-rowwise-tp",
        "torchtitan-asynctp2506-70b-256g-fp8-rowwise-asynctp",
        "torchtitan-asynctp2506-8b-64g-fp8-rowwise-tp",
        "torchtitan-asynctp2506-8b-64g-fp8-rowwise-asynctp",
        "dgxc2505-gb200-llama3.1-405b-256g-fp8",
        "dgxc2505-gb200-llama3.1-405b-512g-fp8",
    }
    known = known_llmfoundry | known_bigscience | known_nanotron | known_techniques
    assert beyond == known, sorted(beyond ^ known)
    # nanotron's tensor-parallel runs at micro-batch 1 on 2 to 8 ranks (the host floor's fit
    # rows are the three on 8): +76% to +132% without the floor
    floored = [
        abs(r["error"]) for r in rows if re.search(r"^nanotron-usp-1node-.*t[248]p\d-mb1-", r["id"])
    ]
    assert len(floored) == 23 and max(floored) <= 0.20, sorted(floored)[-3:]  # 18.4% today
    # nanotron's compute-balanced pipeline stages (the nanotron profile's split): every
    # single-node PP run scored but the 1.3B on 8 stages, whose loss nanotron puts apart from
    # its lm_head, inside autoplan's head unit.
    pp_runs = {r["id"] for r in rows if re.search(r"^nanotron-usp-1node-.*p[248]-", r["id"])}
    assert len(pp_runs) == 40, len(pp_runs)
    # llm-foundry's single-node H100 runs at the preset's H100 GEMM rate, which its 2023 stack
    # did not reach: a median 6.5% too fast
    h100 = sorted(abs(r["error"]) for r in rows if r["id"].startswith("llmfoundry-h100-80g"))
    assert len(h100) >= 30 and h100[len(h100) // 2] <= 0.08 and max(h100) <= 0.30, h100[-3:]
    # BigScience's fp16 topology search, priced by DeepSpeed's fp16 ZeRO-1 pipeline engine
    # (cost_model/parts/deepspeed_pipeline.py): every row scored, from 02-25 on (after the
    # node fix the chronicles note) within a few percent.
    fp16 = {r["id"]: abs(r["error"]) for r in rows if r["id"].startswith("bigscience-prequel-fp16")}
    assert len(fp16) == 77
    assert sorted(fp16.values())[len(fp16) // 2] <= 0.07  # 5.4% today
    dates = {i: int(re.findall(r"-gbs\d+-(\d{4})", i)[0]) for i in fp16}  # MMDD, 2022
    late = sorted(e for i, e in fp16.items() if dates[i] >= 225)
    assert len(late) == 47 and late[len(late) // 2] <= 0.04  # 3.2% today
    # fp8 (issue 41): the DGX Cloud Benchmarking Llama 3.1 8B rows in FP8 (Transformer Engine's
    # delayed scaling, priced as fp8) and their BF16 partners, held out: the fp8 rows within 10%
    # (8.1% today) and the fp8/bf16 speed-up within 5% of the published one (3.5% today)
    fp8 = [
        abs(r["error"])
        for r in rows
        if r["dtype"] in ("fp8", "fp8-rowwise", "mxfp8") and "llama3.1-8b" in r["id"]
    ]
    assert len(fp8) == 15 and max(fp8) <= 0.10, sorted(fp8)[-3:]
    pairs = [p for p in out["fp8_pairs"] if "llama3.1-8b" in p["fp8"]]
    assert len(pairs) == 15 and all(p["scored"] for p in pairs)
    speedup = [abs(p["predicted_speedup"] / p["published_speedup"] - 1) for p in pairs]
    assert max(speedup) <= 0.05, max(speedup)
    published, assumptions = validate_published.load()
    cases = [
        validate_published.build_case(row, assumptions)
        for row in published
        if row["id"].startswith("bloom-176b")
    ]
    assert len(cases) == 3
    for case in cases:
        assert isinstance(case, validate_published.Case)
        inter = case.cluster.inter_node
        assert inter.bandwidth_bytes_per_s == pytest.approx(135e9 / 8 / 8)
        assert case.cluster.calibration.inter_node_comm_efficiency == 1.0


# One source table's family for the hand-made rows below: llm-foundry's way of reporting.
_TABLE = {
    "families": {"t": {"status": "held_out", "throughput": "tokens_per_gpu", "dtype": "bf16"}},
    "gpu_presets": {"a100-80g": {"preset": "dgx-a100-80g"}},
    "rows": {},
}


def _run(
    run_id: str,
    *,
    gpus: int,
    seq: int,
    micro_batch: int,
    accumulation: int,
    tokens_per_s_per_gpu: float,
    source: str = "table A",
    pp: int = 1,
) -> Case:
    """A published row of an FSDP sweep (or, with ``pp``, a ZeRO-1 pipeline run), through the
    bench's own `build_case`."""
    row = {
        "id": f"t-{run_id}",
        "source": source,
        "gpu": "a100-80g",
        "num_gpus": gpus,
        "model": {
            "family": "gpt",
            "num_layers": 24,
            "hidden_size": 1536,
            "num_heads": 12,
            "seq_len": seq,
            "vocab_size": 50368,
        },
        "config": {
            "micro_batch": micro_batch,
            "global_batch": gpus // pp * micro_batch * accumulation,
            "zero": 3 if pp == 1 else 1,
            "pp": pp,
        },
        "measured": {"tokens_per_s": tokens_per_s_per_gpu},
    }
    case = validate_published.build_case(row, _TABLE)
    assert isinstance(case, Case)
    return dataclasses.replace(case, run_id=run_id)


def test_source_contradictions_follow_the_two_rules_beyond_the_noise() -> None:
    """Weak scaling: fewer GPUs with at least as many accumulation steps may not be slower per
    GPU; sequence: a shorter sequence at the same tokens per micro-batch may not be slower.
    Only pairs from one table, and only gaps beyond the 5% noise, are reported."""
    small = _run("g8", gpus=8, seq=2048, micro_batch=4, accumulation=2, tokens_per_s_per_gpu=900)
    big = _run("g16", gpus=16, seq=2048, micro_batch=4, accumulation=1, tokens_per_s_per_gpu=1000)
    found = source_contradictions([small, big])
    assert [(c.slower, c.faster) for c in found] == [("g8", "g16")]
    assert found[0].gap == pytest.approx(-0.1)
    assert found[0].rule == "weak scaling (8 vs 16 GPUs)"
    # Within the noise; fewer accumulation steps on fewer GPUs (per-step costs weigh more);
    # another table; another micro-batch: no rule applies, nothing reported.
    near = dataclasses.replace(small, published_step_s=small.published_step_s * 0.92)
    assert source_contradictions([near, big]) == []
    fewer = _run("g8a1", gpus=8, seq=2048, micro_batch=4, accumulation=1, tokens_per_s_per_gpu=900)
    more = _run(
        "g16a2", gpus=16, seq=2048, micro_batch=4, accumulation=2, tokens_per_s_per_gpu=1000
    )
    assert source_contradictions([fewer, more]) == []
    other = dataclasses.replace(big, source="table B")
    assert source_contradictions([small, other]) == []
    mb8 = _run("mb8", gpus=16, seq=2048, micro_batch=8, accumulation=1, tokens_per_s_per_gpu=1000)
    assert source_contradictions([small, mb8]) == []

    long = _run("s2048", gpus=8, seq=2048, micro_batch=4, accumulation=2, tokens_per_s_per_gpu=1000)
    short = _run("s512", gpus=8, seq=512, micro_batch=16, accumulation=2, tokens_per_s_per_gpu=800)
    found = source_contradictions([long, short])
    assert [(c.slower, c.faster, c.rule) for c in found] == [
        ("s512", "s2048", "sequence (512 vs 2048)")
    ]
    assert found[0].gap == pytest.approx(-0.2)
    # The longer sequence being slower is what attention costs; other tokens per micro-batch
    # change the GEMM shapes, so the rule does not apply.
    assert (
        source_contradictions(
            [dataclasses.replace(long, published_step_s=long.published_step_s * 2), short]
        )
        == []
    )
    short_mb = _run(
        "s512mb8", gpus=8, seq=512, micro_batch=8, accumulation=2, tokens_per_s_per_gpu=800
    )
    assert source_contradictions([long, short_mb]) == []


def test_the_pipeline_rule_allows_only_the_bounded_cost_of_fewer_stages() -> None:
    """Trading pipeline stages for data parallelism (same batch, micro-batch and GPUs): the
    row with fewer stages has fewer micro-batches per pipeline over larger stages, so it may
    be slower only by its stage's share of the embedding and head and its larger gradient sync.
    Hand-worked for the 24-layer GPT (h 1536, V 50368) on 8 A100-80GB, p2 x d4 vs p4 x d2 at
    micro-batch 1, 256 sequences: layer weights 12 h^2 = 28.3M, V h = 77.4M; m = 32 and 64;
    (32 + 1)(12 x 28.3M + 77.4M) / (64 (24 x 28.3M + 77.4M) / 4) = 1.137."""
    deep = _run(
        "p4", gpus=8, seq=2048, micro_batch=1, accumulation=64, pp=4, tokens_per_s_per_gpu=1000
    )
    shallow = _run(
        "p2", gpus=8, seq=2048, micro_batch=1, accumulation=32, pp=2, tokens_per_s_per_gpu=1000
    )
    assert (deep.plan_args["dp"], shallow.plan_args["dp"]) == (2, 4)
    factor, seconds = validate_published.pipeline_allowance(shallow, deep)
    layer, vocab = 12 * 1536**2, 50368 * 1536
    assert factor == pytest.approx(33 * (12 * layer + vocab) / (64 * (24 * layer + vocab) / 4))
    assert factor == pytest.approx(1.137, abs=1e-3)
    # 8 bytes a weight of the busiest stage (12 layers and two vocabulary matrices) over NVLink,
    # 32 at HBM bandwidth
    stage = 12 * layer + 2 * vocab
    cluster = shallow.cluster
    assert seconds == pytest.approx(
        stage * 8 / cluster.intra_node.bandwidth_bytes_per_s
        + stage * 32 / cluster.device.memory_bandwidth_bytes_per_s
    )
    # Within its allowance (and the noise) nothing is reported; beyond it, the pair is.
    allowed = deep.published_step_s * factor + seconds
    within = dataclasses.replace(shallow, published_step_s=allowed * 1.04)
    assert validate_published.source_contradictions([within, deep]) == []
    beyond = dataclasses.replace(shallow, published_step_s=allowed * 1.06)
    found = validate_published.source_contradictions([beyond, deep])
    assert [(c.slower, c.faster) for c in found] == [("p2", "p4")]
    assert found[0].rule.startswith("pipeline depth (p2 x d4 vs p4 x d2: at most 14% + ")
    # The deeper pipeline being slower is no contradiction; nor is another micro-batch.
    slow_deep = dataclasses.replace(deep, published_step_s=deep.published_step_s * 3)
    assert validate_published.source_contradictions([shallow, slow_deep]) == []
    mb2 = _run(
        "p2mb2", gpus=8, seq=2048, micro_batch=2, accumulation=16, pp=2, tokens_per_s_per_gpu=100
    )
    assert validate_published.source_contradictions([mb2, deep]) == []


def test_fitting_a_constant_on_its_own_rows_recovers_its_shipped_value() -> None:
    """Leave-one-source-out re-fits constants with `fit_constant`; on the constant's own fit
    rows it must land where the shipped value was fitted (within the search's tolerance and
    the shipped value's rounding)."""
    published, assumptions = validate_published.load()
    validate_published.FITTED = validate_published.fitted_constants(assumptions)
    constant = next(
        c for c in validate_published.FITTED if c.name == "gemm_efficiency" and "h100-96g" in c.gpus
    )
    rows = {r["id"]: r for r in published}
    cases = [validate_published.build_case(rows[i], assumptions) for i in constant.rows]
    assert all(isinstance(c, Case) for c in cases)
    fitted = validate_published.fit_constant(constant, cases, {})  # type: ignore[arg-type]
    assert fitted == pytest.approx(constant.value, abs=0.005)
    # and every fitted row is listed with status fit, every fit row under a constant
    fit_rows = {i for c in validate_published.FITTED for i in c.rows}
    statuses = {i: (assumptions["rows"].get(i) or {}).get("status") for i in fit_rows}
    assert set(statuses.values()) == {"fit"}, statuses
    declared_fit = {i for i, a in assumptions["rows"].items() if (a or {}).get("status") == "fit"}
    assert declared_fit == fit_rows


def test_a_stacks_fitted_constant_is_the_one_its_profile_ships() -> None:
    """nanotron's host floor is fitted by the bench and shipped by the product's profile: the
    bench refuses to run if the two differ, re-fits it through the profile on its own rows
    (landing on the shipped value), and restores the profile after."""
    published, assumptions = validate_published.load()
    validate_published.FITTED = validate_published.fitted_constants(assumptions)
    constant = next(c for c in validate_published.FITTED if c.framework == "nanotron")
    assert constant.key == "tp_block_host_floor_s[nanotron]"
    shipped = FRAMEWORKS["nanotron"]
    assert shipped.tp_block_host_floor_s == constant.value
    rows = {r["id"]: r for r in published}
    cases = [validate_published.build_case(rows[i], assumptions) for i in constant.rows]
    assert all(isinstance(c, Case) and constant.applies(c) for c in cases)
    fitted = validate_published.fit_constant(constant, cases, {})  # type: ignore[arg-type]
    assert fitted == pytest.approx(constant.value, abs=1e-4)
    assert FRAMEWORKS["nanotron"] is shipped
    # held out, the constant takes Calibration's 0: the rows it was fitted to go 2x too fast
    with validate_published.profile_constants({constant.key: 0.0}):
        assert FRAMEWORKS["nanotron"].tp_block_host_floor_s == 0.0
        errors = [validate_published.predict(c).error for c in cases]  # type: ignore[arg-type]
    assert min(errors) > 0.2 and FRAMEWORKS["nanotron"] is shipped
    # a value the product does not ship is refused, naming both
    changed = {
        **assumptions,
        "fitted_constants": [
            {**c, "value": 0.005} if c.get("framework") == "nanotron" else c
            for c in assumptions["fitted_constants"]
        ],
    }
    with pytest.raises(
        ValueError, match=r"tp_block_host_floor_s\[nanotron\] = 0.005.*ships 0.0044"
    ):
        validate_published.fitted_constants(changed)


def test_megatron_flop_count_reproduces_the_printed_tflops() -> None:
    """`megatron_flops` (Megatron-LM's num_floating_point_operations) with the rows' dimensions
    turns the Qwen3-235B table's printed step times into its printed TFLOP/s (within 0.5%), and
    the MoE and cp rows are built as MoE / cp / ep plans."""
    published, assumptions = validate_published.load()
    rows = {row["id"]: row for row in published}
    checked = 0
    for run_id, row in rows.items():
        measured = row["measured"]
        if not run_id.startswith("mcore-moezoo-h100-qwen3-235b") or not measured["step_time_s"]:
            continue
        model = row["model"]
        moe = model["moe"]
        dims = validate_published.ModelDims(
            family=model["family"],
            num_layers=model["num_layers"],
            hidden_size=model["hidden_size"],
            num_heads=model["num_heads"],
            num_kv_heads=model["num_kv_heads"],
            ffn_hidden_size=None,
            seq_len=model["seq_len"],
            vocab_size=model["vocab_size"],
            head_dim=model["head_dim"],
            num_experts=moe["num_experts"],
            top_k=moe["top_k"],
            moe_ffn_hidden_size=moe["moe_ffn_hidden_size"],
        )
        flops = validate_published.megatron_flops(dims, row["config"]["global_batch"])
        tflops = flops / (measured["step_time_s"] * row["num_gpus"]) / 1e12
        # both printed to 3 figures (19.7 s: +-0.25%; 245: +-0.2%); 246.2 vs 245 is the widest
        assert tflops == pytest.approx(measured["tflops_per_gpu"], rel=0.0055), run_id
        checked += 1
    assert checked == 5
    case = validate_published.build_case(
        rows["mcore-moezoo-h100-qwen3-235b-256g-s16k-cp1"], assumptions
    )
    assert isinstance(case, Case) and case.dims.num_experts == 128 and case.dims.head_dim == 128
    assert (case.plan_args["ep"], case.plan_args["cp"], case.plan_args["dp"]) == (8, 1, 8)
    assert case.plan_args["framework"] == (
        "megatron-lm:split=layers-with-edges,recompute_modules=layernorm+moe,dropout=0"
    )
    # the derived step of the collector (published_runs_moe.yaml) from the same formula
    assert case.published_step_s == pytest.approx(11.37, abs=0.01)
    cp = validate_published.build_case(rows["automodel-h100-llama3.1-70b-64g-cp2"], assumptions)
    assert isinstance(cp, Case) and (cp.plan_args["cp"], cp.plan_args["dp"]) == (2, 32)
    # a row autoplan cannot express is refused, whatever its status says
    with pytest.raises(ValueError, match="ep = 32 does not divide dp = 16"):
        validate_published.check_expressible(rows["mcore-moezoo-h100-qwen3-235b-256g-ep32-pp8"])
    with pytest.raises(ValueError, match="etp = 2"):
        validate_published.check_expressible(
            rows["mcore-moezoo-h100-mixtral-8x22b-128g-forced-balance"]
        )


def test_fp8_recipes_map_to_the_plan_dtype_that_names_them() -> None:
    """A row's fp8 recipe becomes the plan dtype of the same recipe; an unstated or unnamed one
    is refused (the row must be skipped), and delayed scaling only where its family prices it
    as a stated dtype (the assumption written beside it)."""
    plan_dtype = validate_published.plan_dtype
    assert plan_dtype("bf16", None, {}, "r") == "bf16"
    assert plan_dtype("fp8", "tensorwise", {}, "r") == "fp8"
    assert plan_dtype("fp8", "rowwise", {}, "r") == "fp8-rowwise"
    assert plan_dtype("fp8", "mxfp8", {}, "r") == "mxfp8"
    assert plan_dtype("fp8", "delayed", {"fp8_delayed_as": "fp8"}, "r") == "fp8"
    with pytest.raises(ValueError, match="recipe not stated"):
        plan_dtype("fp8", None, {}, "r")
    with pytest.raises(ValueError, match=r"delayed scaling .* has no autoplan name"):
        plan_dtype("fp8", "delayed", {}, "r")
    with pytest.raises(ValueError, match=r"blockwise fp8 .* has no autoplan name"):
        plan_dtype("fp8", "blockwise", {}, "r")
    with pytest.raises(ValueError, match="fp8_recipe 'rowwise' on a bf16 row"):
        plan_dtype("bf16", "rowwise", {}, "r")


def test_every_fp8_row_is_mapped_or_skipped_with_its_reason() -> None:
    """Every published fp8 row has an assumptions entry: predicted with the plan dtype of its
    recipe (and fp8_all_gather where the run gathered fp8 weights), or skipped with a reason of
    its own, never the bench's default."""
    published, assumptions = validate_published.load()
    default = validate_published._default_skip_reason({"config": {"dtype": "fp8"}, "model": {}})
    dtypes: dict[str, str] = {}
    for row in published:
        if row["config"].get("dtype") != "fp8":
            continue
        built = validate_published.build_case(row, assumptions)
        if isinstance(built, validate_published.Skipped):
            assert built.reason != default, row["id"]
            continue
        assert validate_published.is_fp8(built), row["id"]
        dtypes[row["id"]] = built.plan_args["dtype"]
    # (torchtitan's tensor-wise rows are skipped: its profile is 0.3's, which has no tensor-wise
    # float8)
    assert len(dtypes) >= 45
    assert dtypes["torchtitan-asynctp2506-8b-64g-fp8-rowwise-tp"] == "fp8-rowwise"
    assert "torchtitan-asynctp2506-8b-64g-fp8-tensorwise-tp" not in dtypes
    assert dtypes["dgxc2411-h100-llama3.1-8b-8g-fp8"] == "fp8"  # delayed scaling, as fp8
    rows = {row["id"]: row for row in published}
    case = validate_published.build_case(rows["dgxc2411-h100-llama3.1-8b-8g-fp8"], assumptions)
    assert isinstance(case, Case) and case.plan_args["fp8_all_gather"] is True
    assert case.status == "held_out" and case.plan_args["framework"] == "megatron-lm:dropout=0"
    # the DGX Cloud Benchmarking rows: every config value from the recipe's yaml, the step time
    # as printed, seq x GBS / step = the printed tokens/s
    assert case.published_step_s == 9.67
    assert (case.plan_args["cp"], case.plan_args["dp"], case.plan_args["zero"]) == (2, 4, 1)
    for run_id, row in rows.items():
        if run_id.startswith("dgxc") and run_id != "dgxc2411-h100-llama3.1-70b-2048g-bf16":
            tokens = row["model"]["seq_len"] * row["config"]["global_batch"]
            measured = row["measured"]
            assert tokens / measured["step_time_s"] == pytest.approx(
                measured["aggregate_tokens_per_s"], rel=0.001
            ), run_id


def test_fp8_rows_pair_with_the_bf16_row_of_their_configuration() -> None:
    """`fp8_pairs` matches each fp8 row with the bf16 row of the same family, model, GPUs and
    stated config (the same release, not the other one), and the report prints both figures."""
    published, assumptions = validate_published.load()
    cases = [
        validate_published.build_case(row, assumptions)
        for row in published
        if row["id"].startswith(("dgxc2411-h100-llama3.1-8b-", "dgxc2502-h100-llama3.1-8b-8g"))
    ]
    assert len(cases) == 12 and all(isinstance(c, Case) for c in cases)
    results = [validate_published.predict(c) for c in cases]
    pairs = validate_published.fp8_pairs(results)
    assert {(p.fp8.case.run_id, p.bf16.case.run_id) for p in pairs} == {
        (f"{fam}-h100-llama3.1-8b-{g}g-fp8", f"{fam}-h100-llama3.1-8b-{g}g-bf16")
        for fam, gpus in (("dgxc2411", (8, 16, 32, 64, 128)), ("dgxc2502", (8,)))
        for g in gpus
    }
    assert all(p.scored for p in pairs)
    first = next(p for p in pairs if p.fp8.case.run_id == "dgxc2411-h100-llama3.1-8b-8g-fp8")
    assert first.published == pytest.approx(12.91 / 9.67)
    text = "\n".join(validate_published.fp8_report(results))
    assert "fp8 scored       rows   6" in text and "scored pairs 6" in text


def _nextgen_rows() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    published, assumptions = validate_published.load()
    rows = {row["id"]: row for row in published}
    return rows, assumptions


def test_h200_b200_gb200_rows_map_to_their_presets_and_recipes() -> None:
    """Issue 42 item 4: the GB200 and B200 rows are priced on the gb200-nvl72 and dgx-b200-180g
    presets, each GB200 job's NVLink domain is its stated Slurm segment (a whole 8-GPU job
    otherwise), fp8 recipes map as the fp8 family's (current scaling -> fp8 with its fp8 weight
    gathers, MXFP8 -> mxfp8 without them, delayed -> fp8 under the stated assumption), and only
    the rows whose every config value is stated are scored (the TP-overlapped ones since issue
    43 priced the overlap). Trainy's H200 rows are H200's, skipped for their tensor-wise
    float8."""
    rows, assumptions = _nextgen_rows()
    ids = [
        i for i in rows if i.startswith(("dgxc2505-", "mbridge-2511-gb200", "mbridge-2511-b200"))
    ]
    assert len(ids) == 14
    cases = {i: validate_published.build_case(rows[i], assumptions) for i in ids}
    assert all(isinstance(c, Case) for c in cases.values())
    built = {i: c for i, c in cases.items() if isinstance(c, Case)}
    devices = {c.gpu: c.cluster.device.name for c in built.values()}
    assert devices == {"gb200-186g": "GB200-186GB", "b200-180g": "B200-SXM-180GB"}
    scored = {i for i, c in built.items() if c.status in ("fit", "held_out")}
    assert scored == {
        "mbridge-2511-gb200-llama3-8b-8g-fp8cs",
        "mbridge-2511-b200-llama3-8b-8g-fp8cs",
        "mbridge-2511-b200-llama3.1-405b-128g-fp8cs",
        *(i for i in ids if i.startswith("dgxc2505-")),
    }
    gb200_8 = built["mbridge-2511-gb200-llama3-8b-8g-fp8cs"]
    assert (gb200_8.cluster.devices_per_node, gb200_8.cluster.scale_up_domain) == (4, 8)
    assert gb200_8.plan_args["dtype"] == "fp8" and gb200_8.plan_args["fp8_all_gather"] is True
    assert gb200_8.plan_args["framework"] == "megatron-lm:dropout=0"
    mx = built["mbridge-2511-b200-llama3-8b-8g-fp8mx"]
    assert mx.plan_args["dtype"] == "mxfp8" and mx.plan_args["fp8_all_gather"] is False
    assert mx.status == "unscored"
    for i in ids:
        if i.startswith("dgxc2505-") or "405b-256g" in i:
            # 16-node Slurm segments: 64 GPUs share an NVLink domain
            assert built[i].cluster.scale_up_domain == 64, i
            assert (
                built[i].plan_args["framework"] == "megatron-lm:dropout=0,split=layers-with-edges"
            )
    delayed = built["dgxc2505-gb200-llama3.1-405b-128g-fp8"]
    assert delayed.plan_args["dtype"] == "fp8" and delayed.plan_args["fp8_all_gather"] is True
    assert (delayed.plan_args["tp"], delayed.plan_args["cp"], delayed.plan_args["dp"]) == (4, 2, 2)
    assert delayed.published_step_s == 6.131
    for run_id in ("torchtitan-trainy-h200-8b-32g-fp8", "torchtitan-trainy-h200-8b-64g-fp8"):
        skipped = validate_published.build_case(rows[run_id], assumptions)
        assert isinstance(skipped, validate_published.Skipped)
        assert skipped.gpu == "h200-141g" and "tensor-wise float8" in skipped.reason
    presets = assumptions["gpu_presets"]
    assert {g: presets[g]["preset"] for g in ("h200-141g", "b200-180g", "gb200-186g")} == {
        "h200-141g": "dgx-h200-141g",
        "b200-180g": "dgx-b200-180g",
        "gb200-186g": "gb200-nvl72",
    }


def test_h200_b200_gb200_transcriptions_agree_with_their_own_columns() -> None:
    """The transcribed numbers check against each other as their sources compute them: DGX Cloud
    Benchmarking's tokens/s = seq x GBS / step and MFU = GBS x 2.17e16 / step / GPUs / peak
    (2.45 PFLOP/s BF16, 4.9 FP8 on GB200); Megatron-Bridge's Model TFLOP/s/GPU = Megatron-LM's
    FLOP count over the step its tokens/s/GPU gives; every layout multiplies to the GPUs and
    the printed GA is GBS / (dp x MBS)."""
    rows, _ = _nextgen_rows()
    checked = 0
    for run_id, row in rows.items():
        if not run_id.startswith(("dgxc2505-", "mbridge-2511-gb200", "mbridge-2511-b200")):
            continue
        model, config, measured = row["model"], row["config"], row["measured"]
        gpus, batch = row["num_gpus"], config["global_batch"]
        assert gpus == config["tp"] * config["pp"] * config["cp"] * config["dp"], run_id
        if config.get("ga") is not None:
            assert config["ga"] == batch // (config["dp"] * config["micro_batch"]), run_id
        if run_id.startswith("dgxc2505-"):
            step = measured["step_time_s"]
            tokens = model["seq_len"] * batch / step
            assert tokens == pytest.approx(measured["aggregate_tokens_per_s"], rel=1e-4), run_id
            peak = 2.45e15 if config["dtype"] == "bf16" else 4.9e15
            mfu = batch * 2.17e16 / step / gpus / peak
            assert mfu == pytest.approx(measured["mfu"], abs=6e-4), run_id
        else:
            dims = validate_published.ModelDims(
                family=model["family"],
                num_layers=model["num_layers"],
                hidden_size=model["hidden_size"],
                num_heads=model["num_heads"],
                num_kv_heads=model["num_kv_heads"],
                ffn_hidden_size=model["ffn_hidden_size"],
                seq_len=model["seq_len"],
                vocab_size=model["vocab_size"],
            )
            step = batch * model["seq_len"] / (measured["tokens_per_s"] * gpus)
            tflops = validate_published.megatron_flops(dims, batch) / step / gpus / 1e12
            # tokens/s printed to 3-5 figures; 1668.3 vs 1667 is the widest
            assert tflops == pytest.approx(measured["tflops_per_gpu"], rel=0.002), run_id
        checked += 1
    assert checked == 14


def test_device_report_gives_each_device_type_and_the_presets_without_rows() -> None:
    """Each device type's rows apart, scored and unscored, with its skipped count; the presets
    no predicted row runs on are listed, with their skipped rows (issue 42)."""
    case = _run("g8", gpus=8, seq=2048, micro_batch=4, accumulation=2, tokens_per_s_per_gpu=900)
    result = validate_published.predict(case)
    unscored = dataclasses.replace(result, case=dataclasses.replace(case, status="unscored"))
    skipped = [
        validate_published.Skipped(run_id="x", reason="r", gpu="h200-141g"),
        validate_published.Skipped(run_id="y", reason="r", gpu="other"),
    ]
    presets = {"a100-80g": {"preset": "dgx-a100-80g"}, "h200-141g": {"preset": "dgx-h200-141g"}}
    devices = validate_published.device_rows([result, unscored, result], skipped, presets)
    by_gpu = {d.gpu: d for d in devices}
    assert set(by_gpu) == {"a100-80g", "h200-141g", "other"}
    a100 = by_gpu["a100-80g"]
    assert a100.preset == "dgx-a100-80g" and a100.skipped == 0
    assert a100.figures("scored") == {
        "rows": 2,
        "median": pytest.approx(abs(result.error)),
        "max": pytest.approx(abs(result.error)),
    }
    assert a100.figures("unscored")["rows"] == 1
    assert by_gpu["h200-141g"].figures("scored") == {"rows": 0, "median": None, "max": None}
    missing = validate_published.presets_without_rows(devices)
    assert "dgx-a100-80g" not in missing and missing["dgx-h200-141g"] == 1
    assert missing["mi300x-192g"] == 0
    text = "\n".join(validate_published.device_report(devices))
    assert "dgx-h200-141g (1 rows, all skipped)" in text and "mi300x-192g" in text


# The rows whose source states a technique their plan cannot carry (the roll-up lists them as
# dropped by the mapping): torchtitan's per-layer SAC, every k-th block with k not stated.
_DROPPED = {
    ("partial recompute", "torchtitan-a100-llama3-8b-sac-layer"),
    ("partial recompute", "torchtitan-a100-llama2-13b-sac-layer"),
}


def test_each_technique_a_row_states_is_in_its_plan() -> None:
    """Issue 43's roll-up (`validate_published.technique_rows`), without pricing: every row
    whose source states compile, TP overlap, a precision policy, HSDP or offload and that the
    bench predicts carries it in its plan (none dropped by the row-to-plan mapping but the known
    ones: Megatron-Bridge's activation offload is in its plan), and the techniques with a
    scored row are the four the published rows let us score."""
    published, assumptions = validate_published.load()
    scored: dict[str, int] = {}
    for row in published:
        stated = validate_published.stated_techniques(row, assumptions)
        case = validate_published.build_case(row, assumptions) if stated else None
        if not isinstance(case, Case):
            continue
        planned = validate_published.plan_techniques(case)
        for technique in stated:
            assert technique in planned or (technique, row["id"]) in _DROPPED, (technique, row)
            if case.status in ("fit", "held_out"):
                scored[technique] = scored.get(technique, 0) + 1
    assert set(scored) == {"torch.compile", "TP comm overlap", "precision policy", "HSDP"}
    assert scored["torch.compile"] >= 14 and scored["TP comm overlap"] >= 35, scored
    assert scored["HSDP"] == 4, scored
    offloaded = validate_published.build_case(
        next(r for r in published if r["id"] == "mbridge-2511-gb200-llama3-70b-64g-fp8cs"),
        assumptions,
    )
    assert isinstance(offloaded, Case) and offloaded.plan_args["activation_offload"] == 40


def test_the_technique_rollup_prices_each_row_with_and_without_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two small rows through `main --techniques --json` (their sources fit no constant, so
    nothing is re-fitted: a few seconds): the fms-fsdp 7B HSDP row and torchtitan's async-TP
    8B row (compiled and overlapped). Each is priced with the technique stated and without it,
    and the two step times differ (compile and the overlap make the step shorter, HSDP's
    node-local gathers too); the summary counts them as scored."""
    ids = ("fmsfsdp2403-7b-a100-128g", "torchtitan-asynctp2506-8b-64g-bf16-asynctp")
    validate_published.main(["--techniques", "--json", "--only", ",".join(ids)])
    out = json.loads(capsys.readouterr().out)
    rows = {(r["technique"], r["run_id"]): r for r in out["rows"]}
    assert set(rows) == {
        ("HSDP", ids[0]),
        ("torch.compile", ids[1]),
        ("TP comm overlap", ids[1]),
    }
    for r in rows.values():
        assert r["in_plan"] and r["status"] == "held_out", r
        # error = published / predicted step - 1: the technique shortens the predicted step
        assert r["after"] > r["before"], r
    summaries = {s["technique"]: s for s in out["techniques"]}
    assert list(summaries) == list(validate_published.TECHNIQUES)
    assert summaries["torch.compile"]["scored"] == 1
    assert summaries["HSDP"]["scored_after"]["rows"] == 1
    assert summaries["partial recompute"]["rows"] == 0
