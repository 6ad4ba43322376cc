"""The search's outer choices costed and bounded: `Candidate`, `BoundTables`, and the
stage-partition problem of a candidate.

Expects a `CostModel` of one model on one cluster (the cluster as the framework's stack runs
on it). Guarantees: `BoundTables.memory_bound` and ``floors`` and a `Candidate`'s
``time_lower_bound_s`` and ``memory_lower_bound_bytes`` are proven lower bounds on every plan
of their outer choice (`autoplan.planner.search` prunes by them); ``order_key_s`` and the
order floor only order the visit. Each table is cached by a `strategy_keys.Projection` of the
strategy fields it reads.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autoplan.contract.plan import Recompute
from autoplan.planner.bounds import (
    RecomputeCurve,
    UnitFloor,
    UnitModes,
    memory_unit_bound,
    pipeline_factor,
    share_range,
    whole_unit_bound,
)
from autoplan.planner.partition import ModeCosts, PartitionProblem
from autoplan.planner.strategy_keys import ACTIVATION_KEY, FLOOR_KEY, PARAMS_KEY, STATE_KEY
from autoplan.planner.work import RANK_CURVE_S, REFINE_S, Work
from cost_model.estimate import (
    CostModel,
    MemoryConstants,
    UnitCost,
    boundary_send_bytes,
    memory_constants,
)
from cost_model.memory import (
    RECOMPUTABLE_KINDS,
    activation_bytes,
    activation_scale,
    local_num_params,
    static_bytes,
)
from cost_model.parts.memory import offloaded_master_bytes
from cost_model.schedule_memory import even_held, least_held, sends_at_end
from cost_model.schedules import pipeline_lower_bound_s
from cost_model.stage_terms import rank_tail_terms
from cost_model.strategy import RECOMPUTED_UNIT_KINDS, Strategy


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One outer choice: its per-unit costs under each recompute mode and its bounds."""

    strategy: Strategy
    by_mode: dict[Recompute, tuple[UnitCost, ...]]
    constants: MemoryConstants
    time_lower_bound_s: float
    memory_lower_bound_bytes: float  # tensor bytes (before buffers and allocator overhead)
    usable_bytes: float
    order_key_s: float  # the visiting order: an even-split estimate (heuristic, not a bound)
    work_s: float  # least per-micro-batch work of the units (memory-forced recompute included)
    fixed_s: float  # the loop's fixed overhead per step
    forward_cells: tuple[int, int]  # the units' forward shares (`bounds.share_range`)
    weight_cells: tuple[int, int]  # the units' weight shares of their backward

    def schedule_bound_s(self, work: Work | None = None) -> float:
        """A proven lower bound on the step from the schedule's own paths
        (`bounds.pipeline_factor`): costlier than ``time_lower_bound_s``, computed on demand
        and shared by every candidate with the same schedule, degrees and shares (its
        reference seconds charged to ``work``)."""
        spec = self.strategy.schedule_spec
        factor = pipeline_factor(spec, self.forward_cells, self.weight_cells, work=work)
        return self.work_s * factor + self.fixed_s


