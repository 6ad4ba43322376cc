"""Time of collectives and point-to-point sends on a group's real placement (alpha-beta model).

Expects message sizes in bytes per device and a `GroupPlacement` (how many nodes the group
spans, how many of its ranks share a node). Guarantees: times are >= 0, zero for a group of one,
and never grow when a link gets faster (bandwidth up or latency down).

Links: the Cluster gives each device's bandwidth per direction and the one-message latency of
the intra-node link (NVLink/NVSwitch) and of the inter-node link (one NIC per GPU, "rails");
the calibration scales bandwidths by the fraction NCCL reaches (bus bandwidth / line rate).

Collectives (Thakur et al. 2005, "Optimization of Collective Communication Operations in
MPICH", ring algorithms; Patarasuk & Yuan 2009 for the bandwidth-optimal ring all-reduce):

- a group inside one node of G ranks: ring reduce-scatter or all-gather moves (G-1)/G of the
  data through each device's link in G-1 steps; all-reduce = reduce-scatter + all-gather.
- all-reduce over n nodes x k ranks: hierarchical (NCCL's rings/trees over rails): an
  intra-node reduce-scatter among the k local ranks, an inter-node all-reduce of each 1/k shard
  among the n nodes on each rank's own NIC, and an intra-node all-gather. NCCL pipelines the
  phases chunk by chunk, so the bandwidth time is that of the slowest phase (NCCL's own tuning
  model takes the bus bandwidth of the slowest link: nccl src/graph/tuning.cc); the latencies
  add. Its latency across nodes follows NCCL's double binary tree, 2 log2(n) steps (Sanders et
  al. 2009; Jeaugey 2019, "Massively Scale Your Deep Learning Training with NCCL 2.4"), when that
  beats the ring's 2(n-1).
- reduce-scatter and all-gather over n nodes x k ranks: one flat ring of N = n k ranks, the only
  algorithm NCCL has for them on multi-GPU nodes (tuning.cc models nothing else; PAT, from NCCL
  2.23, serves one rank per node). Each of the k rings (one per rail) visits a node's ranks over
  NVLink and crosses to the next node on its own NIC, and every edge of a ring carries (N-1)/N
  of that ring's 1/k share, so a NIC moves (N-1)/N of S/k, against (n-1)/n of it in the
  hierarchical scheme (up to 2x more at two nodes); the N-1 steps are N-n intra-node and n-1
  inter-node ones, as in NCCL's latency model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from cost_model.hardware import Cluster
from cost_model.strategy import GroupPlacement

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkRate:
    """Achievable bandwidth per device per direction and one-message latency of a link class."""

    bandwidth_bytes_per_s: float
    latency_s: float


def link_rate(cluster: Cluster, *, cross_node: bool) -> LinkRate:
    """The calibrated intra-node or inter-node link of ``cluster``."""
    cal = cluster.calibration
    if cross_node:
        return LinkRate(
            bandwidth_bytes_per_s=cluster.inter_node.bandwidth_bytes_per_s
            * cal.inter_node_comm_efficiency,
            latency_s=cluster.inter_node.latency_s,
        )
    return LinkRate(
        bandwidth_bytes_per_s=cluster.intra_node.bandwidth_bytes_per_s
        * cal.intra_node_comm_efficiency,
        latency_s=cluster.intra_node.latency_s,
    )


def ring_half_collective_time_s(
    size_bytes: float, placement: GroupPlacement, cluster: Cluster, efficiency: float
) -> float:
    """Ring reduce-scatter or all-gather of ``size_bytes`` (the full, unsharded buffer), at
    ``efficiency`` of the ring's bandwidth (the library's own shortfall, see Calibration)."""
    intra, inter = link_rate(cluster, cross_node=False), link_rate(cluster, cross_node=True)
    return _ring_half_s(size_bytes, placement, intra, inter, efficiency)


def _ring_half_s(
    size_bytes: float,
    placement: GroupPlacement,
    intra: LinkRate,
    inter: LinkRate,
    efficiency: float,
) -> float:
    if placement.size <= 1 or size_bytes <= 0:
        return 0.0
    k, n = placement.ranks_per_node, placement.num_nodes
    size = k * n
    # Flat ring of all N ranks (module docstring): every device sends (N-1)/N of the buffer over
    # NVLink, every rail carries (N-1)/N of a 1/k share across nodes; N-n steps inside nodes,
    # n-1 across. Inside one node this is the plain ring: (k-1)/k in k-1 steps.
    fraction = (size - 1) / size
    intra_bw_s = fraction * size_bytes / intra.bandwidth_bytes_per_s if k > 1 else 0.0
    inter_bw_s = fraction * (size_bytes / k) / inter.bandwidth_bytes_per_s if n > 1 else 0.0
    latency_s = (size - n) * intra.latency_s + (n - 1) * inter.latency_s
    return max(intra_bw_s, inter_bw_s) / efficiency + latency_s


def all_gather_time_s(size_bytes: float, placement: GroupPlacement, cluster: Cluster) -> float:
    """All-gather producing ``size_bytes`` on every rank (each contributes 1/size of it)."""
    efficiency = cluster.calibration.all_gather_efficiency
    return ring_half_collective_time_s(size_bytes, placement, cluster, efficiency)


def reduce_scatter_time_s(size_bytes: float, placement: GroupPlacement, cluster: Cluster) -> float:
    """Reduce-scatter of a ``size_bytes`` buffer (each rank keeps 1/size of the sum)."""
    efficiency = cluster.calibration.reduce_scatter_efficiency
    return ring_half_collective_time_s(size_bytes, placement, cluster, efficiency)


def all_reduce_time_s(size_bytes: float, placement: GroupPlacement, cluster: Cluster) -> float:
    """All-reduce of ``size_bytes`` on every rank: reduce-scatter + all-gather, hierarchical
    across nodes (see the module docstring)."""
    intra, inter = link_rate(cluster, cross_node=False), link_rate(cluster, cross_node=True)
    return _all_reduce_s(size_bytes, placement, intra, inter)


def _all_reduce_s(
    size_bytes: float, placement: GroupPlacement, intra: LinkRate, inter: LinkRate
) -> float:
    if placement.size <= 1 or size_bytes <= 0:
        return 0.0
    k, n = placement.ranks_per_node, placement.num_nodes
    intra_bw_s = 2 * (k - 1) / k * size_bytes / intra.bandwidth_bytes_per_s
    intra_lat_s = 2 * (k - 1) * intra.latency_s
    inter_bw_s = 2 * (n - 1) / n * (size_bytes / k) / inter.bandwidth_bytes_per_s
    inter_steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n))) if n > 1 else 0
    inter_lat_s = inter_steps * inter.latency_s
    return max(intra_bw_s, inter_bw_s) + intra_lat_s + inter_lat_s


def p2p_time_s(size_bytes: float, cluster: Cluster, *, cross_node: bool) -> float:
    """One send of ``size_bytes`` from a device to a peer (the receiver waits as long)."""
    if size_bytes <= 0:
        return 0.0
    link = link_rate(cluster, cross_node=cross_node)
    return link.latency_s + size_bytes / link.bandwidth_bytes_per_s


def all_to_all_time_s(size_bytes: float, placement: GroupPlacement, cluster: Cluster) -> float:
    """All-to-all in which each rank holds ``size_bytes`` and sends ``size_bytes / size`` to
    every member (itself included): ``(size - 1) / size`` of it leaves the rank, to the
    ``k - 1`` members on its node over NVLink and to the ``size - k`` elsewhere over its own
    NIC, all at once (NCCL's all-to-all is one group of sends and receives to every peer, so
    the two links work in parallel and one latency of the slowest link is paid)."""
    if placement.size <= 1 or size_bytes <= 0:
        return 0.0
    intra, inter = link_rate(cluster, cross_node=False), link_rate(cluster, cross_node=True)
    size, k = placement.size, placement.ranks_per_node
    share = size_bytes / size
    intra_s = (k - 1) * share / intra.bandwidth_bytes_per_s
    inter_s = (size - k) * share / inter.bandwidth_bytes_per_s
    latency = inter.latency_s if placement.crosses_nodes else intra.latency_s
    return max(intra_s, inter_s) + latency


def collective_time_s(
    kind: CollectiveKind,
    size_bytes: float,
    placements: Iterable[GroupPlacement],
    cluster: Cluster,
) -> float:
    """Time of a collective that every group of an axis runs at once: the slowest placement."""
    cal = cluster.calibration
    intra, inter = link_rate(cluster, cross_node=False), link_rate(cluster, cross_node=True)
    times = []
    for p in placements:
        if kind == "all_reduce":
            times.append(_all_reduce_s(size_bytes, p, intra, inter))
        else:
            efficiency = (
                cal.all_gather_efficiency if kind == "all_gather" else cal.reduce_scatter_efficiency
            )
            times.append(_ring_half_s(size_bytes, p, intra, inter, efficiency))
    return max(times, default=0.0)
