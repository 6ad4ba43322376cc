"""Mixed-precision policies (issue 43 item 3): the plan's master-weight, gradient-reduction and
optimizer-state dtypes (`cost_model.precision.PrecisionPolicy`): the plan format, the bytes and
the collectives the cost model prices for them, the stacks' refusals, the search's option, and
the refusals of values that do not go together."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.planner.search import search_plans
from autoplan.planner.space import ConstraintError
from cost_model.communication import collective_time_s
from cost_model.estimate import estimate
from cost_model.frameworks import framework_profile
from cost_model.frameworks.limits import precision_refusal
from cost_model.hardware import Cluster
from cost_model.memory import ParamStateBytes, local_num_params, param_state_bytes, static_bytes
from cost_model.parts.data_parallel import DataParallelCost, data_parallel_cost
from cost_model.parts.optimizer import adam_traffic_bytes, optimizer_cost
from cost_model.precision import precision_policy, precision_problem
from cost_model.strategy import Strategy, group_placements
from cost_model.workload import ModelProfile
from tests.conftest import run_cli
from tests.cost_profiles import gpt_profile, round_cluster

H, F, S, VOCAB = 256, 1024, 128, 1024

BF16_EVERYWHERE = {
    "master_dtype": "bf16",
    "grad_reduce_dtype": "bf16",
    "optimizer_state_dtype": "bf16",
}


def _profile() -> ModelProfile:
    return gpt_profile(num_layers=2, s=S, h=H, a=8, vocab=VOCAB, f=F)


def _plan(**changes: object) -> Plan:
    plan = autoplan.manual_plan(
        _profile(), Cluster.preset("dgx-a100-80g"), dp=8, global_batch=16, zero=3, dtype="bf16"
    )
    return dataclasses.replace(plan, estimate=None, **changes)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ plan format


def test_the_default_policy_is_todays_and_is_not_written(tmp_path: Path) -> None:
    plan = _plan()
    assert plan.precision == precision_policy("bf16")
    assert (plan.precision.master, plan.precision.grad_reduce) == ("fp32", "fp32")
    assert plan.precision.optimizer_state == "fp32"
    # fp16 reduces in fp16 unless stated (Megatron-LM's default there), fp8 trains in bf16
    assert precision_policy("fp16").grad_reduce == "fp16"
    assert precision_policy("fp8").compute == "bf16"
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    text = path.read_text()
    for name in ("master_dtype", "grad_reduce_dtype", "optimizer_state_dtype"):
        assert name not in text
    assert Plan.from_yaml(path) == plan


def test_a_stated_policy_round_trips_through_yaml(tmp_path: Path) -> None:
    plan = _plan(**BF16_EVERYWHERE)
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    text = path.read_text()
    assert "master_dtype: bf16" in text and "optimizer_state_dtype: bf16" in text
    loaded = Plan.from_yaml(path)
    assert loaded == plan and loaded.precision.master_copy is False
    assert loaded.digest() != _plan().digest()
    # written again byte for byte
    again = tmp_path / "again.yaml"
    loaded.to_yaml(again)
    assert again.read_text() == text


@pytest.mark.parametrize(
    ("dtype", "fields", "fragment"),
    [
        ("fp16", {"master_dtype": "bf16"}, "fp16 training needs fp32 master weights"),
        ("fp32", {"optimizer_state_dtype": "bf16"}, "fp32 training keeps its weights"),
        ("fp32", {"grad_reduce_dtype": "bf16"}, "use dtype bf16"),
        ("bf16", {"grad_reduce_dtype": "fp16"}, "reduce in bf16 or fp32"),
        ("fp16", {"grad_reduce_dtype": "bf16"}, "set grad_reduce_dtype fp16 or fp32"),
        ("bf16", {"master_dtype": "fp16"}, "master_dtype = 'fp16' must be one of fp32, bf16"),
    ],
)
def test_combinations_that_do_not_go_together_are_refused_in_one_line(
    dtype: str, fields: dict[str, str], fragment: str
) -> None:
    with pytest.raises(PlanError) as caught:
        _plan(dtype=dtype, **fields)
    message = str(caught.value)
    assert fragment in message and "\n" not in message
    # the same rule for the cost model's own records
    assert precision_problem(
        dtype,
        fields.get("master_dtype", "fp32"),
        fields.get("grad_reduce_dtype"),
        fields.get("optimizer_state_dtype", "fp32"),
    )


def test_a_bad_value_in_a_plan_file_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    _plan().to_yaml(path)
    path.write_text(path.read_text() + "grad_reduce_dtype: fp8\n")
    with pytest.raises(PlanError, match="grad_reduce_dtype"):
        Plan.from_yaml(path)


# ------------------------------------------------------------------------------ cost model


def test_bytes_per_parameter_follow_the_policy() -> None:
    """FSDP2 keeps master-dtype shards (with gradients of their dtype) and the moments in the
    state dtype, all sharded over dp; ZeRO-1/2 add the gathered working weights (bf16)."""
    n, dp = 1000.0, 4
    default = static_bytes(n, "bf16", 3, dp, "fsdp")
    assert (default.param_bytes, default.grad_bytes, default.optimizer_bytes) == (1000, 1000, 2000)
    bf16 = static_bytes(
        n, "bf16", 3, dp, "fsdp", policy=precision_policy("bf16", "bf16", None, "bf16")
    )
    assert (bf16.param_bytes, bf16.grad_bytes, bf16.optimizer_bytes) == (500, 500, 1000)
    # fp32 master, bf16 moments (Megatron's precision-aware optimizer); ZeRO-2 keeps the
    # gathered bf16 weights (2 bytes a parameter, unsharded)
    states = static_bytes(
        n, "bf16", 2, dp, "fsdp", policy=precision_policy("bf16", "fp32", None, "bf16")
    )
    assert (states.param_bytes, states.grad_bytes, states.optimizer_bytes) == (3000, 1000, 1000)
    # unwrapped / DDP accounting (Rajbhandari et al. 2020): 2 + 2 + K, K = master copy + moments
    assert param_state_bytes("bf16") == ParamStateBytes(
        weight_bytes=2, grad_bytes=2, optimizer_bytes=12
    )
    assert (
        param_state_bytes("bf16", precision_policy("bf16", "bf16", None, "bf16")).optimizer_bytes
        == 4
    )
    assert (
        param_state_bytes("bf16", precision_policy("bf16", "fp32", None, "bf16")).optimizer_bytes
        == 8
    )
    assert param_state_bytes("fp32").optimizer_bytes == 8


def test_adam_traffic_follows_the_policy() -> None:
    """2g + 2w + 4s (+ the working copy): 30 and 32 bytes as before, 16 in bf16 throughout."""
    assert adam_traffic_bytes(precision_policy("bf16")) == 30
    assert adam_traffic_bytes(precision_policy("fp32")) == 32
    assert adam_traffic_bytes(precision_policy("bf16", "bf16", None, "bf16")) == 16
    assert adam_traffic_bytes(precision_policy("bf16", "fp32", None, "bf16")) == 22
    cluster = round_cluster()
    # 1e9 parameters at 1 TB/s x 0.5: 30 bytes -> 60 ms, 16 bytes -> 32 ms
    default = optimizer_cost(1e9, Strategy(dtype="bf16"), cluster).step_s
    bf16 = optimizer_cost(1e9, Strategy(dtype="bf16", **BF16_EVERYWHERE), cluster).step_s
    assert (default, bf16) == pytest.approx((0.060, 0.032))


def test_gradients_reduce_in_the_reduction_dtype_and_weights_gather_in_the_compute_one() -> None:
    """ZeRO-3 on 8 ranks of one node: the reduce-scatter moves the reduction dtype's bytes, the
    all-gathers the compute dtype's (FSDP2's param_dtype), whatever the master's."""
    cluster = round_cluster()
    fp32_reduce = Strategy(dtype="bf16", dp_degree=8, zero_stage=3)
    bf16_reduce = dataclasses.replace(fp32_reduce, grad_reduce_dtype="bf16", master_dtype="bf16")
    groups = group_placements(fp32_reduce, cluster, "dp")
    n = 1e8

    def cost(strategy: Strategy) -> DataParallelCost:
        return data_parallel_cost(
            n, strategy, cluster, groups, forward_window_s=0.0, backward_window_s=0.0
        )

    a, b = cost(fp32_reduce), cost(bf16_reduce)
    assert (a.grad_bytes, b.grad_bytes) == (4 * n, 2 * n)
    assert a.param_bytes == b.param_bytes == 2 * n
    gather = collective_time_s("all_gather", 2 * n, groups, cluster)
    assert a.zero3_forward_s == b.zero3_forward_s == pytest.approx(gather)
    assert a.zero3_backward_s - gather == pytest.approx(
        collective_time_s("reduce_scatter", 4 * n, groups, cluster)
    )
    assert b.zero3_backward_s - gather == pytest.approx(
        collective_time_s("reduce_scatter", 2 * n, groups, cluster)
    )


