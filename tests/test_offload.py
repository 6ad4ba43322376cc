"""Offload (issue 43 item 7): optimizer offload (`Plan.optimizer_offload`) and activation
offload (`StagePlan.activation_offload`): the plan fields, their price against numbers worked by
hand (`cost_model.parts.offload`), the host's memory per node (`Cluster.host_memory_bytes`), the
host-link rule at plan time and at `parallelize`, the search taking them only where memory
binds, the stacks that have them and those that refuse them, and the exports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.export import ExportError, export_plan, model_dims
from autoplan.export.deepspeed import deepspeed_config
from autoplan.export.megatron import megatron_args
from cost_model.errors import ClusterError, InputError
from cost_model.estimate import CostModel, estimate
from cost_model.frameworks import FrameworkError
from cost_model.hardware import Cluster, as_cluster
from cost_model.memory import local_num_params
from cost_model.offload import HOST_MEMORY_BANDWIDTH_PER_DEVICE_BYTES_PER_S
from cost_model.parts.offload import host_memory_problem, offload_cost
from cost_model.parts.optimizer import optimizer_cost
from cost_model.strategy import Strategy
from tests.conftest import run_cli
from tests.cost_profiles import gpt_profile, round_cluster
from tests.dist_utils import run_distributed
from tests.numerics import make_plan, refused_plan_worker

HOST_LINK = 10e9  # bytes/s each way, a round number for the hand-worked cases
HOST_MEMORY = 2e12  # bytes a node, a DGX H100's


def _linked(cluster: Cluster, link: float = HOST_LINK) -> Cluster:
    device = dataclasses.replace(cluster.device, host_link_bandwidth_bytes_per_s=link)
    return dataclasses.replace(cluster, device=device, host_memory_bytes=int(HOST_MEMORY))


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


def test_host_memory_is_a_node_s_shared_by_its_devices() -> None:
    """`Cluster.host_memory_bytes`: the presets' datasheet figures, an override, a bad value
    in one line; offload is checked against a device's share (the node's over its devices)
    and refused where the cluster states none."""
    assert Cluster.preset("dgx-a100-80g").host_memory_bytes == 2e12
    assert Cluster.preset("dgx-a100-40g").host_memory_bytes == 1e12
    gb200 = Cluster.preset("gb200-nvl72")
    assert (gb200.host_memory_bytes, gb200.devices_per_node) == (960e9, 4)
    assert Cluster.preset("mi300x-192g").host_memory_bytes == 0  # not stated
    small = Cluster.preset("dgx-h100-80g", host_memory="1TB")
    assert small.host_memory_bytes == 1e12 and "host memory" in small.description
    with pytest.raises(ClusterError) as info:
        Cluster.preset("dgx-h100-80g", host_memory="-1TB")
    assert "host_memory_bytes" in str(info.value) and "\n" not in str(info.value)
    share = 1e12 / 8
    assert host_memory_problem(share, small) is None
    over = host_memory_problem(2 * share, small)
    assert over is not None and "over its share of host memory" in over and "\n" not in over
    unstated = host_memory_problem(1.0, Cluster.preset("mi300x-192g"))
    assert unstated is not None and "states no host memory" in unstated
    assert "host_memory=2TB" in unstated


def test_a_plan_over_its_host_memory_is_refused_at_plan_time() -> None:
    """A 4-layer GPT's optimizer offloaded whole at ZeRO-1 over dp 8 (16 bytes a parameter
    of the rank's shard on the host): within a 2 TB node's share, over a 100 kB one's."""
    profile = gpt_profile()
    plan = _plan(optimizer_offload=1.0)
    plan.validate(profile, "dgx-h100-80g")
    with pytest.raises(PlanError, match="over its share of host memory"):
        plan.validate(profile, "dgx-h100-80g:host_memory=100KB")


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
    # autoplan's runtime at every ZeRO stage, any share (passes/optimizer_offload.py)
    _plan(optimizer_offload=0.5, framework="autoplan", zero=3)
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
    # activation offload: the first of the two blocks (Megatron-LM keeps the last)
    moved = run_cli(*_CLI, "--cluster", "dgx-h100-80g", "--activation-offload", "1", "--json")
    assert moved.returncode == 0, moved.stderr
    offloaded = json.loads(moved.stdout)
    assert offloaded["plan"]["stages"][0]["activation_offload"] == 1
    assert offloaded["peak_memory_bytes"] < before["peak_memory_bytes"]
    assert offloaded["step_time_s"] >= before["step_time_s"]


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


