"""Where a plan leaves what the cost model was checked on: its unvalidated features, and a
predicted MFU above every published run of its size on its GPU with the features it comes from.

Expects a `Plan` with its `Estimate` (whose ``unvalidated`` lists the plan's features with fewer
than `cost_model.uncertainty.MIN_ROWS` published rows) and the `ModelProfile` it was made for.
Guarantees: `coverage` only reads the shipped residuals and re-prices variants of the plan
(the same plan with one unvalidated feature replaced by its fastest validated alternative);
a variant the plan's rules refuse is left out, never guessed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoplan.contract.errors import InputError
from autoplan.contract.plan import RECOMPUTE_MODES, Plan
from cost_model.estimate import Estimate
from cost_model.estimate import estimate as _estimate
from cost_model.hardware import Cluster
from cost_model.precision import precision_problem
from cost_model.uncertainty import MIN_ROWS, best_published_mfu, shipped
from cost_model.workload import ModelProfile

__all__ = ["Coverage", "FeatureGain", "coverage"]

# a step difference below this is no gain: the search's own tie band is 2%, noise well below it
GAIN_NOISE = 0.005


@dataclass(frozen=True, kw_only=True, slots=True)
class FeatureGain:
    """An unvalidated feature against its fastest validated alternative: the plan's step
    relative to that variant's (-0.05: the feature makes the step 5% shorter)."""

    feature: str
    alternative: str
    relative: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Coverage:
    """A plan's unvalidated features and, when its predicted MFU beats every published run of
    its size on its GPU, that best run and the gains of its unvalidated features."""

    unvalidated: tuple[str, ...]
    mfu: float
    best_published_mfu: float | None = None
    best_published_run: str = ""
    gains: tuple[FeatureGain, ...] = ()

    @property
    def above_published(self) -> bool:
        return self.best_published_mfu is not None and self.mfu > self.best_published_mfu

    def lines(self) -> list[str]:
        """What `plan` and `explain` print (none for a plan inside the validated ground)."""
        out = []
        if self.unvalidated:
            out.append("validated by fewer than 5 published rows: " + "; ".join(self.unvalidated))
        if self.above_published:
            assert self.best_published_mfu is not None
            head = (
                f"predicted MFU {self.mfu:.1%} is above the best published run of this size on "
                f"this GPU ({self.best_published_mfu:.1%}, {self.best_published_run})"
            )
            # a feature "gains" when its validated alternative is slower by more than noise
            gaining = [g for g in self.gains if g.relative <= -GAIN_NOISE]
            if gaining:
                head += "; the gain comes from " + ", ".join(
                    f"{g.feature} ({g.relative:+.1%} step against {g.alternative})" for g in gaining
                )
            elif self.unvalidated:
                head += (
                    "; none of its unvalidated features accounts for it (each within "
                    f"{GAIN_NOISE:.1%} of its validated alternative)"
                )
            out.append(head)
        return out


def _validated(feature: str) -> bool:
    return shipped()[0].rows(feature) >= MIN_ROWS


def _variants(plan: Plan, feature: str) -> list[tuple[str, Plan]]:
    """The plan with ``feature`` replaced by each validated alternative (name, variant)."""
    out: list[tuple[str, Plan]] = []
    pipelined = plan.pp_degree > 1
    if feature.endswith(" recompute") and not feature.startswith("recompute "):
        # a schedule with a recompute mode ("1f1b without recompute", "1f1b with full
        # recompute"): either half replaced
        without = feature.endswith(" without recompute")
        schedule = feature.rsplit(" without" if without else " with ", 1)[0]
        mode = "none" if without else feature.rsplit(" ", 2)[-2]
        return _variants(plan, f"schedule {schedule}") + _variants(plan, f"recompute {mode}")
    if feature.startswith("schedule ") and pipelined:
        for schedule, virtual in (("interleaved-1f1b", plan.virtual_stages), ("1f1b", 1)):
            if schedule != plan.schedule and _validated(f"schedule {schedule}"):
                out.append((schedule, _with_schedule(plan, schedule, virtual)))
    elif feature.startswith("recompute "):
        mode = feature.removeprefix("recompute ")
        for other in RECOMPUTE_MODES:
            if other == mode:
                continue
            stages = tuple(
                dataclasses.replace(s, recompute=other) if s.recompute == mode else s
                for s in plan.stages
            )
            out.append((f"recompute {other}", dataclasses.replace(plan, stages=stages)))
    elif feature.startswith("ZeRO-") or feature == "no ZeRO":
        for zero in (0, 1, 2, 3):
            name = f"ZeRO-{zero}" if zero else "no ZeRO"
            if zero != plan.zero_stage and _validated(name):
                # (fp8 all-gather gathers sharded weights: none without ZeRO)
                gather = plan.fp8_all_gather and zero >= 1
                out.append(
                    (name, dataclasses.replace(plan, zero_stage=zero, fp8_all_gather=gather))
                )
    elif feature.startswith("dtype "):
        for dtype in ("bf16", "fp16"):
            # (a precision policy not every dtype goes with: fp16 needs an fp32 master)
            policy = (plan.master_dtype, plan.grad_reduce_dtype, plan.optimizer_state_dtype)
            if precision_problem(dtype, *policy) is not None:
                continue
            if dtype != plan.dtype and _validated(f"dtype {dtype}"):
                out.append((dtype, dataclasses.replace(plan, dtype=dtype, fp8_all_gather=False)))
    return out


def _with_schedule(plan: Plan, schedule: str, virtual: int) -> Plan:
    if virtual == plan.virtual_stages:
        return dataclasses.replace(plan, schedule=schedule)  # type: ignore[arg-type]
    # one stage per rank: each run of v consecutive chunks (in unit order) merged, with the
    # recompute of its first
    v = plan.virtual_stages
    groups = [plan.stages[k * v : (k + 1) * v] for k in range(plan.pp_degree)]
    stages = tuple(dataclasses.replace(g[0], last_unit=g[-1].last_unit) for g in groups)
    return dataclasses.replace(plan, schedule=schedule, virtual_stages=1, stages=stages)  # type: ignore[arg-type]


def coverage(
    plan: Plan, profile: ModelProfile, cluster: Cluster, result: Estimate | None = None
) -> Coverage:
    """The coverage of ``plan`` (module docstring); ``result`` its estimate if known."""
    result = result or _estimate(profile, cluster, plan)
    best = best_published_mfu(cluster.device.name, profile.num_params)
    base = Coverage(unvalidated=result.unvalidated, mfu=result.mfu)
    if best is None or result.mfu <= best.measured_mfu:
        return base
    gains = []
    for line in result.unvalidated:
        feature = line.rsplit(":", 1)[0]
        priced = []
        for name, variant in _variants(plan, feature):
            try:
                variant.validate(profile, cluster)
                other = _estimate(profile, cluster, variant)
            except (InputError, ValueError):
                continue
            priced.append((other.step_time_s, name))
        if priced:
            step, name = min(priced)
            gains.append(
                FeatureGain(
                    feature=feature, alternative=name, relative=result.step_time_s / step - 1.0
                )
            )
    return dataclasses.replace(
        base,
        best_published_mfu=best.measured_mfu,
        best_published_run=best.run_id,
        gains=tuple(gains),
    )
