"""Framework profiles (cost_model.frameworks): a plan priced for the training stack it runs on.

Each profile changes exactly the calibration fields it names (and applying it twice changes
nothing more); ``autoplan``'s is the identity, so every plan made before the field existed keeps
its estimate. The framework is recorded in the plan file, selectable in the API and every
planning command, and an unknown name is refused naming the known ones.
"""

from __future__ import annotations

import dataclasses
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
                               "nanotron"}  # fmt: skip
    for profile in FRAMEWORKS.values():
        assert profile.sources and profile.version and profile.summary, profile.name
        once = profile.cluster_for(graph.profile, cluster)
        twice = profile.cluster_for(graph.profile, once)
        assert twice == once, profile.name
        set_fields = {
            field
            for f in dataclasses.fields(profile)
            if f.name not in ("name", "version", "summary", "sources")
            and getattr(profile, f.name) is not None
            for field in names.get(f.name, {f.name})
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
    assert step("megatron-lm", **pp).ranks[0].memory.total_bytes < held
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
        "deepspeed, torchtitan, llm-foundry"
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
        ({"pp": 2}, r"no pipeline parallelism \(pp 1\)"),
        ({"zero": 1}, r"no ZeRO beyond stage 0 \(zero <= 0\)"),
        ({"sequence_parallel": True, "tp": 2}, "no Megatron-style sequence parallelism"),
        ({"recompute": "selective"}, "has only none and full recompute"),
        ({"dtype": "bf16"}, r"trains in fp16 or fp32 \(dtype\)"),
    ):
        with pytest.raises(InputError, match=why):
            autoplan.manual_plan(
                graph.profile, v100, global_batch=16, framework="megatron-lm-2019", **kwargs
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
