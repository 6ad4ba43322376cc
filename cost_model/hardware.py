"""Cluster description: devices, nodes and the links between them.

A `Cluster` is plain data: `num_nodes` nodes of `devices_per_node` identical devices, an
intra-node link (NVLink/NVSwitch, or shared memory for CPU processes) and an inter-node link
(InfiniBand/Ethernet). Link bandwidths are per device, per direction, in bytes/s. Presets are
YAML files shipped in ``cost_model/presets``; each constant there cites its source.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from cost_model import this_machine
from cost_model.calibration import Calibration
from cost_model.errors import ClusterError, SchemaError
from cost_model.messages import did_you_mean, shown_count
from cost_model.precision import fp8_device_problem
from cost_model.schema import (
    PATH_LIMIT,
    check_schema_version,
    from_data,
    read_yaml,
    shown,
    to_data,
    unit_field,
    write_yaml,
)
from cost_model.units import Dimension, format_bytes, parse_quantity, scaled

logger = logging.getLogger(__name__)

CLUSTER_SCHEMA_VERSION = 1
# Peak rates a device may state: "fp8" for e4m3/e5m2 tensor cores (Hopper, Ada, Blackwell;
# MI300X's e4m3fnuz/e5m2fnuz matrix cores), "mxfp8" for MX block-scaled fp8 ones (Blackwell;
# `cost_model.precision`), "fp4" for 4-bit ones (Blackwell's NVFP4/MXFP4): stated for later,
# no plan dtype computes in it yet, so nothing prices it.
DType = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "fp4"]
DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "fp4")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One accelerator (or one CPU worker process): memory and datasheet peaks."""

    name: str
    kind: Literal["gpu", "cpu"] = "gpu"
    memory_bytes: int = unit_field("bytes")
    # Dense (no sparsity) peak FLOP/s per dtype; dtypes the device lacks are omitted.
    peak_flops: dict[str, float] = unit_field("flops")
    memory_bandwidth_bytes_per_s: float = unit_field("bandwidth")
    # The link to the host CPU (PCIe), each way, at its datasheet rate; 0: not stated (a CPU
    # worker is its own host).
    host_link_bandwidth_bytes_per_s: float = unit_field("bandwidth", default=0.0)

    def __hash__(self) -> int:
        # A device (and the Cluster holding it) is a value: equal devices hash equal whatever
        # order their dtypes were given in. (The dataclass's own hash would hash the dict.)
        return hash(
            (
                self.name,
                self.kind,
                self.memory_bytes,
                frozenset(self.peak_flops.items()),
                self.memory_bandwidth_bytes_per_s,
                self.host_link_bandwidth_bytes_per_s,
            )
        )

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"device.memory_bytes = {shown(self.memory_bytes)} must be positive")
        if self.memory_bytes > _MAX_MEMORY_BYTES:
            raise ValueError(
                f"device.memory_bytes = {shown_count(self.memory_bytes)} is over "
                f"{_MAX_MEMORY_BYTES:,} bytes (1 EiB); check its unit (e.g. '80GiB')"
            )
        if self.memory_bandwidth_bytes_per_s <= 0:
            raise ValueError(
                f"device.memory_bandwidth_bytes_per_s = {shown(self.memory_bandwidth_bytes_per_s)} "
                "must be positive"
            )
        _check_range("device.memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s)
        if self.host_link_bandwidth_bytes_per_s < 0:
            raise ValueError(
                "device.host_link_bandwidth_bytes_per_s = "
                f"{shown(self.host_link_bandwidth_bytes_per_s)} must be >= 0 (0: not stated)"
            )
        if self.host_link_bandwidth_bytes_per_s != 0:
            _check_range(
                "device.host_link_bandwidth_bytes_per_s",
                self.host_link_bandwidth_bytes_per_s,
                zero="not stated",
            )
        if not self.peak_flops:
            raise ValueError("device.peak_flops is empty; give at least 'fp32: <FLOP/s>'")
        for dtype, flops in self.peak_flops.items():
            if dtype not in DTYPES:
                raise ValueError(
                    f"device.peak_flops has unknown dtype {shown(dtype)}; use one of "
                    f"{', '.join(DTYPES)}"
                )
            if flops <= 0:
                raise ValueError(f"device.peak_flops.{dtype} = {shown(flops)} must be positive")
            _check_range(f"device.peak_flops.{dtype}", flops)

    def peak_flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``, falling back to a same-width dtype the device has."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype in ("fp8", "mxfp8"):
            # never an fp8 rate lent from a 16-bit one: a device without the tensor cores
            # refuses the recipes (`missing_rate`)
            raise ClusterError(
                fp8_device_problem(dtype, self.name, self.kind, frozenset(self.peak_flops))
                or f"device {shown(self.name)} has no peak FLOP/s for {dtype}"
            )
        fallback = {"bf16": "fp16", "fp16": "bf16", "tf32": "fp32"}.get(dtype)
        if fallback is not None and fallback in self.peak_flops:
            return self.peak_flops[fallback]
        if "fp32" in self.peak_flops:
            return self.peak_flops["fp32"]
        raise ClusterError(
            f"device {shown(self.name)} has no peak FLOP/s for {shown(dtype)}; add it under "
            "device.peak_flops"
        )

    def missing_rate(self, dtype: str) -> str | None:
        """Why ``dtype`` would be priced at a rate this device lacks, or None: bf16 on a GPU
        that states fp16 tensor cores and no bf16 (a V100; `peak_flops_for` would lend it the
        fp16 rate)."""
        rates = self.peak_flops
        if (
            problem := fp8_device_problem(dtype, self.name, self.kind, frozenset(rates))
        ) is not None:
            return problem
        if dtype == "bf16" and self.kind == "gpu" and "bf16" not in rates and "fp16" in rates:
            return f"{self.name} states no bf16 rate, only fp16 (a V100 has no bf16 tensor cores)"
        return None

    def fastest_training_dtype(self) -> str:
        """The training dtype (fp32, bf16, fp16) with the highest peak FLOP/s the device
        states; on a tie bf16 on GPUs (its range needs no loss scaling), fp32 on CPUs (torch's
        bf16 GEMMs on CPUs without AMX run through slower kernels than the rate says)."""
        order = ("fp32", "bf16", "fp16") if self.kind == "cpu" else ("bf16", "fp16", "fp32")
        stated = [d for d in order if d in self.peak_flops] or ["fp32"]
        return max(stated, key=lambda d: (self.peak_flops.get(d, 0.0), -order.index(d)))


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """A link class: bandwidth per device per direction and one-message latency."""

    bandwidth_bytes_per_s: float = unit_field("bandwidth")
    latency_s: float = unit_field("time")

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(
                f"bandwidth_bytes_per_s = {shown(self.bandwidth_bytes_per_s)} must be positive"
            )
        _check_range("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        if self.latency_s < 0:
            raise ValueError(f"latency_s = {shown(self.latency_s)} must be >= 0")
        if self.latency_s > _MAX_LATENCY_S:
            raise ValueError(
                f"latency_s = {self.latency_s:g} s is over {_MAX_LATENCY_S:g} s; check its unit "
                "(e.g. '5us')"
            )


# Beyond these no device or link is built (a modem's kB/s, a chip's PB/s; a minute a message;
# a MFLOP/s, or 50 times a 2025 wafer-scale chip's 2e16 FLOP/s): a value out there is a slip of
# units, and it would overflow or zero the step time.
_MIN_BANDWIDTH, _MAX_BANDWIDTH, _MAX_LATENCY_S = 1e3, 1e15, 60.0
_MIN_FLOPS, _MAX_FLOPS = 1e6, 1e18
_MAX_MEMORY_BYTES = 2**60


def _check_range(name: str, value: float, *, zero: str = "") -> None:
    """Refuse a bandwidth (``..._bytes_per_s``) or a peak (``peak_flops``) outside the range
    any device has, naming the range (and what ``zero`` means, for a field that takes 0)."""
    low, high, unit, example = (
        (_MIN_FLOPS, _MAX_FLOPS, "FLOP/s", "'312TFLOPS'")
        if "flops" in name
        else (_MIN_BANDWIDTH, _MAX_BANDWIDTH, "bytes/s", "'400GB/s'")
    )
    if not low <= value <= high:
        raise ValueError(
            f"{name} = {value:g} is outside [{low:g}, {high:g}] {unit}"
            f"{f' (or 0: {zero})' if zero else ''}; check its unit (e.g. {example})"
        )


def _scale_up_problem(
    scale_up: object, per_node: int, num_devices: int, *, asked: bool = False
) -> str | None:
    """Why ``scale_up`` devices cannot be a scale-up domain of a cluster of ``num_devices``
    devices on nodes of ``per_node``, in one line with the fix; None when they can. A domain
    ``asked`` for (an override) must also divide the cluster and fit in it; a preset's own
    (a 72-GPU rack) holds jobs of any whole nodes (`Cluster.scale_up_domain`)."""
    if isinstance(scale_up, bool) or not isinstance(scale_up, int) or scale_up < 1:
        return f"scale_up_devices = {shown(scale_up)} must be a whole number of devices >= 1"
    if scale_up % per_node:
        return (
            f"scale_up_devices = {scale_up} must be whole nodes of {per_node} devices (a "
            f"multiple of {per_node}, e.g. {per_node * max(1, scale_up // per_node)})"
        )
    if asked and scale_up > num_devices:
        return (
            f"scale_up_devices = {scale_up} is more than the cluster's {num_devices} devices; "
            f"give at most {num_devices}, or more nodes"
        )
    if asked and num_devices % scale_up:
        return (
            f"scale_up_devices = {scale_up} does not divide the cluster's {num_devices} devices; "
            f"use whole domains ({scale_up}, {2 * scale_up}, ... devices)"
        )
    return None


# The most devices a cluster may have: 2^20, ten times the largest training clusters built by
# 2026 (~100k GPUs); beyond it a search only enumerates degrees for minutes.
MAX_DEVICES = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Homogeneous cluster: ``num_nodes`` x ``devices_per_node`` devices and two link classes."""

    name: str
    num_nodes: int = 1
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    calibration: Calibration = field(default_factory=Calibration)
    description: str = ""
    # CPU worker processes that share a node's cores (the test rig, not a GPU cluster): how
    # many cores the node's devices share. None: every device computes on its own (GPUs, or
    # one worker per core). The cost model then stretches whatever runs concurrently
    # (`cost_model.parts.core_sharing`).
    shared_cores_per_node: int | None = None
    # Devices that share the scale-up fabric (NVLink/NVSwitch, Infinity Fabric): whole nodes,
    # one by default (None); a rack-scale system spans nodes (GB200 NVL72: 72 GPUs on 18 trays
    # of 4). Collectives and transfers inside a domain run at `intra_node`'s rate, across
    # domains at `inter_node`'s (`scale_up_domain`).
    scale_up_devices: int | None = None
    # What one device-hour of this cluster costs, in the what-if's currency (None: not stated).
    price_per_device_hour: float | None = None
    # Each node's host DRAM, shared by its ``devices_per_node`` devices: what optimizer and
    # activation offload may fill (`cost_model.offload`); 0: not stated (offload is refused).
    host_memory_bytes: int = unit_field("bytes", default=0)

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes = {shown(self.num_nodes)} must be at least 1")
        if self.devices_per_node < 1:
            raise ValueError(
                f"devices_per_node = {shown(self.devices_per_node)} must be at least 1"
            )
        if self.num_nodes * self.devices_per_node > MAX_DEVICES:
            raise ValueError(
                f"num_nodes x devices_per_node = {shown_count(self.num_nodes)} x "
                f"{shown_count(self.devices_per_node)} = "
                f"{shown_count(self.num_nodes * self.devices_per_node)} devices is more than the "
                f"{MAX_DEVICES:,} autoplan plans for; give a real cluster size"
            )
        if self.scale_up_devices is not None:
            problem = _scale_up_problem(
                self.scale_up_devices, self.devices_per_node, self.num_devices
            )
            if problem is not None:
                raise ValueError(problem)
        if self.price_per_device_hour is not None and not (
            math.isfinite(self.price_per_device_hour) and self.price_per_device_hour > 0
        ):
            raise ValueError(
                f"price_per_device_hour = {shown(self.price_per_device_hour)} must be a positive "
                "number (e.g. 2.5), or null: not stated"
            )
        if not 0 <= self.host_memory_bytes <= _MAX_MEMORY_BYTES:
            raise ValueError(
                f"host_memory_bytes = {shown_count(self.host_memory_bytes)} must be from 0 (not "
                f"stated) to {_MAX_MEMORY_BYTES:,} bytes (1 EiB) per node; check its unit "
                "(e.g. '2TB')"
            )
        if self.shared_cores_per_node is not None and self.shared_cores_per_node < 1:
            raise ValueError(
                f"shared_cores_per_node = {shown(self.shared_cores_per_node)} must be at least 1 "
                "(or null: devices do not share cores)"
            )
        reserve = self.calibration.reserved_memory_bytes
        if self.device.memory_bytes <= reserve:
            gib = 2.0**30
            raise ValueError(
                f"device.memory_bytes = {self.device.memory_bytes / gib:.3g} GiB leaves nothing "
                f"above calibration.reserved_memory_bytes = {reserve / gib:.3g} GiB (the "
                "framework's own reserve); give the device's real memory or lower the reserve"
            )

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def scale_up_domain(self) -> int:
        """Devices of one scale-up domain of this job: `scale_up_devices` (a node when not
        stated), at most the whole cluster (a job on part of an NVL72 rack); where the job's
        devices are not whole domains, the largest segment of whole nodes within a domain that
        divides them, as a scheduler places such a job (256 GB200 GPUs: 4 segments of 64 GPUs,
        one per rack, as NeMo's launcher asks Slurm for 16-node segments)."""
        per_node, total = self.devices_per_node, self.num_devices
        cap = min(self.scale_up_devices or per_node, total)
        if total % cap == 0:
            return cap
        return max(d for d in range(per_node, cap + 1, per_node) if total % d == 0)

    def node_of(self, rank: int) -> int:
        """Node index of global device ``rank`` (ranks fill one node before the next)."""
        return rank // self.devices_per_node

    def domain_of(self, rank: int) -> int:
        """Scale-up domain of global device ``rank`` (`scale_up_domain` consecutive ranks)."""
        return rank // self.scale_up_domain

    # ----------------------------------------------------------------------------- files

    @classmethod
    def from_yaml(cls, path: str | Path) -> Cluster:
        """Load a cluster file; raises ClusterError naming the bad field."""
        try:
            data = read_yaml(path, "cluster")
        except SchemaError as error:
            raise ClusterError(str(error)) from None
        return cls.from_data(data, source=str(path))

    @classmethod
    def from_data(cls, data: object, *, source: str = "cluster") -> Cluster:
        try:
            body = check_schema_version(data, CLUSTER_SCHEMA_VERSION, "the cluster")
            # `num_devices` is derived (`autoplan cluster show --json` prints it); when a file
            # keeps it, it must agree with the nodes
            body = dict(body)
            stated = body.pop("num_devices", None)
            if isinstance(body.get("device"), str):
                # a device by name: a shipped preset's device, its datasheet rates
                try:
                    body["device"] = to_data(preset_device(body["device"]))
                except ClusterError as error:
                    raise ClusterError(f"cluster {shown(source, PATH_LIMIT)}: {error}") from None
            cluster = from_data(cls, body)
        except SchemaError as error:
            raise ClusterError(f"cluster {shown(source, PATH_LIMIT)}: {error}") from None
        if stated is not None and stated != cluster.num_devices:
            raise ClusterError(
                f"cluster {shown(source, PATH_LIMIT)}: num_devices = {shown(stated)} but "
                f"num_nodes x devices_per_node = {cluster.num_nodes} x "
                f"{cluster.devices_per_node} = {cluster.num_devices}; "
                "drop num_devices (it is derived) or fix num_nodes"
            )
        return cluster

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"schema_version": CLUSTER_SCHEMA_VERSION}
        data.update(to_data(self))
        return data

    def to_yaml(self, path: str | Path) -> None:
        write_yaml(path, self.to_data(), header=f"# autoplan cluster: {self.name}\n")

    # ----------------------------------------------------------------------------- presets

    @classmethod
    def preset(cls, name: str, /, nodes: int = 1, **overrides: object) -> Cluster:
        """A shipped preset (one node as described by its vendor) scaled to ``nodes`` nodes.

        ``overrides`` use the flat keys of `OVERRIDE_KEYS`, e.g. ``inter_node_bandwidth="50GB/s"``.
        """
        if name == "local":
            # N workers on this machine share its memory and cores: the same cluster as
            # `Cluster.local(N)`, not the whole machine's memory for each of N devices.
            raw = overrides.pop("devices_per_node", None)
            workers = (
                None if raw is None else _override_value("devices_per_node", raw, "number", int)
            )
            if workers is not None and workers < 1:
                raise ClusterError(
                    f"cluster override devices_per_node={shown(raw)} must be at least 1 (the "
                    "number of worker processes on this machine)"
                )
            base = cls.local(workers)
        else:
            if name not in preset_names():
                raise ClusterError(
                    f"unknown cluster preset {shown(name)}; {did_you_mean(name, preset_names())}"
                    "valid presets: "
                    f"{', '.join(preset_names())} (or give a path to a cluster YAML file)"
                )
            base = cls.preset_file(name)
        return base.with_overrides(nodes=nodes, **overrides)

    @classmethod
    def preset_file(cls, name: str) -> Cluster:
        """The shipped preset file ``name`` exactly as written (one node, no detection)."""
        return _preset_file(name)

    @classmethod
    def local(cls, num_devices: int | None = None) -> Cluster:
        """This machine: its visible CUDA GPUs, else one device per CPU core.

        ``num_devices`` sets the number of worker processes (e.g. a torchrun world on CPU
        that oversubscribes the cores); CPU memory is divided among them.
        """
        return local_cluster(this_machine.facts(), num_devices)

    def with_overrides(self, nodes: int | None = None, **overrides: object) -> Cluster:
        """A copy with flat-key overrides applied (values may carry units, e.g. '80GiB')."""
        changes: dict[str, Any] = {}
        device: dict[str, Any] = {}
        intra: dict[str, Any] = {}
        inter: dict[str, Any] = {}
        calibration: dict[str, Any] = {}
        if nodes is not None:
            overrides = {"num_nodes": nodes, **overrides}
        for key, raw in overrides.items():
            if key not in OVERRIDE_KEYS and not key.startswith("peak_flops_"):
                raise ClusterError(
                    f"unknown cluster override {shown(key)}; valid keys: "
                    f"{', '.join(OVERRIDE_KEYS)}, peak_flops_<dtype> ({', '.join(DTYPES)})"
                )
            if key.startswith("peak_flops_"):
                dtype = key.removeprefix("peak_flops_")
                if dtype not in DTYPES:
                    raise ClusterError(
                        f"unknown dtype in override {shown(key)}; use "
                        f"peak_flops_<{'|'.join(DTYPES)}>"
                    )
                flops = dict(device.get("peak_flops", self.device.peak_flops))
                flops[dtype] = _override_value(key, raw, "flops", float)
                device["peak_flops"] = flops
                continue
            target, attr, dimension, kind = OVERRIDE_KEYS[key]
            value = _override_value(key, raw, dimension, kind)
            {
                "cluster": changes,
                "device": device,
                "intra": intra,
                "inter": inter,
                "calibration": calibration,
            }[target][attr] = value
        try:
            if device:
                changes["device"] = dataclasses.replace(self.device, **device)
            if intra:
                changes["intra_node"] = dataclasses.replace(self.intra_node, **intra)
            if inter:
                changes["inter_node"] = dataclasses.replace(self.inter_node, **inter)
            if calibration:
                changes["calibration"] = dataclasses.replace(self.calibration, **calibration)
            cluster = dataclasses.replace(self, **changes)
        except ValueError as error:
            raise ClusterError(f"cluster {shown(self.name)} override: {error}") from None
        asked = changes.get("scale_up_devices")
        if asked is not None:
            # (a preset's own domain may outsize or not divide a job on part of it; one asked
            # for may not)
            problem = _scale_up_problem(
                asked, cluster.devices_per_node, cluster.num_devices, asked=True
            )
            if problem is not None:
                raise ClusterError(f"cluster {shown(self.name)} override: {problem}")
        return _named_for_overrides(self, cluster)


# flat override key -> (part, attribute, unit dimension, python type)
OVERRIDE_KEYS: dict[str, tuple[str, str, Dimension, type]] = {
    "name": ("cluster", "name", "number", str),
    "num_nodes": ("cluster", "num_nodes", "number", int),
    "nodes": ("cluster", "num_nodes", "number", int),
    "devices_per_node": ("cluster", "devices_per_node", "number", int),
    "shared_cores_per_node": ("cluster", "shared_cores_per_node", "number", int),
    "scale_up_devices": ("cluster", "scale_up_devices", "number", int),
    "price_per_device_hour": ("cluster", "price_per_device_hour", "number", float),
    "host_memory": ("cluster", "host_memory_bytes", "bytes", int),
    "memory": ("device", "memory_bytes", "bytes", int),
    "memory_bytes": ("device", "memory_bytes", "bytes", int),
    "memory_bandwidth": ("device", "memory_bandwidth_bytes_per_s", "bandwidth", float),
    "host_link_bandwidth": ("device", "host_link_bandwidth_bytes_per_s", "bandwidth", float),
    "intra_node_bandwidth": ("intra", "bandwidth_bytes_per_s", "bandwidth", float),
    "intra_node_latency": ("intra", "latency_s", "time", float),
    "inter_node_bandwidth": ("inter", "bandwidth_bytes_per_s", "bandwidth", float),
    "inter_node_latency": ("inter", "latency_s", "time", float),
    **{
        f.name: ("calibration", f.name, f.metadata.get("unit", "number"), float)
        for f in dataclasses.fields(Calibration)
    },
}


# ----------------------------------------------------------------------------- naming

# What an overridden value is called in a name or description, and how it is shown.
_BANDWIDTH_UNITS = ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1.0, "B/s"))
_FLOPS_UNITS = ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1.0, "FLOP/s"))
_TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"))
_OVERRIDDEN = re.compile(r"(?P<base>.*) \((?P<marks>[^()]*), overridden\)")
# A datasheet's memory in a device name ("A100-SXM4-80GB"), dropped when memory is overridden.
_MEMORY_IN_NAME = re.compile(r"-\d+(?:\.\d+)?GB$")