def test_a_stated_policy_changes_the_estimate_by_the_bytes_it_saves() -> None:
    """A ZeRO-3 bf16 plan on 8 devices: bf16 master weights, reduction and moments hold
    8 bytes a parameter less in state (16 -> 8, sharded over dp) and a 2-byte-smaller reduce
    buffer for the largest unit; the step moves half the gradient bytes and half the Adam
    traffic, so it is no slower."""
    profile = _profile()
    cluster = round_cluster()
    plan = autoplan.manual_plan(profile, cluster, dp=8, global_batch=16, zero=3, dtype="bf16")
    default = estimate(profile, cluster, plan)
    policy = estimate(profile, cluster, dataclasses.replace(plan, **BF16_EVERYWHERE))
    params = [local_num_params(unit, 1, count_shared=False) for unit in profile.units]
    got, new = default.peak_rank.memory, policy.peak_rank.memory
    state = got.param_bytes + got.grad_bytes + got.optimizer_bytes
    assert state - (new.param_bytes + new.grad_bytes + new.optimizer_bytes) == pytest.approx(
        sum(params) * (16 - 8) / 8
    )
    # FSDP2's reduce buffer of the largest group (a block, or the embedding and head) holds the
    # bf16 gradients and their copy in the reduction dtype: 2 + 4 bytes, now 2 + 2
    kinds = [unit.kind for unit in profile.units]
    block = max(p for p, kind in zip(params, kinds, strict=True) if kind == "block")
    root = sum(p for p, kind in zip(params, kinds, strict=True) if kind != "block")
    assert got.working_bytes - new.working_bytes == pytest.approx(2 * max(block, root))
    assert policy.peak_memory_bytes < default.peak_memory_bytes
    assert policy.step_time_s < default.step_time_s


