"""The outer enumeration streamed shape by shape (`autoplan.planner.enumeration`): every member
of a shape once, shape floors below their members' proven floors, and a budgeted search's gap,
shapes left unexpanded included, true against the unbudgeted optimum."""

from __future__ import annotations

import pytest

from autoplan.planner.candidates import BoundTables
from autoplan.planner.enumeration import Enumeration
from autoplan.planner.frontier import SearchStats
from autoplan.planner.search import search_plans
from autoplan.planner.space import SearchSpace, recompute_modes
from autoplan.planner.stack_filter import stack_recompute_modes, stack_strategies
from autoplan.planner.work import Work
from cost_model.estimate import CostModel
from cost_model.frameworks import framework_profile
from tests.cost_profiles import with_routed_experts
from tests.test_search import _random_case


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("experts", [0, 8])
def test_shapes_hold_every_choice_once_above_their_floor(seed: int, experts: int) -> None:
    """Expanding every shape gives each outer choice of the space once (the stack's refusals
    and the memory bound's drops aside), and each kept choice's proven floor is at least its
    shape's floor: the visit may leave a shape unexpanded on that floor. The random cases
    include spaces without "none" among their recompute modes (the shape floor prices none)."""
    profile, cluster, global_batch, constraints = _random_case(seed)
    if experts:
        profile = with_routed_experts(profile, num_experts=experts, top_k=2, expert_ffn=128)
    space = SearchSpace.from_constraints(**constraints)
    tables = BoundTables(CostModel(profile, cluster))
    stats = SearchStats()
    enumeration = Enumeration(space, tables, cluster, global_batch, stats, Work(None))
    assert enumeration.left, "every case has a shape"
    kept = []
    for entry in enumeration.take_left():
        for pending in enumeration.expand(entry):
            assert pending.time_floor_s >= entry.floor_s * (1 - 1e-12)
            kept.append(pending.strategy)
    stack = framework_profile("autoplan")
    # (what the stack runs, with some recompute mode for its stages)
    every = [
        s
        for s, refusal in stack_strategies(space, stack, profile, cluster, global_batch)
        if refusal is None
        and stack_recompute_modes(stack, s, profile, recompute_modes(space, s.schedule))[1] is None
    ]
    dropped = enumeration.infeasible
    assert len(kept) + len(dropped) == len(every) == stats.candidates
    assert sorted(map(repr, kept + dropped)) == sorted(map(repr, every))


@pytest.mark.parametrize("seed", range(6))
def test_a_budgeted_gap_holds_against_the_optimum(seed: int) -> None:
    """A search cut short by its budget (shapes left unexpanded, candidates unvisited) returns
    a plan and a gap that is true: the unbudgeted search's optimum is no better than the
    budgeted best less its gap."""
    profile, cluster, global_batch, constraints = _random_case(seed)
    proven = search_plans(
        profile, cluster, global_batch=global_batch, budget_s=None, **constraints
    ).stats
    assert proven.optimality_gap == 0.0
    assert proven.best_objective_s is not None
    left = 0
    for budget in (0.005, 0.05, 0.5):
        cut = search_plans(
            profile, cluster, global_batch=global_batch, budget_s=budget, **constraints
        ).stats
        assert cut.best_objective_s is not None
        left += cut.shapes_left
        low = cut.best_objective_s * (1 - cut.optimality_gap)
        # (the solver's own relative gap aside)
        assert proven.best_objective_s >= low * (1 - 1e-3)
    if seed in (0, 1):
        assert left > 0, "a small budget leaves shapes unexpanded"