def _device_marks(before: DeviceSpec, after: DeviceSpec) -> dict[str, str]:
    """The device's fields ``after`` changed from ``before``, as label -> shown value."""
    marks: dict[str, str] = {}
    if after.memory_bytes != before.memory_bytes:
        marks["memory"] = format_bytes(after.memory_bytes)
    if after.memory_bandwidth_bytes_per_s != before.memory_bandwidth_bytes_per_s:
        marks["memory bandwidth"] = scaled(after.memory_bandwidth_bytes_per_s, _BANDWIDTH_UNITS)
    if after.host_link_bandwidth_bytes_per_s != before.host_link_bandwidth_bytes_per_s:
        marks["host link"] = scaled(after.host_link_bandwidth_bytes_per_s, _BANDWIDTH_UNITS)
    for dtype, flops in after.peak_flops.items():
        if before.peak_flops.get(dtype) != flops:
            marks[f"peak {dtype}"] = scaled(flops, _FLOPS_UNITS)
    return marks


def _cluster_marks(before: Cluster, after: Cluster) -> dict[str, str]:
    """The hardware ``after`` describes differently from ``before`` (its device, the devices a
    node, the links, the scale-up domain; not the node count, calibration or price)."""
    marks = _device_marks(before.device, after.device)
    if after.devices_per_node != before.devices_per_node:
        marks["devices per node"] = str(after.devices_per_node)
    for label, old, new in (("intra-node", before.intra_node, after.intra_node),
                            ("inter-node", before.inter_node, after.inter_node)):  # fmt: skip
        if new.bandwidth_bytes_per_s != old.bandwidth_bytes_per_s:
            marks[f"{label} link"] = scaled(new.bandwidth_bytes_per_s, _BANDWIDTH_UNITS)
        if new.latency_s != old.latency_s:
            marks[f"{label} latency"] = scaled(new.latency_s, _TIME_UNITS)
    if after.scale_up_devices != before.scale_up_devices:
        marks["scale-up devices"] = str(after.scale_up_devices or after.devices_per_node)
    if after.host_memory_bytes != before.host_memory_bytes:
        marks["host memory"] = format_bytes(after.host_memory_bytes)
    return marks


