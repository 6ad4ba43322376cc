"""Optimizer offload (issue 43 item 7, `Plan.optimizer_offload`): the plan field, its price
against numbers worked by hand (`cost_model.parts.offload`), the host-link rule at plan time and
at `parallelize`, the stacks that have it and those that refuse it, and the exports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.export import ExportError, export_plan, model_dims
from autoplan.export.deepspeed import deepspeed_config
from autoplan.export.megatron import megatron_args
from cost_model.errors import InputError
from cost_model.estimate import estimate
from cost_model.frameworks import FrameworkError
from cost_model.hardware import Cluster, as_cluster
from cost_model.memory import local_num_params
from cost_model.offload import (
    HOST_MEMORY_BANDWIDTH_PER_DEVICE_BYTES_PER_S,
    HOST_MEMORY_PER_DEVICE_BYTES,
)
from cost_model.parts.offload import host_memory_problem, offload_cost
from cost_model.parts.optimizer import optimizer_cost
from cost_model.strategy import Strategy
from tests.conftest import run_cli
from tests.cost_profiles import gpt_profile, round_cluster
from tests.dist_utils import run_distributed
from tests.numerics import make_plan, refused_plan_worker

HOST_LINK = 10e9  # bytes/s each way, a round number for the hand-worked cases


def _linked(cluster: Cluster, link: float = HOST_LINK) -> Cluster:
    device = dataclasses.replace(cluster.device, host_link_bandwidth_bytes_per_s=link)
    return dataclasses.replace(cluster, device=device)


# ------------------------------------------------------------------------------- the price


def test_offloaded_share_by_hand() -> None:
    """1e9 updated parameters, half offloaded, bf16 compute with the default fp32 master,
    moments and reduction: 0.5e9 fp32 gradients out (4 bytes) and fp32 weights back over a
    10 GB/s link, 0.2 s each; the host's Adam moves 32 bytes a parameter at the host's DRAM
    rate."""
    cluster = _linked(round_cluster())
    strategy = Strategy(dtype="bf16", optimizer_offload=0.5)
    cost = offload_cost(1e9, strategy, cluster)
    assert cost.device_to_host_s == pytest.approx(0.5e9 * 4 / 10e9)
    assert cost.host_to_device_s == pytest.approx(0.5e9 * 4 / 10e9)
    assert cost.host_step_s == pytest.approx(
        0.5e9 * 32 / HOST_MEMORY_BANDWIDTH_PER_DEVICE_BYTES_PER_S
    )
    assert cost.host_bytes == pytest.approx(0.5e9 * 16)
    # pipelined: the longest of the three
    assert cost.critical_s == max(cost.device_to_host_s, cost.host_step_s, cost.host_to_device_s)
    # a bf16 reduction halves the gradients' bytes out
    bf16 = offload_cost(1e9, dataclasses.replace(strategy, grad_reduce_dtype="bf16"), cluster)
    assert bf16.device_to_host_s == pytest.approx(cost.device_to_host_s / 2)


def test_the_step_is_the_longer_of_the_device_s_share_and_the_host_s() -> None:
    """round_cluster: 1 TB/s at memory efficiency 0.5, Adam's 30 bytes a parameter in mixed
    precision; the device steps (1 - f) of them while the host steps f."""
    cluster = _linked(round_cluster())
    device_rate = 1e12 * 0.5
    for share in (0.0, 0.25, 1.0):
        strategy = Strategy(dtype="bf16", optimizer_offload=share)
        step = optimizer_cost(1e9, strategy, cluster).step_s
        device = 1e9 * (1 - share) * 30 / device_rate
        host = offload_cost(1e9, strategy, cluster).critical_s
        assert step == pytest.approx(max(device, host))
    # ZeRO-1 over dp 8: the offloaded share is of the shard a rank updates
    sharded = Strategy(dtype="bf16", dp_degree=8, zero_stage=1, optimizer_offload=1.0)
    assert optimizer_cost(8e9, sharded, cluster).offload.host_bytes == pytest.approx(1e9 * 16)


def test_estimate_trades_step_time_for_device_memory() -> None:
    """On a 4-layer GPT priced for Megatron-LM at ZeRO-1: each step is longer by the host's
    share, and the device holds less by the offloaded master weights and moments (fp32 master
    4 + two fp32 moments 8 = 12 bytes a parameter of the rank's shard)."""
    profile = gpt_profile()
    cluster = _linked(round_cluster())
    plans = [
        autoplan.manual_plan(
            profile,
            cluster,
            dp=8,
            global_batch=8,
            zero=1,
            dtype="bf16",
            framework="megatron-lm",
            optimizer_offload=share,
        )
        for share in (0.0, 0.5, 1.0)
    ]
    results = [estimate(profile, cluster, plan) for plan in plans]
    steps = [r.step_time_s for r in results]
    assert steps[0] < steps[1] < steps[2]
    stored = [sum(s.param_bytes + s.optimizer_bytes for s in r.stages) for r in results]
    # the tied embedding and head's weight once (pp = 1)
    params = sum(local_num_params(u, 1, count_shared=False) for u in profile.units)
    for share, held in zip((0.5, 1.0), stored[1:], strict=True):
        assert stored[0] - held == pytest.approx(share * params / 8 * 12)
    assert results[2].stages[0].optimizer_bytes == 0


def test_host_memory_is_checked() -> None:
    assert host_memory_problem(HOST_MEMORY_PER_DEVICE_BYTES) is None
    problem = host_memory_problem(2 * HOST_MEMORY_PER_DEVICE_BYTES)
    assert problem is not None and "over its share of host memory" in problem
    assert "\n" not in problem


# ------------------------------------------------------------------------------- the plan


def _plan(**changes: Any) -> Plan:
    kwargs: dict[str, Any] = dict(dp=8, global_batch=8, zero=1, framework="megatron-lm")
    kwargs.update(changes)
    return autoplan.manual_plan(gpt_profile(), "dgx-h100-80g", **kwargs)


def test_plan_file_round_trip(tmp_path: Path) -> None:
    """Written only when above 0; read back equal; a plan without it reads as before."""
    plain, offloaded = _plan(), _plan(optimizer_offload=0.5)
    plain.to_yaml(tmp_path / "plain.yaml")
    offloaded.to_yaml(tmp_path / "offload.yaml")
    assert "optimizer_offload" not in (tmp_path / "plain.yaml").read_text()
    assert "optimizer_offload: 0.5" in (tmp_path / "offload.yaml").read_text()
    assert Plan.from_yaml(tmp_path / "offload.yaml") == offloaded
    assert Plan.from_yaml(tmp_path / "plain.yaml") == plain


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (1.5, "optimizer_offload = 1.5 must be from 0 to 1"),
        (-0.1, "optimizer_offload = -0.1 must be from 0 to 1"),
        (True, "optimizer_offload = True must be a number from 0 to 1"),
        ("half", "optimizer_offload = 'half' must be a number from 0 to 1"),
    ],
)
def test_bad_values_are_refused_in_one_line(value: object, words: str) -> None:
    with pytest.raises(PlanError) as info:
        dataclasses.replace(_plan(), optimizer_offload=value)  # type: ignore[arg-type]
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_a_device_without_a_host_link_figure_is_refused_at_plan_time() -> None:
    """The bad input of the issue: one line naming the value, the rule and the fix."""
    unstated = round_cluster()  # host_link_bandwidth_bytes_per_s 0: not stated
    plan = autoplan.manual_plan(
        gpt_profile(), _linked(unstated), dp=8, global_batch=8, zero=1, dtype="bf16",
        framework="megatron-lm", optimizer_offload=0.5,
    )  # fmt: skip
    with pytest.raises(PlanError) as info:
        plan.validate(gpt_profile(), unstated)
    message = str(info.value)
    assert message.startswith("optimizer_offload = 0.5 on device 'round-gpu'"), message
    assert "states no host link" in message and "host_link_bandwidth=64GB/s" in message
    assert "\n" not in message
    # the cost model says the same to a caller that prices it anyway
    with pytest.raises(InputError, match="states no host link"):
        estimate(gpt_profile(), unstated, plan)
    cpu = as_cluster("local")
    with pytest.raises(PlanError, match=r"a CPU worker is its own host"):
        dataclasses.replace(plan, dp_degree=cpu.num_devices, global_batch_size=cpu.num_devices,
                            num_micro_batches=1).validate(None, cpu)  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        (dict(framework="autoplan"), "autoplan: its data parallelism is FSDP2"),
        (dict(framework="torchtitan", zero=3), "training.enable_cpu_offload, is FSDP2's"),
        (dict(zero=0), "megatron-lm offloads the optimizer at ZeRO 1 only"),
        (dict(framework="deepspeed"), "deepspeed offloads all of the optimizer or none at ZeRO 1"),
        (dict(framework="megatron-lm-2021"), "megatron-lm-2021 does not offload the optimizer"),
    ],
)
def test_stacks_refuse_what_they_do_not_run(changes: dict[str, Any], words: str) -> None:
    with pytest.raises((PlanError, FrameworkError)) as info:
        _plan(optimizer_offload=0.5, **changes).validate(gpt_profile(), "dgx-h100-80g")
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_its_range_says_no_published_run_validates_it() -> None:
    """No published run offloads its optimizer: an offloaded plan's 80% range widens as an
    unvalidated feature's does."""
    from cost_model.uncertainty import plan_features, step_interval

    plain, offloaded = _plan(), _plan(optimizer_offload=0.5)
    features = plan_features(offloaded, "megatron-lm")
    assert "optimizer offload" in features
    assert "optimizer offload" not in plan_features(plain, "megatron-lm")
    wide, narrow = step_interval(features), step_interval(plan_features(plain, "megatron-lm"))
    assert ("optimizer offload", 0) in wide.unvalidated
    assert wide.high > narrow.high and wide.low < narrow.low


