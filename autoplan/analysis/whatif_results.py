"""The records of a what-if (`autoplan.analysis.whatif.whatif`): per cluster type and device
count the best plan and what it achieves (`WhatIfRow`, with its `TrainingCost`), all rows
(`WhatIfResult`), and the progress reported while the searches run (`WhatIfProgress`).

Guarantees: frozen values; ``to_data`` gives plain JSON-ready dicts (the CLI's ``--json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.contract.plan import Plan

__all__ = ["TrainingCost", "WhatIfProgress", "WhatIfResult", "WhatIfRow"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingCost:
    """Time and money to train on ``tokens`` at a row's throughput.

    ``seconds = tokens / tokens_per_s``: the step-time form of Narayanan et al. 2021, eq. 4
    (training time ~ 8 T P / (n X)), without its FLOP-count approximation.
    """

    tokens: float
    days: float
    device_hours: float
    cost: float | None  # device_hours x price per device-hour; None without a price
    price_per_device_hour: float | None = None  # the cluster type's price the cost is at

    @property
    def cost_per_million_tokens(self) -> float | None:
        """The cost of training on a million tokens at this row's throughput."""
        return None if self.cost is None else self.cost / self.tokens * 1e6


@dataclass(frozen=True, kw_only=True, slots=True)
class WhatIfRow:
    """One cluster type at one device count: the best plan and what it achieves, or why not."""

    cluster: str  # the cluster type's label
    num_devices: int
    num_nodes: int
    devices_per_node: int
    memory_capacity_bytes: float
    plan: Plan | None  # None: no plan fits (see ``reason``)
    reason: str | None  # why no plan fits, shortened
    step_time_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    peak_memory_bytes: float | None
    # the 80% range of the step (`cost_model.uncertainty`), and of the throughput it gives
    step_time_range_s: tuple[float, float] | None
    scaling_efficiency: float | None  # per-device throughput / that of the baseline size
    scaling_baseline_devices: int | None  # the smallest size of this type with a plan
    training: TrainingCost | None
    search_time_s: float
    # How much faster than this plan an unfinished solver call might still be, as a fraction of
    # its step time (`SearchStats.optimality_gap`); 0 when the plan is proven best in the space.
    optimality_gap: float = 0.0
    # False: the what-if's total budget ran out before this size's search started (``reason``
    # says so); not a verdict on the size
    searched: bool = True

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def tokens_per_s_range(self) -> tuple[float, float] | None:
        """The throughput at the ends of the step's 80% range (slowest first)."""
        if self.step_time_range_s is None or self.tokens_per_s is None:
            return None
        assert self.step_time_s is not None
        low, high = self.step_time_range_s
        per_step = self.tokens_per_s * self.step_time_s
        return (per_step / high, per_step / low) if low > 0 else None

    def to_data(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "num_devices": self.num_devices,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "fits": self.fits,
            "reason": self.reason,
            "step_time_s": self.step_time_s,
            "step_time_range_s": self.step_time_range_s,
            "tokens_per_s_range": self.tokens_per_s_range,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "scaling_efficiency": self.scaling_efficiency,
            "scaling_baseline_devices": self.scaling_baseline_devices,
            "training": None
            if self.training is None
            else {
                "tokens": self.training.tokens,
                "days": self.training.days,
                "device_hours": self.training.device_hours,
                "cost": self.training.cost,
                "price_per_device_hour": self.training.price_per_device_hour,
                "cost_per_million_tokens": self.training.cost_per_million_tokens,
            },
            "search_time_s": self.search_time_s,
            "optimality_gap": self.optimality_gap,
            "searched": self.searched,
            "plan": None if self.plan is None else self.plan.to_data(),
        }


# A scaling efficiency above 100% is shown only against a baseline plan proven within this
# fraction of the best in its space (`WhatIfResult.shown_efficiency`).
PROVEN_FOR_SUPERLINEAR = 0.01


@dataclass(frozen=True, kw_only=True, slots=True)
class WhatIfResult:
    """Every (cluster type, device count) row of one what-if."""

    model: str
    global_batch: int
    tokens: float | None
    price_per_device_hour: float | None  # one price for every type, as given (None: not)
    clusters: tuple[str, ...]  # cluster-type labels, in the order given
    cluster_overrides: tuple[tuple[str, str], ...]  # applied to every type
    constraints: tuple[tuple[str, str], ...]  # search constraints, as text
    rows: tuple[WhatIfRow, ...]
    total_time_s: float
    total_budget_s: float | None = None  # the cap the searches ran under (None: none)
    # each cluster type's price per device-hour (given per type, for all, or in its file)
    prices: tuple[tuple[str, float], ...] = ()

    @property
    def priced(self) -> bool:
        """Whether any cluster type has a price (the cost columns are shown)."""
        return bool(self.prices)

    def baseline_of(self, row: WhatIfRow) -> WhatIfRow | None:
        """The row ``row``'s scaling efficiency is measured against (None: none)."""
        return next(
            (
                other
                for other in self.rows
                if other.cluster == row.cluster
                and other.num_devices == row.scaling_baseline_devices
            ),
            None,
        )

    def shown_efficiency(self, row: WhatIfRow) -> float | None:
        """The row's scaling efficiency as the table and the plot show it: None (not shown)
        when it is above 100% and the baseline's plan is not proven within
        `PROVEN_FOR_SUPERLINEAR` of the best in its space: the baseline's unproven gap, not
        the hardware, may be what the extra devices "gain"."""
        efficiency = row.scaling_efficiency
        if efficiency is None or efficiency <= 1.0:
            return efficiency
        baseline = self.baseline_of(row)
        if baseline is None or baseline.optimality_gap > PROVEN_FOR_SUPERLINEAR:
            return None
        return efficiency

    @property
    def not_run(self) -> int:
        """Rows whose search never started: the total budget ran out first."""
        return sum(1 for row in self.rows if not row.searched)

    def rows_of(self, cluster: str) -> tuple[WhatIfRow, ...]:
        """The rows of one cluster type, by ascending device count."""
        if cluster not in self.clusters:
            raise KeyError(f"no cluster type {cluster!r}; have {', '.join(self.clusters)}")
        return tuple(row for row in self.rows if row.cluster == cluster)

    @property
    def feasible_rows(self) -> tuple[WhatIfRow, ...]:
        return tuple(row for row in self.rows if row.fits)

    def to_data(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "global_batch": self.global_batch,
            "tokens": self.tokens,
            "price_per_device_hour": self.price_per_device_hour,
            "prices": dict(self.prices),
            "clusters": list(self.clusters),
            "cluster_overrides": dict(self.cluster_overrides),
            "constraints": dict(self.constraints),
            "rows": [row.to_data() for row in self.rows],
            "total_time_s": self.total_time_s,
            "total_budget_s": self.total_budget_s,
            "not_run": self.not_run,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class WhatIfProgress:
    """Reported before each search (``completed`` searches done so far) and once at the end."""

    completed: int
    total: int
    cluster: str  # the type searched next (the last one at the end)
    num_devices: int
