"""Pipeline schedules as formulas: step time of the pipeline, bubble, micro-batches in flight.

Expects per-pipeline-rank times for one micro-batch (forward + backward of every model chunk the
rank holds, plus its boundary sends). Guarantees: the formulas below, exactly; they reduce to the
textbook uniform-stage results.

Pipeline time (derivation). Let ``T_r`` be the time pipeline rank r needs for one micro-batch
through all v chunks it holds, and ``T_max = max_r T_r``. The bottleneck rank is busy for
``m * T_max``. Before its first micro-batch arrives and after its last one leaves, the
micro-batch must cross every other rank once in each direction; with v chunks a rank holds 1/v
of its work per crossing, so fill and drain add ``(sum_r T_r - T_max) / v``::

    t_pipeline = m * T_max + (sum_r T_r - T_max) / v = (m - 1/v) * T_max + sum_r T_r / v

For v = 1 this is the GPipe/1F1B bound ``(m - 1) * T_max + sum_r T_r`` (Zheng et al. 2022,
Alpa, section 5.2, eq. 2; Li et al. 2021, TeraPipe), and for uniform stages (T_r = T) it is
``(m + (p - 1) / v) * T``: the interleaved schedule's bubble ``(p - 1) / v`` micro-batch times
(Narayanan et al. 2021, section 2.2.2). GPipe and 1F1B share the time (Narayanan et al. 2021,
section 2.2.1: 1F1B only lowers memory).

In-flight micro-batches (activations held at the peak). GPipe runs all m forwards first:
m. 1F1B: pipeline rank r (0-based) warms up with p - r - 1 forwards and holds at most p - r
(Narayanan et al. 2021, section 2.2.1; Megatron-LM ``get_num_warmup_microbatches``), capped
at m. Interleaved 1F1B: rank r runs (v - 1) p + 2 (p - r - 1) warm-up chunk-forwards
(Megatron-LM's and torch's ScheduleInterleaved1F1B warm-up count) and holds one more; each holds
one chunk (1/v of the rank's units), so the rank holds ``min(m v, (v-1) p + 2(p-r-1) + 1) / v``
micro-batches' worth of its activations. For r = 0 that is ``p (1 + (p-1)/(p v))``, Korthikanti
et al. 2022, section 4.2.3.
"""

from __future__ import annotations

from collections.abc import Sequence


def pipeline_time_s(
    rank_times_s: Sequence[float], num_micro_batches: int, virtual_stages: int = 1
) -> float:
    """``(m - 1/v) * max_r T_r + sum_r T_r / v`` (see the module docstring)."""
    if not rank_times_s:
        raise ValueError("pipeline_time_s needs at least one pipeline rank")
    m, v = num_micro_batches, virtual_stages
    return (m - 1.0 / v) * max(rank_times_s) + sum(rank_times_s) / v


def bubble_time_s(
    rank_times_s: Sequence[float], num_micro_batches: int, virtual_stages: int = 1
) -> float:
    """Idle time of the bottleneck rank: pipeline time minus its busy time ``m * T_max``."""
    total = pipeline_time_s(rank_times_s, num_micro_batches, virtual_stages)
    return total - num_micro_batches * max(rank_times_s)


def bubble_fraction(
    rank_times_s: Sequence[float], num_micro_batches: int, virtual_stages: int = 1
) -> float:
    """Share of the pipeline time the bottleneck rank idles (0 for one stage)."""
    total = pipeline_time_s(rank_times_s, num_micro_batches, virtual_stages)
    if total <= 0:
        return 0.0
    return bubble_time_s(rank_times_s, num_micro_batches, virtual_stages) / total


def inflight_microbatches(
    schedule: str, pp_degree: int, num_micro_batches: int, virtual_stages: int, pp_rank: int
) -> float:
    """Micro-batches' worth of activations pipeline rank ``pp_rank`` holds at its peak."""
    p, m, v, r = pp_degree, num_micro_batches, virtual_stages, pp_rank
    if not 0 <= r < p:
        raise ValueError(f"pp_rank = {r} must be in [0, {p})")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - r))
    if schedule == "interleaved-1f1b":
        warmup = (v - 1) * p + 2 * (p - r - 1)
        return min(m * v, warmup + 1) / v
    raise ValueError(f"unknown schedule {schedule!r}; use gpipe, 1f1b or interleaved-1f1b")
