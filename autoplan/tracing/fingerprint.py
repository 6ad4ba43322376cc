"""A stable fingerprint of a traced model's structure, so a plan can tell which model it fits.

Expects, per unit, its kind and the shapes of the parameters it holds. Guarantees: the same
structure gives the same 16-hex-digit string in every process and on every machine (SHA-256 of a
canonical JSON text, no Python ``hash``); a different unit count, unit kind, parameter shape or
sequence length gives a different one. Batch size, dtype, device and module names do not enter.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

__all__ = ["fingerprint"]

FINGERPRINT_VERSION = 1


def fingerprint(
    units: Sequence[tuple[str, Iterable[tuple[int, ...]]]],
    *,
    seq_len: int,
) -> str:
    """Fingerprint of ``units`` (each: kind, shapes of its parameters) at ``seq_len``."""
    canonical = {
        "version": FINGERPRINT_VERSION,
        "seq_len": seq_len,
        "units": [[kind, sorted(list(shape) for shape in shapes)] for kind, shapes in units],
    }
    text = json.dumps(canonical, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