def _marked(text: str, marks: dict[str, str], *, drop_memory: bool = False) -> str:
    """``text`` (a device name or a description) saying which of its values are overridden:
    "A100-SXM4 (memory 40 GiB, overridden)". Marks already on ``text`` are kept, a label marked
    again takes its new value; ``drop_memory`` drops a datasheet memory from the name."""
    found = _OVERRIDDEN.fullmatch(text)
    base, old = (found["base"], found["marks"].split(", ")) if found else (text, [])
    merged: dict[str, str] = {}
    labels = sorted(
        {*marks, "memory", "memory bandwidth", "host link"}, key=len, reverse=True
    )  # the longest label first: "memory bandwidth 2 TB/s" is not "memory"
    for item in old:
        label = next((lb for lb in labels if item.startswith(f"{lb} ")), item)
        merged[label] = item[len(label) + 1 :] if label != item else ""
    merged.update(marks)
    if drop_memory:
        base = _MEMORY_IN_NAME.sub("", base)
    shown_marks = ", ".join(f"{label} {value}".strip() for label, value in merged.items())
    return f"{base} ({shown_marks}, overridden)"


def _named_for_overrides(before: Cluster, after: Cluster) -> Cluster:
    """``after`` (``before`` with overrides) with a device name and description that say what
    it describes: a preset's "A100-SXM4-80GB" given 40 GiB is "A100-SXM4 (memory 40 GiB,
    overridden)" (in `autoplan cluster show`, estimates and every message naming the device)."""
    device_marks = _device_marks(before.device, after.device)
    cluster_marks = _cluster_marks(before, after)
    if not cluster_marks:
        return after
    device = after.device
    if device_marks:
        name = _marked(device.name, device_marks, drop_memory="memory" in device_marks)
        device = dataclasses.replace(device, name=name)
    description = _marked(after.description, cluster_marks) if after.description else ""
    return dataclasses.replace(after, device=device, description=description)


