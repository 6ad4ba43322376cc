"""Trace and profile any Transformer on the meta device: `trace(model) -> ModelGraph`.

Private modules: ``tracer`` (torch.fx / torch.export front ends), ``profiler`` (per-node FLOPs,
bytes, saved activations on meta tensors), ``units`` (pipeline units and TP structure),
``fingerprint``, ``api`` (putting them together).
"""

from autoplan.graph import ModelGraph, NodeProfile
from autoplan.tracing.api import trace

__all__ = ["ModelGraph", "NodeProfile", "trace"]
