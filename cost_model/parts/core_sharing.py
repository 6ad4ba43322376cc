"""Core sharing: CPU worker processes that share a node's cores (the test rig, not a GPU
cluster) run slower when more of them are busy at once. Processor sharing stretches what runs
inside the pipeline and what runs after it (the rank tail, the loop's fixed overhead). The
identity on clusters whose devices do not share cores (``Cluster.shared_cores_per_node`` None).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from cost_model.hardware import Cluster
from cost_model.strategy import Strategy
from cost_model.unit_cost import UnitCost

# UnitCost times that run inside the pipeline schedule, and after its flush (the rank tail).
_PIPELINE_TIMES = (
    "forward_compute_s",
    "backward_compute_s",
    "recompute_s",
    "tp_forward_s",
    "tp_backward_s",
    "zero3_forward_s",
    "zero3_backward_s",
    "zero3_exposed_s",
    "forward_s",
    "backward_s",
    "weight_s",
)
_TAIL_TIMES = ("dp_sync_s", "post_sync_s", "optimizer_s")


class SharingFactors(NamedTuple):
    """How much longer work takes when workers share cores (1: they do not)."""

    pipeline: float  # inside the pipeline schedule (and its boundaries)
    tail: float  # after it: every worker at once


NOT_SHARED = SharingFactors(1.0, 1.0)


def oversubscription_factors(strategy: Strategy, cluster: Cluster) -> SharingFactors:
    """How much longer the pipeline and the rank tail take when CPU workers share cores.

    Processor sharing: ``a`` runnable workers on ``C`` cores each run at ``min(1, C / a)`` of
    their own speed, and a worker blocked on a receive uses no core. The pipeline advances in
    ``n = m v + p - 1`` waves of one chunk per micro-batch, forward and backward; wave ``d``
    keeps ``a_d = min(d + 1, p, n - d, m v)`` pipeline ranks busy, each replicated over the
    ``dp x tp`` workers of its stage, so it takes ``max(1, a_d dp tp / C)`` times as long.
    The pipeline factor is the mean over the waves (exact for uniform stages); the tail runs on
    every worker at once: ``max(1, p dp tp / C)``. Without pipelining both reduce to the even
    share ``P / C``. (1, 1) when devices do not share cores (GPUs).
    """
    if cluster.shared_cores_per_node is None:
        return NOT_SHARED
    p, v, m = strategy.pp_degree, strategy.virtual_stages, strategy.num_micro_batches
    replicas = strategy.dp_degree * strategy.cp_degree * strategy.tp_degree
    workers = p * replicas
    nodes = max(1, -(-workers // cluster.devices_per_node))  # nodes the job occupies
    cores = float(cluster.shared_cores_per_node * nodes)
    waves = m * v + p - 1
    pipe = sum(max(1.0, min(d + 1, p, waves - d, m * v) * replicas / cores) for d in range(waves))
    return SharingFactors(pipe / waves, max(1.0, workers / cores))


def sharing_key(strategy: Strategy) -> tuple[int, int, int, int]:
    """The strategy fields `oversubscription_factors` reads (for a table of them)."""
    return (
        strategy.pp_degree,
        strategy.virtual_stages,
        strategy.num_micro_batches,
        strategy.dp_degree * strategy.cp_degree * strategy.tp_degree,
    )


def loop_overhead_s(cluster: Cluster, factors: SharingFactors) -> float:
    """The training loop's fixed time per step (``calibration.step_overhead_s``), which every
    worker spends at once after its tail (so workers sharing cores stretch it too)."""
    return cluster.calibration.step_overhead_s * factors.tail


def stretched(costs: Sequence[UnitCost], factors: SharingFactors) -> tuple[UnitCost, ...]:
    """``costs`` with their pipeline and tail times stretched by ``factors`` (units that share
    one cost object still do)."""
    if factors == NOT_SHARED:
        return tuple(costs)
    pipe_factor, tail_factor = factors
    done: dict[int, UnitCost] = {}
    out = []
    for c in costs:
        if id(c) not in done:
            changes = {name: getattr(c, name) * pipe_factor for name in _PIPELINE_TIMES}
            changes.update({name: getattr(c, name) * tail_factor for name in _TAIL_TIMES})
            done[id(c)] = dataclasses.replace(c, **changes)
        out.append(done[id(c)])
    return tuple(out)


def stretched_boundary_s(seconds: float, factors: SharingFactors) -> float:
    """A pipeline boundary's time (link or host) stretched like the pipeline."""
    return seconds * factors.pipeline