class BoundTables:
    """The search's bounds (memory, compute floors) for one model on one cluster, over the
    `CostModel` that prices them; each table is keyed by the strategy fields it reads."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.profile = profile = model.profile
        self.cluster = cluster = model.cluster
        self._params: dict[tuple[object, ...], float] = {}
        self._least_act: dict[tuple[object, ...], float] = {}
        self._memory: dict[tuple[object, ...], tuple[float, float]] = {}
        # the cost model without core sharing: `floors` applies each strategy's own stretch
        self._apart = model
        if cluster.shared_cores_per_node is not None:
            self._apart = CostModel(
                profile, replace(cluster, shared_cores_per_node=None), model.framework
            )
        self._floor_work: dict[tuple[object, ...], tuple[float, float, float, float]] = {}
        # how many per-mode unit-cost tables the floors have built (the search charges them)
        self.unit_cost_tables = 0
        # per floor key: the first, middle and last units' least compute alone (no tails)
        self._floor_units: dict[tuple[object, ...], tuple[UnitFloor, UnitFloor, UnitFloor]] = {}
        # per floor key and pipeline shape: `bounds.whole_unit_bound` of those
        self._whole_units: dict[tuple[object, ...], float] = {}
        # per floor key: the units' recompute curve, alone (`RecomputeCurve`)
        self._floor_curves: dict[tuple[object, ...], RecomputeCurve] = {}
        cal = cluster.calibration
        # at least the usable bytes of any plan's device (no buffers counted)
        self._usable_at_most = MemoryConstants(
            buffer_bytes=0.0,
            reserved_bytes=cal.reserved_memory_bytes,
            allocator_overhead_fraction=cal.allocator_overhead_fraction,
        ).usable_bytes(model.usable_capacity_bytes())
        # representative unit -> how many units share its content
        self.class_counts = Counter(model.classes)
        # per sample at the traced dtype: the smallest tensor a pipeline stage can send
        self._smallest_output = min((u.output_bytes for u in profile.units[:-1]), default=0.0)
        # the routed experts' parameters (stored E / ep per device)
        self._expert_params = sum(facts.expert_params for facts in profile.moe_layers)
        # (first unit's class, the middle units' one class, how many, last unit's class) when
        # the units between the first and the last are identical (`bounds.whole_unit_bound`)
        classes = model.classes
        self.uniform_middle: tuple[int, int, int, int] | None = None
        if len(classes) >= 3 and len(set(classes[1:-1])) == 1:
            self.uniform_middle = (classes[0], classes[1], len(classes) - 2, classes[-1])

    def memory_bound(self, strategy: Strategy, modes: Sequence[Recompute]) -> float:
        """A lower bound on the device memory of any plan with these outer choices, plus the
        reserved bytes and the allocator overhead: the larger of (a) weights, gradients,
        optimizer state and the activations of the fewest micro-batches any rank holds (under
        the leanest recompute mode), spread evenly over the pipeline ranks, and (b) at the
        step's end, the same state and the boundary tensors the ranks' pending sends keep
        (`sends_at_end`, each at least the smallest output a stage can end with), spread
        evenly, or the busiest rank's sends alone if more."""
        inflight = least_held(strategy.schedule_spec)
        state, least_act = self._state(strategy, modes)
        p = strategy.pp_degree
        per_rank = (state + inflight * least_act) / p
        # (not cached: the sends depend on the schedule's micro-batches; a few operations)
        sends = sends_at_end(strategy.schedule_spec)
        cal = self.cluster.calibration
        if any(sends):
            scale = activation_scale(strategy, self.profile.traced_dtype_bytes)
            scale /= strategy.tp_degree if strategy.sequence_parallel else 1
            scale /= strategy.cp_degree
            size = self._smallest_output * scale * cal.pipeline_boundary_retention
            per_rank = max(per_rank, (state + sum(sends) * size) / p, max(sends) * size)
        return (1.0 + cal.allocator_overhead_fraction) * per_rank + cal.reserved_memory_bytes

    def _state(self, strategy: Strategy, modes: Sequence[Recompute]) -> tuple[float, float]:
        """`_state_memory`, cached by the strategy fields it reads."""
        whole = STATE_KEY.key(strategy, tuple(modes))
        found = self._memory.get(whole)
        if found is None:
            found = self._state_memory(strategy, modes)
            self._memory[whole] = found
        return found

    def _state_memory(self, strategy: Strategy, modes: Sequence[Recompute]) -> tuple[float, float]:
        """(weights, gradients and optimizer state of all ranks; the activations of one
        micro-batch through every unit under the leanest mode), in bytes."""
        key = PARAMS_KEY.key(strategy)
        params = self._params.get(key)
        if params is None:
            params = self._params[key] = self._param_count(strategy)
        # as `CostModel` stores them: dense weights data-parallel over dp x cp, the routed
        # experts E / ep per device over dp x cp / ep
        # (the weights' view decides as the strategy: `Strategy.weights_view`)
        dense = static_bytes(
            params - self._expert_params,
            strategy.dtype,
            strategy.runtime_zero_stage,
            strategy.weight_dp_degree,
            strategy.dp_wrapper,
            policy=strategy.precision,
        )
        # optimizer offload's share of the state is on the host (`parts.memory.unit_bytes`)
        share = strategy.optimizer_offload
        state = dense.total_bytes - share * dense.optimizer_bytes
        state -= offloaded_master_bytes(params - self._expert_params, strategy.weights_view)
        if self._expert_params:
            experts = strategy.expert_view
            routed = static_bytes(
                self._expert_params / strategy.ep_degree,
                strategy.dtype,
                experts.runtime_zero_stage,
                experts.dp_degree,
                experts.dp_wrapper,
                policy=experts.precision,
            )
            state += routed.total_bytes - share * routed.optimizer_bytes
        act_key = ACTIVATION_KEY.key(strategy, tuple(modes))
        least_act = self._least_act.get(act_key)
        if least_act is None:
            least_act = self._least_act[act_key] = self._least_activations(strategy, modes)
        return state, least_act

    def _param_count(self, strategy: Strategy) -> float:
        """The parameters of all units on one device before data-parallel sharding (cached
        by `strategy_keys.PARAMS_KEY`)."""
        return sum(
            local_num_params(
                unit,
                strategy.tp_degree,
                count_shared=strategy.pp_degree > 1,
                shared_expert_whole=self.model.shared_expert_whole(strategy),
            )
            for unit in self.profile.units
        )

    def _least_activations(self, strategy: Strategy, modes: Sequence[Recompute]) -> float:
        """The activations of one micro-batch through every unit under the leanest of
        ``modes`` (cached by `strategy_keys.ACTIVATION_KEY`)."""
        traced = self.profile.traced_dtype_bytes
        least_act = 0.0
        for rep, count in self.class_counts.items():
            unit = self.model.local_unit(rep, strategy.cp_degree)
            # the activation-offload twin's blocks under 'none' hold none on the device (its
            # kept last block counted as offloaded too: a lower bound)
            offloaded = strategy.activation_offload and unit.kind in RECOMPUTABLE_KINDS
            least_act += count * min(
                0.0
                if offloaded and mode == "none"
                else activation_bytes(unit, strategy, mode, traced)
                + (
                    self.model.expert_cost(strategy, rep, mode, ()).activation_bytes
                    if unit.moe is not None
                    else 0.0
                )
                for mode in modes
            )
        return least_act

    def _floor_tables(
        self, strategy: Strategy, modes: tuple[Recompute, ...]
    ) -> tuple[tuple[float, float, float, float], RecomputeCurve]:
        """The units' work with one device per TP group (order work, its largest unit, compute
        work, its largest unit) and their recompute curve, alone (cached by
        `strategy_keys.FLOOR_KEY`)."""
        # (dp = ep: the experts split as in the strategy, their all-to-all on the nearest
        # ranks; the cp ring on the strategy's own cp degree, its ranks the nearest too)
        alone = replace(
            strategy,
            dp_degree=strategy.ep_degree,
            pp_degree=1,
            virtual_stages=1,
            num_micro_batches=1,
            schedule="1f1b",
            zero_stage=0,
            dp_shard_degree=None,
        )
        by_mode = [self._apart.unit_costs(alone, mode) for mode in modes]
        curve = RecomputeCurve.of(
            [
                (count, [(c[rep].activation_bytes, c[rep].time_s) for c in by_mode])
                for rep, count in self.class_counts.items()
            ]
        )
        if self.uniform_middle is not None:
            first, middle, _, last = self.uniform_middle
            self._floor_units[FLOOR_KEY.key(strategy, modes)] = (
                _compute_floor([c[first] for c in by_mode]),
                _compute_floor([c[middle] for c in by_mode]),
                _compute_floor([c[last] for c in by_mode]),
            )
        order_work = order_largest = compute_work = compute_largest = 0.0
        for rep, count in self.class_counts.items():
            full = min(costs[rep].time_s for costs in by_mode)
            compute = min(
                costs[rep].forward_compute_s
                + costs[rep].backward_compute_s
                + costs[rep].recompute_s
                for costs in by_mode
            )
            order_work += count * full
            order_largest = max(order_largest, full)
            compute_work += count * compute
            compute_largest = max(compute_largest, compute)
        return (order_work, order_largest, compute_work, compute_largest), curve

    def _floor_work_of(
        self, key: tuple[object, ...], strategy: Strategy, modes: tuple[Recompute, ...]
    ) -> tuple[float, float, float, float]:
        """`_floor_tables`'s work, cached by ``key`` (`strategy_keys.FLOOR_KEY` and the modes);
        each table built counts its modes in ``unit_cost_tables``."""
        work = self._floor_work.get(key)
        if work is None:
            work, self._floor_curves[key] = self._floor_tables(strategy, modes)
            self._floor_work[key] = work
            self.unit_cost_tables += len(modes)
        return work

    def shape_floor(self, members: Sequence[Strategy], modes: tuple[Recompute, ...]) -> float:
        """A proven lower bound on the step of every plan of a shape (`space.Shape`: the outer
        choices with one set of degrees and micro-batching) whose stages use modes among
        ``modes``, from compute alone: ``m max(W / p, largest)`` plus the loop's overhead, the
        first term of `pipeline_lower_bound_s` (so at most every member's ``floors`` bound).
        ``members``: one of the shape's members for each sequence-parallel choice and virtual
        stage count (what the compute and the core-sharing stretch read), its least taken.
        The compute tables are `floors`' own (members with these modes reuse them)."""
        floor = math.inf
        for strategy in members:
            _, _, compute_work, compute_largest = self._floor_work_of(
                FLOOR_KEY.key(strategy, modes), strategy, modes
            )
            stretch = self.model.sharing(strategy).pipeline
            p, m = strategy.pp_degree, strategy.num_micro_batches
            share = max(compute_work / p, compute_largest)
            floor = min(floor, stretch * m * share + self.model.step_overhead_s(strategy))
        return floor

    def floors(self, strategy: Strategy, modes: tuple[Recompute, ...]) -> tuple[float, float]:
        """(a floor under the order key, a proven lower bound on the step) from the units'
        costs with one device per TP group and nothing else: no data or pipeline parallelism
        (their collectives, sharding and host time only add), TP groups on adjacent ranks
        (the fastest links), times stretched by the strategy's own core sharing (CPU rigs).
        The bound counts compute alone (no communication at all)."""
        key = FLOOR_KEY.key(strategy, modes)
        work = self._floor_work_of(key, strategy, modes)
        stretch = self.model.sharing(strategy).pipeline
        order_work, order_largest, compute_work, compute_largest = (w * stretch for w in work)
        p, v, m = strategy.pp_degree, strategy.virtual_stages, strategy.num_micro_batches
        fixed = self.model.step_overhead_s(strategy)
        spec = strategy.schedule_spec
        time_floor = pipeline_lower_bound_s(spec, compute_work, compute_largest) + fixed
        if key in self._floor_units and p > 1:
            # whole units per rank (`bounds.whole_unit_bound`), from compute alone (no tails:
            # the virtual stages, which only move rank 0's tail, need not be in the key)
            shape = (key, p, m, spec.splits_backward, spec.placement)
            whole = self._whole_units.get(shape)
            if whole is None:
                first, middle, last = self._floor_units[key]
                count = self.uniform_middle[2] if self.uniform_middle else 0
                whole = self._whole_units[shape] = whole_unit_bound(
                    spec, first, middle, count, last
                )
            time_floor = max(time_floor, stretch * whole + fixed)
        # The recompute the order key's even cut must buy (`costed_candidate`), from the same units
        # alone: no more state than `_state_memory`'s, no less usable memory than without
        # buffers, times no longer than the strategy's, so it stays under the key.
        held = even_held(spec)
        overflow = 1.0
        if held > least_held(spec):
            state, least_act = self._state(strategy, modes)
            room = p * self._usable_at_most - state
            order_work = stretch * self._floor_curves[key].time_within(room / held, saturate=True)
            overflow = even_overflow(held, room, least_act)
            if math.isinf(overflow):
                return math.inf, time_floor
        share = max(order_work / p, order_largest)
        order_floor = overflow * (even_pipeline_s(share, order_work, p, v, m) + fixed)
        return order_floor, time_floor


