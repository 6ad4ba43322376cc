"""The issue-42 presets (H200, B200, GB200 NVL72, MI300X): they load, state the rates each device
has and no others, price a small model, show in `autoplan cluster list`; `local` detection maps
their GPU names to them; an overridden preset says what it describes."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from click.testing import CliRunner

import autoplan
from autoplan import Cluster
from autoplan._format import WIDTH
from autoplan.cli import cli
from cost_model.hardware import gpu_preset, load_cluster, local_cluster
from cost_model.this_machine import CudaDevices, MachineFacts

NEW_PRESETS = ("dgx-h200-141g", "dgx-b200-180g", "gb200-nvl72", "mi300x-192g")
BLACKWELL = ("dgx-b200-180g", "gb200-nvl72")


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_preset_loads_and_round_trips(name: str, tmp_path: Path) -> None:
    cluster = Cluster.preset(name, nodes=2)
    assert cluster.device.kind == "gpu" and cluster.num_nodes == 2
    cluster.to_yaml(tmp_path / "c.yaml")
    assert Cluster.from_yaml(tmp_path / "c.yaml") == cluster


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_rates_each_device_has(name: str) -> None:
    rates = Cluster.preset(name).device.peak_flops
    # every one states fp8 (MI300X: e4m3fnuz, AMD's data sheet); MX fp8 and fp4 only Blackwell
    assert {"fp32", "tf32", "bf16", "fp16", "fp8"} <= set(rates)
    assert ("mxfp8" in rates) == (name in BLACKWELL)
    assert ("fp4" in rates) == (name in BLACKWELL)
    if name in BLACKWELL:
        assert rates["mxfp8"] == rates["fp8"] == 2 * rates["bf16"] == rates["fp4"] / 2


def test_datasheet_figures() -> None:
    # dense figures: half the datasheets' sparse ones
    h200, b200 = Cluster.preset("dgx-h200-141g"), Cluster.preset("dgx-b200-180g")
    h100 = Cluster.preset("dgx-h100-80g")
    assert h200.device.peak_flops == h100.device.peak_flops  # the same GH100 die
    assert h200.device.memory_bytes == 141 * 2**30
    assert h200.device.memory_bandwidth_bytes_per_s == 4.8e12
    assert (
        b200.device.peak_flops["bf16"] == 2.25e15 and b200.intra_node.bandwidth_bytes_per_s == 900e9
    )
    assert b200.device.memory_bytes == 183359 * 2**20  # nvidia-smi's 180 GB
    mi300x = Cluster.preset("mi300x-192g")
    assert mi300x.device.peak_flops["bf16"] == 1307.4e12
    assert mi300x.intra_node.bandwidth_bytes_per_s == 7 * 64e9  # 7 peers x 64 GB/s each way
    for name in NEW_PRESETS:  # one 400 Gb/s NIC per GPU
        assert Cluster.preset(name).inter_node.bandwidth_bytes_per_s == 50e9


def test_gb200_nvl72_spans_the_rack() -> None:
    tray = Cluster.preset("gb200-nvl72")
    assert tray.devices_per_node == 4 and tray.scale_up_devices == 72
    assert tray.scale_up_domain == 4  # one tray alone
    assert Cluster.preset("gb200-nvl72", nodes=18).scale_up_domain == 72
    assert Cluster.preset("gb200-nvl72", nodes=36).scale_up_domain == 72  # two racks
    for name in ("dgx-h200-141g", "dgx-b200-180g", "mi300x-192g"):
        assert Cluster.preset(name, nodes=4).scale_up_domain == 8  # a node


def test_every_new_calibration_is_marked_assumed() -> None:
    folder = Path(__file__).parents[1] / "cost_model" / "presets"
    for name in NEW_PRESETS:
        text = (folder / f"{name}.yaml").read_text()
        assert (
            "assumed: transferred from H100 until a published run or `autoplan calibrate`" in text
        )
        assert "Transfer rule" in text
        assert Cluster.preset(name).price_per_device_hour is None  # prices are the user's


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("name", NEW_PRESETS)
def test_a_small_model_is_priced(name: str, dtype: Literal["bf16", "fp8"]) -> None:
    graph = autoplan.trace(autoplan.models.gpt(2, 64, 4, 32, 128))
    cluster = Cluster.preset(name, nodes=2)
    plan = autoplan.manual_plan(graph, cluster, global_batch=cluster.num_devices, dtype=dtype)
    assert plan.estimate is not None
    assert plan.estimate.step_time_s > 0 and plan.estimate.peak_memory_bytes > 0


def test_mxfp8_is_refused_on_mi300x_in_one_line() -> None:
    graph = autoplan.trace(autoplan.models.gpt(2, 64, 4, 32, 128))
    with pytest.raises(autoplan.PlanError) as refused:
        autoplan.manual_plan(
            graph, "mi300x-192g", global_batch=8, dtype="mxfp8", framework="torchtitan"
        )
    message = str(refused.value)
    assert "\n" not in message
    assert "MI300X-OAM-192GB has fp8 tensor cores but no MX block-scaled ones" in message


def test_cluster_list_shows_them_in_100_columns() -> None:
    result = CliRunner().invoke(cli, ["cluster", "list"])
    assert result.exit_code == 0, result.output
    assert all(name in result.output for name in NEW_PRESETS)
    assert all(len(line.rstrip()) <= WIDTH for line in result.output.splitlines())
    assert "…" not in result.output


@pytest.mark.parametrize(
    ("gpu_name", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", "dgx-h100-80g"),
        ("NVIDIA H200", "dgx-h200-141g"),
        ("NVIDIA B200", "dgx-b200-180g"),
        ("NVIDIA GB200", "gb200-nvl72"),  # not the B200 inside its name
        ("AMD Instinct MI300X", "mi300x-192g"),  # ROCm: a cuda device by its marketing name
        ("AMD Instinct MI300X VF", "mi300x-192g"),
        ("NVIDIA A100-SXM4-80GB", "dgx-a100-80g"),
        ("NVIDIA A100-SXM4-40GB", "dgx-a100-40g"),
        ("Tesla V100-SXM2-16GB", "p3.16xlarge"),
        ("NVIDIA GH200 480GB", None),  # Grace Hopper: not an H200
        ("AMD Instinct MI300A", None),
        ("AMD Instinct MI325X", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_gpu_names_match_their_preset(gpu_name: str, preset: str | None) -> None:
    assert gpu_preset(gpu_name) == preset


def _machine(name: str, count: int, memory_bytes: int) -> MachineFacts:
    cuda = CudaDevices(count=count, name=name, memory_bytes=memory_bytes)
    return MachineFacts(cuda=cuda, cpu_cores=8, ram_bytes=2**36, calibrated_path=Path("/no"))


def test_local_gpus_take_their_preset_and_say_so() -> None:
    # 3 GB200s of a tray: the machine's own GPUs, not the rack's 72, are its NVLink domain
    local = local_cluster(_machine("NVIDIA GB200", 3, 185 * 2**30))
    assert local.device.name == "NVIDIA GB200" and local.device.memory_bytes == 185 * 2**30
    assert local.device.peak_flops == Cluster.preset("gb200-nvl72").device.peak_flops
    assert local.scale_up_domain == 3
    assert local.description == "this machine: 3x NVIDIA GB200; GB200-186GB's rates (gb200-nvl72)"
    unknown = local_cluster(_machine("NVIDIA GeForce RTX 4090", 1, 24 * 2**30))
    assert "no preset matches its name: A100-SXM4-80GB's rates" in unknown.description


def test_an_overridden_preset_names_what_it_describes() -> None:
    smaller = load_cluster("dgx-a100-80g:memory=40GiB")
    assert smaller.device.name == "A100-SXM4 (memory 40 GiB, overridden)"
    assert smaller.description.endswith("(memory 40 GiB, overridden)")
    # overriding again keeps the marks, a field marked again shows its new value
    again = smaller.with_overrides(memory="30GiB", inter_node_bandwidth="50GB/s")
    assert again.device.name == "A100-SXM4 (memory 30 GiB, overridden)"
    assert again.description.endswith("(memory 30 GiB, inter-node link 50 GB/s, overridden)")
    faster = load_cluster("dgx-h100-80g:peak_flops_fp8=2PFLOPS,memory_bandwidth=3.9TB/s")
    assert faster.device.name == (
        "H100-SXM5-80GB (memory bandwidth 3.9 TB/s, peak fp8 2 PFLOP/s, overridden)"
    )
    # node counts, calibration and unchanged values describe the same device
    same = load_cluster("dgx-a100-80g:nodes=4,gemm_efficiency=0.6,memory=80GiB")
    assert same.device.name == "A100-SXM4-80GB"
    assert same.description == Cluster.preset_file("dgx-a100-80g").description


def test_cluster_show_of_an_overridden_preset() -> None:
    result = CliRunner().invoke(cli, ["cluster", "show", "dgx-a100-80g:memory=40GiB"])
    assert result.exit_code == 0, result.output
    assert "8 A100-SXM4 (memory 40 GiB, overridden)" in result.output
    assert "A100-SXM4-80GB" not in result.output.split("description")[0]


def test_cluster_show_states_the_scale_up_domain() -> None:
    result = CliRunner().invoke(cli, ["cluster", "show", "gb200-nvl72:nodes=18"])
    assert result.exit_code == 0, result.output
    assert "72 devices on the intra-node link (72 in this cluster)" in result.output
    assert all(len(line.rstrip()) <= WIDTH for line in result.output.splitlines())
    assert (
        "scale-up domain"
        not in CliRunner().invoke(cli, ["cluster", "show", "dgx-h200-141g"]).output
    )
