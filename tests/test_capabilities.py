"""One statement of what each stack runs: on a grid of plans, the search's space, `Plan.validate`,
the exporters and `parallelize`'s refusal (`runtime_refusal`) agree for every stack with its
profile's limits (`cost_model.frameworks.limits`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import ModelRef, Plan, StagePlan, even_stages, runtime_refusal
from autoplan.export import ExportError, ModelDims, MoEDims, export_plan
from autoplan.planner.search import _space_for
from autoplan.planner.space import ConstraintError, SearchSpace, recompute_modes, strategies
from autoplan.planner.stack_filter import stack_recompute_modes
from cost_model.frameworks import DEFAULT_FRAMEWORK, FRAMEWORKS, FrameworkError, framework_profile
from cost_model.frameworks.limits import axis_limits, outer_refusals, plan_refusals
from cost_model.stage_splits import StageSplitError
from cost_model.strategy import Strategy
from cost_model.workload import ModelProfile
from tests.cost_profiles import gpt_profile, with_routed_experts

# H100s with MX block-scaled rates too (as Blackwell states them), so every fp8 recipe prices
_H100 = autoplan.Cluster.preset("dgx-h100-80g", nodes=2)
CLUSTER = dataclasses.replace(
    _H100,
    device=dataclasses.replace(
        _H100.device, peak_flops={**_H100.device.peak_flops, "mxfp8": 1979e12}
    ),
)
GLOBAL_BATCH = 32
GRID = {"tp": (1, 2), "pp": (1, 2, 4), "cp": (1, 2), "micro_batch": (1,)}
DTYPES = ("bf16", "fp16", "fp32", "fp8", "fp8-rowwise", "mxfp8")
# every k-th outer choice of the grid (all of them: ~10x the time, the same verdicts)
STRIDE = 5


def _models() -> dict[str, ModelProfile]:
    dense = gpt_profile(num_layers=4, s=1024, h=256, a=8)
    moe = with_routed_experts(dense, num_experts=4, top_k=2, expert_ffn=256)
    return {
        "dense": dense,
        "moe": moe,
        # autoplan's runtime on a torch.export graph, and on a model without RoPE tables
        "exported": dataclasses.replace(dense, exported=True),
        "no-rope": dataclasses.replace(moe, rope_tables=False),
    }


MODELS = _models()


def _constraints(profile: ModelProfile) -> dict[str, tuple[int, ...]]:
    """The grid's constraints (expert parallelism for a model with experts)."""
    return {**GRID, "ep": (1, 2)} if profile.has_experts else GRID


def _grid(profile: ModelProfile) -> Iterator[Strategy]:
    """The grid's valid outer choices (dominated ones too), every `STRIDE`-th."""
    found = (
        strategy
        for dtype in DTYPES
        for strategy in strategies(
            SearchSpace(**_constraints(profile), dtype=(dtype,)),  # type: ignore[arg-type]
            profile,
            CLUSTER,
            GLOBAL_BATCH,
            skip_dominated=False,
        )
    )
    return itertools.islice(found, 0, None, STRIDE)


def _stage_choices(
    strategy: Strategy, profile: ModelProfile, framework: str
) -> Iterator[tuple[StagePlan, ...]]:
    """Each recompute mode on every stage, one mix, and the stack's own cut where it differs."""
    num_stages = strategy.pp_degree * strategy.virtual_stages
    for mode in ("none", "selective", "full"):
        yield even_stages(profile.num_units, num_stages, mode)
    if num_stages > 1:
        even = even_stages(profile.num_units, num_stages, "full")
        yield (dataclasses.replace(even[0], recompute="none"), *even[1:])
        stack = framework_profile(framework)
        if stack.stage_cuts == "own":
            try:
                starts = stack.stage_starts(profile, num_stages)
            except StageSplitError:
                return  # its rule cuts inside a unit: it has no cut of its own here
            ends = [*starts[1:], profile.num_units]
            own = tuple(
                StagePlan(first_unit=first, last_unit=end - 1, recompute="none")
                for first, end in zip(starts, ends, strict=True)
            )
            if own != even_stages(profile.num_units, num_stages):
                yield own