def refused_plans_worker(rank: int, world_size: int, plans: list[Any]) -> list[dict[str, Any]]:
    """`refused_plan_worker` of each of ``plans`` in turn, on the same ranks."""
    return [refused_plan_worker(rank, world_size, plan) for plan in plans]


@pytest.mark.slow
def test_parallelize_refuses_it_on_cpu_on_every_rank(tmp_path: Path) -> None:
    """A CPU worker is its own host: every rank refuses an optimizer-offload plan and an
    activation-offload plan in one line naming the value, the rule and the fix, before anything
    is built (nothing hangs)."""
    optimizer = make_plan(dp=2, zero=1, optimizer_offload=0.5)
    stages = tuple(dataclasses.replace(s, activation_offload=1) for s in make_plan(dp=2).stages)
    activations = dataclasses.replace(make_plan(dp=2), stages=stages)
    plans = [optimizer.to_data(), activations.to_data()]
    results = run_distributed(refused_plans_worker, plans, world_size=2, tmp_path=tmp_path)
    for first, second in results:
        for result, start in (
            (first, "optimizer_offload = 0.5"),
            (second, "activation_offload [1]"),
        ):
            message = result["message"]
            assert message.startswith(f"{start} on device"), message
            assert "a CPU worker is its own host" in message and "\n" not in message
            assert result["meta"]


# ------------------------------------------------------------------- activation offload


def _offloaded(plan: Plan, *counts: int) -> Plan:
    """``plan`` with its stages' ``activation_offload`` set to ``counts``, in order."""
    stages = tuple(
        dataclasses.replace(stage, activation_offload=count)
        for stage, count in zip(plan.stages, counts, strict=True)
    )
    return dataclasses.replace(plan, stages=stages)


@pytest.mark.parametrize(("framework", "overlapped"), [("autoplan", False), ("megatron-lm", True)])
def test_an_offloaded_block_by_hand(framework: str, overlapped: bool) -> None:
    """A block's saved activations A go out and come back over a 1 GB/s link, A / 1e9 s each
    way: autoplan's save_on_cpu on the compute stream shows all of it and holds the block's A
    again while its backward runs; Megatron-Core's (Transformer Engine's) copy streams hide it
    behind the next block's forward and backward (this block's, alike) and hold two blocks' A
    while they move. The embedding and head are never offloaded."""
    profile = gpt_profile()
    model = CostModel(profile, _linked(round_cluster(), link=1e9), framework)
    strategy = Strategy(dtype="bf16", dp_degree=8)
    plain, offloaded = model.unit_costs(strategy, "none"), model.offloaded_costs(strategy)
    block, moved = plain[1], offloaded[1]
    copy_s = block.activation_bytes / 1e9
    out_s = max(0.0, copy_s - block.forward_s) if overlapped else copy_s
    back_s = max(0.0, copy_s - block.backward_s) if overlapped else copy_s
    assert copy_s > block.forward_s  # (the link is slow enough to show)
    assert moved.forward_s == pytest.approx(block.forward_s + out_s)
    assert moved.backward_s == pytest.approx(block.backward_s + back_s)
    assert moved.host_link_s == pytest.approx(out_s + back_s)
    assert moved.activation_bytes == 0 and moved.host_activation_bytes == block.activation_bytes
    in_flight = 2 if overlapped else 1
    assert moved.working_bytes == pytest.approx(block.working_bytes + in_flight * copy_s * 1e9)
    assert offloaded[0] == plain[0] and offloaded[-1] == plain[-1]
    # a link fast enough hides the copies behind the compute where the stack overlaps them
    fast = CostModel(profile, _linked(round_cluster(), link=1e15), framework)
    hidden = fast.offloaded_costs(strategy)[1]
    assert (hidden.host_link_s == 0) == overlapped


