"""Cluster presets, YAML round trips, overrides and every rejection of a bad cluster file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from autoplan import Cluster, ClusterError
from cost_model.hardware import load_cluster, preset_names

EXPECTED_PRESETS = {
    "dgx-a100-80g",
    "dgx-a100-40g",
    "dgx-h100-80g",
    "dgx2-v100-32g",
    "p3.16xlarge",
    "local",
}


def test_all_required_presets_ship() -> None:
    assert set(preset_names()) >= EXPECTED_PRESETS


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_round_trip(name: str, tmp_path: Path) -> None:
    cluster = Cluster.preset(name, nodes=3)
    assert cluster.num_nodes == 3
    path = tmp_path / "cluster.yaml"
    cluster.to_yaml(path)
    loaded = Cluster.from_yaml(path)
    assert loaded == cluster
    assert loaded.to_data() == cluster.to_data()


def test_preset_constants_are_physical() -> None:
    a100 = Cluster.preset("dgx-a100-80g")
    assert a100.device.memory_bytes == 80 * 2**30
    assert a100.device.peak_flops["bf16"] == 312e12
    assert a100.intra_node.bandwidth_bytes_per_s == 300e9
    assert a100.inter_node.bandwidth_bytes_per_s == 25e9  # 200 Gb/s HDR per GPU
    h100 = Cluster.preset("dgx-h100-80g", nodes=2)
    assert h100.num_devices == 16
    assert h100.device.peak_flops_for("bf16") > 3 * a100.device.peak_flops_for("bf16")
    v100 = Cluster.preset("dgx2-v100-32g")
    assert v100.devices_per_node == 16
    assert v100.device.peak_flops_for("bf16") == v100.device.peak_flops["fp16"]  # fallback


def test_every_preset_constant_cites_a_source() -> None:
    """Each number has a comment on its line, in a comment block above it, or on its parent key."""
    folder = Path(__file__).parents[1] / "cost_model" / "presets"
    for path in folder.glob("*.yaml"):
        lines = path.read_text().splitlines()
        for idx, line in enumerate(lines):
            key, _, value = line.partition(":")
            value = value.split("#")[0].strip()
            if key.strip() in ("name", "description", "kind", "schema_version", "num_nodes"):
                continue
            if value and value[0].isdigit():
                assert _cited(lines, idx), f"{path.name}:{idx + 1}: {line.strip()!r} has no source"


def _cited(lines: list[str], idx: int) -> bool:
    if "#" in lines[idx]:
        return True
    indent = len(lines[idx]) - len(lines[idx].lstrip())
    for above in reversed(lines[:idx]):
        if above.strip().startswith("#"):
            return True
        above_indent = len(above) - len(above.lstrip())
        if above_indent < indent:
            return "#" in above  # the parent key carries the source for its block
    return False


def test_overrides_with_units() -> None:
    c = load_cluster(
        "dgx-a100-80g:nodes=4,inter_node_bandwidth=50GB/s,memory=40GiB,gemm_efficiency=0.6"
    )
    assert c.num_nodes == 4 and c.num_devices == 32
    assert c.inter_node.bandwidth_bytes_per_s == 50e9
    assert c.device.memory_bytes == 40 * 2**30
    assert c.calibration.gemm_efficiency == 0.6
    assert load_cluster("dgx-a100-80g:memory=2.2GiB").device.memory_bytes == round(2.2 * 2**30)
    c2 = Cluster.preset("dgx-h100-80g", nodes=2, peak_flops_fp8="2PFLOPS")
    assert c2.device.peak_flops["fp8"] == 2e15


def test_local_cluster_describes_this_machine() -> None:
    local = Cluster.local()
    assert local.num_nodes == 1 and local.devices_per_node >= 1
    assert local.device.kind in ("cpu", "gpu")
    four = Cluster.local(num_devices=4)
    assert four.num_devices == 4
    if local.device.kind == "cpu":
        # twice as many workers as cores: one worker's rates, and the cores they share
        cores = local.devices_per_node
        assert local.shared_cores_per_node is None
        crowded = Cluster.local(num_devices=2 * cores)
        assert crowded.shared_cores_per_node == cores
        assert crowded.device.peak_flops == local.device.peak_flops
        assert crowded.intra_node == local.intra_node
        with pytest.raises(ClusterError, match="shared_cores_per_node"):
            crowded.with_overrides(shared_cores_per_node=0)
    assert Cluster.preset("local", nodes=1).device.name == local.device.name
    # the CLI's way to ask for N workers: the same cluster as Cluster.local(N), whose workers
    # share the machine's memory (and cores), not N copies of the whole machine
    assert load_cluster("local:devices_per_node=4") == four
    if local.device.kind == "cpu":  # the machine's memory, divided among the workers
        total = local.device.memory_bytes * local.devices_per_node
        assert total - 4 * local.devices_per_node < 4 * four.device.memory_bytes <= total
    with pytest.raises(ClusterError, match="devices_per_node='0' must be at least 1"):
        load_cluster("local:devices_per_node=0")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("nosuch", "unknown cluster preset 'nosuch'; valid presets: dgx-a100-40g"),
        ("dgx-a100-80g:bogus=1", "unknown cluster override 'bogus'"),
        ("dgx-a100-80g:nodes=0", "num_nodes = 0 must be at least 1"),
        ("dgx-a100-80g:nodes=1.5", "must be a whole number"),
        ("dgx-a100-80g:memory=-1GB", "memory_bytes = -1000000000 must be positive"),
        ("dgx-a100-80g:memory=0", "memory_bytes = 0 must be positive"),
        (
            "dgx-a100-80g:memory=2GiB",
            "device.memory_bytes = 2 GiB leaves nothing above "
            "calibration.reserved_memory_bytes = 2 GiB",
        ),
        (
            "dgx-a100-80g:reserved_memory_bytes=81GiB",
            "device.memory_bytes = 80 GiB leaves nothing above",
        ),
        ("dgx-a100-80g:inter_node_bandwidth=10GB", "not a unit of bandwidth"),
        ("dgx-a100-80g:gemm_efficiency=1.5", "must be a fraction in (0, 1]"),
        ("dgx-a100-80g:peak_flops_fp64=1", "unknown dtype in override"),
        ("dgx-a100-80g:nodes", "write key=value"),
    ],
)
def test_bad_cluster_specs(spec: str, fragment: str) -> None:
    with pytest.raises(ClusterError) as info:
        load_cluster(spec)
    assert fragment in str(info.value)


def _valid_data() -> dict[str, object]:
    return Cluster.preset("dgx-a100-80g").to_data()


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


BAD_CLUSTER_FILES: list[tuple[str, object, str]] = [
    ("malformed", "name: [unclosed\n", "not valid YAML at line"),
    ("not a mapping", "- 1\n- 2\n", "must be a mapping"),
    ("no version", {"name": "x"}, "has no 'schema_version'"),
    ("future version", {**_valid_data(), "schema_version": 9}, "schema_version 9"),
    ("unknown key", {**_valid_data(), "gpus": 8}, "unknown key 'gpus' for Cluster"),
    (
        "missing key",
        {k: v for k, v in _valid_data().items() if k != "device"},
        "missing required key 'device'",
    ),
    (
        "wrong type",
        {**_valid_data(), "devices_per_node": "eight"},
        "devices_per_node: cannot read 'eight'",
    ),
    ("bool for int", {**_valid_data(), "num_nodes": True}, "num_nodes: expected a number"),
    (
        "zero devices",
        {**_valid_data(), "devices_per_node": 0},
        "devices_per_node = 0 must be at least 1",
    ),
    (
        "negative memory",
        {**_valid_data(), "device": {**_valid_data()["device"], "memory_bytes": -5}},  # type: ignore[dict-item]
        "device: device.memory_bytes = -5 must be positive",
    ),
    (
        "negative bandwidth",
        {**_valid_data(), "inter_node": {"bandwidth_bytes_per_s": -1.0, "latency_s": 1e-5}},
        "inter_node: bandwidth_bytes_per_s = -1.0 must be positive",
    ),
    (
        "unknown dtype",
        {**_valid_data(), "device": {**_valid_data()["device"], "peak_flops": {"int4": 1e15}}},  # type: ignore[dict-item]
        "unknown dtype 'int4'",
    ),
    (
        "unknown nested key",
        {
            **_valid_data(),
            "intra_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0, "mtu": 9000},
        },
        "intra_node: unknown key 'mtu' for LinkSpec",
    ),
]


@pytest.mark.parametrize(
    ("label", "data", "fragment"), BAD_CLUSTER_FILES, ids=[c[0] for c in BAD_CLUSTER_FILES]
)
def test_bad_cluster_files(tmp_path: Path, label: str, data: object, fragment: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ClusterError) as info:
        Cluster.from_yaml(path)
    message = str(info.value)
    assert fragment in message, message
    assert "\n" not in message


def test_missing_cluster_file(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="does not exist"):
        Cluster.from_yaml(tmp_path / "absent.yaml")


@pytest.mark.parametrize("form", ["--json", "--yaml"])
def test_cluster_show_output_loads_back(form: str, tmp_path: Path) -> None:
    from tests.conftest import run_cli

    done = run_cli("cluster", "show", "dgx-h100-80g:nodes=2,inter_node_bandwidth=50GB/s", form)
    assert done.returncode == 0, done.stderr
    path = tmp_path / f"cluster.{form[2:]}"
    path.write_text(done.stdout)
    loaded = Cluster.from_yaml(path)  # JSON is YAML
    assert loaded == Cluster.preset("dgx-h100-80g", nodes=2, inter_node_bandwidth="50GB/s")
    again = run_cli("cluster", "show", str(path), "--json")
    assert again.returncode == 0, again.stderr


def test_a_stated_device_count_must_agree_with_the_nodes() -> None:
    data = Cluster.preset("dgx-a100-80g", nodes=2).to_data()
    assert Cluster.from_data({**data, "num_devices": 16}).num_devices == 16
    with pytest.raises(ClusterError, match=r"num_devices = 8 but num_nodes x devices_per_node"):
        Cluster.from_data({**data, "num_devices": 8})


def test_cluster_list_names_every_preset() -> None:
    import json

    from tests.conftest import run_cli

    done = run_cli("cluster", "list", "--json")
    assert done.returncode == 0, done.stderr
    assert [row["name"] for row in json.loads(done.stdout)] == preset_names()
    table = run_cli("cluster", "list")
    assert all(name in table.stdout for name in preset_names())
