"""The planner behind `autoplan.search`: outer enumeration, then CP-SAT for the stage cuts."""

from __future__ import annotations

from autoplan.planner.partition import ModeCosts, Partition, PartitionProblem

__all__ = ["ModeCosts", "Partition", "PartitionProblem"]