@pytest.mark.parametrize(
    ("framework", "count", "in_flight"), [("autoplan", 4, 1), ("megatron-lm", 3, 2)]
)
def test_the_estimate_trades_step_time_for_the_offloaded_blocks_memory(
    framework: str, count: int, in_flight: int
) -> None:
    """One stage of 4 blocks, 2 micro-batches (1F1B holds 1 at the peak): the peak falls by
    the offloaded blocks' A, less what the blocks in flight (one for save_on_cpu, two for
    Transformer Engine's copy streams) hold beyond the activations the stage keeps (the later
    blocks' and the embedding's and head's E: freed by then), with the allocator's overhead on
    top; autoplan's pipeline grows by both copies of each block per micro-batch."""
    profile = gpt_profile()
    cluster = _linked(round_cluster(), link=1e9)
    plan = autoplan.manual_plan(
        profile, cluster, dp=8, global_batch=16, micro_batch=1, dtype="bf16", framework=framework
    )
    offloaded = _offloaded(plan, count)
    before, after = estimate(profile, cluster, plan), estimate(profile, cluster, offloaded)
    plain = CostModel(profile, cluster, framework).unit_costs(Strategy.of(plan), "none")
    block = plain[1]
    a = block.activation_bytes
    kept = (4 - count) * a + sum(u.activation_bytes for u in plain if u.kind != "block")
    overhead = 1 + cluster.calibration.allocator_overhead_fraction
    freed = (count * a - max(0.0, in_flight * a - kept)) * overhead
    assert before.peak_memory_bytes - after.peak_memory_bytes == pytest.approx(freed)
    assert after.step_time_s > before.step_time_s
    if framework == "autoplan":
        # (the pipeline's time; the step's tail hides more of the gradient sync behind the
        # longer last backward)
        copies = plan.num_micro_batches * count * 2 * block.activation_bytes / 1e9
        assert after.pipeline_time_s - before.pipeline_time_s == pytest.approx(copies)


def test_activation_offload_plan_field() -> None:
    """Written only when above 0 and read back equal; bad values refused in one line at load,
    a count over the stage's blocks that its recompute does not cover against the model."""
    plan = _offloaded(_plan(), 2)
    data = plan.to_data()
    assert data["stages"][0]["activation_offload"] == 2
    assert "activation_offload" not in _plan().to_data()["stages"][0]
    assert Plan.from_data(data) == plan
    for value, words in ((-1, "must be a whole number >= 0"), (True, "must be a whole number"),
                         (1.5, "must be a whole number")):  # fmt: skip
        with pytest.raises(PlanError) as info:
            _offloaded(_plan(), value)  # type: ignore[arg-type]
        message = str(info.value)
        assert f"activation_offload = {value}" in message and words in message, message
        assert "\n" not in message
    profile = gpt_profile()
    with pytest.raises(PlanError) as info:
        _offloaded(_plan(framework="autoplan", zero=0), 5).validate(profile, "dgx-h100-80g")
    assert "stages[0].activation_offload = 5, but the stage holds 4 block(s)" in str(info.value)
    recomputed = autoplan.manual_plan(profile, "dgx-h100-80g", dp=8, global_batch=8,
                                      recompute="full")  # fmt: skip
    partial = dataclasses.replace(
        recomputed, stages=(dataclasses.replace(recomputed.stages[0], recompute_units=3),)
    )
    _offloaded(partial, 1).validate(profile, "dgx-h100-80g")  # the one block not recomputed
    with pytest.raises(PlanError, match="holds 1 block"):
        _offloaded(partial, 2).validate(profile, "dgx-h100-80g")


