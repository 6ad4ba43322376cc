"""What a search budget counts: deterministic work in reference seconds.

Expects the search's steps to charge their work as they do it (`Work.charge`, or the helpers
for a simulation, a costed candidate, an LP round, a CP-SAT solve). Guarantees: every charge
is computed from the step's size (actions simulated, stages, CP-SAT's own deterministic time),
never read from a clock, so a search whose decisions depend only on `Work.spent_s` makes the
same decisions on every machine, loaded or idle: the same question gets the same plan.

A reference second is what the step takes on the reference machine (the 2-core rig the costs
below were measured on, Python 3.12, torch 2.13, OR-tools 9.x); on a faster machine a budget
ends sooner in wall time, on a slower one later. A wall-clock cap (`WALL_CAP_FACTOR` times the
budget by default) is the safety limit for a machine far slower than the reference, or a step
whose charge underestimates it: when it cuts a search `Work.capped` says so, and only then can
two runs differ.
"""

from __future__ import annotations

import math
import time

from cost_model.schedules import ScheduleSpec

# Reference costs (seconds on the reference machine, measured 2026-11-29 by timing each step
# over the first 300 candidates of gpt3-175b on 1024 A100 and llama3-8b on 32 H100).
ENUMERATE_S = 20e-6  # one outer choice enumerated: its stack check, memory bound and floors
SHAPE_S = 20e-6  # one shape of outer choices listed, its options and floor (`enumeration`)
# one recompute mode's per-unit costs with one device per TP group (the floors' tables)
UNIT_COSTS_S = 400e-6
COST_S = 250e-6  # one outer choice costed (`candidates.costed_candidate`)
PROBLEM_STAGE_S = 10e-6  # one stage of a partition problem built (`partition_problem`)
ACTION_S = 1e-6  # one action of a simulated schedule (`cost_model.schedules.simulate`)
# A schedule's first use: torch's orders built and compiled, its held micro-batches counted
# (`cost_model.schedules.compile_schedule`, `held_microbatches`; cached per process, charged
# once per search): 2.5-13 us an action measured (interleaved 1F1B p 8-21, zero-bubble, V).
SCHEDULE_ACTION_S = 6e-6
# One round of a Kelley LP (`bounds.pipeline_factor`): GLOP's solve, per constraint row of the
# LP at that round (20-36 us measured on interleaved 1F1B, p 4-16, v 3-8, m 16-96), plus:
LP_ROW_S = 30e-6
LP_ROUND_BASE_S = 1e-3
# Refining a candidate's bound with each rank's memory (`candidates.refined_candidate`): per
# peak-point curve (each evaluated at every unit count at once), plus the split's search
# (measured on gpt3-175b on 1024 A100, 283 candidates, p 4-8, v 1-8).
RANK_CURVE_S = 40e-6
REFINE_S = 500e-6
# One unit of CP-SAT's deterministic time (`CpSolver.deterministic_time`) took 0.7-1.4 s of
# wall time on the partition models of gpt3-175b.
CPSAT_UNIT_S = 1.0
CPSAT_VARIABLE_S = 20e-6  # building a CP-SAT model, per variable
# The wall-clock cap on a budgeted search, as a multiple of its budget (plus a second, so a
# tiny budget is not cut by the process's own jitter).
WALL_CAP_FACTOR = 10.0


class Work:
    """The work a search has done and may do (see the module docstring).

    ``budget_s``: reference seconds it may spend (None: no limit). ``wall_cap_s``: wall
    seconds after which it stops regardless (None: `WALL_CAP_FACTOR` times the budget plus
    one; inf: none)."""

    def __init__(self, budget_s: float | None, wall_cap_s: float | None = None) -> None:
        self.budget_s = math.inf if budget_s is None else budget_s
        if wall_cap_s is None:
            wall_cap_s = WALL_CAP_FACTOR * self.budget_s + 1.0
        self._wall_end = time.perf_counter() + wall_cap_s
        self.spent_s = 0.0
        self.capped = False  # the wall-clock cap stopped it
        self._charged: set[object] = set()  # keys charged by `charge_once`

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of reference work."""
        self.spent_s += seconds

    def charge_once(self, key: object, seconds: float) -> None:
        """Count ``seconds`` of reference work the first time ``key`` is charged (a result
        this search reuses costs it once, whoever computed it)."""
        if key not in self._charged:
            self._charged.add(key)
            self.spent_s += seconds

    def schedule(self, spec: ScheduleSpec) -> None:
        """Count ``spec``'s first use in this search (`SCHEDULE_ACTION_S`)."""
        self.charge_once(("schedule", spec), spec.num_actions * SCHEDULE_ACTION_S)

    def simulation(self, spec: ScheduleSpec, count: int = 1) -> None:
        """Count ``count`` simulations of ``spec`` (and its first use)."""
        self.schedule(spec)
        self.spent_s += count * spec.num_actions * ACTION_S

    def left_s(self) -> float:
        """Reference seconds left (inf without a budget; 0 once capped)."""
        if self.wall_capped():
            return 0.0
        return max(0.0, self.budget_s - self.spent_s)

    def wall_left_s(self) -> float:
        """Wall seconds left before the cap."""
        return max(0.0, self._wall_end - time.perf_counter())

    def exhausted(self, level_s: float | None = None) -> bool:
        """Whether the budget (or ``level_s``, a level of `spent_s` a step may work to) is
        spent, or the wall-clock cap reached."""
        limit = self.budget_s if level_s is None else level_s
        return self.spent_s >= limit or self.wall_capped()

    def wall_capped(self) -> bool:
        """Whether the wall-clock cap has been reached (and records it)."""
        if not self.capped and time.perf_counter() > self._wall_end:
            self.capped = True
        return self.capped
