"""Expert tensor parallelism (issue 43 item 6, `Plan.etp_degree`): the plan field and its
one-line refusals, the expert groups against Megatron-Core's own rank generator, the cost by
hand (`cost_model.parts.expert_parallel`), the stacks' refusals and the Megatron-LM export."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.export import ExportError, export_plan, model_dims
from autoplan.export.megatron import megatron_args
from autoplan.planner.search import _space_for, search_plans
from autoplan.planner.space import ConstraintError, etp_choices, strategies
from cost_model.communication import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from cost_model.estimate import CostModel
from cost_model.frameworks import framework_profile
from cost_model.frameworks.limits import outer_refusals
from cost_model.parts.expert_parallel import expert_cost
from cost_model.strategy import GroupPlacement, Strategy, group_placements, mesh_groups
from tests.cost_profiles import gpt_profile, round_cluster, with_routed_experts
from tests.test_export import _cp_ep_plan, _flags


def _moe_profile() -> Any:
    return with_routed_experts(
        gpt_profile(num_layers=2, s=1024, h=1024, a=8, e=2),
        num_experts=8,
        top_k=2,
        expert_ffn=512,
    )


def _groups(strategy: Strategy, group: str) -> list[list[int]]:
    inside, outside = mesh_groups(strategy, group)  # type: ignore[arg-type]
    offsets, bases = [0], [0]
    for step, count in inside:
        offsets = [o + i * step for o in offsets for i in range(count)]
    for step, count in outside:
        bases = [b + i * step for b in bases for i in range(count)]
    return sorted(sorted(b + o for o in offsets) for b in bases)


# ------------------------------------------------------------------------------ the plan


def test_default_is_not_written_and_etp_round_trips() -> None:
    plan = _cp_ep_plan()
    assert plan.etp_degree == 1 and "etp_degree" not in plan.to_data()
    split = _cp_ep_plan(etp_degree=2, ep_degree=2, framework="megatron-lm")
    data = split.to_data()
    assert data["etp_degree"] == 2
    assert Plan.from_data(data) == split


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"etp_degree": 3},
            r"^etp_degree = 3 does not divide tp_degree = 2: .* use one of \[1, 2\]$",
        ),
        ({"etp_degree": 0}, r"^etp_degree = 0 must be a whole number >= 1$"),
        ({"etp_degree": "2"}, r"^etp_degree = '2' must be a whole number >= 1$"),
        (
            {"etp_degree": 2, "ep_degree": 8},
            r"^ep_degree = 8 with ep_folding does not fold over tp 2 / etp 2 x cp 2 x dp 2: .*"
            r"use one of \[1, 2, 4\]$",
        ),
    ],
)
def test_bad_etp_is_one_line(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message) as caught:
        _cp_ep_plan(**changes)
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------------------ groups


@pytest.mark.parametrize(("tp", "etp", "ep"), [(4, 2, 2), (4, 2, 4), (4, 4, 2), (2, 1, 4)])
def test_groups_are_megatron_core_s(tp: int, etp: int, ep: int) -> None:
    """initialize_model_parallel's expert generator (order tp-cp-ep-dp-pp read as
    etp-ep-edp-pp, megatron/core/parallel_state.py) builds the strategy's etp, ep and
    expert-data-parallel groups, folded, on dp 4 x tp ranks and pp 2."""
    pytest.importorskip("megatron.core.parallel_state")
    from megatron.core.parallel_state import RankGenerator

    dp, pp = 4, 2
    strategy = Strategy(
        dp_degree=dp,
        tp_degree=tp,
        pp_degree=pp,
        ep_degree=ep,
        etp_degree=etp,
        ep_folding=True,
        sequence_parallel=True,
    )
    world = dp * tp * pp
    generator = RankGenerator(
        tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
    )

    def theirs(token: str) -> list[list[int]]:
        return sorted(sorted(g) for g in generator.get_ranks(token))

    assert _groups(strategy, "etp") == theirs("tp")
    assert _groups(strategy, "ep") == theirs("ep")
    assert _groups(strategy, "edp_cp") == theirs("dp")
    assert strategy.expert_dp_degree == world // (etp * ep * pp)


# ------------------------------------------------------------------------------ the cost


def test_expert_cost_with_etp_by_hand() -> None:
    """tp 2 with sequence parallelism, ep 4 folded over tp x dp (etp 1) or over dp (etp 2) on
    one 8-device node. etp 2: each rank stores half of each of its 2 experts; the pair
    all-gathers the tokens it received (2 x 1024 assignments x 1024 x 2 B) and reduce-
    scatters the outputs, forward and backward; each GEMM runs on twice the rows and half the
    width, the same FLOPs."""
    facts = _moe_profile().units[1].moe
    assert facts is not None
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    common: dict[str, Any] = dict(
        dp_degree=4, tp_degree=2, ep_degree=4, ep_folding=True, sequence_parallel=True
    )
    one = Strategy(**common)
    two = Strategy(**common, etp_degree=2)
    base = expert_cost(facts, one, cluster, group_placements(one, cluster, "ep"), "none", 2)
    split = expert_cost(facts, two, cluster, group_placements(two, cluster, "ep"), "none", 2)
    etp_group = group_placements(two, cluster, "etp")
    assert etp_group == (GroupPlacement(size=2, num_nodes=1, ranks_per_node=2),)
    assert split.local_params == base.local_params / 2 == 2 * 3 * 1024 * 512 / 2
    assert split.tokens_per_expert == 2 * base.tokens_per_expert
    assert split.forward_flops == base.forward_flops
    # ep 4 spans 2 tp x 2 dp ranks at etp 1, 4 dp ranks at etp 2: both one node, 4 ranks
    message = 1024 * 1024 * 2  # a rank's 1024 assignments (2048 / tp) of 1024 bf16
    gathered = 2 * message
    pair = all_gather_time_s(gathered, etp_group[0], cluster) + reduce_scatter_time_s(
        gathered, etp_group[0], cluster
    )
    assert split.all_to_all_forward_s == pytest.approx(base.all_to_all_forward_s + pair)
    assert split.all_to_all_backward_s == pytest.approx(base.all_to_all_backward_s + pair)
    # the gathered input kept for the weight gradients: the other rank's 1024 x 1024 x 2 B
    assert split.activation_bytes == base.activation_bytes + message
    full = expert_cost(facts, two, cluster, group_placements(two, cluster, "ep"), "full", 2)
    assert full.activation_bytes == 0.0 and full.all_activation_bytes == message
    # without sequence parallelism the TP ranks hold the same tokens: nothing gathered, the
    # GEMMs' FLOPs halve and the outputs are all-reduced once each way
    plain: dict[str, Any] = dict(dp_degree=4, tp_degree=2, ep_degree=4)
    whole, halves = Strategy(**plain), Strategy(**plain, etp_degree=2)
    w = expert_cost(facts, whole, cluster, group_placements(whole, cluster, "ep"), "none", 2)
    h = expert_cost(facts, halves, cluster, group_placements(halves, cluster, "ep"), "none", 2)
    reduce = all_reduce_time_s(2 * message, group_placements(halves, cluster, "etp")[0], cluster)
    assert h.tokens_per_expert == w.tokens_per_expert
    assert h.forward_flops == w.forward_flops / 2
    assert h.all_to_all_forward_s == pytest.approx(w.all_to_all_forward_s + reduce)


def test_unit_costs_and_memory_with_etp() -> None:
    """In the unit: etp 2 halves the expert weights a rank stores, and the plan's estimate
    prices it (Megatron-LM, the stack that runs it)."""
    profile = _moe_profile()
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    model = CostModel(profile, cluster)
    common: dict[str, Any] = dict(
        dp_degree=4, tp_degree=2, ep_degree=4, ep_folding=True, sequence_parallel=True
    )
    one = model.unit_costs(Strategy(**common), "none")[1]
    two = model.unit_costs(Strategy(**common, etp_degree=2), "none")[1]
    per_expert = 3 * 1024 * 512
    assert one.local_params - two.local_params == 2 * per_expert / 2
    assert two.ep_forward_s > one.ep_forward_s


# ------------------------------------------------------------------------------ stacks


@pytest.mark.parametrize("stack", ["torchtitan", "deepspeed"])
def test_stacks_without_etp_refuse_it_in_their_words(stack: str) -> None:
    strategy = Strategy(
        dp_degree=4,
        tp_degree=2,
        ep_degree=2,
        etp_degree=2,
        ep_folding=True,
        sequence_parallel=True,
    )
    model = _moe_profile()
    profile = framework_profile(stack)
    found = [r for r in outer_refusals(profile, strategy, model) if r.limit == "etp"]
    assert len(found) == 1
    text = str(found[0])
    assert text.startswith("etp_degree 2: ") and "\n" not in text
    assert profile.capabilities.explained["etp"].why in text
    megatron = framework_profile("megatron-lm")
    assert not [r for r in outer_refusals(megatron, strategy, model) if r.limit == "etp"]


def test_autoplan_s_runtime_splits_experts_below_tp_with_sp_and_folded_groups() -> None:
    """autoplan's runtime runs any etp dividing tp; below tp only where each TP rank routes its
    own tokens (sequence parallelism) and the ep groups are Megatron-Core's (folded, or ep 1),
    and it refuses the rest in its words, one line naming the fix; Megatron-LM runs them (its
    own rules refuse tp > 1 without sequence parallelism on a MoE model)."""
    own, megatron, model = (
        framework_profile("autoplan"),
        framework_profile("megatron-lm"),
        _moe_profile(),
    )

    def etp_refusals(stack: Any, **degrees: Any) -> list[str]:
        fields: dict[str, Any] = dict(
            dp_degree=2, ep_degree=2, ep_folding=True, sequence_parallel=True
        )
        fields.update(degrees)
        strategy = Strategy(**fields)
        return [str(r) for r in outer_refusals(stack, strategy, model) if r.limit == "etp"]

    for tp, etp in ((2, 2), (4, 4), (4, 1), (4, 2), (8, 2)):
        assert etp_refusals(own, tp_degree=tp, etp_degree=etp) == [], (tp, etp)
    assert etp_refusals(own, tp_degree=4, etp_degree=2, ep_degree=1, ep_folding=False) == []
    (no_sp,) = etp_refusals(
        own, tp_degree=4, etp_degree=2, ep_degree=1, ep_folding=False, sequence_parallel=False
    )
    assert no_sp.startswith("etp_degree 2 with tp_degree 4 without sequence parallelism: ")
    assert no_sp.endswith("; set sequence_parallel: true, or etp_degree 4 or 1")
    (inside,) = etp_refusals(own, tp_degree=4, etp_degree=2, ep_folding=False)
    assert inside.startswith("etp_degree 2 with tp_degree 4 and ep_degree 2 inside dp: ")
    assert inside.endswith("; set ep_folding: true, or etp_degree 4 or 1")
    for text in (no_sp, inside):
        assert own.capabilities.explained["etp"].why in text and "\n" not in text
        assert "megatron/training/arguments.py" in text
    assert etp_refusals(megatron, tp_degree=4, etp_degree=2) == []


def test_megatron_layout_agrees_with_ep_inside_dp_when_etp_is_tp() -> None:
    """Megatron-LM places ep over the tp / etp groups first: ep inside dp is its layout when
    etp = tp (and cp = 1), so it is not refused there, and is at etp 1."""
    megatron = framework_profile("megatron-lm")
    common: dict[str, Any] = dict(dp_degree=4, tp_degree=2, ep_degree=2, sequence_parallel=True)
    layouts = [
        r.limit
        for etp in (1, 2)
        for r in outer_refusals(megatron, Strategy(**common, etp_degree=etp), _moe_profile())
        if r.limit == "expert-layout"
    ]
    assert layouts == ["expert-layout"]


def test_megatron_export_states_etp() -> None:
    plan = _cp_ep_plan(etp_degree=2, ep_degree=2, framework="megatron-lm")
    flags = _flags(megatron_args(plan, model_dims("mixtral-8x7b")))
    assert flags["--expert-tensor-parallel-size"] == "2"
    assert flags["--expert-model-parallel-size"] == "2"
    pytest.importorskip("megatron.core.model_parallel_config")
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(
        tensor_model_parallel_size=int(flags["--tensor-model-parallel-size"]),  # type: ignore[arg-type]
        expert_model_parallel_size=int(flags["--expert-model-parallel-size"]),  # type: ignore[arg-type]
        expert_tensor_parallel_size=int(flags["--expert-tensor-parallel-size"]),  # type: ignore[arg-type]
        sequence_parallel=True,
    )
    assert config.expert_tensor_parallel_size == 2


# ------------------------------------------------------------------------------ search


def test_search_offers_etp_where_the_stack_runs_it() -> None:
    """Megatron-LM's and autoplan's spaces try etp 1 and tp (experts whole, or split as the
    dense TP splits them), and the degrees between when a constraint asks for them; a dense
    model only 1; a constraint is taken where it divides tp, and refused in one line for a
    stack without expert tensor parallelism."""
    profile = _moe_profile()
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    megatron = _space_for(profile, cluster, 16, "megatron-lm", {})
    assert megatron.expert_tensor_parallel
    assert etp_choices(megatron, profile, 4) == [1, 4]
    assert etp_choices(megatron, profile, 1) == [1]
    assert etp_choices(replace(megatron, etp=(1, 2, 3)), profile, 4) == [1, 2]
    dense = gpt_profile(num_layers=2, s=1024, h=1024, a=8, e=2)
    assert etp_choices(megatron, dense, 4) == [1]
    own = _space_for(profile, cluster, 16, "autoplan", {})
    assert own.expert_tensor_parallel and etp_choices(own, profile, 8) == [1, 8]
    assert etp_choices(replace(own, etp=(1, 2, 4, 8)), profile, 8) == [1, 2, 4, 8]
    with pytest.raises(ConstraintError, match=r"^etp=2: torchtitan does not split routed experts"):
        _space_for(profile, cluster, 16, "torchtitan", {"etp": 2})
    # every member the enumeration yields is a valid strategy; below tp its ep groups fold
    # over the tp / etp groups (ep 1 is the same layout either way)
    every_etp = replace(megatron, etp=(1, 2, 4, 8))
    found = {
        (s.tp_degree, s.etp_degree, s.ep_degree, s.ep_folding)
        for s in strategies(every_etp, profile, cluster, 16)
    }
    assert {t for t, e, _, _ in found if e > 1} == {2, 4, 8}
    assert {(t, e) for t, e, _, _ in found if 1 < e < t} == {(4, 2), (8, 2), (8, 4)}
    assert all(f or ep == 1 for t, e, ep, f in found if 1 < e < t)
    assert (2, 2, 4, True) in found and (2, 1, 4, True) in found and (4, 2, 4, True) in found


def test_search_for_megatron_returns_an_etp_plan_that_exports() -> None:
    """Constrained to tp 2 and etp 2, the search's best plan states etp and Megatron-LM's
    export carries it."""
    profile = _moe_profile()
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    result = search_plans(
        profile, cluster, global_batch=16, framework="megatron-lm", tp=2, etp=2, ep=4
    )
    (plan,) = result.plans
    assert (plan.tp_degree, plan.etp_degree, plan.ep_degree) == (2, 2, 4)
    assert Plan.from_data(plan.to_data()) == plan
    assert plan.to_data()["etp_degree"] == 2


def test_search_for_autoplan_returns_an_etp_below_tp_plan_it_runs() -> None:
    """Constrained to tp 4 and etp 2, autoplan's search returns a plan its runtime runs:
    sequence parallelism on (the members without it are refused), ep 4 folded over dp 2 x the
    two expert-TP groups of each TP group."""
    from autoplan.contract.plan import runtime_refusal

    profile = _moe_profile()
    cluster = round_cluster(num_nodes=1, devices_per_node=8)
    result = search_plans(
        profile, cluster, global_batch=16, framework="autoplan", tp=4, etp=2, ep=4
    )
    (plan,) = result.plans
    assert (plan.tp_degree, plan.etp_degree, plan.sequence_parallel) == (4, 2, True)
    assert (plan.ep_degree, plan.ep_folding) == (4, True)
    assert runtime_refusal(plan, profile) is None


# ------------------------------------------------------------------------------ bench


def test_published_rows_are_expressible_with_megatron_s_default_etp() -> None:
    """The bench prices a MoE row at its stated etp, else Megatron-LM's default, tp
    (`row_etp`), where the row's stack splits experts; the Mixtral 8x22B row (tp 2, ep 8 over
    dp 8) folds so, and the Qwen3-235B fp8 row cannot have run at etp = tp = 2 (2 x 32 x 8 does
    not divide 256 GPUs: its ep does not fold over the block's 16 expert-TP groups)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import validate_published  # type: ignore[import-not-found]

    rows = {row["id"]: row for row in validate_published.load()[0]}
    mixtral = rows["mcore-moezoo-h100-mixtral-8x22b-128g-forced-balance"]
    assert validate_published.row_etp(mixtral) == 2
    with pytest.raises(ValueError, match=r"etp = 2 \(the row's stack profile does not split"):
        validate_published.check_expressible(mixtral, folded=True)
    validate_published.check_expressible(mixtral, folded=True, expert_tp=True)
    qwen = rows["mbridge-260401-h100-qwen3-235b-a22b-256g-fp8"]
    with pytest.raises(ValueError, match=r"ep = 32 does not fold over tp 2 / etp 2 x cp 1 x dp 16"):
        validate_published.check_expressible(qwen, folded=True, expert_tp=True)


def test_parallelize_s_check_takes_etp_below_tp_and_refuses_it_without_sp() -> None:
    """`parallelize` asks `runtime_refusal` of every plan on every rank before building
    anything: an etp = tp plan and an etp between 1 and tp with sequence parallelism and folded
    ep groups (priced for Megatron-LM) run; without sequence parallelism autoplan refuses the
    latter in its words, one line."""
    from autoplan.contract.plan import runtime_refusal

    common: dict[str, Any] = dict(ep_degree=2, framework="megatron-lm", pp_degree=1, num_units=4)
    assert runtime_refusal(_cp_ep_plan(etp_degree=2, **common), _moe_profile()) is None
    wide = _cp_ep_plan(etp_degree=2, tp_degree=4, **common)
    assert runtime_refusal(wide, _moe_profile()) is None
    plain = _cp_ep_plan(
        etp_degree=2, tp_degree=4, ep_folding=False, sequence_parallel=False, cp_degree=1,
        **{**common, "ep_degree": 1},
    )  # fmt: skip
    why = runtime_refusal(plain, _moe_profile())
    assert why is not None and why.startswith(
        "etp_degree 2 with tp_degree 4 without sequence parallelism: autoplan splits an expert "
        "over part of a TP group only with sequence parallelism"
    )
    assert "passes/expert_parallel.py" in why and "\n" not in why
    assert runtime_refusal(_cp_ep_plan(pp_degree=1, num_units=4), _moe_profile()) is None


def test_cli_estimate_states_etp_and_refuses_bad_input_in_one_line() -> None:
    """`autoplan estimate --etp` (Mixtral 8x7B, tp 2 x ep 8 inside dp 8): Megatron-LM refuses
    ep inside dp with the experts whole (its ep groups would take TP ranks), and runs it at etp =
    tp, where its expert rank generator builds the same groups; the plan carries etp. etp not
    dividing tp, or a stack without it, is one line on stderr without a traceback; autoplan's
    runtime takes etp = tp."""
    from tests.conftest import run_cli

    args = (
        "estimate", "--model", "mixtral-8x7b", "--cluster", "dgx-h100-80g:nodes=4", "--tp", "2",
        "--pp", "2", "--ep", "8", "--sequence-parallel", "--global-batch", "64", "--zero", "1",
    )  # fmt: skip
    megatron = ("--framework", "megatron-lm", "--json")
    whole = run_cli(*args, *megatron)
    assert whole.returncode != 0 and "set ep_folding: true" in whole.stderr
    split = run_cli(*args, "--etp", "2", *megatron)
    assert split.returncode == 0, split.stderr
    assert json.loads(split.stdout)["plan"]["etp_degree"] == 2
    own = run_cli(*args, "--etp", "2", "--json")
    assert own.returncode == 0, own.stderr
    assert json.loads(own.stdout)["plan"]["etp_degree"] == 2
    for extra, words in (
        (("--etp", "3", *megatron), "etp_degree = 3 does not divide tp_degree = 2"),
        (("--etp", "2", "--framework", "torchtitan"), "etp_degree 2: torchtitan"),
    ):
        refused = run_cli(*args, *extra)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert words in refused.stderr and refused.stderr.count("\n") <= 1, refused.stderr


@pytest.mark.parametrize(
    ("stack", "words"),
    [
        ("torchtitan", "no expert_tensor_parallel_degree"),
        ("deepspeed", "enable_expert_tensor_parallelism"),
    ],
)
def test_exports_without_etp_refuse_it_in_their_words(stack: str, words: str) -> None:
    plan = _cp_ep_plan(etp_degree=2, ep_degree=2, framework="megatron-lm")
    with pytest.raises(ExportError) as refused:
        export_plan(plan, stack, model="mixtral-8x7b")
    (item,) = [part for part in str(refused.value).split("; (") if "etp_degree = 2" in part]
    assert words in item and "--expert-tensor-parallel-size" in item


def test_its_range_says_no_scored_run_validates_it() -> None:
    """No published MoE run states its etp and every scored one keeps its experts whole: a
    plan that splits them has the feature, and its 80% range widens as an unvalidated
    feature's does."""
    from cost_model.uncertainty import plan_features, step_interval

    whole = _cp_ep_plan(ep_degree=2, framework="megatron-lm")
    split = _cp_ep_plan(ep_degree=2, etp_degree=2, framework="megatron-lm")
    features = plan_features(split, "megatron-lm")
    assert "expert tensor parallel" in features
    assert "expert tensor parallel" not in plan_features(whole, "megatron-lm")
    wide, narrow = step_interval(features), step_interval(plan_features(whole, "megatron-lm"))
    assert ("expert tensor parallel", 0) in wide.unvalidated
    assert wide.high > narrow.high and wide.low < narrow.low


# ------------------------------------------------------------------------------ runtime


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "degrees", "groups"),
    [
        # etp = tp: ep 2 inside dp 2, ZeRO-3; rank 1's ep pair (1, 3), etp group its TP group
        ("moe", {"tp": 2, "ep": 2, "zero": 3}, ((1, 3), (0, 1), (1,))),
        # etp < tp, ep 1 (no dense replicas): rank 1's etp group (0, 1), and its expert-data
        # group (1, 3), the TP group's other expert-TP group at the same place
        ("moe-mha", {"tp": 4}, ((1,), (0, 1), (1, 3))),
    ],
    ids=["tp2-etp2-ep2-zero3", "tp4-etp2-edp2"],
)
def test_etp_sp_moe_trains_as_one_process(
    tmp_path: Path, model: str, degrees: dict[str, int], groups: tuple[tuple[int, ...], ...]
) -> None:
    """autoplan's runtime at etp 2 with sequence parallelism on 4 ranks: each TP rank routes
    its own part of the sequence to its ep group, the rows received are gathered over the etp
    group, every rank runs its half of each local expert's width on them, and the partial
    outputs are reduce-scattered back (passes/expert_parallel.py). At etp = tp = 2 (ep 2 inside
    dp 2, ZeRO-3) the etp group is the TP group; at tp 4 it is half of it, on the expert
    layer's own (edp, ep, etp) mesh, and the expert weights' gradients are summed over the
    expert-data group, the other half of the TP group, which saw the other tokens. Loss and
    every gradient (the experts' gathered from their DTensors) match one process over 3 AdamW
    steps, load-balancing loss included."""
    from tests.dist_utils import run_distributed
    from tests.numerics import assert_matches, train_worker
    from tests.test_parallelize_cp_ep import _micro_batch_reference, _plan

    plan = _plan(model, 4, etp=2, global_batch=4, sequence_parallel=True, **degrees)
    experts = replace(plan, ep_folding=True) if plan.ep_degree == 1 else plan
    assert (
        experts.ep_group_ranks(1),
        experts.etp_group_ranks(1),
        experts.expert_data_group_ranks(1),
    ) == groups
    results = run_distributed(
        train_worker, model, plan.to_data(), world_size=plan.num_devices, tmp_path=tmp_path
    )
    assert_matches(results, _micro_batch_reference(model, plan))