def test_activation_offload_needs_a_host_link_and_host_memory() -> None:
    """The issue's bad input, at plan time (so at `parallelize`, which validates first): one
    line naming the value, the rule and the fix; a CPU worker refuses it as its own host."""
    plan = _offloaded(_plan(framework="autoplan", zero=0), 2)
    with pytest.raises(PlanError) as info:
        plan.validate(gpt_profile(), "dgx-h100-80g:host_link_bandwidth=0")
    message = str(info.value)
    assert message.startswith("activation_offload [2] on device"), message
    assert "states no host link" in message and "stages[*].activation_offload: 0" in message
    assert "\n" not in message
    cpu = as_cluster("local")
    local = dataclasses.replace(plan, dp_degree=cpu.num_devices, global_batch_size=cpu.num_devices,
                                num_micro_batches=1)  # fmt: skip
    with pytest.raises(PlanError, match=r"a CPU worker is its own host.*runs on CUDA devices"):
        local.validate(None, cpu)
    with pytest.raises(PlanError, match="states no host memory"):
        plan.validate(gpt_profile(), "dgx-h100-80g:host_memory=0")


@pytest.mark.parametrize(
    ("changes", "counts", "words"),
    [
        (dict(pp=2, dp=4), (1, 1), "offloads activations without pipeline parallelism only"),
        (dict(recompute="full"), (2,), "does not work with activation recompute"),
        (dict(), (4,), "offloads fewer layers than the model has"),
        (dict(framework="torchtitan", zero=3), (2,), "has no option that keeps a block's"),
        (dict(framework="deepspeed"), (2,), "cpu_checkpointing, moves the inputs"),
    ],
)
def test_stacks_refuse_the_activation_offload_they_do_not_run(
    changes: dict[str, Any], counts: tuple[int, ...], words: str
) -> None:
    plan = _plan(**changes)
    if plan.stages[0].recompute != "none":  # its last 2 blocks not recomputed
        stage = dataclasses.replace(plan.stages[0], recompute_units=2)
        plan = dataclasses.replace(plan, stages=(stage,))
    plan = _offloaded(plan, *counts)
    with pytest.raises((PlanError, FrameworkError)) as info:
        plan.validate(gpt_profile(), "dgx-h100-80g")
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_megatron_export_and_megatron_core_take_activation_offload(llama8b: Any) -> None:
    """--cpu-offloading-num-layers N, which megatron-core's TransformerConfig takes below the
    model's layers."""
    plan = _offloaded(_export_plan(llama8b, zero=1, framework="megatron-lm", dp=16), 31)
    args = megatron_args(plan, model_dims("llama3-8b"))
    assert args[args.index("--cpu-offloading-num-layers") + 1] == "31"
    assert "--cpu-offloading-num-layers" not in megatron_args(
        _export_plan(llama8b, zero=1, framework="megatron-lm", dp=16), model_dims("llama3-8b")
    )
    config = pytest.importorskip("megatron.core.transformer.transformer_config")
    dims = dict(num_layers=32, hidden_size=64, num_attention_heads=4, cpu_offloading=True)
    assert config.TransformerConfig(**dims, cpu_offloading_num_layers=31).cpu_offloading
    with pytest.raises(ValueError, match="only for layers less than 32"):
        config.TransformerConfig(**dims, cpu_offloading_num_layers=32)
    with pytest.raises(ExportError, match="has no option that keeps a block's saved activations"):
        export_plan(dataclasses.replace(plan, framework="torchtitan", zero_stage=3), "torchtitan")