def test_stacks_that_have_it_take_it() -> None:
    _plan(optimizer_offload=0.25)
    _plan(optimizer_offload=1.0, framework="deepspeed", zero=2)
    _plan(optimizer_offload=0.5, framework="deepspeed", zero=3)


# ------------------------------------------------------------------------------- the search


def _search(memory_mib: int, link: float = HOST_LINK, **constraints: Any) -> Plan:
    """A 4-layer GPT with short sequences (its state, not its activations, binds) on 8 devices
    of ``memory_mib`` MiB, for DeepSpeed (ZeRO-Offload at ZeRO 1-3), no headroom."""
    cluster = _linked(round_cluster(memory_bytes=memory_mib * 2**20), link)
    plan: Plan = autoplan.search(
        gpt_profile(s=16),
        cluster,
        global_batch=8,
        framework="deepspeed",
        tp=1,
        pp=1,
        dtype="bf16",
        memory_headroom=0.0,
        **constraints,
    )
    return plan


def test_the_search_offloads_only_where_memory_binds() -> None:
    """At 13 MiB no plan fits with its optimizer on the device (the leanest, ZeRO-3 with full
    recompute, needs about 15 MiB) and one fits with it on the host; at 40 MiB every plan
    keeps it on the device, and the search's plan is the one it finds without offload."""
    tight = _search(13)
    assert tight.optimizer_offload == 1.0 and tight.zero_stage == 3
    with pytest.raises(autoplan.NoFeasiblePlanError):
        _search(13, optimizer_offload=False)
    loose = _search(40)
    assert loose.optimizer_offload == 0.0
    assert loose == _search(40, optimizer_offload=False)


