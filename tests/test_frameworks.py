"""Framework profiles (cost_model.frameworks): a plan priced for the training stack it runs on.

Each profile changes exactly the calibration fields it names (and applying it twice changes
nothing more); ``autoplan``'s is the identity, so every plan made before the field existed keeps
its estimate. The framework is recorded in the plan file, selectable in the API and every
planning command, and an unknown name is refused naming the known ones.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import autoplan
from autoplan.contract.errors import InputError, PlanError
from autoplan.contract.plan import Plan
from cost_model.calibration import Calibration
from cost_model.compute import op_time
from cost_model.frameworks import (
    DEFAULT_FRAMEWORK,
    FRAMEWORKS,
    FrameworkError,
    framework_profile,
    unfused_attention_efficiency,
)
from cost_model.parts.host import sync_copies_s
from cost_model.parts.optimizer import optimizer_cost
from cost_model.strategy import Strategy
from cost_model.workload import GemmShape, OpProfile
from tests.conftest import run_cli

CLUSTER = "dgx-a100-80g:nodes=2"
MODEL = "gpt:num_layers=8,hidden_size=1024,num_heads=16,seq_len=2048,vocab_size=51200"


@pytest.fixture(scope="module")
def graph() -> Any:
    return autoplan.trace(
        autoplan.models.gpt(8, 1024, 16, 2048, 51200)  # MODEL's GPT, on meta
    )


def _changed(a: Calibration, b: Calibration) -> set[str]:
    return {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}


def _fields(profile: Any) -> list[tuple[str, Any]]:
    """A profile's fields by name, those of its nested records (`Pricing` and the like) as
    its own."""
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(profile):
        value = getattr(profile, f.name)
        out += _fields(value) if dataclasses.is_dataclass(value) else [(f.name, value)]
    return out


def test_every_profile_changes_only_what_it_names_and_is_idempotent(graph: Any) -> None:
    cluster = autoplan.Cluster.preset("dgx-a100-80g")
    names = {
        "attention": {"attention_efficiency", "attention_backward_efficiency"},
        "attention_efficiency_by_device": {"attention_efficiency"},
        "dp_overlap": {"dp_overlap_fraction"},
        "unfused_score_bytes": {"attention_efficiency", "attention_backward_efficiency"},
    }
    assert set(FRAMEWORKS) == {"autoplan", "megatron-lm", "megatron-lm-2021", "megatron-lm-2019",
                               "deepspeed", "megatron-deepspeed", "torchtitan", "llm-foundry",
                               "nanotron", "flash-attn-training"}  # fmt: skip
    for profile in FRAMEWORKS.values():
        assert profile.sources and profile.version and profile.summary, profile.name
        once = profile.cluster_for(graph.profile, cluster)
        twice = profile.cluster_for(graph.profile, once)
        assert twice == once, profile.name
        set_fields = {
            field
            for name, value in _fields(profile)
            if name not in ("name", "version", "summary", "sources") and value is not None
            for field in names.get(name, {name})
        }
        assert _changed(cluster.calibration, once.calibration) <= set_fields, profile.name
        assert once.device == cluster.device and once.inter_node == cluster.inter_node
    assert FRAMEWORKS[DEFAULT_FRAMEWORK].cluster_for(graph.profile, cluster) is cluster


def test_megatron_lm_runs_te_cudnn_attention_on_hopper_only(graph: Any) -> None:
    megatron = framework_profile("megatron-lm")
    h100 = autoplan.Cluster.preset("dgx-h100-80g")
    a100 = autoplan.Cluster.preset("dgx-a100-80g")
    assert megatron.cluster_for(graph.profile, h100).calibration.attention_efficiency == 0.54
    assert megatron.cluster_for(graph.profile, a100).calibration.attention_efficiency == (
        a100.calibration.attention_efficiency
    )
    # the cuDNN kernel's rate is well above the FlashAttention-2-era preset's
    assert h100.calibration.attention_efficiency < 0.54


def test_an_unfused_core_costs_the_whole_square_whatever_the_trace_counts(graph: Any) -> None:
    """The trace counts about half the scores of a causal kernel; the unfused core computes
    all of them, so its efficiency in the trace's terms is halved with it: the attention op's
    time is the full square at `unfused_attention_efficiency`."""
    cluster = autoplan.Cluster.preset("dgx-a100-80g")
    fraction = graph.profile.score_fraction
    seq = 2048
    assert fraction == pytest.approx((seq + 1) / (2 * seq))
    unfused = framework_profile("megatron-lm-2021").cluster_for(graph.profile, cluster)
    assert unfused.calibration.attention_efficiency == pytest.approx(
        unfused_attention_efficiency(cluster, 1024 // 16) * fraction
    )
    assert unfused.calibration.attention_backward_efficiency == pytest.approx(
        unfused_attention_efficiency(cluster, 1024 // 16, "backward") * fraction
    )


def test_an_unfused_cores_backward_moves_fewer_bytes_per_flop_than_its_forward() -> None:
    """Per score element: 13 bytes over 4 d FLOPs forward, 19 over 8 d backward; each
    direction's time is its GEMM FLOPs at the GEMM rate plus its bytes at the memory rate."""
    cluster = autoplan.Cluster.preset("dgx-a100-80g")
    cal, device = cluster.calibration, cluster.device
    peak = device.peak_flops_for("bf16")
    bandwidth = device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    d = 128
    for direction, flops, nbytes in (("forward", 4 * d, 13), ("backward", 8 * d, 19)):
        seconds = flops / (peak * cal.gemm_efficiency) + nbytes / bandwidth
        assert unfused_attention_efficiency(cluster, d, direction) == pytest.approx(
            flops / seconds / peak
        )
    assert unfused_attention_efficiency(cluster, d, "backward") > unfused_attention_efficiency(
        cluster, d
    )