def _deep_search(
    memory_mib: int, link: float = HOST_LINK, host_memory: float = HOST_MEMORY, **constraints: Any
) -> Plan:
    """A 96-block GPT with short wide-enough sequences, on 8 devices of ``memory_mib`` MiB
    for autoplan's runtime (dp 8, no headroom): deep enough that its blocks' activations on
    the host (all but the last one's, which stays) hold less than recomputing every block
    (96 inputs and a block's working set)."""
    cluster = _linked(round_cluster(memory_bytes=memory_mib * 2**20), link)
    cluster = dataclasses.replace(cluster, host_memory_bytes=int(host_memory))
    profile = gpt_profile(num_layers=96, s=256, h=256, a=4, vocab=256)
    # (autoplan's runtime offloads its optimizer too, which would fit at 189 MiB with full
    # recompute: kept out, so that the activations' offload is what the search finds)
    constraints.setdefault("optimizer_offload", False)
    plan: Plan = autoplan.search(
        profile, cluster, global_batch=8, framework="autoplan", tp=1, pp=1, dp=8,
        dtype="bf16", memory_headroom=0.0, **constraints,
    )  # fmt: skip
    return plan


def test_the_search_offloads_activations_only_where_memory_binds() -> None:
    """At 189 MiB no plan fits with its activations on the device, even recomputing every
    block, and one fits with 95 of its 96 blocks' on the host (the twin never offloads the
    model's last block), unless the host link or the host's memory is missing; at 200 MiB full
    recompute fits and nothing is offloaded."""
    tight = _deep_search(189)
    assert [(s.recompute, s.activation_offload) for s in tight.stages] == [("none", 95)]
    with pytest.raises(autoplan.NoFeasiblePlanError):
        _deep_search(189, activation_offload=False)
    with pytest.raises(autoplan.NoFeasiblePlanError):
        _deep_search(189, link=0.0)
    # 95 blocks' activations (about 320 MiB a device) over a 1 MiB share of the host's memory:
    # no twin, rather than a plan the host-memory check refuses
    with pytest.raises(autoplan.NoFeasiblePlanError):
        _deep_search(189, host_memory=8 * 2**20)
    loose = _deep_search(200)
    assert [(s.recompute, s.activation_offload) for s in loose.stages] == [("full", 0)]


def test_an_activation_offloading_plan_s_range_says_no_scored_run_validates_it() -> None:
    from cost_model.uncertainty import plan_features, step_interval

    plain = _plan(framework="autoplan", zero=0)
    features = plan_features(_offloaded(plain, 2), "autoplan")
    assert "activation offload" in features
    assert "activation offload" not in plan_features(plain, "autoplan")
    wide, narrow = step_interval(features), step_interval(plan_features(plain, "autoplan"))
    assert ("activation offload", 0) in wide.unvalidated
    assert wide.high > narrow.high


def _split_gpt(recompute_units: int) -> tuple[Any, Plan]:
    """The numerics GPT (2 blocks) as one stage, its first ``recompute_units`` blocks
    checkpointed."""
    from autoplan.tracing import trace
    from passes import apply_recompute, split_stages
    from tests.numerics import build_model

    plan = make_plan(recompute="full")
    (stage,) = split_stages(trace(build_model("gpt")), plan).stages
    apply_recompute(stage, "full", plan.decisions.recompute, recompute_units)
    return stage, plan


def test_the_offload_pass_runs_on_cuda_only() -> None:
    """Reached only past the plan's host-link rule; on a CPU device it says why itself."""
    from passes.offload import apply_activation_offload

    stage, plan = _split_gpt(1)
    assert apply_activation_offload(stage, 0, plan.decisions.recompute, torch.device("cpu")) == 0
    with pytest.raises(RuntimeError, match="a CPU worker already is; it runs on CUDA devices"):
        apply_activation_offload(stage, 1, plan.decisions.recompute, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="save_on_cpu moves CUDA tensors to host")
