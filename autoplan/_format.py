"""Human-readable numbers for tables: bytes, FLOP/s, bandwidth, time."""

from __future__ import annotations

from cost_model.units import format_bytes
from cost_model.units import scaled as _scaled

fmt_bytes = format_bytes


def fmt_flops(value: float) -> str:
    return _scaled(value, ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1.0, "FLOP/s")))


def fmt_bandwidth(value: float) -> str:
    return _scaled(value, ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1.0, "B/s")))


def fmt_time(seconds: float) -> str:
    return _scaled(
        seconds,
        (
            (86400.0, "days"),
            (3600.0, "h"),
            (60.0, "min"),
            (1.0, "s"),
            (1e-3, "ms"),
            (1e-6, "us"),
            (1e-9, "ns"),
        ),
    )


def fmt_count(value: float) -> str:
    return _scaled(value, ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"), (1.0, "")))


def fmt_memory(peak_bytes: float, reserve_bytes: float, capacity_bytes: float) -> str:
    """A device's peak with its headroom explicit: "predicted 72.4 GiB + 7.5 GiB
    reserve/margin of 80 GiB" (the reserve is the framework's, the margin the allocator's;
    without a recorded reserve or capacity, what is known)."""
    if capacity_bytes <= 0:
        return fmt_bytes(peak_bytes)
    if reserve_bytes <= 0:
        return f"{fmt_bytes(peak_bytes)} of {fmt_bytes(capacity_bytes)}"
    return (
        f"predicted {fmt_bytes(peak_bytes - reserve_bytes)} + {fmt_bytes(reserve_bytes)} "
        f"reserve/margin of {fmt_bytes(capacity_bytes)}"
    )
