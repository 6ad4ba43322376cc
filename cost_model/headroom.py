"""Memory headroom: the share of each device's memory a plan leaves free beyond its predicted peak.

Expects a headroom as a fraction of the device's capacity in [0, `MAX_MEMORY_HEADROOM`).
Guarantees: `usable_capacity_bytes` is the one definition of "the bytes a plan may use" that the
estimate's ``fits``, `autoplan validate`, `autoplan.parallelize`, the search's memory bounds
and its stage-partition solver all compare a predicted peak with, so the search never offers a
plan the others refuse: a peak fits when the upper end of its 80% range (the prediction times
`memory_upper_factor`) stays within the capacity less the headroom.

What each term covers (docs/guide.md, "Memory headroom"), so nothing is counted twice
unsaid: the predicted peak already holds the framework reserve (CUDA context, library buffers)
and the allocator margin (`Calibration.allocator_overhead_fraction`: the caching allocator's
steady-state cached-but-unused share of the tensors, 5% on the GPU presets); the range factor
is the model's own error on measured peaks; the headroom is what neither sees: fragmentation
beyond the steady state under irregular allocation patterns (recompute, ZeRO gathers, varying
sequence lengths), memory outside the step (communicators created lazily, checkpoint staging,
evaluation), and room for the allocator not to flush and retry at the edge.
"""

from __future__ import annotations

import math

from cost_model.errors import InputError
from cost_model.messages import shown
from cost_model.uncertainty import memory_upper_factor

# GMLake (Guo et al., ASPLOS 2024, arXiv:2401.08156) measured PyTorch's caching allocator on
# eight LLMs fine-tuned on A100-80GB with recompute, ZeRO, offloading and LoRA: stitching freed
# 9.2 GB of reserved memory on average (up to 25 GB) and cut fragmentation by 15 percentage
# points on average (up to 33). The modelled allocator margin (5% of the tensors on the GPU
# presets) covers about a third of that average; the default headroom covers the rest.
# PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "CUDA
# semantics: optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF") grow one segment instead of
# caching fixed ones, which removes most of it: a job that sets it can run with 0.05.
DEFAULT_MEMORY_HEADROOM = 0.10
# A headroom of 0.9 or more leaves under a tenth of the device: no real plan; a typo (10 for
# 10%) is far more likely.
MAX_MEMORY_HEADROOM = 0.9


class MemoryHeadroomError(InputError):
    """A memory headroom is not a fraction in [0, 0.9) (the message names the value)."""


def check_memory_headroom(value: object) -> float:
    """``value`` as a memory headroom (a number in [0, `MAX_MEMORY_HEADROOM`)), or
    `MemoryHeadroomError` naming it, the valid range and the default."""
    if not _valid(value):
        raise MemoryHeadroomError(_refusal(shown(value)))
    return float(value)  # type: ignore[arg-type]  # (a real number: `_valid`)


def parse_memory_headroom(text: str) -> float:
    """A headroom given as text (a command-line option), checked as `check_memory_headroom`
    checks a number; the refusal names the text as given."""
    try:
        value = float(text)
    except ValueError:
        raise MemoryHeadroomError(_refusal(shown(text))) from None
    if not _valid(value):
        raise MemoryHeadroomError(_refusal(shown(text)))
    return value


def _valid(value: object) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and 0 <= value < MAX_MEMORY_HEADROOM
    )


def _refusal(value_text: str) -> str:
    return (
        f"memory headroom {value_text} must be a fraction of device memory in "
        f"[0, {MAX_MEMORY_HEADROOM:g}): the share each device keeps free beyond the predicted "
        f"peak, e.g. {DEFAULT_MEMORY_HEADROOM:g} for {DEFAULT_MEMORY_HEADROOM:.0%} (the default)"
    )


def plan_memory_headroom(plan: object, given: float | None = None) -> float:
    """The headroom to check ``plan`` with: ``given`` if not None, else the one the plan records
    (``memory_headroom``; a plan without one, written before it existed, has the default)."""
    if given is not None:
        return check_memory_headroom(given)
    recorded = getattr(plan, "memory_headroom", None)
    return DEFAULT_MEMORY_HEADROOM if recorded is None else check_memory_headroom(recorded)


def usable_capacity_bytes(capacity_bytes: float, headroom: float) -> float:
    """The largest predicted peak (allocator-level, as `Estimate.peak_memory_bytes`) a device of
    ``capacity_bytes`` holds with ``headroom`` left free at the upper end of the peak's range:
    ``capacity x (1 - headroom) / memory_upper_factor()``."""
    return capacity_bytes * (1.0 - check_memory_headroom(headroom)) / memory_upper_factor()