def test_the_attention_backward_runs_at_its_own_rate_when_one_is_set() -> None:
    op = OpProfile(name="sdpa", kind="attention", tp="column", forward_flops=4e12,
                   backward_flops=8e12, activation_bytes=1e6)  # fmt: skip
    device = autoplan.Cluster.preset("dgx-a100-80g").device
    same = Calibration(attention_efficiency=0.2)
    faster = Calibration(attention_efficiency=0.2, attention_backward_efficiency=0.3)
    kwargs: dict[str, Any] = {"device": device, "dtype": "bf16", "micro_batch_size": 1}
    a, b = op_time(op, calibration=same, **kwargs), op_time(op, calibration=faster, **kwargs)
    assert a.forward_s == b.forward_s
    assert a.backward_s - same.kernel_overhead_s == pytest.approx(
        (b.backward_s - same.kernel_overhead_s) * 0.3 / 0.2
    )


def test_unfused_attention_is_slower_than_the_fused_kernel_and_grows_with_head_size() -> None:
    cluster = autoplan.Cluster.preset("dgx-a100-80g")
    fused = cluster.calibration.attention_efficiency
    assert unfused_attention_efficiency(cluster, 64) < unfused_attention_efficiency(cluster, 128)
    assert unfused_attention_efficiency(cluster, 128) < fused


def test_a_plan_without_the_field_is_autoplans_and_keeps_its_estimate(graph: Any) -> None:
    plan = autoplan.manual_plan(graph, CLUSTER, tp=2, pp=2, global_batch=32)
    data = plan.to_data()
    assert data["framework"] == "autoplan"
    del data["framework"]  # a plan file written before the field existed
    old = Plan.from_data(data)
    assert old.framework == DEFAULT_FRAMEWORK
    assert autoplan.estimate(graph, CLUSTER, old) == autoplan.estimate(graph, CLUSTER, plan)


def test_megatron_profiles_price_what_those_stacks_do(graph: Any) -> None:
    def step(framework: str, **kwargs: Any) -> Any:
        plan = autoplan.manual_plan(graph, CLUSTER, global_batch=64, framework=framework, **kwargs)
        return autoplan.estimate(graph, CLUSTER, plan)

    full = {"tp": 2, "pp": 2, "recompute": "full"}
    # Reentrant full recompute re-runs each block's whole forward: slower than early stop.
    assert step("megatron-lm", **full).step_time_s > step("autoplan", **full).step_time_s
    # ... and the 2021 stack's unfused attention core is slower still.
    assert step("megatron-lm-2021", **full).step_time_s > step("megatron-lm", **full).step_time_s
    # Megatron frees a stage's output once sent (torch's pipelining keeps it until its
    # backward): the first pipeline rank, which sends the most, holds less.
    pp = {"pp": 4, "micro_batch": 1}
    held = step("autoplan", **pp).ranks[0].memory.total_bytes
    # (without dropout, whose masks the traced model does not keep either)
    assert step("megatron-lm:dropout=0", **pp).ranks[0].memory.total_bytes < held
    # torchtitan's op-level SAC re-runs every second matmul: slower than keeping them all.
    selective = {"tp": 2, "recompute": "selective"}
    assert step("torchtitan", **selective).step_time_s > step("autoplan", **selective).step_time_s


