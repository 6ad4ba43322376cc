"""Mixed-precision policies (issue 43 item 3): the plan's master-weight, gradient-reduction and
optimizer-state dtypes (`cost_model.precision.PrecisionPolicy`): the plan format, the bytes and
the collectives the cost model prices for them, the stacks' refusals, the search's option, and
the refusals of values that do not go together."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from cost_model.hardware import Cluster
from cost_model.precision import precision_policy, precision_problem
from cost_model.workload import ModelProfile
from tests.cost_profiles import gpt_profile

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
