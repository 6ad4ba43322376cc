"""The planner behind `autoplan.search`: outer enumeration of degrees and batching, CP-SAT for stage cuts."""

from __future__ import annotations

from autoplan.planner.partition import ModeCosts, Partition, PartitionProblem

__all__ = ["ModeCosts", "Partition", "PartitionProblem"]
