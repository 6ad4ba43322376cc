"""Plan files: exact YAML round trips (hypothesis) and one bad file per validation rule."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan import Cluster, ModelRef, Plan, PlanError, PlanEstimate, StagePlan
from autoplan.contract.plan import RECOMPUTE_MODES, SCHEDULES, even_stages
from cost_model.degrees import (
    COUNT_FIELDS,
    count_problems,
    model_problems,
    sequence_parallel_problems,
    shape_problems,
)
from cost_model.hardware import load_cluster
from cost_model.workload import ModelProfile, OpProfile, TpStructure, UnitProfile
from tests.cost_profiles import gpt_profile, with_routed_experts


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    pp = draw(st.integers(1, 8))
    schedule = draw(st.sampled_from(SCHEDULES if pp > 1 else ("gpipe", "1f1b")))
    if schedule in ("interleaved-1f1b", "interleaved-zb"):
        virtual = draw(st.integers(2, 4))
    elif schedule in ("zbv", "dualpipev"):
        virtual = 2
    else:
        virtual = 1
    num_stages = pp * virtual
    num_units = draw(st.integers(num_stages, num_stages + 40))
    cuts = (
        sorted(
            draw(
                st.sets(
                    st.integers(1, max(num_units - 1, 1)),
                    min_size=num_stages - 1,
                    max_size=num_stages - 1,
                )
            )
        )
        if num_stages > 1
        else []
    )
    bounds = [0, *cuts, num_units]
    stages = tuple(
        StagePlan(
            first_unit=bounds[i],
            last_unit=bounds[i + 1] - 1,
            recompute=draw(st.sampled_from(RECOMPUTE_MODES)),
        )
        for i in range(num_stages)
    )
    if schedule in ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"):
        micro_batches = 2 * pp * draw(st.integers(1, 4))  # whole rounds: valid for each
    elif schedule == "1f1b":
        micro_batches = draw(st.integers(pp, pp + 32))
    else:
        micro_batches = draw(st.integers(1, 64))
    dp, mb = draw(st.integers(1, 64)), draw(st.integers(1, 16))
    estimate = draw(
        st.none()
        | st.builds(
            PlanEstimate,
            cluster=st.sampled_from(["dgx-a100-80g", "local"]),
            num_devices=st.integers(1, 4096),
            step_time_s=st.floats(1e-4, 1e4),
            tokens_per_s=st.floats(1.0, 1e9),
            model_tflops_per_device=st.floats(0.0, 1e3),
            mfu=st.floats(0.0, 1.0),
            peak_memory_bytes=st.integers(1, 2**40),
        )
    )
    return Plan(
        model=draw(
            st.none()
            | st.just(ModelRef(name="gpt", num_units=num_units, seq_len=2048, fingerprint="abc123"))
        ),
        dp_degree=dp,
        tp_degree=draw(st.sampled_from([1, 2, 4, 8])),
        pp_degree=pp,
        virtual_stages=virtual,
        stages=stages,
        micro_batch_size=mb,
        num_micro_batches=micro_batches,
        global_batch_size=mb * micro_batches * dp,
        schedule=schedule,  # type: ignore[arg-type]
        zero_stage=draw(st.integers(0, 3)),
        sequence_parallel=draw(st.booleans()),
        dtype=draw(st.sampled_from(["fp32", "bf16", "fp16"])),
        rank_layout=draw(st.permutations(["pp", "dp", "tp"]).map(tuple)),  # type: ignore[arg-type]
        estimate=estimate,
    )


@settings(max_examples=150, deadline=None)
@given(plan=plans())
def test_plan_yaml_round_trip_is_exact(
    plan: Plan, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    plan.to_yaml(path)
    loaded = Plan.from_yaml(path)
    assert loaded == plan
    assert loaded.to_data() == plan.to_data()  # including the estimate, which == ignores
    assert loaded.estimate == plan.estimate


def _plan(**changes: Any) -> Plan:
    fields: dict[str, Any] = dict(
        dp_degree=2,
        tp_degree=2,
        pp_degree=2,
        stages=even_stages(6, 2),
        micro_batch_size=1,
        num_micro_batches=4,
        global_batch_size=8,
    )
    fields.update(changes)
    return Plan(**fields)


def test_a_plan_says_when_its_zero_stage_runs_as_another() -> None:
    """The ZeRO stage in summaries is the one that runs (`Plan.decisions`), not only the named one:
    ZeRO-1 with TP or PP runs under FSDP2, which shards gradients too; plain fp32 data parallelism
    runs it with DDP and ZeroRedundancyOptimizer, as named."""
    assert _plan(zero_stage=1).zero_text == "ZeRO-1 (runs as ZeRO-2)"
    plain = _plan(
        dp_degree=8,
        tp_degree=1,
        pp_degree=1,
        stages=even_stages(6, 1),
        global_batch_size=32,
        dtype="fp32",
    )
    assert dataclasses.replace(plain, zero_stage=1).zero_text == "ZeRO-1"
    assert _plan(zero_stage=3).zero_text == "ZeRO-3"


def test_group_ranks_follow_the_layout() -> None:
    plan = _plan()  # layout pp, dp, tp: tp innermost
    assert plan.group_ranks("tp", 5) == (4, 5)
    assert plan.group_ranks("dp", 5) == (5, 7)
    assert plan.group_ranks("pp", 5) == (1, 5)
    swapped = _plan(rank_layout=("pp", "tp", "dp"))
    assert swapped.group_ranks("tp", 0) == (0, 2)
    assert swapped.mesh_shape == (2, 2, 2)


def test_even_stages_differ_by_at_most_one() -> None:
    stages = even_stages(10, 4)
    assert [s.num_units for s in stages] == [3, 3, 2, 2]
    with pytest.raises(PlanError, match="lower pp_degree"):
        even_stages(3, 4)


# One bad plan file per validation rule: (id, edit of a valid plan's data, expected fragment).
BAD_PLANS: list[tuple[str, dict[str, Any], str]] = [
    ("unknown key", {"tensor_parallel": 2}, "unknown key 'tensor_parallel' for Plan"),
    ("wrong type", {"dp_degree": "two"}, "dp_degree: cannot read 'two'"),
    ("float degree", {"dp_degree": 1.5}, "dp_degree: expected a whole number"),
    (
        "zero degree",
        {"tp_degree": 0, "global_batch_size": 8},
        "tp_degree = 0 must be a whole number >= 1",
    ),
    ("negative micro-batch", {"micro_batch_size": -1}, "micro_batch_size = -1 must be"),
    (
        "batch does not divide",
        {"global_batch_size": 10},
        "global_batch_size = 10 must equal micro_batch_size x num_micro_batches x dp_degree = 1 x 4 x 2 = 8",
    ),
    (
        "bad schedule",
        {"schedule": "zigzag"},
        "schedule: 'zigzag' is not one of 'gpipe', '1f1b', 'interleaved-1f1b', 'interleaved-zb'",
    ),
    ("bad zero", {"zero_stage": 4}, "zero_stage = 4 must be 0, 1, 2 or 3"),
    (
        "bad recompute",
        {
            "stages": [
                {"first_unit": 0, "last_unit": 2, "recompute": "most"},
                {"first_unit": 3, "last_unit": 5},
            ]
        },
        "stages[0].recompute: 'most' is not one of",
    ),
    (
        "bad layout",
        {"rank_layout": ["pp", "pp", "tp"]},
        "rank_layout = ['pp', 'pp', 'tp'] must order each",
    ),
    (
        "too few stages",
        {"stages": [{"first_unit": 0, "last_unit": 5}]},
        "stages has 1 entries; pp_degree x virtual_stages = 2 x 1 = 2 are needed",
    ),
    (
        "gap between stages",
        {"stages": [{"first_unit": 0, "last_unit": 2}, {"first_unit": 4, "last_unit": 5}]},
        "stages[1].first_unit = 4; stages must cover the units once each in order, so it must be 3",
    ),
    (
        "overlapping stages",
        {"stages": [{"first_unit": 0, "last_unit": 3}, {"first_unit": 3, "last_unit": 5}]},
        "stages[1].first_unit = 3",
    ),
    (
        "not from unit 0",
        {"stages": [{"first_unit": 1, "last_unit": 2}, {"first_unit": 3, "last_unit": 5}]},
        "stages[0].first_unit = 1",
    ),
    (
        "reversed stage",
        {"stages": [{"first_unit": 0, "last_unit": -1}, {"first_unit": 0, "last_unit": 5}]},
        "last_unit = -1 is before first_unit = 0",
    ),
    (
        "virtual without interleaving",
        {"virtual_stages": 2},
        "schedule '1f1b' runs one stage per pipeline rank, got virtual_stages = 2; use",
    ),
    (
        "interleaving one stage per rank",
        {"schedule": "interleaved-1f1b"},
        "needs pp_degree >= 2 and virtual_stages >= 2",
    ),
    (
        "1f1b too few micro-batches",
        {"num_micro_batches": 1, "global_batch_size": 2},
        "num_micro_batches = 1 must be >= pp_degree = 2 for '1f1b'",
    ),
    (
        "model units not covered",
        {"model": {"name": "gpt", "num_units": 8, "seq_len": 64}},
        "stages end at unit 5 but the plan's model.num_units = 8 (units 0..7)",
    ),
    ("schema version", {"schema_version": 2}, "schema_version 2"),
    ("schema version string", {"schema_version": "1"}, "'1' (a str, not a number)"),
    ("bad estimate", {"estimate": {"cluster": "x"}}, "missing required key 'estimate.num_devices'"),
]


@pytest.mark.parametrize(("label", "edit", "fragment"), BAD_PLANS, ids=[b[0] for b in BAD_PLANS])
def test_bad_plan_files(tmp_path: Path, label: str, edit: dict[str, Any], fragment: str) -> None:
    data = _plan().to_data()
    data.update(edit)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError) as info:
        Plan.from_yaml(path)
    message = str(info.value)
    assert fragment in message, message
    assert str(path) in message and "\n" not in message


def test_malformed_and_missing_plan_files(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("dp_degree: [1,\n")
    with pytest.raises(PlanError, match="not valid YAML at line"):
        Plan.from_yaml(path)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.from_yaml(tmp_path / "absent.yaml")
    path.write_text("schema_version: 1\n")
    with pytest.raises(PlanError, match="missing required key 'dp_degree'"):
        Plan.from_yaml(path)


# ---------------------------------------------------------------- against a cluster and a model


def _profile(
    num_units: int = 6, num_heads: int = 12, seq_len: int = 64, fingerprint: str = "f1"
) -> ModelProfile:
    op = OpProfile(
        name="mm",
        kind="matmul",
        tp="column",
        forward_flops=1.0,
        backward_flops=2.0,
        activation_bytes=1.0,
    )
    units = tuple(
        UnitProfile(
            name=f"u{i}",
            kind="block",
            ops=(op,),
            num_params=10,
            num_params_tp_sharded=8,
            param_bytes=40,
            saved_bytes_sharded=1.0,
            saved_bytes_replicated=1.0,
            input_bytes=1.0,
            output_bytes=1.0,
            tp=TpStructure(num_heads=num_heads, num_kv_heads=num_heads, vocab_size=None),
        )
        for i in range(num_units)
    )
    return ModelProfile(
        name="toy", units=units, seq_len=seq_len, hidden_size=64, fingerprint=fingerprint
    )


def test_validate_accepts_a_consistent_plan() -> None:
    _plan().validate(_profile(), Cluster.preset("dgx-a100-80g"))


@pytest.mark.parametrize(
    ("plan", "cluster", "profile", "fragment"),
    [
        (
            _plan(),
            "dgx-a100-80g:nodes=2",
            None,
            "= 8 devices, but cluster 'dgx-a100-80g' has 16 (2 node(s) x 8)",
        ),
        (
            _plan(
                tp_degree=16,
                dp_degree=1,
                pp_degree=1,
                stages=even_stages(6, 1),
                num_micro_batches=1,
                global_batch_size=1,
            ),
            "dgx-a100-80g:nodes=2",
            None,
            "tp_degree = 16 with rank_layout ['pp', 'dp', 'tp'] puts a tensor-parallel group across nodes",
        ),
        (
            _plan(rank_layout=("tp", "dp", "pp")),
            "dgx-a100-80g:devices_per_node=4,nodes=2",
            None,
            "puts a tensor-parallel group across nodes",
        ),
        (
            _plan(),
            "dgx-a100-80g",
            _profile(num_heads=9),
            "tp_degree = 2 does not divide num_heads = 9",
        ),
        (
            _plan(),
            "dgx-a100-80g",
            _profile(num_units=7),
            "stages cover 6 units but model 'toy' has 7",
        ),
        (
            _plan(model=ModelRef(name="other", num_units=6, seq_len=64, fingerprint="zz")),
            "dgx-a100-80g",
            _profile(),
            "plan was made for model 'other' (fingerprint zz)",
        ),
        (
            # a hand-edited sequence length keeps the file's fingerprint
            _plan(model=ModelRef(name="toy", num_units=6, seq_len=10**12, fingerprint="f1")),
            "dgx-a100-80g",
            _profile(),
            "model.seq_len = 1000000000000, but model 'toy' is traced at 64 tokens",
        ),
        (
            _plan(tp_degree=1, dp_degree=4, global_batch_size=16, sequence_parallel=True),
            "dgx-a100-80g",
            _profile(),
            "sequence_parallel: true needs tp_degree > 1",
        ),
        (
            _plan(sequence_parallel=True),
            "dgx-a100-80g",
            _profile(seq_len=63),
            "needs tp_degree = 2 to divide seq_len = 63",
        ),
    ],
)
def test_validate_rejects(
    plan: Plan, cluster: str, profile: ModelProfile | None, fragment: str
) -> None:
    from cost_model.hardware import load_cluster

    with pytest.raises(PlanError) as info:
        plan.validate(profile, load_cluster(cluster))
    assert fragment in str(info.value)


def test_cross_node_tp_can_be_allowed() -> None:
    plan = _plan(
        tp_degree=16,
        dp_degree=1,
        pp_degree=1,
        stages=even_stages(6, 1),
        num_micro_batches=1,
        global_batch_size=1,
    )
    plan.validate(None, Cluster.preset("dgx-a100-80g", nodes=2), allow_cross_node_tp=True)


# ---------------------------------------------------------------- the validity rules themselves

# What a refusal says: the rule it breaks, then how to mend it (a "must be ..." or "N are
# needed" states the values that are allowed, which is the fix for a single field).
_RULE_WORDS = (
    "must",
    "needs",
    "are needed",
    "does not divide",
    "does not fold",
    "shards",
    "is over",
    "more than",
)
_FIX_WORDS = (
    "use ",
    "set ",
    "change ",
    "give ",
    "lower ",
    "turn ",
    "raise ",
    "extend",
    "must be ",
    # the stage count: the message names the count that is needed
    "are needed",
)


def _degrees(**changes: Any) -> SimpleNamespace:
    """The fields `cost_model.degrees` reads, at a consistent default (dp 2, tp 2, pp 2)."""
    fields: dict[str, Any] = dict(
        dp_degree=2,
        tp_degree=2,
        pp_degree=2,
        cp_degree=1,
        ep_degree=1,
        ep_folding=False,
        sequence_parallel=False,
        virtual_stages=1,
        micro_batch_size=1,
        num_micro_batches=4,
        global_batch_size=8,
        schedule="1f1b",
    )
    fields.update(changes)
    return SimpleNamespace(**fields)


def _counts(**changes: object) -> dict[str, object]:
    values: dict[str, object] = {name: 1 for name in COUNT_FIELDS}
    values.update(changes)
    return values


_DENSE = gpt_profile(num_layers=4, s=128, h=256, a=8)
_MOE = with_routed_experts(_DENSE, num_experts=6, top_k=2, expert_ffn=64)
_TOP_K = with_routed_experts(_DENSE, num_experts=2, top_k=4, expert_ffn=64)
_NO_ATTENTION = _profile(num_heads=8, seq_len=64)

# (label, the problems, the value the first must name): one case per refusal of the module
_REFUSALS: list[tuple[str, Callable[[], Iterator[str]], str]] = [
    ("not whole", lambda: count_problems(_counts(tp_degree=1.5)), "tp_degree = 1.5"),
    ("a bool", lambda: count_problems(_counts(pp_degree=True)), "pp_degree = True"),
    ("below one", lambda: count_problems(_counts(dp_degree=0)), "dp_degree = 0"),
    ("over MAX_COUNT", lambda: count_problems(_counts(num_micro_batches=2**60)), f"{2**60:,}"),
    (
        "too many devices",
        lambda: count_problems(_counts(dp_degree=2**11, tp_degree=2**10)),
        "2,048",
    ),
    ("ep in dp", lambda: shape_problems(_degrees(ep_degree=4), 2), "ep_degree = 4"),
    ("folding", lambda: shape_problems(_degrees(ep_degree=3, ep_folding=True), 2), "ep_degree = 3"),
    (
        "folding sp",
        lambda: shape_problems(_degrees(ep_degree=2, ep_folding=True), 2),
        "tp_degree = 2",
    ),
    ("batch", lambda: shape_problems(_degrees(global_batch_size=9), 2), "global_batch_size = 9"),
    (
        "schedule",
        lambda: shape_problems(_degrees(num_micro_batches=1, global_batch_size=2), 2),
        "= 1",
    ),
    ("stage count", lambda: shape_problems(_degrees(), 3), "stages has 3 entries"),
    ("tp counts", lambda: model_problems(_degrees(tp_degree=3), _DENSE), "tp_degree = 3"),
    ("cp sequence", lambda: model_problems(_degrees(cp_degree=3), _DENSE), "cp_degree = 3"),
    ("cp attention", lambda: model_problems(_degrees(cp_degree=2), _NO_ATTENTION), "cp_degree = 2"),
    ("top_k", lambda: model_problems(_degrees(), _TOP_K), "top_k = 4"),
    ("ep dense", lambda: model_problems(_degrees(ep_degree=2), _DENSE), "ep_degree = 2"),
    (
        "ep experts",
        lambda: model_problems(_degrees(ep_degree=4, dp_degree=4), _MOE),
        "ep_degree = 4",
    ),
    (
        "sp tp 1",
        lambda: sequence_parallel_problems(_degrees(tp_degree=1, sequence_parallel=True), 64),
        "sequence_parallel: true",
    ),
    (
        "sp seq",
        lambda: sequence_parallel_problems(_degrees(sequence_parallel=True), 63),
        "seq_len = 63",
    ),
]


@pytest.mark.parametrize(
    ("problems", "value"), [(p, v) for _, p, v in _REFUSALS], ids=[label for label, *_ in _REFUSALS]
)
def test_every_refusal_names_the_value_the_rule_and_the_fix(
    problems: Callable[[], Iterator[str]], value: str
) -> None:
    message = next(problems())
    assert "\n" not in message
    assert value in message
    assert any(word in message for word in _RULE_WORDS), message
    assert any(word in message for word in _FIX_WORDS), message


def test_the_validity_rules_refuse_nothing_consistent_and_plan_raises_their_text() -> None:
    consistent = _degrees(ep_degree=2)
    assert list(count_problems({n: getattr(consistent, n, 1) for n in COUNT_FIELDS})) == []
    assert list(shape_problems(consistent, 2)) == []
    assert list(model_problems(_degrees(ep_degree=2, cp_degree=2), _MOE)) == []
    assert list(sequence_parallel_problems(_degrees(sequence_parallel=True), 64)) == []
    # Plan raises the rule's own line (the same text), first rule first
    with pytest.raises(PlanError) as info:
        _plan(global_batch_size=9)
    assert str(info.value) == next(shape_problems(_degrees(global_batch_size=9), 2))
    with pytest.raises(PlanError) as info:
        _plan(tp_degree=3, stages=even_stages(_DENSE.num_units, 2)).validate(
            _DENSE, load_cluster("dgx-a100-80g:devices_per_node=6,nodes=2")
        )
    assert str(info.value) == next(model_problems(_degrees(tp_degree=3), _DENSE))
