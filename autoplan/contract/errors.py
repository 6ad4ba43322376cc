"""autoplan's error types. Every user mistake is an `InputError`: the CLI prints its message
as one line and exits 2; library callers can catch the specific subclass."""

from __future__ import annotations

from cost_model.errors import ClusterError, InputError, SchemaError

__all__ = [
    "CalibrationError",
    "ClusterError",
    "InputError",
    "ModelSpecError",
    "NoFeasiblePlanError",
    "PlanError",
    "SchemaError",
    "TraceError",
]


class CalibrationError(InputError):
    """Measuring this machine failed or stalled (`autoplan calibrate`); the message has a hint."""


class PlanError(InputError):
    """A plan is inconsistent, or does not fit the model or the cluster it is used with."""


class ModelSpecError(InputError):
    """A model name, preset or builder override is invalid."""


class TraceError(InputError):
    """A model could not be traced or profiled."""


class NoFeasiblePlanError(InputError):
    """No plan in the searched space fits the cluster.

    When memory is the reason, ``least_memory_bytes`` is the least any candidate needs per
    device, ``capacity_bytes`` the device's memory and ``usable_bytes`` the most a predicted
    peak may take of it with the memory headroom and the peak's range (None otherwise).
    """

    def __init__(
        self,
        message: str,
        *,
        least_memory_bytes: float | None = None,
        capacity_bytes: float | None = None,
        usable_bytes: float | None = None,
    ) -> None:
        super().__init__(message)
        self.least_memory_bytes = least_memory_bytes
        self.capacity_bytes = capacity_bytes
        self.usable_bytes = usable_bytes