def _plan(
    strategy: Strategy, stages: tuple[StagePlan, ...], profile: ModelProfile, framework: str
) -> Plan:
    return Plan(
        model=ModelRef.of(profile),
        dp_degree=strategy.dp_degree,
        tp_degree=strategy.tp_degree,
        pp_degree=strategy.pp_degree,
        cp_degree=strategy.cp_degree,
        ep_degree=strategy.ep_degree,
        ep_folding=strategy.ep_folding,
        virtual_stages=strategy.virtual_stages,
        stages=stages,
        micro_batch_size=strategy.micro_batch_size,
        num_micro_batches=strategy.num_micro_batches,
        global_batch_size=GLOBAL_BATCH,
        schedule=strategy.schedule,
        zero_stage=strategy.zero_stage,
        sequence_parallel=strategy.sequence_parallel,
        dtype=strategy.dtype,  # type: ignore[arg-type]
        fp8_all_gather=strategy.fp8_all_gather,
        rank_layout=strategy.rank_layout,
        framework=framework,
    )


def _meaning(strategy: Strategy) -> tuple[object, ...]:
    """What a stack runs of ``strategy``: its schedule only with pipeline stages, its rank
    order only over the axes of degree > 1, where its ep groups sit only where that differs
    (the search enumerates one spelling of each)."""
    fields = dataclasses.asdict(strategy)
    if strategy.pp_degree == 1:
        fields["schedule"] = None
    fields["rank_layout"] = tuple(a for a in strategy.rank_layout if strategy.degree(a) > 1)
    if strategy.ep_degree == 1 or strategy.tp_degree == strategy.cp_degree == 1:
        fields["ep_folding"] = None  # the same ranks either way (`Plan.folded_expert_groups`)
    return tuple(sorted(fields.items()))


class _Offered:
    """What the search offers ``framework`` on ``profile``: its space per dtype
    (`_space_for`, the stack's restriction applied), the outer choices in it, and the
    recompute modes and cuts it gives their stages."""

    def __init__(self, profile: ModelProfile, framework: str) -> None:
        self.profile, self.stack = profile, framework_profile(framework)
        self.spaces: dict[str, SearchSpace | None] = {}
        self.choices: dict[str, set[tuple[object, ...]]] = {}
        for dtype in DTYPES:
            try:
                space = _space_for(
                    profile,
                    CLUSTER,
                    GLOBAL_BATCH,
                    framework,
                    {**_constraints(profile), "dtype": dtype},
                )
            except ConstraintError:
                self.spaces[dtype], self.choices[dtype] = None, set()
                continue
            self.spaces[dtype] = space
            self.choices[dtype] = {
                _meaning(s)
                for s in strategies(space, profile, CLUSTER, GLOBAL_BATCH, skip_dominated=False)
            }

    def offers(self, plan: Plan) -> bool:
        strategy, space = Strategy.of(plan), self.spaces[plan.dtype]
        if space is None or _meaning(strategy) not in self.choices[plan.dtype]:
            return False
        if self.stack.refusal(strategy, self.profile, running=self._running) is not None:
            return False
        space_modes = recompute_modes(space, strategy.schedule)
        modes, _ = stack_recompute_modes(self.stack, strategy, self.profile, space_modes)
        used = {stage.recompute for stage in plan.stages}
        if not used <= set(modes):
            return False
        if self.stack.recompute_scope == "global" and len(used) > 1:
            return False  # the search prices each mode alone
        if self.stack.stage_cuts == "own" and len(plan.stages) > 1:
            try:
                starts = self.stack.stage_starts(self.profile, len(plan.stages))
            except StageSplitError:
                return False  # the search prices no cut of its own there
            return tuple(stage.first_unit for stage in plan.stages) == starts
        return True

    @property
    def _running(self) -> bool:
        return self.stack.name == DEFAULT_FRAMEWORK


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_search_validate_and_parallelize_agree_with_the_stack(framework: str, model: str) -> None:
    """For every plan of the grid: the search offers it iff the stack's profile runs it, and
    `Plan.validate` refuses it iff the profile refuses it, with the profile's message; for
    autoplan's runtime that refusal is `runtime_refusal`, what `parallelize` checks."""
    profile, stack = MODELS[model], framework_profile(framework)
    offered = _Offered(profile, framework)
    running = framework == DEFAULT_FRAMEWORK
    checked = refused = 0
    for strategy in _grid(profile):
        for stages in _stage_choices(strategy, profile, framework):
            try:
                plan = _plan(strategy, stages, profile, framework)
            except PlanError as error:
                # the one stack rule a plan checks as it is built: where ep groups go
                layout = [
                    str(r)
                    for r in outer_refusals(stack, strategy, profile, running=running)
                    if r.limit == "expert-layout"
                ]
                assert layout == [str(error)], error
                assert not offered.offers(plan_fields(strategy, stages, profile))
                continue
            refusal = stack.plan_refusal(plan, profile, running=running)
            if refusal is not None:
                _assert_one_line_value_rule_fix(str(refusal), refusal.value, refusal.fix)
            if running:
                assert runtime_refusal(plan, profile) == (None if refusal is None else str(refusal))
            try:
                plan.validate(profile, CLUSTER)
            except (PlanError, FrameworkError) as error:
                said = str(error)
                if refusal is None or str(refusal) not in said:
                    continue  # refused for what every stack refuses (not this test's concern)
            else:
                assert refusal is None, (plan, refusal)
            checked += 1
            refused += refusal is not None
            assert offered.offers(plan) == (refusal is None), (plan, refusal)
    # the grid reaches both verdicts where the stack limits an axis of this model
    assert checked >= 40
    if axis_limits(stack, profile, running=running):
        assert refused > 0


