"""Plan search: outer enumeration of degrees and batching, CP-SAT for stage cuts."""

from __future__ import annotations

from autoplan.search.partition import ModeCosts, Partition, PartitionProblem

__all__ = ["ModeCosts", "Partition", "PartitionProblem"]