def costed_candidate(
    strategy: Strategy, modes: Sequence[Recompute], tables: BoundTables
) -> Candidate:
    """Per-unit costs of one outer choice and lower bounds on its step time and memory."""
    model, cluster = tables.model, tables.cluster
    by_mode = {mode: model.unit_costs(strategy, mode) for mode in modes}
    first = next(iter(by_mode.values()))
    p, v, m = strategy.pp_degree, strategy.virtual_stages, strategy.num_micro_batches
    constants = memory_constants(first, cluster, strategy)
    usable = constants.usable_bytes(model.usable_capacity_bytes())
    # Identical units share their cost objects: bound over distinct units with multiplicity.
    overlap = model.dp_overlap(strategy)
    largest = tail_a = tail_b = least_act = static_sum = static_max = 0.0
    classes: list[tuple[int, list[tuple[float, float]]]] = []  # (count, [(bytes, time)])
    for rep, count in tables.class_counts.items():
        per_mode = [costs[rep] for costs in by_mode.values()]
        largest = max(largest, min(c.time_s for c in per_mode))
        tail_a += count * min(rank_tail_terms(c, overlap)[0] for c in per_mode)
        tail_b += count * min(rank_tail_terms(c, overlap)[1] for c in per_mode)
        least_act += count * min(c.activation_bytes for c in per_mode)
        static_sum += count * per_mode[0].static_bytes
        static_max = max(static_max, per_mode[0].static_bytes)
        classes.append((count, [(c.activation_bytes, c.time_s) for c in per_mode]))
    spec = strategy.schedule_spec
    # Each rank's stages all hold at least this many micro-batches at once at some point.
    least_inflight = least_held(spec)
    memory_bound = max((static_sum + least_inflight * least_act) / p, static_max)
    # Rank r needs static_r + held_r * act_r <= usable, so summed over the ranks the
    # activations held per micro-batch cannot exceed (p * usable - static) / least held:
    # the recompute modes must at least buy that much memory back.
    budget = (p * usable - static_sum) / least_inflight if least_inflight else math.inf
    curve = RecomputeCurve.of(classes)
    total = curve.time_within(budget)
    if math.isinf(total):  # not even the leanest recompute modes fit: no plan does
        memory_bound = math.inf
    work = total  # the units' own work (what `schedule_bound` scales)
    # Every message of every boundary costs its host time on some rank (busy work), whatever
    # the cut; links only delay (they are not counted).
    # (every crossing boundary posts its messages at the same host cost: count them)
    crossings = boundary_crossings(strategy)
    messages = 2 * crossings * model.boundary(first[0], strategy, 0).message_s if crossings else 0.0
    total += messages
    # Proven: the pipeline's bound (`pipeline_lower_bound_s`), after which some rank's tail
    # (at least the loop's fixed overhead) still runs; and every rank's own work plus its tail
    # (the busiest rank's at least the average).
    fixed = model.step_overhead_s(strategy)
    # the least share of a stage's work off its weight half (`pipeline_lower_bound_s`)
    chain = min(
        (
            1.0 - c.weight_s / (c.forward_s + c.backward_s)
            for costs in by_mode.values()
            for c in costs
            if c.forward_s + c.backward_s > 0
        ),
        default=0.0,
    )
    time_bound = max(
        pipeline_lower_bound_s(spec, total, largest, chain) + fixed,
        m * total / p + max(0.0, tail_a, tail_b) / p + fixed,
    )
    if tables.uniform_middle is not None and p > 1:
        # whole units per rank, with each rank's fill, drain and tail
        first_class, middle_class, count, last_class = tables.uniform_middle
        floors = [
            unit_floor([c[rep] for c in by_mode.values()], overlap)
            for rep in (first_class, middle_class, last_class)
        ]
        time_bound = max(
            time_bound, whole_unit_bound(spec, floors[0], floors[1], count, floors[2]) + fixed
        )
    units = [costs[rep] for costs in by_mode.values() for rep in tables.class_counts]
    forward_shares = [c.forward_s / c.time_s for c in units if c.time_s > 0]
    weight_shares = [c.weight_s / c.backward_s for c in units if c.backward_s > 0]
    # Visiting order: evenly cut stages (`even_pipeline_s`), plus the average tail. The work
    # pays for the recompute an even cut needs: every rank holds its share of the activations
    # as often as its schedule makes it (`even_held`), not as rarely as the bound above may
    # assume (`least_held`, 1 for every schedule but GPipe, as if one stage of each rank could
    # take all of them). Ordered by the bound's work instead, memory-tight pipelines with
    # large micro-batches, whose cuts must recompute nearly everything, came first by up to a
    # third of their step and used up the budget before plans without that recompute (e.g.
    # expert parallelism on one pipeline rank) were reached; and if no even cut fits even
    # under the leanest modes, it goes behind by its overflow (`even_overflow`).
    held = even_held(spec)
    order_work = total
    if held > least_inflight:
        order_work = messages + curve.time_within((p * usable - static_sum) / held, saturate=True)
    share = max(order_work / p, largest)
    order_key = even_pipeline_s(share, order_work, p, v, m) + max(0.0, tail_a, tail_b) / p + fixed
    overflow = even_overflow(held, p * usable - static_sum, least_act)
    order_key = math.inf if math.isinf(overflow) else overflow * order_key
    return Candidate(
        order_key_s=order_key,
        work_s=work,
        fixed_s=fixed,
        forward_cells=share_range(forward_shares or [0.0, 1.0]),
        weight_cells=share_range(weight_shares or [0.0, 1.0]),
        strategy=strategy,
        by_mode=by_mode,
        constants=constants,
        time_lower_bound_s=time_bound,
        memory_lower_bound_bytes=memory_bound,
        usable_bytes=usable,
    )


