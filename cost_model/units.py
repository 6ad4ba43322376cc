"""Parse human-written quantities such as ``80GiB``, ``312 TFLOPS``, ``600 GB/s`` or ``5us``.

YAML files and CLI overrides may give sizes with units; everything inside autoplan is in base
units (bytes, FLOP/s, bytes/s, seconds). Plain numbers pass through unchanged. Decimal prefixes
(k, M, G, T, P) are powers of 1000, binary ones (Ki, Mi, Gi, Ti) powers of 1024; a lower-case
``b`` means bits (``200Gb/s`` is 25e9 bytes/s).
"""

from __future__ import annotations

import math
import re
from typing import Literal

from cost_model.messages import shown

Dimension = Literal["bytes", "flops", "bandwidth", "time", "number"]

_PREFIX: dict[str, float] = {
    "": 1.0,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
}
_TIME_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PATTERN = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-zµ/]*)\s*$")


def parse_quantity(value: object, dimension: Dimension) -> float:
    """Return ``value`` in base units of ``dimension``; raise ValueError naming the problem."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {shown(value)}")
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a number or a string with a unit, got {shown(value)}")
    match = _PATTERN.match(value)
    if match is None:
        raise ValueError(
            f"cannot read {shown(value)} as a quantity (e.g. '80GiB', '300GB/s', '5us')"
        )
    number = float(match.group(1))
    unit = match.group(2)
    scale = 1.0 if unit == "" else _unit_scale(unit, dimension)
    if scale is None:
        raise ValueError(
            f"unit {shown(unit, 20)} in {shown(value)} is not a unit of {_EXAMPLES[dimension]}"
        )
    return _in_range(number * scale, match.group(1), value)


def _in_range(number: float, digits: str, value: str) -> float:
    """``number``, refused when the text overflowed a float (to inf) or underflowed it (to 0:
    ``1e-400GB/s`` would read as 0, which some fields take as "not stated")."""
    mantissa = digits.lower().partition("e")[0]
    if number == 0 and any(digit in mantissa for digit in "123456789"):
        raise ValueError(
            f"{shown(value)} is too small for a number: it would read as 0 (the smallest is "
            "about 2.2e-308); check its unit"
        )
    if math.isinf(number):
        raise ValueError(
            f"{shown(value)} is too large for a number (the largest is about 1.8e308); check "
            "its unit"
        )
    return number


_EXAMPLES: dict[Dimension, str] = {
    "bytes": "memory (B, KB, MB, GB, GiB, ...)",
    "flops": "compute (FLOPS, GFLOPS, TFLOPS, ...)",
    "bandwidth": "bandwidth (GB/s, GiB/s, Gb/s, ...)",
    "time": "time (s, ms, us, ns)",
    "number": "a plain number (no unit)",
}


def _unit_scale(unit: str, dimension: Dimension) -> float | None:
    if dimension == "time":
        return _TIME_UNITS.get(unit)
    if dimension == "bytes":
        return _prefixed(unit, ("B",), bits_ok=False)
    if dimension == "flops":
        for suffix in ("FLOPS", "FLOP/s", "flops", "FLOP"):
            if unit.endswith(suffix):
                return _PREFIX.get(unit[: -len(suffix)])
        return None
    if dimension == "bandwidth":
        if not unit.endswith("/s"):
            return None
        return _prefixed(unit[:-2], ("B", "b"), bits_ok=True)
    return None


def _prefixed(unit: str, bases: tuple[str, ...], *, bits_ok: bool) -> float | None:
    for base in bases:
        if unit.endswith(base):
            prefix = _PREFIX.get(unit[: -len(base)])
            if prefix is None:
                return None
            return prefix / 8.0 if (bits_ok and base == "b") else prefix
    return None


def scaled(value: float, units: tuple[tuple[float, str], ...], digits: int = 3) -> str:
    """``value`` in the first of ``units`` (scale, suffix; largest first) it reaches."""
    if value == 0:
        return "0"
    for scale, suffix in units:
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {suffix}"
    scale, suffix = units[-1]
    return f"{value / scale:.{digits}g} {suffix}"


def format_bytes(value: float) -> str:
    """Binary units, as memory is sold and reported (80 GiB)."""
    return scaled(
        value,
        (
            (2.0**50, "PiB"),
            (2.0**40, "TiB"),
            (2.0**30, "GiB"),
            (2.0**20, "MiB"),
            (2.0**10, "KiB"),
            (1.0, "B"),
        ),
    )
