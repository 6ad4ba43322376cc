from __future__ import annotations

import pytest

from cost_model.units import parse_quantity


@pytest.mark.parametrize(
    ("text", "dimension", "expected"),
    [
        ("80GiB", "bytes", 80 * 2**30),
        ("80 GB", "bytes", 80e9),
        ("512", "bytes", 512.0),
        (1024, "bytes", 1024.0),
        ("312TFLOPS", "flops", 312e12),
        ("19.5 TFLOP/s", "flops", 19.5e12),
        ("300GB/s", "bandwidth", 300e9),
        ("200Gb/s", "bandwidth", 25e9),  # bits: 200e9 / 8
        ("1GiB/s", "bandwidth", 2.0**30),
        ("5us", "time", 5e-6),
        ("1.5ms", "time", 1.5e-3),
        ("2e-3", "time", 2e-3),
        ("156e12", "flops", 156e12),
    ],
)
def test_parse_quantity(text: object, dimension: str, expected: float) -> None:
    assert parse_quantity(text, dimension) == pytest.approx(expected, rel=1e-12)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "dimension", "fragment"),
    [
        ("80GB/s", "bytes", "not a unit of memory"),
        ("fast", "bandwidth", "cannot read"),
        ("10 parsecs", "time", "not a unit of time"),
        (True, "bytes", "expected a number"),
        ([1], "bytes", "expected a number or a string"),
    ],
)
def test_parse_quantity_rejects(text: object, dimension: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_quantity(text, dimension)  # type: ignore[arg-type]