def refined_candidate(candidate: Candidate, tables: BoundTables, work: Work) -> Candidate:
    """``candidate`` with its bounds raised by each rank's memory (`bounds.memory_unit_bound`:
    a rank that must recompute to fit holds whole units and pays for it), its work charged;
    itself when the units between the first and the last are not identical."""
    if tables.uniform_middle is None:
        return candidate
    model, strategy = tables.model, candidate.strategy
    overlap = model.dp_overlap(strategy)

    def modes(rep: int) -> UnitModes:
        costs = [by_unit[rep] for by_unit in candidate.by_mode.values()]
        return UnitModes(
            modes=tuple(
                (c.forward_s + c.backward_s, c.activation_bytes, c.retained_bytes) for c in costs
            ),
            static_bytes=costs[0].static_bytes,
            floor=unit_floor(costs, overlap),
        )

    first_class, middle_class, count, last_class = tables.uniform_middle
    first = next(iter(candidate.by_mode.values()))
    found = memory_unit_bound(
        strategy.schedule_spec,
        modes(first_class),
        modes(middle_class),
        count,
        modes(last_class),
        capacity_bytes=candidate.usable_bytes,
        send_bytes=boundary_send_bytes(first, tables.cluster.calibration),
    )
    work.schedule(strategy.schedule_spec)
    work.charge(REFINE_S + found.curves * RANK_CURVE_S)
    return replace(
        candidate,
        time_lower_bound_s=max(candidate.time_lower_bound_s, found.level_s + candidate.fixed_s),
        work_s=max(candidate.work_s, found.work_s),
    )