# ------------------------------------------------------------------------------ stacks, search, CLI


@pytest.mark.parametrize(
    ("framework", "fields", "zero", "fragment"),
    [
        # torch's AdamW keeps its moments in the parameters' dtype
        ("autoplan", {"optimizer_state_dtype": "bf16"}, 3, "torch.zeros_like(param)"),
        ("torchtitan", {"grad_reduce_dtype": "bf16"}, 3, "mixed_precision_reduce is float32"),
        ("torchtitan", {"master_dtype": "bf16"}, 3, "training.dtype"),
        # Megatron-LM: bf16 moments from the distributed optimizer on, a bf16 master under
        # Megatron-FSDP only
        ("megatron-lm", {"optimizer_state_dtype": "bf16"}, 0, "from ZeRO 1"),
        ("megatron-lm", BF16_EVERYWHERE, 1, "from ZeRO 2"),
        ("deepspeed", {"optimizer_state_dtype": "bf16"}, 1, "bf16_optimizer_states"),
        ("deepspeed", BF16_EVERYWHERE, 0, "from ZeRO 1"),
        ("megatron-lm-2021", {"grad_reduce_dtype": "bf16"}, 1, "reduces gradients in fp32 or fp16"),
    ],
)
def test_a_stack_refuses_the_policies_it_does_not_run(
    framework: str, fields: dict[str, str], zero: int, fragment: str
) -> None:
    strategy = Strategy(dtype="bf16", dp_degree=8, zero_stage=zero, **fields)  # type: ignore[arg-type]
    refusal = precision_refusal(framework_profile(framework), strategy)
    assert refusal is not None and fragment in str(refusal), refusal
    assert "\n" not in str(refusal)