def test_a_stacks_own_flags_are_options_of_its_profile(graph: Any) -> None:
    """Megatron-LM 2021's --DDP-impl: local (one all-reduce after the backward, its default) or
    torch (DDP's buckets overlap the backward)."""
    assert framework_profile("megatron-lm-2021:ddp=torch").dp_overlap == 1.0
    assert framework_profile("megatron-lm-2021:ddp=local") == dataclasses.replace(
        framework_profile("megatron-lm-2021"), name="megatron-lm-2021:ddp=local"
    )

    def step(framework: str) -> float:
        plan = autoplan.manual_plan(graph, CLUSTER, tp=2, global_batch=64, framework=framework)
        assert plan.framework == framework
        return autoplan.estimate(graph, CLUSTER, plan).step_time_s

    assert step("megatron-lm-2021:ddp=torch") < step("megatron-lm-2021")
    with pytest.raises(
        FrameworkError, match=r"has no option 'ddp=apex'; its options: ddp=local\|torch"
    ):
        framework_profile("megatron-lm-2021:ddp=apex")
    with pytest.raises(FrameworkError, match="torchtitan has no option 'ddp=torch'; it takes no"):
        framework_profile("torchtitan:ddp=torch")
    with pytest.raises(FrameworkError, match=r"option 'ddp' is given twice \(ddp=local, ddp=torch"):
        framework_profile("megatron-lm-2021:ddp=local,ddp=torch")


def test_the_framework_is_recorded_and_searches_price_for_it(graph: Any, tmp_path: Path) -> None:
    plans = autoplan.search(
        graph, CLUSTER, global_batch=64, top_k=2, framework="megatron-lm", budget_s=2.0
    )
    for plan in plans:
        assert plan.framework == "megatron-lm"
        estimate = autoplan.estimate(graph, CLUSTER, plan)
        assert plan.estimate is not None
        assert plan.estimate.step_time_s == estimate.step_time_s
        path = tmp_path / "plan.yaml"
        plan.to_yaml(path)
        assert yaml.safe_load(path.read_text())["framework"] == "megatron-lm"
        assert Plan.from_yaml(path) == plan


def test_an_unknown_framework_is_refused_naming_the_known_ones(graph: Any, tmp_path: Path) -> None:
    known = (
        "autoplan, megatron-lm, nanotron, megatron-lm-2021, megatron-lm-2019, megatron-deepspeed, "
        "deepspeed, torchtitan, llm-foundry, flash-attn-training"
    )
    with pytest.raises(FrameworkError, match=f"unknown framework 'nemo'; use one of {known}"):
        framework_profile("nemo")
    with pytest.raises(
        PlanError, match=f"framework = 'nemo': unknown framework 'nemo'; use one of {known}"
    ):
        autoplan.manual_plan(graph, CLUSTER, global_batch=64, framework="nemo")
    with pytest.raises(InputError, match="unknown framework 'nemo'"):
        autoplan.search(graph, CLUSTER, global_batch=64, framework="nemo")
    data = autoplan.manual_plan(graph, CLUSTER, global_batch=64).to_data()
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({**data, "framework": 3}))
    with pytest.raises(PlanError, match="framework: expected a string, got 3"):
        Plan.from_yaml(path)