def _compute_floor(costs: Sequence[UnitCost]) -> UnitFloor:
    """A unit's least compute over its costs under each recompute mode, no communication and
    no tail (what `BoundTables.floors` may count from a strategy's units alone)."""
    return UnitFloor(
        forward_s=min(c.forward_compute_s for c in costs),
        backward_s=min(c.backward_compute_s + c.recompute_s for c in costs),
        tail_s=(0.0, 0.0),
    )


def unit_floor(costs: Sequence[UnitCost], overlap: float) -> UnitFloor:
    """A unit's least times over its costs under each recompute mode (`bounds.UnitFloor`)."""
    tails = [rank_tail_terms(c, overlap) for c in costs]
    return UnitFloor(
        forward_s=min(c.forward_s for c in costs),
        backward_s=min(c.backward_s for c in costs),
        tail_s=(min(t[0] for t in tails), min(t[1] for t in tails)),
    )


def boundary_crossings(strategy: Strategy) -> int:
    """Stage boundaries whose two stages sit on different pipeline ranks: all of them when
    p > 1, but the turn of a V (stage p-1 to p, both on rank p-1)."""
    if strategy.pp_degree == 1:
        return 0
    return strategy.num_stages - 1 - (strategy.schedule_placement == "v")


def even_pipeline_s(share_s: float, work_s: float, p: int, v: int, m: int) -> float:
    """The visiting order's pipeline time of an even cut: ``max(m, p) T + (min(m, p) - 1) T' / v``
    with ``T`` a rank's share of the per-micro-batch work (``share_s``: ``work_s / p``, or the
    largest unit if more) and ``T' = work_s / p``. One stage per rank: 1F1B's ``(m + p - 1) T``;
    ``v`` stages per rank and ``m >= p``: the bubble shrinks to ``(p - 1) T / v`` (Narayanan
    et al. 2021, section 2.2). With fewer micro-batches than ranks every chunk waits for the
    whole pipeline: one micro-batch runs its ``p v`` stages in turn, ``p T``. (The former key,
    ``(m - 1/v) T + p T / v``, gave one micro-batch ``T + (p - 1) T / v`` and put pipelines of
    one or two micro-batches first at half their step.) Monotone in both times, so the floors
    stay under the keys."""
    return max(m, p) * share_s + (min(m, p) * work_s / p - share_s) / v