def test_the_search_never_offloads_without_a_host_link() -> None:
    with pytest.raises(autoplan.NoFeasiblePlanError):
        _search(13, link=0.0)


# ------------------------------------------------------------------------------- the CLI

_CLI = ("estimate", "--model", "gpt:num_layers=2,hidden_size=256,num_heads=4,seq_len=128,"
        "vocab_size=1024", "--global-batch", "8", "--zero", "1", "--framework", "megatron-lm")  # fmt: skip


def test_cli_estimate_prices_it_and_refuses_bad_input_in_one_line() -> None:
    plain = run_cli(*_CLI, "--cluster", "dgx-h100-80g", "--json")
    offloaded = run_cli(*_CLI, "--cluster", "dgx-h100-80g", "--optimizer-offload", "1", "--json")
    assert plain.returncode == offloaded.returncode == 0, offloaded.stderr
    before, after = json.loads(plain.stdout), json.loads(offloaded.stdout)
    assert after["plan"]["optimizer_offload"] == 1 and "optimizer_offload" not in before["plan"]
    assert after["step_time_s"] > before["step_time_s"]
    assert after["peak_memory_bytes"] < before["peak_memory_bytes"]
    text = run_cli(*_CLI, "--cluster", "dgx-h100-80g", "--optimizer-offload", "0.5")
    assert "optimizer offload: 0.5 of the optimizer step on the host" in text.stdout
    unstated = run_cli(
        *_CLI, "--cluster", "dgx-h100-80g:host_link_bandwidth=0", "--optimizer-offload", "0.5"
    )
    assert unstated.returncode != 0 and "Traceback" not in unstated.stderr
    assert "states no host link" in unstated.stderr
    assert len(unstated.stderr.strip().splitlines()) == 1, unstated.stderr