@pytest.mark.parametrize(
    ("framework", "fields", "zero"),
    [
        ("autoplan", BF16_EVERYWHERE, 0),
        ("autoplan", {"grad_reduce_dtype": "bf16"}, 3),
        ("torchtitan", {"master_dtype": "bf16", "optimizer_state_dtype": "bf16"}, 3),
        ("megatron-lm", {"optimizer_state_dtype": "bf16", "grad_reduce_dtype": "bf16"}, 1),
        ("megatron-lm", BF16_EVERYWHERE, 3),
        ("deepspeed", BF16_EVERYWHERE, 1),
        ("llm-foundry", {"grad_reduce_dtype": "bf16"}, 3),
    ],
)
def test_a_stack_runs_the_policies_it_has(
    framework: str, fields: dict[str, str], zero: int
) -> None:
    strategy = Strategy(dtype="bf16", dp_degree=8, zero_stage=zero, **fields)  # type: ignore[arg-type]
    assert precision_refusal(framework_profile(framework), strategy) is None


def test_the_search_gives_every_plan_the_policy_and_keeps_to_the_stack() -> None:
    """A policy, not an axis: every plan carries it; Megatron-LM's bf16 moments make the
    search pick the distributed optimizer or Megatron-FSDP; a policy the stack never runs, or
    that the search's dtype cannot go with, is refused before the search in one line."""
    profile = gpt_profile(num_layers=4, s=512, h=512, a=8, vocab=4096)
    cluster = Cluster.preset("dgx-a100-80g")
    found = search_plans(profile, cluster, global_batch=64, budget_s=10, top_k=3, **BF16_EVERYWHERE)
    assert all(
        (p.master_dtype, p.grad_reduce_dtype, p.optimizer_state_dtype) == ("bf16",) * 3
        for p in found.plans
    )
    megatron = search_plans(
        profile,
        cluster,
        global_batch=64,
        budget_s=10,
        framework="megatron-lm",
        optimizer_state_dtype="bf16",
    )
    assert megatron.plans[0].zero_stage >= 1
    refused = [
        ({"framework": "torchtitan", "grad_reduce_dtype": "bf16"}, "float32 only"),
        ({"optimizer_state_dtype": "bf16"}, "torch's AdamW keeps its moments"),
        ({"master_dtype": "bf16", "dtype": "fp32"}, "fp32 training keeps its weights"),
        ({"master_dtype": "fp8"}, "master_dtype='fp8'"),
    ]
    for constraints, fragment in refused:
        with pytest.raises(ConstraintError, match=re.escape(fragment)):
            search_plans(profile, cluster, global_batch=64, budget_s=1, **constraints)  # type: ignore[arg-type]


