"""A partition problem's tables as the CP-SAT model's integers (`_scale`): times and bytes
each in a unit chosen so that the worst total over all units is `_RESOLUTION` units, bytes
finer where rounding could move a rank's memory by a noticeable share of its capacity.

Expects a `PartitionProblem`. Guarantees the scaled capacity keeps free the most the byte
rounding can move a rank's memory, so every partition the model allows fits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoplan.contract.plan import Recompute
from autoplan.planner.partition.problem import PartitionProblem
from cost_model.schedule_memory import held_microbatches

# Integer resolution of the CP-SAT model: times and bytes are scaled so that the total over all
# units is this many integer units. A path sums rounded unit times, each off by at most half a
# unit, so its relative rounding error is at most (units on it) / (2 * resolution). Finer
# scales make CP-SAT much slower (larger coefficients weaken its propagation).
_RESOLUTION = 10**6
# Memory rounding (`_fine_byte_unit`): a byte unit whose rounding could move a rank's memory
# by more than this share of its capacity is refined until it can move it by at most the second.
_COARSE_MEMORY = 0.25
_FINE_MEMORY = 1e-3


@dataclass(frozen=True, kw_only=True, slots=True)
class _Scaled:
    """A problem's tables as the model's integers: times in units of ``time_unit_s``, bytes in
    units of ``byte_unit`` (per-mode tables are indexed [mode][unit])."""

    mode_names: tuple[Recompute, ...]
    time_unit_s: float
    byte_unit: float
    time_bound: int  # above any rank's tail
    path_bound: int  # above any path's length
    forward: Mapping[Recompute, tuple[int, ...]]
    backward: Mapping[Recompute, tuple[int, ...]]
    weight: Mapping[Recompute, tuple[int, ...]]  # zeros unless the schedule splits backwards
    act: Mapping[Recompute, tuple[int, ...]]
    kept: Mapping[Recompute, tuple[int, ...]]
    static: tuple[int, ...]
    send: int
    tail: tuple[Mapping[Recompute, tuple[int, ...]], ...]  # [term j][mode][unit]
    tail_constants: tuple[int, ...]
    transfer: tuple[tuple[int, ...], ...]  # [stage][its last unit]
    message: tuple[int, ...]
    memory_capacity: int


def _ints(values: Sequence[float], unit: float) -> tuple[int, ...]:
    return tuple(round(value / unit) for value in values)


def _shared_ints(rows: Sequence[Sequence[float]], unit: float) -> tuple[tuple[int, ...], ...]:
    """`_ints` of each row, rows that are one object scaled once and shared again."""
    scaled: dict[int, tuple[int, ...]] = {}
    out = []
    for row in rows:
        found = scaled.get(id(row))
        if found is None:
            found = scaled[id(row)] = _ints(row, unit)
        out.append(found)
    return tuple(out)


def _scale(problem: PartitionProblem) -> _Scaled:
    """The problem's tables rounded to integers so that the worst total over all units is
    `_RESOLUTION` units (times and bytes separately)."""
    n, spec = problem.num_units, problem.spec
    modes = problem.modes
    worst = sum(max(c.forward_s[u] + c.backward_s[u] for c in modes.values()) for u in range(n))
    distinct = {id(row): row for row in problem.transfer_s}  # (stages share rows)
    largest = {key: max(row) for key, row in distinct.items()}
    worst += sum(largest[id(row)] for row in problem.transfer_s) + 2 * sum(problem.message_s)
    worst_tail = sum(
        sum(max(abs(c.tail_s[j][u]) for c in modes.values()) for u in range(n))
        + abs(problem.tail_constants_s[j])
        for j in range(problem.num_tail_terms)
    )
    t = max(worst, worst_tail, 1e-30) / _RESOLUTION
    b = max(_worst_bytes(problem), problem.memory_capacity_bytes, 1.0) / _RESOLUTION
    b, margin = _fine_byte_unit(problem, b)
    time_bound = 4 * _RESOLUTION
    split = spec.splits_backward
    return _Scaled(
        mode_names=tuple(modes),
        time_unit_s=t,
        byte_unit=b,
        time_bound=time_bound,
        # a path runs at most every action and crossing once: m (2 or 3) actions per stage
        path_bound=(3 * spec.num_micro_batches + 2) * time_bound,
        forward={k: _ints(c.forward_s, t) for k, c in modes.items()},
        backward={k: _ints(c.backward_s, t) for k, c in modes.items()},
        weight={k: _ints(c.weight_s if split else (0.0,) * n, t) for k, c in modes.items()},
        act={k: _ints(c.activation_bytes, b) for k, c in modes.items()},
        kept={k: _ints(c.retained_bytes, b) for k, c in modes.items()},
        static=_ints(problem.static_bytes, b),
        send=round(problem.send_bytes / b),
        tail=tuple(
            {k: _ints(c.tail_s[j], t) for k, c in modes.items()}
            for j in range(problem.num_tail_terms)
        ),
        tail_constants=_ints(problem.tail_constants_s, t),
        transfer=_shared_ints(problem.transfer_s, t),
        message=_ints(problem.message_s, t),
        memory_capacity=math.floor((problem.memory_capacity_bytes - margin) / b),
    )


def _fine_byte_unit(problem: PartitionProblem, byte_unit: float) -> tuple[float, float]:
    """(``byte_unit``, 0), or a finer unit and a margin to keep off the capacity, where
    ``byte_unit``'s rounding could move a rank's memory by more than `_COARSE_MEMORY` of the
    capacity: each unit's static, activation and retained bytes round by up to half a unit,
    counted as often as a rank's point holds them, and a rank may hold every unit. Thousands
    of units (4,096 layers) spread `_RESOLUTION` so thin that a block's activations rounded to
    nothing and the solver's cuts overflowed memory by 60%; the finer unit's rounding moves a
    rank by at most `_FINE_MEMORY` of the capacity, and the model keeps that much free, so
    every partition it allows fits. (Models of a few hundred units stay under the threshold:
    their models are as they were.)"""
    held = held_microbatches(problem.spec)
    most = max((h + k for pr in held for pt in pr.points for h, k in pt), default=1)
    sends = max((n for pr in held for n in pr.sends), default=0)
    halves = 0.5 * (problem.num_units * (1 + most) + sends)  # rounding error, in units
    capacity = max(problem.memory_capacity_bytes, 1.0)
    if halves * byte_unit <= _COARSE_MEMORY * capacity:
        return byte_unit, 0.0
    return _FINE_MEMORY * capacity / halves, _FINE_MEMORY * capacity


def _worst_bytes(problem: PartitionProblem) -> float:
    """An upper bound on any rank's memory under any partition: every unit's static bytes
    and the most micro-batches any stage holds times every unit's activations, plus the most
    pending sends."""
    held = held_microbatches(problem.spec)
    most = max((h + k for pr in held for pt in pr.points for h, k in pt), default=1)
    sends = max((n for pr in held for n in pr.sends), default=0)
    return (
        sum(problem.static_bytes)
        + sends * problem.send_bytes
        + most
        * sum(
            max(max(c.activation_bytes[u], c.retained_bytes[u]) for c in problem.modes.values())
            for u in range(problem.num_units)
        )
    )
