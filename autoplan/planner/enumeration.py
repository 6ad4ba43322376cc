"""The search's outer enumeration, streamed shape by shape under the budget.

Expects a search space cut to the framework's stack, the `BoundTables` of the model on the
cluster and the search's `Work`. The outer choices come in shapes (`space.Shape`: one set of
degrees and micro-batching; the members differ in schedule, virtual stages, sequence
parallelism, ZeRO level and rank layout). Every shape gets a proven floor on its members' steps
from compute alone (`BoundTables.shape_floor`), and shapes are expanded (their members checked
against the stack, bounded in memory and given their floors) lowest floor first, each one's
work charged, so that a space of millions of choices is enumerated within the budget.

Guarantees: `Enumeration.expand` yields each member of a shape once, as `Pending` choices (or
records it as refused or unable to fit); `Enumeration.left` holds every shape not expanded yet
with its floor (a proven lower bound on the step of every member, for the search's gap).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from autoplan.contract.plan import Recompute, split_backward_conflict
from autoplan.planner.candidates import BoundTables
from autoplan.planner.frontier import Pending, SearchStats
from autoplan.planner.space import ConstraintError, SearchSpace, Shape, ShapeOptions
from autoplan.planner.space import recompute_modes as space_recompute_modes
from autoplan.planner.stack_filter import StackChoices, stack_recompute_modes
from autoplan.planner.work import ENUMERATE_S, SHAPE_S, UNIT_COSTS_S, Work
from cost_model.frameworks import Refusal
from cost_model.frameworks.limits import (
    activation_offload_twin_allowed,
    optimizer_offload_refusal,
)
from cost_model.hardware import Cluster
from cost_model.offload import host_memory_per_device_bytes
from cost_model.parts.offload import (
    BLOCKS_SAVED_FIELDS,
    blocks_saved_bytes,
    host_held_micro_batches,
    optimizer_host_bytes,
    units_params_of,
)
from cost_model.strategy import Strategy

__all__ = ["Enumeration", "ShapeEntry"]


@dataclass(frozen=True, slots=True)
class ShapeEntry:
    """A shape not expanded yet: its proven floor, its place in the visiting order (ties), and
    what its members choose from."""

    floor_s: float
    order_s: float  # the order floor of one of its members (`_order`): which to expand first
    index: int
    shape: Shape
    options: ShapeOptions


class Enumeration:
    """The outer choices of a space, shape by shape (see the module docstring).

    ``report(enumerated)`` is called every ``report_every`` members enumerated (progress)."""

    def __init__(
        self,
        space: SearchSpace,
        tables: BoundTables,
        cluster: Cluster,
        global_batch: int,
        stats: SearchStats,
        work: Work,
        *,
        report: Callable[[int], None] | None = None,
        report_every: int = 1024,
    ) -> None:
        model = tables.model
        self._stack, self._profile = model.stack, model.profile
        self._choices = choices = StackChoices(
            space, model.stack, model.profile, cluster, global_batch
        )
        self._space = choices.space
        self._tables, self._stats, self._work = tables, stats, work
        self._report, self._report_every = report, report_every
        # the largest predicted peak a plan may have (the headroom and the peak's range off)
        self._capacity = model.usable_capacity_bytes()
        # optimizer offload needs a host link to price and run it (`cost_model.offload`)
        device = cluster.device
        self._host_link = device.kind == "gpu" and device.host_link_bandwidth_bytes_per_s > 0
        # and host memory to offload to: a device's share of its node's
        self._host_share = host_memory_per_device_bytes(
            cluster.host_memory_bytes, cluster.devices_per_node
        )
        # one micro-batch's block activations, by `BLOCKS_SAVED_FIELDS` (`offload_twins`)
        self._blocks_saved: dict[tuple[object, ...], float] = {}
        self._units_params = units_params_of(self._profile)
        self.infeasible: list[Strategy] = []  # members the memory bound proves cannot fit
        # the stack's rule -> the first plan it refused so, and how many
        self._refusals: dict[str, tuple[Refusal, int]] = {}
        self._enumerated = 0  # members enumerated (progress)
        self._members = 0  # members kept (each `Pending`'s index)
        self._charged_tables = 0  # the tables' unit-cost tables charged so far
        entries = []
        for index, shape in enumerate(choices.shapes()):
            options = choices.options(shape)
            work.charge(SHAPE_S)
            if not options.schedules or not options.sequence_parallel:
                continue  # no member
            base = self._member(shape, options)
            floor, order = self._floor(base, options), self._order(base, options)
            entries.append(ShapeEntry(floor, order, index, shape, options))
        self._charge_tables()
        # popped from the end: the lowest order last
        self._left = sorted(entries, key=lambda e: (e.order_s, e.index), reverse=True)

    @property
    def left(self) -> list[ShapeEntry]:
        """The shapes not expanded yet (the next to expand last)."""
        return self._left

    def take_left(self) -> list[ShapeEntry]:
        """The shapes not expanded yet, and none left here (the visit takes them)."""
        left, self._left = self._left, []
        return left

    def run(self, until_s: float | None) -> list[Pending]:
        """Expand shapes in order (`ShapeEntry.order_s`) until ``until_s`` reference seconds
        of the budget are spent (None: every shape) and some member may fit, or none is left;
        their members that may fit."""
        pending: list[Pending] = []
        while self._left:
            if until_s is not None and self._work.exhausted(until_s) and pending:
                break
            pending += self.expand(self._left.pop())
        return pending

    def expand(self, entry: ShapeEntry) -> list[Pending]:
        """The members of ``entry``'s shape that may fit, with their floors (their work
        charged); refused ones counted, those that cannot fit recorded in ``infeasible``."""
        tables, stats, work, space = self._tables, self._stats, self._work, self._space
        pending: list[Pending] = []
        for strategy, refusal in self._choices.choices(entry.shape, entry.options):
            self._enumerated += 1
            if self._report is not None and self._enumerated % self._report_every == 0:
                self._report(self._enumerated)
            if refusal is None:
                space_modes = space_recompute_modes(space, strategy.schedule)
                modes, refusal = stack_recompute_modes(
                    self._stack, strategy, self._profile, space_modes
                )
            work.charge(ENUMERATE_S)
            if refusal is not None:
                first, count = self._refusals.get(refusal.rule, (refusal, 0))
                self._refusals[refusal.rule] = (first, count + 1)
                continue
            stats.candidates += 1
            if tables.memory_bound(strategy, modes) > self._capacity:
                twin = next(
                    (
                        twin
                        for twin in self.offload_twins(strategy, modes)
                        if tables.memory_bound(twin, modes) <= self._capacity
                    ),
                    None,
                )
                if twin is None:
                    stats.pruned_memory += 1
                    self.infeasible.append(strategy)
                    continue
                strategy = twin  # fits only with its optimizer or activations on the host
            # a stack with one recompute setting for the model: each mode is its own choice
            alone = (
                [(mode,) for mode in modes] if self._stack.recompute_scope == "global" else [modes]
            )
            fitting = [
                c
                for c in alone
                if len(alone) == 1 or tables.memory_bound(strategy, c) <= self._capacity
            ]
            if not fitting:
                stats.pruned_memory += 1
                self.infeasible.append(strategy)
            for choice in fitting:
                order_floor, time_floor = tables.floors(strategy, choice)
                self._members += 1
                pending.append(Pending(order_floor, time_floor, self._members, strategy, choice))
        self._charge_tables()
        return pending

    def offload_twins(
        self, strategy: Strategy, modes: tuple[Recompute, ...]
    ) -> tuple[Strategy, ...]:
        """``strategy`` with what it may put on the host, in the order tried: its whole
        optimizer step (`offloaded`), its blocks' saved activations (`activation_twin`), both.
        Tried only for members that cannot fit (here, and when costed: `Frontier.cost`): each
        twin's step is never shorter than the member's (its copies and the host's step only
        add), so the member's floors bound it."""
        optimizer = self.offloaded(strategy)
        activations = self.activation_twin(strategy, modes)
        both = (
            replace(optimizer, activation_offload=True)
            if optimizer is not None and activations is not None
            else None
        )
        # (no twin whose offload the host's memory cannot hold: the plan would be refused;
        # `optimizer_host_bytes` + `activation_twin_host_bytes`, the latter summed once for the
        # two twins that have it)
        saved = self._activation_twin_bytes(activations) if activations else 0.0
        return tuple(
            twin
            for twin in (optimizer, activations, both)
            if twin is not None
            and optimizer_host_bytes(self._profile, twin, self._units_params)
            + (saved if twin.activation_offload else 0.0)
            <= self._host_share
        )

    def _activation_twin_bytes(self, twin: Strategy) -> float:
        """`cost_model.parts.offload.activation_twin_host_bytes` of ``twin``, its blocks' bytes
        computed once per combination of the fields they read (members of a shape share it)."""
        key = tuple(getattr(twin, name) for name in BLOCKS_SAVED_FIELDS)
        saved = self._blocks_saved.get(key)
        if saved is None:
            saved = self._blocks_saved[key] = blocks_saved_bytes(self._profile, twin)
        return host_held_micro_batches(twin) * saved

    def activation_twin(self, strategy: Strategy, modes: tuple[Recompute, ...]) -> Strategy | None:
        """``strategy`` with every block under recompute 'none' but the model's last keeping
        its saved activations on the host (`Strategy.activation_offload`), where the space
        allows it, the device states a host link and the stack offloads activations for this
        choice (`activation_offload_twin_allowed`); else None. Only where 'none' is the first
        of ``modes``: the candidate's memory constants come from its first mode's costs
        (`costed_candidate`), which then hold the offloaded blocks' in-flight buffers."""
        first_none = tuple(modes[:1]) == ("none",)
        if not (self._space.activation_offload and self._host_link and first_none):
            return None
        if not activation_offload_twin_allowed(self._stack, strategy):
            return None
        return replace(strategy, activation_offload=True)

    def offloaded(self, strategy: Strategy) -> Strategy | None:
        """``strategy`` with its whole optimizer step on the host, where the space allows it,
        the device states a host link and the stack offloads at its ZeRO stage; else None.
        Tried only for members that cannot fit (here, and when costed: `Frontier.cost`): its
        step is never shorter than the member's (the host's share only adds to the optimizer
        step), so the member's floors bound it too."""
        if not (self._space.optimizer_offload and self._host_link):
            return None
        if strategy.zero_stage not in self._stack.optimizer_offload_zero_stages:
            return None  # (the refusal's first rule, without building a strategy)
        offloaded = replace(strategy, optimizer_offload=1.0)
        if optimizer_offload_refusal(self._stack, offloaded) is not None:
            return None
        return offloaded

    def check_refused(self) -> None:
        """`ConstraintError` when every shape is expanded and the stack refused every member
        (none may fit, none is proven unable to)."""
        if self._refusals and not self._left and not self._members and not self.infeasible:
            stack = self._stack
            raise ConstraintError(
                f"{stack.name} runs none of the plans the constraints allow: "
                + "; ".join(
                    f"{rule} ({count} plans, e.g. {first.value}: {first.fix})"
                    for rule, (first, count) in self._refusals.items()
                )
                + "; allow what the parentheses name"
            )

    def _member(self, shape: Shape, options: ShapeOptions) -> Strategy:
        """A member of ``shape``: its options' first schedule, its first layout, its least
        ZeRO level, its first sequence-parallel choice."""
        schedule, v = options.schedules[0]
        return shape.member(
            schedule, v, options.zero[0], options.sequence_parallel[0], options.layouts[0]
        )

    def _floor(self, base: Strategy, options: ShapeOptions) -> float:
        """`BoundTables.shape_floor` of ``base``'s shape without recompute: a unit's forward
        and backward compute do not depend on its mode, which only adds the recompute, so no
        member's modes compute less (and one table a floor key, not one a mode)."""
        # one schedule of each virtual-stage count (the core-sharing stretch reads the count)
        by_count = {v: schedule for schedule, v in reversed(options.schedules)}
        members = [
            replace(base, sequence_parallel=sp, schedule=schedule, virtual_stages=v)
            for sp in options.sequence_parallel
            for v, schedule in sorted(by_count.items())
        ]
        return self._tables.shape_floor(members, ("none",))

    def _order(self, base: Strategy, options: ShapeOptions) -> float:
        """Which shapes to expand first: the order floor (`BoundTables.floors`) of one member
        that holds little, so that the memory a shape's micro-batches need orders it: one
        stage a rank (1F1B where the options have it), the most sharding and sequence
        parallelism the options allow. Not a bound: the visit bounds a shape by its floor."""
        schedule, v = next(
            ((s, v) for s, v in options.schedules if s == "1f1b"), options.schedules[0]
        )
        zero = max(
            (z for z in options.zero if split_backward_conflict(schedule, z, ("none",)) is None),
            default=options.zero[0],
        )
        member = replace(
            base,
            schedule=schedule,
            virtual_stages=v,
            zero_stage=zero,
            sequence_parallel=options.sequence_parallel[-1],
        )
        modes = space_recompute_modes(self._space, schedule)
        return self._tables.floors(member, modes)[0] if modes else math.inf

    def _charge_tables(self) -> None:
        """Charge the unit-cost tables the floors built since the last charge."""
        built = self._tables.unit_cost_tables - self._charged_tables
        self._work.charge(built * UNIT_COSTS_S)
        self._charged_tables += built