def test_every_planning_command_takes_the_framework(tmp_path: Path) -> None:
    common = ("--model", MODEL, "--cluster", CLUSTER, "--global-batch", "64")
    done = run_cli("estimate", *common, "--tp", "2", "--framework", "megatron-lm")
    assert done.returncode == 0, done.stderr
    assert "priced for megatron-lm" in done.stdout
    plan_path = tmp_path / "plan.yaml"
    done = run_cli("plan", *common, "--framework", "torchtitan", "--budget", "2",
                   "-o", str(plan_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert Plan.from_yaml(plan_path).framework == "torchtitan"
    done = run_cli("explain", str(plan_path), "--no-alternatives", "--framework", "deepspeed")
    assert done.returncode == 0, done.stderr
    assert "for deepspeed" in done.stdout
    done = run_cli("whatif", "--model", MODEL, "--cluster", "dgx-a100-80g", "--num-devices",
                   "16", "--global-batch", "64", "--budget", "1", "--framework",
                   "megatron-lm-2021", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"framework": "megatron-lm-2021"' in done.stdout
    done = run_cli("estimate", *common, "--framework", "nemo")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown framework 'nemo'; use one of autoplan, megatron-lm" in done.stderr


def test_deepspeed_pipeline_engine_re_times_the_step_and_keeps_throughput_consistent(
    graph: Any,
) -> None:
    """megatron-deepspeed differs from megatron-lm-2021 only by its engine: fp32 accumulation
    every micro-batch, an fp32 all-reduce and a weight all-gather after the flush. Those only
    add time, and the throughput and MFU follow the new step time."""
    cluster = autoplan.Cluster.preset("dgx-a100-80g", nodes=2)
    args = dict(tp=2, pp=2, dp=4, micro_batch=1, global_batch=32, zero=1, dtype="bf16")
    plain = autoplan.manual_plan(graph, cluster, framework="megatron-lm-2021", **args)
    engine = autoplan.manual_plan(graph, cluster, framework="megatron-deepspeed", **args)
    assert plain.estimate is not None and engine.estimate is not None
    assert engine.estimate.step_time_s > plain.estimate.step_time_s
    tokens = 32 * graph.profile.seq_len
    assert engine.estimate.tokens_per_s * engine.estimate.step_time_s == pytest.approx(tokens)
    ratio = plain.estimate.mfu / engine.estimate.mfu
    assert ratio == pytest.approx(engine.estimate.step_time_s / plain.estimate.step_time_s)


def test_megatron_lm_2019_prices_its_separate_passes(graph: Any) -> None:
    """Megatron-LM 2019 (Shoeybi et al.'s code): the scale and mask as passes of their own over
    the scores, each linear's bias add and each row-parallel output's dropout as kernels of
    their own, FP16_Optimizer's 76 bytes per parameter, and only what it ran: TP and DP
    (no pipeline, ZeRO, sequence parallelism or selective recompute), in fp16 or fp32."""
    v100 = autoplan.Cluster.preset("dgx2-v100-32g")
    old = framework_profile("megatron-lm-2019")
    newer = framework_profile("megatron-lm-2021")
    cal = old.cluster_for(graph.profile, v100).calibration
    cal_2021 = newer.cluster_for(graph.profile, v100).calibration
    assert cal.attention_efficiency < cal_2021.attention_efficiency
    assert cal.attention_backward_efficiency < cal_2021.attention_backward_efficiency
    head_dim = 1024 // 16
    for direction, nbytes in (("forward", 25.0), ("backward", 27.0)):
        assert unfused_attention_efficiency(
            v100, head_dim, direction, nbytes
        ) < unfused_attention_efficiency(v100, head_dim, direction)  # type: ignore[arg-type]
    assert (cal.separate_bias_add, cal.separate_output_dropout) == (1.0, 1.0)
    assert cal.optimizer_bytes_per_param == 76.0 and cal.dp_overlap_fraction == 0.0
    # the same plan costs more on the 2019 stack than on 2021's
    plan = autoplan.manual_plan(
        graph.profile, v100, tp=2, micro_batch=2, global_batch=16, recompute="full",
        dtype="fp16", framework="megatron-lm-2019",
    )  # fmt: skip
    later = dataclasses.replace(plan, framework="megatron-lm-2021")
    assert autoplan.estimate(graph, v100, plan).step_time_s > (
        autoplan.estimate(graph, v100, later).step_time_s
    )
    for kwargs, why in (
        ({"pp": 2}, "pp 2: megatron-lm-2019 has no pipeline parallelism; set --pp 1"),
        ({"zero": 1}, "zero 1: megatron-lm-2019 runs only ZeRO 0; set --zero 0"),
        ({"sequence_parallel": True, "tp": 2}, "no Megatron-style sequence parallelism; leave"),
        ({"recompute": "selective"}, "has only none and full recompute; set --recompute full"),
    ):
        with pytest.raises(InputError, match=why):
            autoplan.manual_plan(
                graph.profile, v100, global_batch=16, framework="megatron-lm-2019", **kwargs
            )
    # bf16: the stack has none (on a V100 the device refuses it first: no bf16 tensor cores)
    with pytest.raises(InputError, match="dtype bf16: megatron-lm-2019 trains in fp16 or fp32"):
        autoplan.manual_plan(
            graph.profile, "dgx-a100-80g", global_batch=16, framework="megatron-lm-2019",
            dtype="bf16",
        )  # fmt: skip
    with pytest.raises(InputError, match="V100-SXM3-32GB states no bf16 rate"):
        autoplan.manual_plan(
            graph.profile, v100, global_batch=16, framework="megatron-lm-2019", dtype="bf16"
        )


def test_separate_epilogue_passes_hand_worked() -> None:
    """A linear's bias add (read and write the output; backward, read its gradient) and a
    row-parallel output's dropout (read, write and a 1-byte mask each way), priced as kernels of
    their own over the output this device holds."""
    device = autoplan.Cluster.preset("dgx2-v100-32g").device
    bandwidth = device.memory_bandwidth_bytes_per_s * 0.5
    base = Calibration(memory_efficiency=0.5, kernel_overhead_s=1e-6)
    separate = dataclasses.replace(base, separate_bias_add=1.0, separate_output_dropout=1.0)
    m, n, k = 1024, 4096, 1024  # per sample, traced in fp32 with a bias of n
    column = OpProfile(
        name="up", kind="matmul", tp="column", forward_flops=2 * m * n * k,
        backward_flops=4 * m * n * k, activation_bytes=4 * (m * k + m * n),
        param_bytes_read=4 * (k * n + n), gemm=GemmShape(m_per_sample=m, n=n, k=k),
    )  # fmt: skip
    row = dataclasses.replace(column, name="down", tp="row")
    no_bias = dataclasses.replace(row, param_bytes_read=4 * k * n)

    def extra(op: OpProfile, tp: int, sp: bool = False) -> tuple[float, float]:
        args = dict(device=device, dtype="fp16", micro_batch_size=2, tp_degree=tp,
                    sequence_parallel=sp, traced_dtype_bytes=4)  # fmt: skip
        a = op_time(op, calibration=base, **args)  # type: ignore[arg-type]
        b = op_time(op, calibration=separate, **args)  # type: ignore[arg-type]
        return b.forward_s - a.forward_s, b.backward_s - a.backward_s

    elements = 2 * m * n  # fp16 output of a micro-batch of 2
    # column-parallel on TP 4: its bias over a quarter of the output; no dropout
    forward, backward = extra(column, 4)
    assert forward == pytest.approx(4 * elements / 4 / bandwidth + 1e-6)
    assert backward == pytest.approx(2 * elements / 4 / bandwidth + 1e-6)
    # row-parallel on TP 4: bias and dropout over the whole output after the all-reduce
    forward, backward = extra(row, 4)
    assert forward == pytest.approx((4 + 5) * elements / bandwidth + 2e-6)
    assert backward == pytest.approx((2 + 5) * elements / bandwidth + 2e-6)
    # with sequence parallelism the reduce-scatter leaves a TP share of the tokens
    forward, _ = extra(row, 4, sp=True)
    assert forward == pytest.approx((4 + 5) * elements / 4 / bandwidth + 2e-6)
    # a linear without a bias: the dropout alone
    forward, _ = extra(no_bias, 1)
    assert forward == pytest.approx(5 * elements / bandwidth + 1e-6)


def test_the_optimizers_bytes_per_parameter_are_the_stacks() -> None:
    cluster = autoplan.Cluster.preset("dgx2-v100-32g")
    strategy = Strategy(dtype="fp16")
    fused = optimizer_cost(1e9, strategy, cluster).step_s
    heavy = dataclasses.replace(
        cluster, calibration=dataclasses.replace(cluster.calibration, optimizer_bytes_per_param=76)
    )
    overhead = cluster.calibration.kernel_overhead_s
    assert (optimizer_cost(1e9, strategy, heavy).step_s - overhead) == pytest.approx(
        (fused - overhead) * 76 / 30
    )


def test_megatron_lm_2019_waits_for_its_rng_state_copies(graph: Any) -> None:
    """torch 1.1 copied the CUDA RNG state (200 x 4120 bytes) synchronously on every get and
    set; Megatron-LM 2019 does 4 around each forward run of a layer's attention dropout and 4
    more per checkpointed layer. Priced at the device's host link, the device waiting."""
    v100 = autoplan.Cluster.preset("dgx2-v100-32g")
    cluster = framework_profile("megatron-lm-2019").cluster_for(graph.profile, v100)
    assert cluster.calibration.block_sync_copy_bytes == 4 * 200 * 4120
    assert cluster.device.host_link_bandwidth_bytes_per_s == 16e9  # PCIe Gen3 x16, each way
    per_run = 4 * 824_000 / 16e9
    assert sync_copies_s(cluster, "none") == pytest.approx((per_run, 0.0))
    # full recompute re-runs the forward's copies and adds the checkpoint's
    assert sync_copies_s(cluster, "full") == pytest.approx((per_run, 2 * per_run))
    assert sync_copies_s(v100, "full") == (0.0, 0.0)  # stacks that copy nothing
    # a step pays them for every layer, as the host's share
    plan = autoplan.manual_plan(
        graph.profile, v100, tp=8, dp=2, micro_batch=1, global_batch=4, recompute="full",
        dtype="fp16", framework="megatron-lm-2019",
    )  # fmt: skip
    est = autoplan.estimate(graph, v100, plan)
    blocks = sum(u.kind == "block" for u in graph.profile.units)
    assert sum(s.host_s for s in est.stages) == pytest.approx(2 * blocks * 3 * per_run)
    # a GPU whose host link is not stated: one line naming the override
    unstated = v100.with_overrides(host_link_bandwidth=0)
    with pytest.raises(InputError, match="host_link_bandwidth=16GB/s"):
        sync_copies_s(dataclasses.replace(unstated, calibration=cluster.calibration), "full")


LLAMA = "llama:num_layers=8,hidden_size=1024,num_heads=16,seq_len=2048,vocab_size=32000"


@pytest.fixture(scope="module")
def llama() -> Any:
    return autoplan.trace(autoplan.models.llama(8, 1024, 16, 2048, 32000))  # LLAMA, on meta


@pytest.mark.parametrize(
    ("framework", "kwargs", "message"),
    [
        # Composer's FSDP: NO_SHARD, SHARD_GRAD_OP, FULL_SHARD; no PP, TP or CP
        ("llm-foundry", {"pp": 2}, "pp 2: llm-foundry has no pipeline parallelism; set --pp 1"),
        ("llm-foundry", {"tp": 2},
         "tp 2: llm-foundry has no Megatron-style tensor parallelism; set --tp 1"),
        ("llm-foundry", {"zero": 1}, "zero 1: llm-foundry runs only ZeRO 0, 2, 3; set --zero 2"),
        ("llm-foundry", {"cp": 2},
         "cp 2: llm-foundry has no ring-attention context parallelism; set --cp 1"),
        # nanotron: ZeroDistributedOptimizer is ZeRO-1; no cp for its Llama
        ("nanotron", {"zero": 3}, "zero 3: nanotron runs only ZeRO 0, 1; set --zero 1"),
        ("nanotron", {"cp": 2}, "cp 2: nanotron has no ring-attention context parallelism"),
        # Megatron-LM 2020-22: the distributed optimizer (ZeRO-1) at most; no cp
        ("megatron-lm-2021", {"zero": 3},
         "zero 3: megatron-lm-2021 runs only ZeRO 0, 1; set --zero 1"),
        ("megatron-lm-2021", {"cp": 2},
         "cp 2: megatron-lm-2021 has no ring-attention context parallelism; set --cp 1"),
        # the value, the rule and the nearest change
        ("megatron-lm", {"pp": 2, "schedule": "gpipe"},
         "megatron-lm cannot run this plan: schedule gpipe: megatron-lm runs only 1f1b, "
         "interleaved-1f1b; set --schedule 1f1b, or price it for autoplan's runtime"),
        ("megatron-lm", {"pp": 4, "virtual_stages": 2, "schedule": "interleaved-1f1b",
                         "global_batch": 4},
         "interleaved-1f1b with m = 1 micro-batch on pp = 4: megatron-lm's interleaved "
         "schedule needs m >= pp; use at least 4 micro-batches, or --schedule 1f1b"),
        ("megatron-lm-2021", {"pp": 2, "virtual_stages": 2, "schedule": "interleaved-1f1b",
                              "global_batch": 32},
         "interleaved-1f1b with m = 4 micro-batches on pp = 2: megatron-lm-2021's interleaved "
         "schedule needs pp > 2 and a multiple of pp micro-batches; use pp > 2, or --schedule"),
        ("deepspeed", {"recompute": "selective"},
         "recompute selective: deepspeed has only none and full recompute; set --recompute full"),
        ("deepspeed", {"pp": 2, "tp": 2},
         "tp 2 with pp 2: deepspeed's pipeline engine has no tensor parallelism; set --tp 1, or"),
        ("torchtitan", {"cp": 2, "zero": 0},
         "zero 0 with cp 2: torchtitan shards the weights over dp x cp with context "
         "parallelism; set --zero 1 or more, or --cp 1"),
    ],
)  # fmt: skip
def test_a_stack_refuses_what_it_cannot_run_naming_the_value_and_the_fix(
    llama: Any, framework: str, kwargs: dict[str, Any], message: str
) -> None:
    args = {"global_batch": 64, **kwargs}
    with pytest.raises(InputError) as err:
        autoplan.manual_plan(llama, CLUSTER, framework=framework, **args)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    # autoplan's runtime runs each of them
    autoplan.manual_plan(llama, CLUSTER, **args)


@pytest.mark.parametrize(
    ("framework", "constraints", "message"),
    [
        ("llm-foundry", {"zero": [1]}, "zero=[1]: llm-foundry runs only ZeRO 0, 2, 3"),
        ("llm-foundry", {"tp": [2, 4]},
         "tp=[2, 4]: llm-foundry has no Megatron-style tensor parallelism; allow tp 1"),
        ("llm-foundry", {"pp": [2]}, "pp=[2]: llm-foundry has no pipeline parallelism"),
        ("nanotron", {"zero": [2, 3]}, "zero=[2, 3]: nanotron runs only ZeRO 0, 1"),
        ("megatron-lm-2021", {"cp": [2]},
         "cp=[2]: megatron-lm-2021 has no ring-attention context parallelism"),
    ],
)  # fmt: skip
def test_a_search_for_a_stack_keeps_to_its_degrees_and_zero_stages(
    llama: Any, framework: str, constraints: dict[str, Any], message: str
) -> None:
    with pytest.raises(InputError, match=re.escape(message)):
        autoplan.search(llama, CLUSTER, global_batch=64, framework=framework, **constraints)


def test_the_search_proposes_only_what_the_stack_runs(llama: Any) -> None:
    """Unconstrained, each search returns plans its own framework prices without refusal;
    nanotron's ZeRO-1 (which the search otherwise drops as dominated by ZeRO-2) is offered."""
    for framework in ("llm-foundry", "nanotron", "megatron-lm-2021", "flash-attn-training"):
        plans = autoplan.search(
            llama, CLUSTER, global_batch=64, top_k=3, framework=framework, budget_s=1.0
        )
        stack = framework_profile(framework)
        for plan in plans:
            assert stack.plan_refusal(plan, llama.profile) is None, (framework, plan)
            autoplan.estimate(llama, CLUSTER, plan)
        if framework == "llm-foundry":
            assert all(p.pp_degree == p.tp_degree == 1 and p.zero_stage != 1 for p in plans)
    plan = autoplan.search(
        llama, CLUSTER, global_batch=64, pp=[2], zero=[1, 2], framework="nanotron", budget_s=1.0
    )
    assert plan.zero_stage == 1


@pytest.mark.parametrize(
    "framework", ["deepspeed", "nanotron", "megatron-lm-2021", "megatron-deepspeed"]
)
def test_a_stack_that_cuts_its_own_stages_refuses_another_cut(
    llama: Any, framework: str, tmp_path: Path
) -> None:
    """manual_plan and the search build the stack's own cut; a plan with another cut is
    refused naming both cuts, by estimate and by `autoplan validate` and `explain`."""
    stack = framework_profile(framework)
    assert stack.stage_cuts == "own"
    num_units = llama.profile.num_units
    for pp in (2, 4):
        plan = autoplan.manual_plan(llama, CLUSTER, pp=pp, global_batch=64, framework=framework)
        starts = stack.stage_starts(llama.profile, pp)
        assert tuple(stage.first_unit for stage in plan.stages) == starts
    found = autoplan.search(
        llama, CLUSTER, global_batch=64, pp=[2], framework=framework, budget_s=1.0
    )
    assert tuple(s.first_unit for s in found.stages) == stack.stage_starts(llama.profile, 2)
    plan = autoplan.manual_plan(llama, CLUSTER, pp=2, global_batch=64, framework=framework)
    own = plan.stages
    moved = (
        dataclasses.replace(own[0], last_unit=own[0].last_unit - 1),
        dataclasses.replace(own[1], first_unit=own[1].first_unit - 1),
    )
    other = dataclasses.replace(plan, stages=moved, estimate=None)
    cut = f"[0-{own[0].last_unit - 1}, {own[1].first_unit - 1}-{num_units - 1}]"
    theirs = f"[0-{own[0].last_unit}, {own[1].first_unit}-{num_units - 1}]"
    expected = (
        f"{framework} cannot run this plan: stages {cut}: {framework} cuts the stages itself; "
        f"use its cut {theirs}"
    )
    with pytest.raises(InputError, match=re.escape(expected)):
        autoplan.estimate(llama, CLUSTER, other)
    # autoplan's runtime takes any cut
    autoplan.estimate(llama, CLUSTER, dataclasses.replace(other, framework="autoplan"))
    path = tmp_path / "plan.yaml"
    other.to_yaml(path)
    for command in (("validate", str(path), "--cluster", CLUSTER, "--model", LLAMA),
                    ("explain", str(path), "--cluster", CLUSTER, "--model", LLAMA,
                     "--no-alternatives")):  # fmt: skip
        done = run_cli(*command)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr
        assert f"use its cut {theirs}" in done.stderr


def test_an_empty_option_list_names_the_stack_alone(graph: Any, tmp_path: Path) -> None:
    """``megatron-lm:`` is ``megatron-lm``; spaces and empty options drop out of the name the
    plan records."""
    assert framework_profile("megatron-lm:") is FRAMEWORKS["megatron-lm"]
    assert framework_profile(" megatron-lm-2021 : ddp = torch ,").name == (
        "megatron-lm-2021:ddp=torch"
    )
    plan = autoplan.manual_plan(graph, CLUSTER, tp=2, global_batch=64, framework="megatron-lm:")
    assert plan.framework == "megatron-lm"
    assert autoplan.estimate(graph, CLUSTER, plan) == autoplan.estimate(
        graph, CLUSTER, dataclasses.replace(plan, framework="megatron-lm")
    )
    path = tmp_path / "plan.yaml"
    done = run_cli("plan", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "64",
                   "--framework", "megatron-lm:", "--budget", "1", "-o", str(path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(path.read_text())["framework"] == "megatron-lm"


def test_deepspeed_overlaps_the_gradient_sync_only_with_a_zero_optimizer_and_no_pipeline() -> None:
    """DeepSpeed 0.19.8 reduces during the backward only through its ZeRO optimizer's hooks
    (overlap_comm, which the export sets), and turns them off under a PipelineModule: without
    ZeRO, or with pipeline stages, the whole sync follows the backward. The search prices the
    same overlap as the estimate (`CostModel.dp_overlap`)."""
    from cost_model.estimate import CostModel
    from cost_model.hardware import Cluster
    from tests.cost_profiles import gpt_profile

    profile, cluster = gpt_profile(), Cluster.preset("dgx-a100-80g")
    full = cluster.calibration.dp_overlap_fraction
    deepspeed, runtime = CostModel(profile, cluster, "deepspeed"), CostModel(profile, cluster)
    cases = [(0, 1, False), (1, 1, True), (2, 1, True), (3, 1, True), (0, 2, False), (1, 2, False)]
    for zero, pp, overlapped in cases:
        strategy = Strategy(
            dp_degree=2, pp_degree=pp, zero_stage=zero, dtype="bf16", num_micro_batches=4
        )
        assert deepspeed.dp_overlap(strategy) == (full if overlapped else 0.0), (zero, pp)
        assert runtime.dp_overlap(strategy) == full  # autoplan's runtime overlaps always
    # Without ZeRO the step's tail holds the whole all-reduce, after the last backward.
    plan = autoplan.manual_plan(
        profile, cluster, dp=8, micro_batch=1, global_batch=32, framework="deepspeed"
    )
    assert plan.zero_stage == 0
    result = autoplan.estimate(profile, cluster, plan)
    units = deepspeed.unit_costs(Strategy.of(plan), "none")
    synced = sum(u.dp_sync_s + u.post_sync_s + u.optimizer_s for u in units)
    assert result.ranks[0].tail_s == pytest.approx(synced, rel=1e-9)