def _override_value(key: str, raw: object, dimension: Dimension, kind: type) -> Any:
    if kind is str:
        return str(raw)
    try:
        number = parse_quantity(raw, dimension)
    except ValueError as error:
        if dimension == "number":  # a count or a plain fraction: no unit to show
            raise ClusterError(
                f"cluster override {key}={shown(raw)}: expected "
                f"{'a whole number' if kind is int else 'a number'}"
            ) from None
        accepted = _accepted(key)
        raise ClusterError(
            f"cluster override {key}={shown(raw)}: {error}"
            + (f"; {key} takes {accepted}" if accepted else "")
        ) from None
    if not math.isfinite(number):
        raise ClusterError(f"cluster override {key}={shown(raw)} must be a finite number")
    if kind is int:
        if dimension == "bytes":
            return round(number)  # 2.2GiB is not a whole number of bytes: the nearest one
        if number != int(number):
            raise ClusterError(f"cluster override {key}={shown(raw)} must be a whole number")
        return int(number)
    return number


def _accepted(key: str) -> str | None:
    """The values a bandwidth or peak override takes (for a message), else None."""
    if key.startswith("peak_flops_"):
        return f"{_MIN_FLOPS:g} to {_MAX_FLOPS:g} FLOP/s, e.g. '312TFLOPS'"
    if key.endswith("bandwidth"):
        span = f"{_MIN_BANDWIDTH:g} to {_MAX_BANDWIDTH:g} bytes/s, e.g. '32GB/s'"
        return f"0 (not stated) or {span}" if key == "host_link_bandwidth" else span
    return None