def test_the_cli_states_the_policy_and_validate_prices_it(tmp_path: Path) -> None:
    """estimate takes the policy and prints it; validate prices a plan file's stated policy,
    or the one its options restate; bad values are one line, no traceback."""
    base = ["--model", "gpt2-small", "--cluster", "dgx-a100-80g", "--dp", "8"]
    base += ["--global-batch", "64", "--zero", "3", "--json"]
    default = json.loads(run_cli("estimate", *base).stdout)
    bf16 = run_cli("estimate", *base, "--master-dtype", "bf16", "--optimizer-state-dtype", "bf16")
    assert bf16.returncode == 0, bf16.stderr
    data = json.loads(bf16.stdout)
    assert data["plan"]["master_dtype"] == "bf16"
    assert data["peak_memory_bytes"] < default["peak_memory_bytes"]
    # a plan file that ran with bf16 weights and states: validate prices what it states
    path = tmp_path / "plan.yaml"
    Plan.from_data(default["plan"]).to_yaml(path)
    plain = json.loads(run_cli("validate", str(path), "--model", "gpt2-small", "--json").stdout)
    restated = run_cli(
        "validate", str(path), "--model", "gpt2-small", "--json",
        "--master-dtype", "bf16", "--optimizer-state-dtype", "bf16",
    )  # fmt: skip
    assert restated.returncode == 0, restated.stderr
    assert json.loads(restated.stdout)["precision"]["master"] == "bf16"
    assert json.loads(restated.stdout)["peak_memory_bytes"] < plain["peak_memory_bytes"]
    Plan.from_data(data["plan"]).to_yaml(path)
    stated = json.loads(run_cli("validate", str(path), "--model", "gpt2-small", "--json").stdout)
    assert stated["peak_memory_bytes"] == json.loads(restated.stdout)["peak_memory_bytes"]
    for args, fragment in [
        (["--master-dtype", "bf16"], "torch's AdamW keeps its moments"),
        (["--grad-reduce-dtype", "fp8"], "'fp8' is not one of"),
        (["--dtype", "fp16", "--master-dtype", "bf16", "--optimizer-state-dtype", "bf16"],
         "fp16 training needs fp32 master weights"),
    ]:  # fmt: skip
        bad = run_cli("estimate", *base, *args)
        assert bad.returncode != 0 and fragment in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


def test_the_bench_states_the_policy_its_rows_ran() -> None:
    """bench/validate_published.py prices each published run with the precision policy its
    source states (validation_assumptions*.yaml: llm-foundry's FSDP PURE rows, DGX Cloud
    Benchmarking's grad_sync_dtype bf16, Megatron-Bridge's grad_reduce_in_fp32 False) and
    the defaults elsewhere."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import validate_published

    rows, assumptions = validate_published.load()
    by_id = {row["id"]: row for row in rows}

    def reduce_dtype(run_id: str) -> object:
        case = validate_published.build_case(by_id[run_id], assumptions)
        assert isinstance(case, validate_published.Case), case
        return case.plan_args.get("grad_reduce_dtype")

    assert reduce_dtype("llmfoundry-a100-40g-mpt-7b-s2048-g8-mb12") == "bf16"  # PURE
    assert reduce_dtype("llmfoundry-a100-80g-mpt-70b-s2048-g64-mb8") == "bf16"  # PURE
    assert reduce_dtype("llmfoundry-h100-80g-mpt-70b-s2048-g64-mb8") is None  # DEFAULT
    assert reduce_dtype("dgxc2411-h100-llama3.1-8b-8g-bf16") == "bf16"
    assert reduce_dtype("mbridge-2511-b200-llama3-8b-8g-fp8cs") == "bf16"
    assert reduce_dtype("dgxc2505-gb200-llama3.1-405b-256g-fp8") == "bf16"
    assert reduce_dtype("dgxc2505-gb200-llama3.1-405b-256g-bf16") is None
    case = validate_published.build_case(
        by_id["llmfoundry-a100-40g-mpt-7b-s2048-g8-mb12"], assumptions
    )
    assert isinstance(case, validate_published.Case)
    assert validate_published.predict(case).estimate.peak_rank is not None