def test_offloaded_blocks_keep_the_gradients_on_cuda() -> None:
    """The block recompute does not cover runs under save_on_cpu: the same loss and gradients
    as without it (the copies are exact)."""
    import copy

    from passes.offload import OffloadWrapper, apply_activation_offload
    from tests.numerics import VOCAB, loss_fn

    stage, plan = _split_gpt(1)
    stage.module.to("cuda")
    reference = copy.deepcopy(stage.module)
    wrapped = apply_activation_offload(stage, 1, plan.decisions.recompute, torch.device("cuda"))
    assert wrapped == 1
    assert sum(isinstance(stage.unit_module(u), OffloadWrapper) for u in stage.units) == 1
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, VOCAB, (2, 16), generator=generator).cuda()
    targets = torch.randint(0, VOCAB, (2, 16), generator=generator).cuda()
    losses = []
    for module in (reference, stage.module):
        loss = loss_fn(module(inputs), targets)
        loss.backward()
        losses.append(loss.detach())
    # (the forward is the same kernels on the same inputs; the embedding's CUDA backward
    # accumulates with atomics, in any order: float32 rounding apart)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    grads = [
        [p.grad for p in module.parameters()]  # (same order: the wrapper adds no parameter)
        for module in (reference, stage.module)
    ]
    for ref, got in zip(*grads, strict=True):
        torch.testing.assert_close(ref, got, rtol=1e-5, atol=1e-7)


def test_explain_names_the_offload_copies() -> None:
    """The copies nothing hides are their own share of the critical path (not ZeRO-3's)."""
    from autoplan.analysis.explain import critical_path

    profile, cluster = gpt_profile(), _linked(round_cluster(), link=1e9)
    plain = autoplan.manual_plan(
        profile, cluster, dp=8, global_batch=16, dtype="bf16", framework="autoplan"
    )
    plan = _offloaded(plain, 2)
    result = estimate(profile, cluster, plan)
    path = critical_path(result)
    block = CostModel(profile, cluster, "autoplan").unit_costs(Strategy.of(plan), "none")[1]
    copies = plan.num_micro_batches * 2 * 2 * block.activation_bytes / 1e9
    assert sum(s.offload_s for s in result.stages) == pytest.approx(copies)
    assert path.offload_s == pytest.approx(copies) and path.zero3_exposed_s == 0
    assert "activation offload copies" in path.summary()
    assert critical_path(estimate(profile, cluster, plain)).offload_s == 0


def test_the_blocks_saved_bytes_read_only_the_fields_the_search_caches_them_by() -> None:
    """`blocks_saved_bytes` (the search caches it by `BLOCKS_SAVED_FIELDS` for every member of
    a shape, `Enumeration.offload_twins`) is unchanged by the fields it does not name, changed
    by each it names, and times the held micro-batches is `activation_twin_host_bytes`."""
    from cost_model.parts.offload import (
        BLOCKS_SAVED_FIELDS,
        activation_twin_host_bytes,
        blocks_saved_bytes,
        host_held_micro_batches,
    )
    from cost_model.strategy import Strategy
    from tests.cost_profiles import gpt_profile

    profile = gpt_profile(num_layers=4, s=256, h=512, a=8, vocab=4096)
    base = Strategy(tp_degree=2, sequence_parallel=True, micro_batch_size=2, dtype="bf16")
    saved = blocks_saved_bytes(profile, base)
    assert saved > 0
    others = (
        {"pp_degree": 2, "num_micro_batches": 8},
        {
            "pp_degree": 2,
            "virtual_stages": 2,
            "schedule": "interleaved-1f1b",
            "num_micro_batches": 4,
        },
        {"zero_stage": 3, "dp_degree": 4},
        {"optimizer_offload": 1.0},
    )
    for fields in others:
        assert blocks_saved_bytes(profile, dataclasses.replace(base, **fields)) == saved, fields
    named = {
        "tp_degree": 4,
        "sequence_parallel": False,
        "micro_batch_size": 4,
        "dtype": "fp32",
        "cp_degree": 2,
    }
    assert set(named) == set(BLOCKS_SAVED_FIELDS)
    for name, value in named.items():
        layout = {"rank_layout": ("pp", "dp", "cp", "tp")} if name == "cp_degree" else {}
        changed = dataclasses.replace(base, **{name: value}, **layout)
        assert blocks_saved_bytes(profile, changed) != saved, name
    twin = dataclasses.replace(
        base, activation_offload=True, pp_degree=2, num_micro_batches=8, schedule="1f1b"
    )
    assert activation_twin_host_bytes(profile, twin) == host_held_micro_batches(twin) * saved