def as_cluster(value: object) -> Cluster:
    """A `Cluster`, or one from a spec string (``NAME[:key=value,...]`` or a YAML path);
    anything else raises `ClusterError` naming what to pass."""
    if isinstance(value, Cluster):
        return value
    if isinstance(value, str):
        return load_cluster(value)
    raise ClusterError(
        f"cluster must be a Cluster or a spec string (e.g. 'dgx-a100-80g:nodes=4' or a YAML "
        f"path), got {type(value).__name__} {shown(value)}"
    )


@functools.cache
def _preset_file(name: str) -> Cluster:
    """Parse a shipped preset once: the files are package data, and a Cluster is immutable
    (what-if questions and the validation bench build thousands from a few presets)."""
    resource = resources.files("cost_model") / "presets" / f"{name}.yaml"
    with resources.as_file(resource) as path:
        return Cluster.from_yaml(path)


def preset_device(name: str) -> DeviceSpec:
    """The device of the shipped preset whose device is called ``name`` (e.g.
    ``B200-SXM-180GB``), for a cluster file that names its device; `ClusterError` naming the
    value, the closest known name and the fix for an unknown one."""
    devices = {
        preset.device.name: preset.device
        for preset in map(_preset_file, preset_names())
        if preset.device.kind == "gpu"
    }
    if name in devices:
        return devices[name]
    close = difflib.get_close_matches(name, list(devices), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ClusterError(
        f"device {shown(name)} is not a device autoplan knows; {hint}name one of "
        f"{', '.join(sorted(devices))}, or describe the device as a mapping (name, memory_bytes, "
        "peak_flops, memory_bandwidth_bytes_per_s)"
    )


def preset_names() -> list[str]:
    """Names of the shipped cluster presets."""
    folder = resources.files("cost_model") / "presets"
    names = sorted(
        entry.name.removesuffix(".yaml")
        for entry in folder.iterdir()
        if entry.name.endswith(".yaml")
    )
    return names


def load_cluster(spec: str) -> Cluster:
    """Resolve a CLI cluster spec: ``NAME[:key=value,...]`` or a path to a cluster YAML file."""
    if spec.endswith((".yaml", ".yml")) or _is_file(spec):
        return Cluster.from_yaml(spec)
    name, _, rest = spec.partition(":")
    overrides: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ClusterError(
                f"cannot read cluster override {shown(item)} in {shown(spec)}; write key=value, "
                "e.g. 'dgx-a100-80g:nodes=4,inter_node_bandwidth=50GB/s'"
            )
        overrides[key.strip()] = value.strip()
    nodes = overrides.pop("nodes", None)
    return Cluster.preset(
        name, nodes=_override_value("nodes", nodes, "number", int) if nodes else 1, **overrides
    )


def _is_file(spec: str) -> bool:
    try:
        return Path(spec).is_file()
    except (OSError, ValueError):  # too long a name for a path (a 100 KB spec), a NUL byte
        return False


# ----------------------------------------------------------------------------- this machine

# GPU name fragment -> preset whose device describes it, first match wins. Names are torch's
# (`get_device_properties(0).name`, nvidia-smi's): "NVIDIA H100 80GB HBM3", "NVIDIA H200",
# "NVIDIA B200", "NVIDIA GB200", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB"; ROCm GPUs show
# as cuda devices under their marketing name, "AMD Instinct MI300X" ("... VF" virtualised).
_GPU_PRESETS: tuple[tuple[str, str], ...] = (
    ("H100", "dgx-h100-80g"),
    ("H200", "dgx-h200-141g"),
    ("GB200", "gb200-nvl72"),
    ("B200", "dgx-b200-180g"),
    ("MI300X", "mi300x-192g"),
    ("A100-SXM4-80GB", "dgx-a100-80g"),
    ("A100 80GB", "dgx-a100-80g"),
    ("A100", "dgx-a100-40g"),
    ("V100-SXM3", "dgx2-v100-32g"),
    ("V100", "p3.16xlarge"),
)


def _name_tokens(name: str) -> list[str]:
    return re.findall(r"[A-Z0-9]+", name.upper())


def gpu_preset(gpu_name: str) -> str | None:
    """The preset whose device a GPU named ``gpu_name`` is, or None. A fragment matches whole
    words of the name, in order (so "B200" is not a GB200, "H200" not a GH200, "MI300X" not an
    MI300A or MI325X)."""
    words = _name_tokens(gpu_name)
    for fragment, preset in _GPU_PRESETS:
        want = _name_tokens(fragment)
        if any(words[i : i + len(want)] == want for i in range(len(words) - len(want) + 1)):
            return preset
    return None


def local_cluster(machine: this_machine.MachineFacts, num_devices: int | None = None) -> Cluster:
    """``machine`` as a one-node cluster of ``num_devices`` (default: all) devices: its CUDA
    GPUs (see `cost_model.local_machine`), else CPU worker processes."""
    if machine.cuda is not None:
        return _cuda_cluster(
            machine.cuda, machine.cuda.count if num_devices is None else num_devices
        )
    cores = machine.cpu_cores
    workers = num_devices if num_devices is not None else cores
    base = _cpu_base(machine.calibrated_path)
    memory = machine.ram_bytes // max(workers, 1)
    device = dataclasses.replace(base.device, memory_bytes=memory)
    return dataclasses.replace(
        base,
        name="local",
        devices_per_node=workers,
        device=device,
        shared_cores_per_node=cores if workers > cores else None,
    )


def _cpu_base(calibrated: Path) -> Cluster:
    if calibrated.exists():
        logger.info("using the calibrated local cluster in %s", calibrated)
        return Cluster.from_yaml(calibrated)
    return Cluster.preset_file("local")


def _cuda_cluster(cuda: this_machine.CudaDevices, count: int) -> Cluster:
    preset = gpu_preset(cuda.name)
    base = Cluster.preset_file(preset or "dgx-a100-80g")
    device = dataclasses.replace(base.device, name=cuda.name, memory_bytes=cuda.memory_bytes)
    rates = f"{base.device.name}'s rates ({base.name})"
    if preset is None:
        logger.warning(
            "no preset matches GPU %r; using %s: run `autoplan calibrate`", cuda.name, rates
        )
        rates = f"no preset matches its name: {rates} until `autoplan calibrate` measures it"
    return dataclasses.replace(
        base,
        name="local",
        description=f"this machine: {count}x {cuda.name}; {rates}",
        devices_per_node=count,
        device=device,
        # (one machine: its own GPUs are the scale-up domain, not the preset's rack of them)
        scale_up_devices=None,
    )