def even_overflow(held: float, room_bytes: float, least_act_bytes: float) -> float:
    """How far an even cut overflows memory under the leanest modes, as a factor >= 1 on the
    visiting order's key: ``held`` rank shares of ``least_act_bytes`` must fit the
    ``room_bytes`` the pipeline ranks' state leaves. When they do not (e.g. a split backward,
    which cannot recompute), only cuts that load the ranks holding fewer micro-batches can
    fit: ordered behind by the overflow, finitely, so that a model no even cut fits keeps an
    order; inf when no room is left at all (the memory bound drops those). Smaller with more
    room and fewer bytes, so the floors (more room, fewer bytes) stay under the keys."""
    need = held * least_act_bytes
    if need <= room_bytes:
        return 1.0
    return need / room_bytes if room_bytes > 0 else math.inf


def partition_problem(candidate: Candidate, model: CostModel) -> PartitionProblem:
    """The stage-partition problem of a candidate, in the cost model's own terms."""
    cluster = model.cluster
    strategy = candidate.strategy
    spec = strategy.schedule_spec
    overlap = model.dp_overlap(strategy)
    first = next(iter(candidate.by_mode.values()))
    fixed = model.step_overhead_s(strategy)
    # the rank tail as two linear terms (`rank_tail_terms`), each plus the fixed overhead
    tables = {
        mode: ModeCosts(
            forward_s=tuple(c.forward_s for c in costs),
            backward_s=tuple(c.backward_s for c in costs),
            weight_s=tuple(c.weight_s for c in costs),
            activation_bytes=tuple(c.activation_bytes for c in costs),
            retained_bytes=tuple(c.retained_bytes for c in costs),
            tail_s=tuple(zip(*(rank_tail_terms(c, overlap) for c in costs), strict=True)),
        )
        for mode, costs in candidate.by_mode.items()
    }
    # A boundary's cost depends on the stage and its last unit's output bytes only: priced
    # once per stage and distinct size, and stages with equal rows share one row (thousands of
    # stages of thousands of units would otherwise hold millions of floats).
    sizes: dict[float, int] = {}  # output bytes -> index among the distinct sizes
    size_of = [sizes.setdefault(c.output_bytes, len(sizes)) for c in first]
    sample = {c.output_bytes: c for c in reversed(first)}  # a unit of each size
    rows: dict[tuple[float, ...], tuple[float, ...]] = {}
    transfer_s, message_s = [], []
    for s in range(spec.num_stages):
        priced = [model.boundary(sample[size], strategy, s) for size in sizes]
        by_size = tuple(b.transfer_s for b in priced)
        row = rows.get(by_size)
        if row is None:
            row = rows[by_size] = tuple(by_size[k] for k in size_of)
        transfer_s.append(row)
        message_s.append(priced[0].message_s)  # (unit 0's size comes first)
    return PartitionProblem(
        spec=spec,
        modes=tables,
        static_bytes=tuple(c.static_bytes for c in first),
        transfer_s=tuple(transfer_s),
        message_s=tuple(message_s),
        memory_capacity_bytes=candidate.usable_bytes,
        send_bytes=boundary_send_bytes(first, cluster.calibration),
        tail_constants_s=(fixed, fixed),
        # a stage may recompute its first few blocks only where the stack runs that
        # (`FrameworkProfile.partial_recompute` "stage": autoplan's runtime)
        recomputable=(
            tuple(c.kind in RECOMPUTED_UNIT_KINDS for c in first)
            if model.stack.partial_recompute == "stage"
            else ()
        ),
    )
