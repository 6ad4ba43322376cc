"""Predicted against measured step time of a training run, as one line for its end.

Expects a `DistributedModel` from `autoplan.parallelize` (which records the cost model's
prediction for the plan on the job's cluster, and the wall time of every `train_step`).
Guarantees: the measured time is the median of the steps after the first `WARMUP_STEPS`
(first-call costs: allocations, shape inference, gloo's connections); with no step after
warm-up or no prediction there is no line (None). A measurement outside the predicted range
says so and names `autoplan calibrate`; `log_step_timing` logs it (logger
``autoplan.runtime.step_timing``: INFO, or WARNING when outside the range).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

from autoplan._format import fmt_time, fmt_time_bounds
from passes import log_rank0
from passes.runtime import DistributedModel

__all__ = ["WARMUP_STEPS", "StepTiming", "log_step_timing", "step_timing"]

logger = logging.getLogger(__name__)

WARMUP_STEPS = 3

CALIBRATE_HINT = (
    "run `autoplan calibrate` to measure this machine's rates and training-step overheads, "
    "then plan again"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTiming:
    """A run's predicted step (with its 80% range) and its measured median step."""

    predicted_s: float
    range_s: tuple[float, float]
    measured_s: float
    steps: int  # steps in the median

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def within_range(self) -> bool:
        low, high = self.range_s
        return low <= self.measured_s <= high

    def line(self) -> str:
        """The line: "predicted 53.1 ms a step (range 47.2-60.3 ms), measured 43.0 ms (+23%)"; when
        the measurement is outside the range, what to do."""
        text = (
            f"predicted {fmt_time(self.predicted_s)} a step (range "
            f"{fmt_time_bounds(self.predicted_s, self.range_s)}), measured "
            f"{fmt_time(self.measured_s)} ({self.error:+.0%}; median of {self.steps} steps)"
        )
        if self.within_range:
            return text
        side = "slower" if self.measured_s > self.range_s[1] else "faster"
        return f"{text}: the run is {side} than the predicted range; {CALIBRATE_HINT}"


def step_timing(model: DistributedModel) -> StepTiming | None:
    """``model``'s predicted and measured step time on this rank, or None (no prediction, or
    no step after the warm-up)."""
    timed = model.step_times_s[WARMUP_STEPS:]
    if model.predicted_step_s is None or not timed:
        return None
    low_high = model.predicted_step_range_s
    if low_high is None or low_high[1] <= 0:
        low_high = (model.predicted_step_s, model.predicted_step_s)
    return StepTiming(
        predicted_s=model.predicted_step_s,
        range_s=low_high,
        measured_s=statistics.median(timed),
        steps=len(timed),
    )


def log_step_timing(model: DistributedModel) -> StepTiming | None:
    """Log ``model``'s `StepTiming` line on rank 0 (INFO; WARNING when the measured step is
    outside the predicted range) and return it."""
    timing = step_timing(model)
    if timing is not None:
        level = logging.INFO if timing.within_range else logging.WARNING
        log_rank0(logger, level, "%s", timing.line())
    return timing
