"""How far off a prediction may be: 80% intervals of the step time and the peak memory, sized by
the measured residuals of the validation benches.

Expects ``cost_model/validation/residuals.json``, written by ``bench/validate_published.py
--write-residuals`` (step times: each scored published run's leave-one-source-out residual,
with the features of its plan; peak memory: the published peaks) and ``bench/memory.py
--write-residuals`` (peak tensor memory measured on CPU processes). A residual is
``log(measured / predicted)``.

Guarantees: `step_interval` and `memory_interval` are pure functions of a plan's features and the
shipped residuals, the same on every rank and every run; an interval always contains the
prediction (factors ``low <= 1 <= high``); a feature with fewer than `MIN_ROWS` validating rows
widens the interval by the spread between features' biases (below), so the less a plan's
features were checked, the wider its range. The derivation is in docs/cost-model.md
("How far off a figure may be").
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cost_model.errors import InputError
from cost_model.frameworks import framework_profile
from cost_model.messages import shown
from cost_model.strategy import PlanLike, Strategy

if TYPE_CHECKING:
    from cost_model.results import Estimate


class RangeLevelError(InputError):
    """A requested range level is not a fraction in (0, 1) (the message names the value)."""


RESIDUALS_PATH = Path(__file__).resolve().parent / "validation" / "residuals.json"
COVERAGE = 0.8  # the interval's nominal coverage: 80% of measured values inside
# A feature is "validated" when at least this many scored rows use it: below it a group's own
# 10% and 90% quantiles are not estimable (with 4 rows the sample's extremes already lie inside
# the 10-90% band most of the time), so the feature counts as unseen.
MIN_ROWS = 5

# A stack with no published runs of its own is checked through the stack whose engine it shares:
# autoplan's runtime is torch's own FSDP2, DTensor tensor parallelism, torch.distributed.
# pipelining and SDPA attention, as torchtitan's is (cost_model/frameworks/, both profiles).
VALIDATED_THROUGH: dict[str, str] = {"autoplan": "torchtitan"}


def plan_features(plan: PlanLike, framework: str) -> tuple[str, ...]:
    """The features of ``plan`` priced for ``framework`` (`strategy_features`; a stage that
    compiles makes the plan a compiled one)."""
    strategy = Strategy.of(plan)
    if any(getattr(stage, "compile", None) for stage in plan.stages):
        strategy = dataclasses.replace(strategy, compile=True)
    if any(getattr(stage, "activation_offload", 0) for stage in plan.stages):
        strategy = dataclasses.replace(strategy, activation_offload=True)
    return strategy_features(strategy, [s.recompute for s in plan.stages], framework)


def strategy_features(strategy: Strategy, modes: Iterable[str], framework: str) -> tuple[str, ...]:
    """The features by which the residuals are grouped, of a plan with ``strategy`` whose
    stages use the recompute ``modes``, priced for ``framework``: its pipeline schedule, each
    recompute mode it uses (and each with the schedule: a pair the cost model prices jointly
    through the schedule's memory), its ZeRO level (and HSDP), torch.compile, tensor, sequence,
    context and expert parallelism (and TP communication overlap, expert tensor parallelism),
    optimizer and activation offload, its precision and its training stack."""
    schedule = "no pipeline" if strategy.pp_degree == 1 else strategy.schedule
    features = [f"schedule {schedule}"]
    for mode in sorted(set(modes)):
        features.append(f"recompute {mode}")
        recompute = "without recompute" if mode == "none" else f"with {mode} recompute"
        features.append(f"{schedule} {recompute}")
    features.append(f"ZeRO-{strategy.zero_stage}" if strategy.zero_stage else "no ZeRO")
    if strategy.hsdp:
        # four scored published runs shard within groups (fms-fsdp's HSDP rows), fewer than
        # MIN_ROWS: a plan with it is unvalidated there, and its range says so
        features.append("HSDP")
    if strategy.compile:
        # the compiled published runs (torchtitan's and fms-fsdp's, scored since issue 43)
        # size a compiled plan's range
        features.append("torch.compile")
    if strategy.tp_comm_overlap:
        # the published runs that overlap their TP communication (scored since issue 43; the
        # achieved fraction is assumed, `cost_model.tp_overlap`, and these rows check it)
        features.append("TP communication overlap")
    if strategy.tp_degree > 1:
        features.append("tensor parallel")
    if strategy.sequence_parallel:
        features.append("sequence parallel")
    if strategy.cp_degree > 1:
        features.append("context parallel")
    if strategy.ep_degree > 1:
        features.append("expert parallel")
    if strategy.etp_degree > 1:
        # no published MoE run states its etp (`validate_published.row_etp`), and every
        # scored one keeps its experts whole: a plan that splits them is unvalidated there
        features.append("expert tensor parallel")
    if strategy.optimizer_offload > 0:
        # no published run offloads its optimizer (the one offloading row, Megatron-Bridge's
        # GB200 70B, offloads activations and is unscored): a plan with it is unvalidated
        # there, and its range says so
        features.append("optimizer offload")
    if strategy.activation_offload:
        # the one published run that offloads activations (Megatron-Bridge's GB200 70B) is
        # unscored: a plan with it is unvalidated there, and its range says so
        features.append("activation offload")
    features.append(f"dtype {strategy.dtype}")
    name = framework_profile(framework).name.partition(":")[0]
    features.append(f"stack {VALIDATED_THROUGH.get(name, name)}")
    return tuple(features)


# What a search minimises: the predicted step ("expected") or the upper end of its 80% range
# ("pessimistic": the plan's step is below it in 9 of 10 cases).
OBJECTIVES: tuple[str, ...] = ("pessimistic", "expected")
DEFAULT_OBJECTIVE = "pessimistic"
# Two plans whose objectives differ by less than this tie: repeated runs of one configuration
# spread by up to 2% (llm-foundry repeats each H100 configuration three times,
# scripts/train/benchmarking/h100.md at beb8dee; bench/validate_published.py SOURCE_NOISE).
TIE_FRACTION = 0.02


def objective_factor(features: Sequence[str], objective: str) -> float:
    """What a plan with ``features`` multiplies its predicted step by under ``objective``."""
    return step_interval(features).high if objective == "pessimistic" else 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Residual:
    """One measured run: ``value = log(measured / predicted)`` (step time or peak memory)."""

    run_id: str
    source: str  # the publication (or "this machine"): the unit of leave-one-source-out
    features: tuple[str, ...]
    value: float
    # for the MFU check (`best_published_mfu`): the run's device, model parameters, measured MFU
    device: str = ""
    params: float = 0.0
    measured_mfu: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Interval:
    """Multiplicative factors of an 80% interval (``low <= 1 <= high``) and the plan's features
    that fewer than `MIN_ROWS` residuals validate, with their row counts."""

    low: float
    high: float
    unvalidated: tuple[tuple[str, int], ...] = ()


def _quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between order statistics)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])


class ResidualModel:
    """Intervals from a set of residuals grouped by feature.

    For a plan with features F: each validated feature f (n_f >= `MIN_ROWS` rows) estimates the
    plan's error distribution by its rows' 10% and 90% quantiles; the interval's ends are the
    means of these estimates (with no validated feature, the quantiles of all rows). Each
    unvalidated feature then widens both ends in quadrature by z80 x tau: its bias is unknown,
    modelled as a draw from the biases seen where the model met something new, tau being the
    larger of the spread (standard deviation) of the validated features' median residuals and
    that of the sources' median held-out residuals. The interval always contains 1 (the
    prediction). docs/cost-model.md compares this with the alternatives (the union of the
    groups' ranges covers 89% of held-out rows at twice the width).
    """

    def __init__(self, residuals: Iterable[Residual]) -> None:
        self.residuals = tuple(residuals)
        self._groups: dict[str, list[float]] = {}
        for r in self.residuals:
            for f in r.features:
                self._groups.setdefault(f, []).append(r.value)
        self._values = [r.value for r in self.residuals]
        medians = [statistics.median(v) for v in self._groups.values() if len(v) >= MIN_ROWS]
        sources: dict[str, list[float]] = {}
        for r in self.residuals:
            sources.setdefault(r.source, []).append(r.value)
        source_medians = [statistics.median(v) for v in sources.values()]
        self.tau = max(
            statistics.pstdev(medians) if len(medians) >= 2 else 0.0,
            statistics.pstdev(source_medians) if len(source_medians) >= 2 else 0.0,
        )
        self._validated = {f for f, v in self._groups.items() if len(v) >= MIN_ROWS}

    def rows(self, feature: str) -> int:
        """How many residuals use ``feature``."""
        return len(self._groups.get(feature, ()))

    def without_source(self, source: str) -> ResidualModel:
        """The model of every residual but ``source``'s (to size that source's own intervals)."""
        return ResidualModel(r for r in self.residuals if r.source != source)

    @cache  # noqa: B019 (the models live as long as the process: `shipped`)
    def _ends(self, feature: str | None, level: float) -> tuple[float, float]:
        """The (1 - level) / 2 and (1 + level) / 2 quantiles of a feature's residuals (None:
        of all of them)."""
        values = self._values if feature is None else self._groups[feature]
        if not values:
            return (0.0, 0.0)
        return (_quantile(values, (1 - level) / 2), _quantile(values, (1 + level) / 2))

    def interval(self, features: Iterable[str], level: float = COVERAGE) -> Interval:
        """The ``level`` interval (default 80%) of a plan with ``features`` (see the class)."""
        features = tuple(features)
        known = [self._ends(f, level) for f in features if f in self._validated]
        low, high = (
            (statistics.fmean(q[0] for q in known), statistics.fmean(q[1] for q in known))
            if known
            else self._ends(None, level)
        )
        unvalidated = tuple((f, self.rows(f)) for f in features if f not in self._validated)
        # z of the normal's (1 + level) / 2 quantile: a centred interval's half-width in sigmas
        z = statistics.NormalDist().inv_cdf((1 + level) / 2)
        widen = z * self.tau * math.sqrt(len(unvalidated))
        low = -math.hypot(max(0.0, -low), widen)
        high = math.hypot(max(0.0, high), widen)
        return Interval(low=math.exp(low), high=math.exp(high), unvalidated=unvalidated)

    def coverage(self) -> tuple[int, int, dict[str, tuple[int, int]]]:
        """Leave-one-source-out calibration: each residual against the interval sized without
        its source. Returns (inside, total, per source (inside, total))."""
        per: dict[str, tuple[int, int]] = {}
        for source in sorted({r.source for r in self.residuals}):
            others = self.without_source(source)
            mine = [r for r in self.residuals if r.source == source]
            inside = 0
            for r in mine:
                iv = others.interval(r.features)
                inside += math.log(iv.low) <= r.value <= math.log(iv.high)
            per[source] = (inside, len(mine))
        return sum(i for i, _ in per.values()), sum(n for _, n in per.values()), per


def _residual(data: dict[str, Any]) -> Residual:
    return Residual(
        run_id=str(data["id"]),
        source=str(data["source"]),
        features=tuple(data["features"]),
        value=float(data["residual"]),
        device=str(data.get("device", "")),
        params=float(data.get("params", 0.0)),
        measured_mfu=float(data.get("measured_mfu", 0.0)),
    )


@cache
def shipped() -> tuple[ResidualModel, ResidualModel]:
    """The step-time and peak-memory models of the shipped residuals."""
    data = json.loads(RESIDUALS_PATH.read_text())
    return (
        ResidualModel(_residual(r) for r in data["step"]),
        ResidualModel(_residual(r) for r in data["memory"]),
    )


def step_interval(features: Sequence[str], level: float = COVERAGE) -> Interval:
    """The ``level`` interval of a step time predicted for a plan with ``features``."""
    return _interval(0, tuple(features), level)


def memory_interval(features: Sequence[str], level: float = COVERAGE) -> Interval:
    """The ``level`` interval of a peak memory predicted for a plan with ``features``."""
    return _interval(1, tuple(features), level)


@cache
def _interval(kind: int, features: tuple[str, ...], level: float) -> Interval:
    return shipped()[kind].interval(features, level)


def check_range_level(level: object) -> float:
    """``level`` as the coverage of a range (0 < level < 1), or `RangeLevelError`."""
    if (
        isinstance(level, bool)
        or not isinstance(level, (int, float))
        or not math.isfinite(level)
        or not 0 < level < 1
    ):
        raise RangeLevelError(
            f"range level {shown(level)} must be a fraction between 0 and 1 (exclusive), the "
            "share of outcomes a range holds: e.g. 0.8 for an 80% range (the default)"
        )
    return float(level)


def memory_upper_factor() -> float:
    """The factor from a predicted peak to the upper end of its 80% range (>= 1), the same for
    every plan (`with_ranges`)."""
    return memory_interval(()).high


def with_ranges(est: Estimate, features: Sequence[str], level: float = COVERAGE) -> Estimate:
    """``est`` with its step-time and peak-memory ``level`` ranges and its unvalidated
    features (always those of the 80% range: a feature is unvalidated by its row count)."""
    level = check_range_level(level)
    step = step_interval(features, level)
    # One memory factor for every plan, on the whole peak: the one the memory check applies
    # (`cost_model.headroom.usable_capacity_bytes`), so a plan fits exactly when the upper end
    # of the range it shows stays within the capacity less its headroom. (Its residuals are
    # nearly all of one runtime on CPU: per-feature groups would only split that one source.)
    memory = memory_interval((), level)
    return dataclasses.replace(
        est,
        step_time_range_s=(est.step_time_s * step.low, est.step_time_s * step.high),
        peak_memory_range_bytes=(
            est.peak_memory_bytes * memory.low,
            est.peak_memory_bytes * memory.high,
        ),
        range_level=level,
        features=tuple(features),
        unvalidated=tuple(f"{f}: {n} published rows" for f, n in step.unvalidated),
    )


def best_published_mfu(device: str, params: float) -> Residual | None:
    """The published run with the highest measured MFU on ``device`` for a model within a
    factor 2 of ``params`` parameters (None: no such run)."""
    runs = [
        r
        for r in shipped()[0].residuals
        if r.device == device and r.params and 0.5 <= params / r.params <= 2.0
    ]
    return max(runs, key=lambda r: r.measured_mfu, default=None)


def write_residuals(section: str, rows: Sequence[dict[str, Any]], origin: str) -> None:
    """Replace ``section`` ("step" or "memory") rows of ``origin`` (the bench that measured
    them) in the shipped residual file; the benches' ``--write-residuals``."""
    from cost_model.files import atomic_write_text

    data: dict[str, Any] = {"step": [], "memory": []}
    if RESIDUALS_PATH.exists():
        data = json.loads(RESIDUALS_PATH.read_text())
    kept = [r for r in data[section] if r.get("origin") != origin]
    data[section] = kept + [{**r, "origin": origin} for r in rows]
    data["about"] = (
        "log(measured / predicted) per run: written by bench/validate_published.py and "
        "bench/memory.py --write-residuals; read by cost_model/uncertainty.py"
    )
    RESIDUALS_PATH.parent.mkdir(exist_ok=True)
    atomic_write_text(RESIDUALS_PATH, json.dumps(data, indent=1, sort_keys=True) + "\n")
    shipped.cache_clear()
    _interval.cache_clear()
