"""`autoplan.search` against brute-force enumeration of the same space under the same cost model.

Brute force visits every outer choice the space allows (no bounds, no pruning), every set of
stage cuts and every per-stage recompute assignment, scoring each with `partition.evaluate` on
the cost model's unit costs; a sample of those scores is checked against `cost_model.estimate`
itself, so the reference is the cost model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable

import pytest

from autoplan.contract.errors import NoFeasiblePlanError, PlanError
from autoplan.contract.plan import Plan, StagePlan
from autoplan.planner.bounds import RecomputeCurve
from autoplan.planner.candidates import (
    BoundTables,
    boundary_crossings,
    costed_candidate,
    partition_problem,
    refined_candidate,
)
from autoplan.planner.partition import brute_force, count_choices, evaluate
from autoplan.planner.search import SearchStats, _Frontier, _Pending, search_plans
from autoplan.planner.space import ConstraintError, SearchSpace, recompute_modes, strategies
from autoplan.planner.strategy_keys import (
    ACTIVATION_KEY,
    FLOOR_KEY,
    PARAMS_KEY,
    STATE_KEY,
    STRATEGY_FIELDS,
    Projection,
)
from autoplan.planner.work import Work
from cost_model.estimate import CostModel, estimate
from cost_model.hardware import Cluster
from cost_model.headroom import DEFAULT_MEMORY_HEADROOM, usable_capacity_bytes
from cost_model.schedules import SCHEDULES, pipeline_lower_bound_s
from cost_model.strategy import Strategy
from cost_model.uncertainty import TIE_FRACTION
from tests.cost_profiles import gpt_profile, round_cluster, with_routed_experts


def _random_case(seed: int) -> tuple[object, Cluster, int, dict[str, object]]:
    rng = random.Random(seed)
    num_layers = rng.randint(2, 14)  # 4-16 units with embedding and head
    h = rng.choice([256, 512, 1024])
    profile = gpt_profile(
        num_layers=num_layers, s=rng.choice([256, 512]), h=h, a=8, vocab=rng.choice([4096, 32768])
    )
    devices_per_node = rng.choice([4, 8])
    nodes = rng.choice([2, 4, 8]) if devices_per_node == 8 else rng.choice([2, 4, 8, 16])
    nodes = min(nodes, 64 // devices_per_node)
    base = round_cluster(num_nodes=nodes, devices_per_node=devices_per_node)
    cluster = base.with_overrides(
        memory_bytes=int(rng.uniform(0.05, 2.0) * 2**30),
        inter_node_bandwidth=rng.choice([1e9, 10e9, 50e9]),
        intra_node_bandwidth=rng.choice([50e9, 300e9]),
        step_overhead_s=rng.choice([0.0, 0.0, 5e-3]),
    )
    # Sometimes workers that share cores (the CPU rig): the search must stay exact there too.
    shared = rng.choice([None, None, None, 2])
    cluster = dataclasses.replace(cluster, shared_cores_per_node=shared)
    global_batch = rng.choice([16, 32, 64])
    n = profile.num_units
    # Keep brute force affordable: at most ~600 (cuts x modes) per outer choice.
    modes = tuple(rng.sample(["none", "selective", "full"], rng.randint(1, 2)))
    max_stages = n

    def work(stages: int) -> int:
        return max(math.comb(n - 1, s - 1) * len(modes) ** s for s in range(1, stages + 1))

    while work(max_stages) > 600 and len(modes) > 1:
        modes = modes[:1]
    while work(max_stages) > 600:
        max_stages -= 1
    virtual = (1, 2, 3)[: 1 + (max_stages >= 4) + (max_stages >= 6)]
    zero = tuple(sorted(rng.sample([0, 1, 2, 3], rng.randint(1, 2))))
    if work(max_stages) > 300:
        # (one ZeRO level where each outer choice has hundreds of partitions: the levels
        # multiply the outer choices, and the cases with fewer partitions try two)
        zero = zero[-1:]
    constraints: dict[str, object] = {
        "recompute": modes,
        "zero": zero,
        "max_micro_batch": rng.choice([2, 4]),
        "max_pp": max_stages // virtual[-1],
        "virtual_stages": virtual,
        "schedules": SCHEDULES,
        "dtype": "bf16",
    }
    return profile, cluster, global_batch, constraints


def _brute_force(profile, cluster, global_batch, constraints):  # type: ignore[no-untyped-def]
    # HSDP's members too, as the search offers them for autoplan's runtime (`_space_for`)
    space = dataclasses.replace(
        SearchSpace.from_constraints(**constraints), hsdp_domain=cluster.scale_up_domain
    )
    cache = BoundTables(CostModel(profile, cluster))
    best = math.inf
    checked = partial_checked = 0
    # every outer choice, the dominated ones (GPipe beside 1F1B, ZeRO-1 beside ZeRO-2, layouts
    # that cannot differ) included: skipping them must lose nothing
    for strategy in strategies(space, profile, cluster, global_batch, skip_dominated=False):
        candidate = costed_candidate(strategy, recompute_modes(space, strategy.schedule), cache)
        problem = partition_problem(candidate, cache.model)
        n, num_stages = problem.num_units, problem.num_stages
        for cuts in itertools.combinations(range(1, n), num_stages - 1):
            allowed = recompute_modes(space, strategy.schedule)
            for modes in itertools.product(allowed, repeat=num_stages):
                # partial stages too, as the search offers them (`PartitionProblem.partial`)
                for counts in count_choices(problem, (0, *cuts), modes):
                    result = evaluate(problem, (0, *cuts), modes, counts)
                    fits = result.peak_memory_bytes <= problem.memory_capacity_bytes
                    # (each improvement, and a few partial partitions, against the estimate)
                    partial_check = bool(counts) and partial_checked < 3
                    if checked < 3 or (fits and result.step_time_s < best) or partial_check:
                        checked += 1
                        partial_checked += partial_check
                        _check_against_estimate(
                            profile, cluster, strategy, (0, *cuts), modes, result, counts
                        )
                    if fits:
                        best = min(best, result.step_time_s)
    return best


def _check_against_estimate(profile, cluster, strategy, starts, modes, result, counts=()):  # type: ignore[no-untyped-def]
    ends = (*starts[1:], profile.num_units)
    counts = counts or (None,) * len(modes)
    plan = Plan(
        dp_degree=strategy.dp_degree,
        tp_degree=strategy.tp_degree,
        pp_degree=strategy.pp_degree,
        virtual_stages=strategy.virtual_stages,
        stages=tuple(
            StagePlan(first_unit=a, last_unit=b - 1, recompute=k, recompute_units=c)
            for a, b, k, c in zip(starts, ends, modes, counts, strict=True)
        ),
        micro_batch_size=strategy.micro_batch_size,
        num_micro_batches=strategy.num_micro_batches,
        global_batch_size=strategy.global_batch_size,
        schedule=strategy.schedule,
        zero_stage=strategy.zero_stage,
        dp_shard_degree=strategy.dp_shard_degree,
        sequence_parallel=strategy.sequence_parallel,
        dtype=strategy.dtype,
        rank_layout=strategy.rank_layout,
    )
    reference = estimate(profile, cluster, plan)
    assert reference.step_time_s == pytest.approx(result.step_time_s, rel=1e-9)
    # fits: within the device less the default headroom and the peak's range
    usable = usable_capacity_bytes(cluster.device.memory_bytes, DEFAULT_MEMORY_HEADROOM)
    assert reference.fits == (reference.peak_memory_bytes <= usable)


# No wall clock in an optimality test: no visit budget, and solver limits far beyond the work
# (a loaded machine must not turn a proof into a time-out).
UNTIMED: dict[str, object] = {"budget_s": None, "time_limit_s": 3600.0}


@pytest.mark.parametrize("seed", range(48))
def test_search_finds_the_brute_force_optimum(seed: int) -> None:
    profile, cluster, global_batch, constraints = _random_case(seed)
    expected = _brute_force(profile, cluster, global_batch, constraints)
    if math.isinf(expected):
        with pytest.raises(NoFeasiblePlanError):
            search_plans(profile, cluster, global_batch=global_batch, **UNTIMED, **constraints)
        return
    # the objective the brute force minimises: the predicted step
    result = search_plans(
        profile,
        cluster,
        global_batch=global_batch,
        objective="expected",
        **UNTIMED,
        **constraints,
    )
    best = result.plans[0]
    assert best.estimate is not None
    # the search stops within RELATIVE_GAP of the proven optimum of each outer choice
    found = result.stats.best_objective_s
    assert found is not None
    assert found <= expected * (1 + 1e-3)
    assert found >= expected * (1 - 1e-9)
    # the plan returned first is the optimum, or a tie within TIE_FRACTION of it that has
    # fewer unvalidated features or more memory headroom
    assert best.estimate.step_time_s <= found * (1 + TIE_FRACTION) * (1 + 1e-9)
    best.validate(profile, cluster)


@pytest.mark.parametrize(
    ("constraints", "fragment"),
    [
        ({"tp": 16, "max_tp": 8}, "tp=16 contradicts max_tp=8"),
        (
            {"virtual_stages": 2, "schedules": ("1f1b",)},
            "virtual_stages=2 needs a schedule with several stages per rank",
        ),
        ({"tp": 1, "sequence_parallel": True}, "sequence_parallel=True needs tp > 1"),
        ({"zero": 5}, "ZeRO levels are 0, 1, 2, 3"),
        ({"recompute": "most"}, "recompute: unknown 'most'"),
        ({"schedules": ("zb",)}, "schedules: unknown 'zb'"),
        ({"tensor_parallel": 2}, "unknown search constraint 'tensor_parallel'"),
        ({"micro_batch": 8, "max_micro_batch": 4}, "micro_batch=8 contradicts max_micro_batch=4"),
        ({"tp": ()}, "tp=() allows nothing"),
    ],
)
def test_contradictory_constraints_are_named(constraints: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConstraintError) as info:
        search_plans(gpt_profile(num_layers=2), round_cluster(), global_batch=8, **constraints)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("constraints", "fragment"),
    [
        ({"tp": 16}, "tp=16 does not divide the 8 devices"),
        ({"tp": 3}, "tp=3 does not divide the 8 devices"),
        ({"pp": 8}, "pp=8 exceeds the 4 pipeline units"),
        ({"dp": 8}, "dp=8 does not divide global_batch=4"),
    ],
)
def test_constraints_that_contradict_the_cluster(
    constraints: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ConstraintError) as info:
        search_plans(gpt_profile(num_layers=2), round_cluster(), global_batch=4, **constraints)
    assert fragment in str(info.value)


def test_errors_name_what_fails_and_only_that() -> None:
    profile = gpt_profile(num_layers=2, h=96, a=6)  # vocab 1024, ffn 384: tp=4 divides those
    with pytest.raises(ConstraintError, match=r"tp=4 does not divide the model's num_heads=6$"):
        search_plans(profile, round_cluster(), global_batch=8, tp=4)
    # one sample on 32 devices: dp = 1, and tp x pp cannot cover the rest; no constraint given
    with pytest.raises(NoFeasiblePlanError) as info:
        search_plans(profile, round_cluster(num_nodes=4), global_batch=1)
    message = str(info.value)
    assert "dp dividing global_batch=1" in message and "pp at most its 4 units" in message
    assert "constraints" not in message
    with pytest.raises(
        NoFeasiblePlanError, match=r"with the constraints pp=2; .*or relax the constraints"
    ):
        search_plans(profile, round_cluster(num_nodes=4), global_batch=1, pp=2)


def test_bf16_needs_a_device_that_states_it() -> None:
    """A V100 states fp16 tensor cores and no bf16: a bf16 plan would be priced at the fp16
    rate it cannot have, so search and manual plans refuse it."""
    from autoplan import manual_plan

    profile = gpt_profile(num_layers=2)
    v100 = Cluster.preset("dgx2-v100-32g")
    with pytest.raises(ConstraintError, match=r"dtype=bf16: V100-SXM3-32GB states no bf16"):
        search_plans(profile, v100, global_batch=16, dtype="bf16")
    with pytest.raises(PlanError, match=r"use dtype 'fp16'"):
        manual_plan(profile, v100, global_batch=16, dtype="bf16")
    assert search_plans(profile, v100, global_batch=16, budget_s=0).plans[0].dtype == "fp16"


def test_cross_node_tp_needs_permission() -> None:
    with pytest.raises(ConstraintError, match="tp=16 does not fit inside a node of 8 devices"):
        search_plans(
            gpt_profile(num_layers=2, a=16), round_cluster(num_nodes=2), global_batch=4, tp=16
        )


def test_no_feasible_plan_names_the_least_memory() -> None:
    profile = gpt_profile(num_layers=4, h=1024, s=512)
    tiny = round_cluster(memory_bytes=8 * 2**20)  # 8 MiB per device
    with pytest.raises(NoFeasiblePlanError) as info:
        search_plans(profile, tiny, global_batch=8)
    message = str(info.value)
    assert "the least memory per device any of the" in message
    assert "the device has 0.0 GiB" in message or "the device has 0.01 GiB" in message
    # nothing was restricted: only more or larger devices help
    assert message.endswith("; use more devices or devices with more memory"), message
    with pytest.raises(NoFeasiblePlanError) as info:
        search_plans(profile, tiny, global_batch=8, recompute="none", zero=(0, 1))
    message = str(info.value)
    # the user's own constraints are the ones it suggests lifting
    assert message.endswith(
        "use more devices or devices with more memory, allow recompute 'full', or allow ZeRO "
        "level 3"
    ), message


def test_top_k_is_ranked_and_constraints_are_obeyed() -> None:
    profile = gpt_profile(num_layers=6, h=512, s=256)
    cluster = round_cluster(num_nodes=2)
    result = search_plans(
        profile, cluster, global_batch=32, top_k=4, tp=(2, 4), zero=(0, 1), recompute="none"
    )
    # ranked by the default objective, the upper end of each step's 80% range, except that
    # plans within TIE_FRACTION of the best tie (and go to fewer unvalidated features)
    highs = [p.estimate.step_time_high_s for p in result.plans if p.estimate]
    assert len(highs) == 4
    # (the best's own high equals it up to the last bit: the range is applied twice apart)
    best = result.stats.best_objective_s
    assert all(h >= best * (1 - 1e-12) for h in highs)  # type: ignore[operator]
    band = result.stats.best_objective_s * (1 + TIE_FRACTION)  # type: ignore[operator]
    outside = [h for h in highs if h > band]
    assert outside == sorted(outside) and highs[len(highs) - len(outside) :] == outside
    for plan in result.plans:
        assert plan.tp_degree in (2, 4) and plan.zero_stage in (0, 1)
        assert all(s.recompute == "none" for s in plan.stages)
        plan.validate(profile, cluster)
    assert result.stats.solver_calls >= 4
    assert result.stats.candidates >= result.stats.solver_calls


def test_memory_aware_time_bound_by_hand() -> None:
    # Two identical units, modes (bytes, seconds): none (10, 1.0), selective (6, 1.2),
    # full (1, 2.0). From "none" the hull goes to selective (0.2 s / 4 B = 0.05 s/B), then to
    # full (0.8 s / 5 B = 0.16 s/B); each segment saves that many bytes per unit.
    curve = RecomputeCurve.of([(2, [(10.0, 1.0), (6.0, 1.2), (1.0, 2.0)])])
    assert curve.time_within(25.0) == pytest.approx(2.0)  # fits as is
    # 20 B held, budget 12: save 8 B at 0.05 s/B -> 2.0 + 0.4 = 2.4 (both selective)
    assert curve.time_within(12.0) == pytest.approx(2.4)
    # budget 7: 8 B at 0.05 + 5 B at 0.16 -> 2.0 + 0.4 + 0.8 = 3.2 (selective + full)
    assert curve.time_within(7.0) == pytest.approx(3.2)
    # even full recompute holds 2 B
    assert curve.time_within(1.0) == math.inf
    # ... unless saturated (the visiting order's even cut): the leanest modes, 2 x 2.0 s
    assert curve.time_within(1.0, saturate=True) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("schedule", "p", "v"),
    [
        ("1f1b", 1, 1),
        ("1f1b", 4, 1),
        ("interleaved-1f1b", 3, 3),
        ("zbv", 4, 2),
        ("dualpipev", 2, 2),
    ],
)
def test_boundary_crossings_follow_the_placement(schedule: str, p: int, v: int) -> None:
    strategy = Strategy(pp_degree=p, virtual_stages=v, schedule=schedule, num_micro_batches=8)
    ranks = [strategy.pipeline_rank_of_stage(s) for s in range(p * v)]
    assert boundary_crossings(strategy) == sum(a != b for a, b in itertools.pairwise(ranks))


def test_the_costed_bound_is_below_the_optimum() -> None:
    """A candidate's proven bound (with whole units per rank, each rank's fill, drain and tail:
    `bounds.whole_unit_bound`) never exceeds the best simulated step of any partition that
    fits, found by brute force, over random cases; and it is above the fractional bounds
    somewhere (it matters)."""
    checked = raised = refined_raised = 0
    for seed in range(10):
        profile, cluster, global_batch, constraints = _random_case(seed)
        space = SearchSpace.from_constraints(**constraints)
        cache = BoundTables(CostModel(profile, cluster))
        assert cache.uniform_middle is not None
        for strategy in strategies(space, profile, cluster, global_batch):
            if strategy.pp_degree == 1:
                continue
            modes = recompute_modes(space, strategy.schedule)
            candidate = costed_candidate(strategy, modes, cache)
            if candidate.memory_lower_bound_bytes > candidate.usable_bytes:
                continue
            problem = partition_problem(candidate, cache.model)
            best = brute_force(problem)
            if best is None:
                continue
            assert candidate.time_lower_bound_s <= best.step_time_s * (1 + 1e-9), strategy
            checked += 1
            fractional = (
                pipeline_lower_bound_s(strategy.schedule_spec, candidate.work_s, 0.0)
                + candidate.fixed_s
            )
            raised += candidate.time_lower_bound_s > fractional * 1.01
            # with each rank's memory (`bounds.memory_unit_bound`): the step, and the units'
            # work summed over the stages, of the best fitting partition
            refined = refined_candidate(candidate, cache, Work(None))
            assert refined.time_lower_bound_s <= best.step_time_s * (1 + 1e-9), strategy
            units = best.stage_units(problem.num_units)
            work = sum(
                candidate.by_mode[mode][u].forward_s + candidate.by_mode[mode][u].backward_s
                for mode, stage in zip(best.modes, units, strict=True)
                for u in stage
            )
            assert refined.work_s <= work * (1 + 1e-9), strategy
            refined_raised += refined.time_lower_bound_s > candidate.time_lower_bound_s * 1.01
    assert checked >= 20 and raised >= 5, (checked, raised)
    assert refined_raised >= 1, refined_raised


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("experts", [0, 8])
def test_floors_are_below_the_order_key_and_every_step(seed: int, experts: int) -> None:
    """The lazy visit costs a choice only when its floor passes the order keys of costed ones
    (so the order is the eager one), and drops choices by the proven floor: both must hold
    for every choice, against random partitions' simulated steps; for dense models and with
    routed experts (expert parallelism, its all-to-all and its memory in the floors)."""
    profile, cluster, global_batch, constraints = _random_case(seed)
    if experts:
        profile = with_routed_experts(profile, num_experts=experts, top_k=2, expert_ffn=128)
    space = SearchSpace.from_constraints(**constraints)
    cache = BoundTables(CostModel(profile, cluster))
    rng = random.Random(seed)
    pending = []
    for index, strategy in enumerate(strategies(space, profile, cluster, global_batch)):
        modes = recompute_modes(space, strategy.schedule)
        order_floor, time_floor = cache.floors(strategy, modes)
        candidate = costed_candidate(strategy, modes, cache)
        pending.append(_Pending(order_floor, time_floor, index, strategy, modes))
        if candidate.memory_lower_bound_bytes > candidate.usable_bytes:
            continue  # dropped as it is costed
        assert order_floor <= candidate.order_key_s * (1 + 1e-12)
        problem = partition_problem(candidate, cache.model)
        n, S = problem.num_units, problem.num_stages
        for _ in range(3):
            cuts = sorted(rng.sample(range(1, n), S - 1))
            chosen = tuple(rng.choice(modes) for _ in range(S))
            step = evaluate(problem, (0, *cuts), chosen).step_time_s
            assert time_floor <= step * (1 + 1e-12)
    # the lazy frontier pops in the order of the order key, as costing all up front would
    frontier = _Frontier(pending, cache, SearchStats(), [], Work(None))
    popped = []
    while (entry := frontier.pop(math.inf)) is not None:
        popped.append(entry[1].order_key_s)
    assert popped == sorted(popped)
    fitting = [
        e
        for e in pending
        if (c := costed_candidate(e.strategy, e.modes, cache)).memory_lower_bound_bytes
        <= c.usable_bytes
    ]
    assert len(popped) == len(fitting)


# Other values of every `Strategy` field (a field added to `Strategy` fails the test below until
# it is named here, and `strategy_keys` refuses to import until every key sorts it).
_OTHER_VALUES: dict[str, tuple[object, ...]] = {
    "tp_degree": (1, 2, 4),
    "dp_degree": (1, 2, 4, 8),
    "pp_degree": (1, 2, 4),
    "virtual_stages": (1, 2),
    "micro_batch_size": (1, 2),
    "num_micro_batches": (1, 2, 4, 8),
    "schedule": SCHEDULES,
    "zero_stage": (0, 1, 2, 3),
    "sequence_parallel": (False, True),
    "tp_comm_overlap": (False, True),
    "dtype": ("bf16", "fp32", "fp8"),
    "fp8_all_gather": (False, True),
    "fp8_exclude": (("head",), ()),
    "master_dtype": ("fp32", "bf16"),
    "grad_reduce_dtype": (None, "fp32", "bf16"),
    "optimizer_state_dtype": ("fp32", "bf16"),
    "rank_layout": (
        ("pp", "dp", "tp"),
        ("dp", "pp", "tp"),
        ("pp", "dp", "cp", "tp"),
        ("pp", "cp", "dp", "tp"),
    ),
    "cp_degree": (1, 2),
    "ep_degree": (1, 2, 4),
    "ep_folding": (False, True),
    "etp_degree": (1, 2),
    "dp_shard_degree": (None, 2, 4),
    "compile": (False, True),
    "optimizer_offload": (0.0, 0.5, 1.0),
    "activation_offload": (False, True),
}


def test_cache_keys_name_every_field_their_values_read() -> None:
    """Each table's key (`strategy_keys`): changing a field the key ignores while the key stays
    the same leaves the table's value, computed afresh, unchanged."""
    assert set(_OTHER_VALUES) == STRATEGY_FIELDS
    profile = with_routed_experts(
        gpt_profile(num_layers=2, s=1024, h=256, a=8, e=2), num_experts=4, top_k=2, expert_ffn=128
    )
    cluster = round_cluster(num_nodes=2, devices_per_node=8)
    model = CostModel(profile, cluster)
    space = SearchSpace(cp=(1, 2))
    found = list(strategies(space, profile, cluster, 32))
    bases = found[:: max(1, len(found) // 12)]
    # and fp8 ones, whose fp8 fields the keys sort too
    bases += [dataclasses.replace(base, dtype="fp8", zero_stage=3) for base in bases[::3]]
    values: dict[str, Callable[[BoundTables, Strategy, tuple[str, ...]], object]] = {
        PARAMS_KEY.name: lambda t, s, m: t._param_count(s),
        ACTIVATION_KEY.name: lambda t, s, m: t._least_activations(s, m),
        STATE_KEY.name: lambda t, s, m: t._state_memory(s, m),
        FLOOR_KEY.name: lambda t, s, m: t._floor_tables(s, m),
    }
    compared: dict[tuple[str, str], int] = {}
    for projection in (PARAMS_KEY, ACTIVATION_KEY, STATE_KEY, FLOOR_KEY):
        value = values[projection.name]
        for base in bases:
            modes = tuple(recompute_modes(space, base.schedule))
            before = value(BoundTables(model), base, modes)
            for name in sorted(projection.ignores):
                for other in _OTHER_VALUES[name]:
                    changed = _changed(base, name, other)
                    if changed in (None, base) or projection.key(changed) != projection.key(base):
                        continue
                    assert changed is not None
                    after = value(BoundTables(model), changed, modes)
                    assert after == before, (projection.name, name, base, other)
                    compared[projection.name, name] = compared.get((projection.name, name), 0) + 1
    # every ignored field was changed at least once under an unchanged key
    for projection in (PARAMS_KEY, ACTIVATION_KEY, STATE_KEY, FLOOR_KEY):
        for name in projection.ignores:
            assert compared.get((projection.name, name), 0) > 0, (projection.name, name)


def _changed(strategy: Strategy, name: str, value: object) -> Strategy | None:
    """``strategy`` with field ``name`` set to ``value`` (None: that is no strategy)."""
    try:
        return dataclasses.replace(strategy, **{name: value})
    except ValueError:
        return None


def test_a_key_that_misses_a_field_is_refused() -> None:
    """A projection that leaves a `Strategy` field unsorted (e.g. one added to `Strategy`
    later) cannot be built."""
    with pytest.raises(TypeError, match=r"none \['zero_stage'\]"):
        Projection(
            "test",
            reads=("tp_degree",),
            ignores=STRATEGY_FIELDS - {"tp_degree", "zero_stage"},
        )
    with pytest.raises(TypeError, match=r"both \['tp_degree'\]"):
        Projection("test", reads=("tp_degree",), ignores=STRATEGY_FIELDS)