# ------------------------------------------------------------------------------- exports


@pytest.fixture(scope="module")
def llama8b() -> Any:
    return autoplan.trace(autoplan.models.preset("llama3-8b"))


def _export_plan(graph: Any, **options: Any) -> Plan:
    return autoplan.manual_plan(graph, "dgx-h100-80g:nodes=2", global_batch=64, **options)


def test_megatron_export_and_megatron_core_take_it(
    llama8b: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _export_plan(llama8b, zero=1, framework="megatron-lm", optimizer_offload=0.5)
    args = megatron_args(plan, model_dims("llama3-8b"))
    for flag in (
        "--use-distributed-optimizer",
        "--use-precision-aware-optimizer",
        "--optimizer-cpu-offload",
        "--overlap-cpu-optimizer-d2h-h2d",
    ):
        assert flag in args, flag
    assert args[args.index("--optimizer-offload-fraction") + 1] == "0.5"
    assert args.count("--use-precision-aware-optimizer") == 1
    plain = _export_plan(llama8b, zero=1, framework="megatron-lm")
    assert "--optimizer-cpu-offload" not in megatron_args(plain, model_dims("llama3-8b"))
    # megatron-core's own checks on the flags' OptimizerConfig fields
    optimizer_config = pytest.importorskip("megatron.core.optimizer.optimizer_config")
    OptimizerConfig = optimizer_config.OptimizerConfig
    with pytest.raises(AssertionError, match="only supported with distributed optimizer"):
        OptimizerConfig(use_precision_aware_optimizer=True, optimizer_cpu_offload=True, bf16=True)
    # its version check of Transformer Engine (not on this CPU machine) stands in for an
    # installed 2.1; with the offload it returns before asking for TE's FusedAdam
    monkeypatch.setattr(optimizer_config, "is_te_min_version", lambda *args, **kwargs: True)
    config = OptimizerConfig(
        optimizer="adam",
        bf16=True,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.5,
        overlap_cpu_optimizer_d2h_h2d=True,
    )
    assert config.optimizer_cpu_offload and config.optimizer_offload_fraction == 0.5


def test_deepspeed_config_loads_with_deepspeed_s_own_class(
    llama8b: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)

    class _DataParallel:
        def __init__(self, size: int) -> None:
            self.size = size

        def get_data_parallel_world_size(self) -> int:
            return self.size

    for zero, share in ((1, 1.0), (3, 0.25)):
        plan = _export_plan(llama8b, zero=zero, framework="deepspeed", optimizer_offload=share)
        text = export_plan(plan, "deepspeed").files["ds_config.json"]
        loaded = ds_config.DeepSpeedConfig(json.loads(text), mpu=_DataParallel(plan.dp_degree))
        offload = loaded.zero_config.offload_optimizer
        assert offload is not None and offload.device == "cpu"
        assert offload.ratio == share
    plain = _export_plan(llama8b, zero=1, framework="deepspeed")
    assert (
        "offload_optimizer"
        not in deepspeed_config(plain, model_dims("llama3-8b"))["zero_optimization"]
    )


def test_torchtitan_refuses_the_export_in_its_words(llama8b: Any) -> None:
    plan = _export_plan(llama8b, zero=1, framework="megatron-lm", optimizer_offload=0.5)
    with pytest.raises(ExportError) as info:
        export_plan(plan, "torchtitan")
    assert "training.enable_cpu_offload" in str(info.value)


# ------------------------------------------------------------------------------- runtime


@pytest.mark.slow
def test_parallelize_refuses_it_on_cpu_on_every_rank(tmp_path: Path) -> None:
    """A CPU worker is its own host: every rank refuses the plan in one line naming the value,
    the rule and the fix, before anything is built (nothing hangs)."""
    plan = make_plan(dp=2, zero=1, optimizer_offload=0.5)
    results = run_distributed(refused_plan_worker, plan.to_data(), world_size=2, tmp_path=tmp_path)
    for result in results:
        message = result["message"]
        assert message.startswith("optimizer_offload = 0.5 on device"), message
        assert "a CPU worker is its own host" in message and "\n" not in message
        assert result["meta"]