def _assert_one_line_value_rule_fix(message: str, value: str, fix: str) -> None:
    """A refusal names the value, the rule and the fix, on one line."""
    assert value and fix and value in message and message.endswith(fix), message
    assert len(message) > len(value) + len(fix) + 10, message  # and a rule between them
    assert "\n" not in message, message


def plan_fields(strategy: Strategy, stages: tuple[StagePlan, ...], profile: ModelProfile) -> Plan:
    """The plan under autoplan's runtime (which places ep groups either way): what the search's
    membership is asked of when the stack's own plan cannot be built."""
    return _plan(strategy, stages, profile, DEFAULT_FRAMEWORK)


def _dims(profile: ModelProfile) -> ModelDims:
    moe = None
    if profile.has_experts:
        moe = MoEDims(
            num_experts=4,
            top_k=2,
            moe_ffn_hidden_size=256,
            shared_ffn_hidden_size=0,
            num_dense_layers=0,
            norm_topk_prob=True,
            aux_loss_coef=0.0,
        )
    return ModelDims(
        spec=profile.name,
        family="llama",
        num_layers=profile.num_units - 2,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=8,
        ffn_hidden_size=1024,
        seq_len=profile.seq_len,
        vocab_size=1024,
        tie_embeddings=False,
        moe=moe,
    )


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("target", ["deepspeed", "megatron-lm", "torchtitan"])
def test_exporters_refuse_what_the_stack_refuses(target: str, model: str) -> None:
    """An exporter refuses a plan for a stack limit iff the stack's profile refuses it, and
    names every limit the profile lists; its other problems are the file format's or the
    model's (`ExportProblem.limit` None)."""
    profile, stack = MODELS[model], framework_profile(target)
    dims = _dims(profile)
    checked = refused = 0
    for strategy in _grid(profile):
        for stages in _stage_choices(strategy, profile, target):
            plan = _plan(strategy, stages, profile, DEFAULT_FRAMEWORK)
            limits = {r.limit for r in plan_refusals(stack, plan, profile)}
            try:
                export_plan(plan, target, model=dims)
                problems: tuple[str | None, ...] = ()
            except ExportError as error:
                problems = tuple(problem.limit for problem in error.problems)
                for problem in error.problems:
                    _assert_one_line_value_rule_fix(str(problem), problem.value, problem.fix)
                    assert problem.field and problem.option
            assert {limit for limit in problems if limit is not None} == limits, plan
            checked += 1
            refused += bool(limits)
    assert checked >= 40 and refused > 0
