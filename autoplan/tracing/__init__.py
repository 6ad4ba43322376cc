"""Trace and profile any Transformer on the meta device: `trace(model) -> ModelGraph`.

Private modules, in the order `trace` runs them: ``tracer`` (torch.fx / torch.export front
ends), ``measure`` (the traced graph, each distinct unit run once on meta), ``units`` (pipeline
units and TP structure), ``profiler`` (per-node FLOPs, bytes, saved activations on meta
tensors: it runs nodes through ``node_runner`` under ``meter``, which counts by ``op_flops``
and remembers kernels by ``call_keys``; its records are ``node_measures`` and
``tensor_specs``), ``unit_profiles`` (each unit's profile), ``experts`` (mixture-of-experts
layers as units of work), ``assemble`` (the `ModelGraph`),
``fingerprint``; ``api`` composes them.
"""

from autoplan.contract.graph import ModelGraph, MoELayerProfile, NodeProfile
from autoplan.tracing.api import trace

__all__ = ["MoELayerProfile", "ModelGraph", "NodeProfile", "trace"]
