"""`autoplan export` of mixed-precision policies (issue 43 item 3): Megatron-LM's reduction and
precision-aware-optimizer flags and Megatron-FSDP's buffers, torchtitan's ``training.dtype``,
DeepSpeed's ``communication_data_type``, ``data_types.grad_accum_dtype`` and bf16 master
weights; each loaded by the stack's own code where it installs here, refused in the stack's
words where it has no such setting."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import autoplan
from autoplan.contract.plan import Plan
from autoplan.export import ExportError, export_plan, model_dims
from autoplan.export.deepspeed import deepspeed_config
from autoplan.export.megatron import megatron_args
from tests.test_export import CLUSTER, _DataParallel, _flags

BF16_EVERYWHERE = {
    "master_dtype": "bf16",
    "grad_reduce_dtype": "bf16",
    "optimizer_state_dtype": "bf16",
}
# The precision flags, as megatron/training/arguments.py defines them (NVIDIA/Megatron-LM
# d98e8a6: _add_mixed_precision_args, the precision-aware optimizer's and Megatron-FSDP's
# arguments), with their choices
MEGATRON_PRECISION_FLAGS = {
    "--grad-reduce-in-bf16": None,
    "--accumulate-allreduce-grads-in-fp32": None,
    "--use-precision-aware-optimizer": None,
    "--exp-avg-dtype": ("fp32", "fp16", "bf16", "fp8"),
    "--exp-avg-sq-dtype": ("fp32", "fp16", "bf16", "fp8"),
    "--megatron-fsdp-main-params-dtype": ("fp32", "bf16", "fp16", "auto"),
    "--megatron-fsdp-main-grads-dtype": ("fp32", "bf16", "fp16", "auto"),
}


@pytest.fixture(scope="module")
def llama8b() -> Any:
    return autoplan.trace(autoplan.models.preset("llama3-8b"))


def _plan(graph: Any, framework: str, **options: Any) -> Plan:
    options.setdefault("global_batch", 64)
    return autoplan.manual_plan(graph, CLUSTER, framework=framework, **options)


def _precision_flags(plan: Plan) -> dict[str, str | bool]:
    flags = _flags(megatron_args(plan, model_dims("llama3-8b")))
    precision = {k: v for k, v in flags.items() if k in MEGATRON_PRECISION_FLAGS}
    for flag, value in precision.items():
        choices = MEGATRON_PRECISION_FLAGS[flag]
        assert (value is True) if choices is None else (value in choices), (flag, value)
    return precision


def test_megatron_flags_state_the_policy(llama8b: Any) -> None:
    # the default under the distributed optimizer: Megatron reduces bf16 in fp32 by itself
    assert _precision_flags(_plan(llama8b, "megatron-lm", tp=8, dp=2, zero=1)) == {}
    reduce = _plan(llama8b, "megatron-lm", tp=8, dp=2, zero=1, grad_reduce_dtype="bf16")
    assert _precision_flags(reduce) == {"--grad-reduce-in-bf16": True}
    states = _plan(llama8b, "megatron-lm", tp=8, dp=2, zero=1, optimizer_state_dtype="bf16")
    assert _precision_flags(states) == {
        "--use-precision-aware-optimizer": True,
        "--exp-avg-dtype": "bf16",
        "--exp-avg-sq-dtype": "bf16",
    }
    # Megatron-FSDP's gradients follow its own buffer (default: the compute dtype): stated
    assert _precision_flags(_plan(llama8b, "megatron-lm", tp=8, dp=2, zero=3)) == {
        "--megatron-fsdp-main-grads-dtype": "fp32"
    }
    everywhere = _plan(llama8b, "megatron-lm", tp=8, dp=2, zero=3, **BF16_EVERYWHERE)
    assert _precision_flags(everywhere) == {
        "--megatron-fsdp-main-grads-dtype": "bf16",
        "--megatron-fsdp-main-params-dtype": "auto",
        "--use-precision-aware-optimizer": True,
        "--exp-avg-dtype": "bf16",
        "--exp-avg-sq-dtype": "bf16",
    }
    fp16 = _plan(llama8b, "megatron-lm", tp=8, dp=2, zero=1, dtype="fp16", grad_reduce_dtype="fp32")
    assert _precision_flags(fp16) == {"--accumulate-allreduce-grads-in-fp32": True}
    notes = export_plan(states, "megatron-lm").notes
    assert any("Transformer Engine >= 2.1" in note for note in notes)


def test_megatron_core_checks_what_the_flags_need() -> None:
    """megatron-core's OptimizerConfig: lower-precision moments need the precision-aware
    optimizer, which needs the distributed optimizer (the profile's rule), then Transformer
    Engine's FusedAdam (the export's note; not installed on this CPU machine)."""
    optimizer_config = pytest.importorskip("megatron.core.optimizer.optimizer_config")
    import torch

    config = optimizer_config.OptimizerConfig
    with pytest.raises(AssertionError, match="exp_avg_dtype can only be fp32"):
        config(exp_avg_dtype=torch.bfloat16, bf16=True)
    with pytest.raises(AssertionError, match="only supported with distributed optimizer"):
        config(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, bf16=True)
    # past both checks, megatron-core looks for Transformer Engine (its version, then its
    # FusedAdam's arguments), which this CPU machine does not have
    with pytest.raises((RuntimeError, TypeError)):
        config(
            use_precision_aware_optimizer=True,
            use_distributed_optimizer=True,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
            bf16=True,
        )


def test_megatron_refuses_a_bf16_master_outside_megatron_fsdp(llama8b: Any) -> None:
    plan = _plan(llama8b, "autoplan", tp=8, dp=2, zero=3, **BF16_EVERYWHERE)
    import dataclasses

    at_zero1 = dataclasses.replace(plan, zero_stage=1, framework="megatron-lm", estimate=None)
    with pytest.raises(ExportError) as caught:
        export_plan(at_zero1, "megatron-lm")
    text = str(caught.value)
    assert "--main-params-dtype is fp32 or fp16" in text and "master_dtype" in text


def test_torchtitan_module_states_a_bf16_master(
    llama8b: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(llama8b, "torchtitan", tp=8, dp=2, zero=3, master_dtype="bf16",
                 optimizer_state_dtype="bf16")  # fmt: skip
    exported = export_plan(plan, "torchtitan")
    module = exported.files["autoplan_torchtitan.py"]
    assert 'config.training.dtype = "bfloat16"' in module
    default = export_plan(_plan(llama8b, "torchtitan", tp=8, dp=2, zero=3), "torchtitan")
    assert "config.training.dtype" not in default.files["autoplan_torchtitan.py"]
    # torchtitan 0.3.0 imports triton (its MoE kernels) at import time: skipped without it
    pytest.importorskip("torchtitan.trainer", exc_type=ImportError)
    from torchtitan.config import ConfigManager

    (tmp_path / "autoplan_torchtitan.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("autoplan_torchtitan", None)
    try:
        config = ConfigManager().parse_args(["--module", exported.command[-3],
                                             "--config", exported.command[-1]])  # fmt: skip
    finally:  # the next test's module of the same name is its own
        sys.modules.pop("autoplan_torchtitan", None)
    assert config.training.dtype == "bfloat16"
    assert config.training.mixed_precision_param == "bfloat16"
    assert config.training.mixed_precision_reduce == "float32"


def test_torchtitan_refuses_a_bf16_reduction(llama8b: Any) -> None:
    import dataclasses

    plan = _plan(llama8b, "autoplan", tp=8, dp=2, zero=3, grad_reduce_dtype="bf16")
    plan = dataclasses.replace(plan, framework="torchtitan", estimate=None)
    with pytest.raises(ExportError, match="mixed_precision_reduce is float32 only"):
        export_plan(plan, "torchtitan")


def test_deepspeed_config_states_the_policy(llama8b: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    dims = model_dims("llama3-8b")
    default = deepspeed_config(_plan(llama8b, "deepspeed", tp=2, dp=8, zero=1), dims)
    # DeepSpeed reduces bf16 gradients in bf16 unless told: the plan's fp32 is stated
    assert default["communication_data_type"] == "fp32"
    assert default["data_types"] == {"grad_accum_dtype": "fp32"}
    assert default["bf16"] == {"enabled": True}
    plan = _plan(llama8b, "deepspeed", tp=2, dp=8, zero=1, **BF16_EVERYWHERE)
    config = deepspeed_config(plan, dims)
    assert config["communication_data_type"] == "bf16"
    assert config["data_types"] == {"grad_accum_dtype": "bf16"}
    assert config["bf16"] == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)
    for one in (plan, _plan(llama8b, "deepspeed", tp=2, dp=8, zero=1)):
        text = export_plan(one, "deepspeed").files["ds_config.json"]
        loaded = ds_config.DeepSpeedConfig(json.loads(text), mpu=_DataParallel(one.dp_degree))
        reduce = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[one.precision.grad_reduce]
        assert str(loaded.communication_data_type) == reduce
        assert loaded.grad_accum_dtype == one.precision.grad_reduce
        master = one.master_dtype == "bf16"
        assert loaded.bfloat16_config.bf16_master_weights_and_grads is master
        assert loaded.bfloat16_config.bf16_optimizer_states is master


def test_deepspeed_at_zero0_notes_its_accumulation_and_refuses_a_bf16_master(
    llama8b: Any,
) -> None:
    import dataclasses

    plan = _plan(llama8b, "deepspeed", tp=2, dp=8, zero=0)
    notes = export_plan(plan, "deepspeed").notes
    assert any("accumulates micro-batches' gradients in bf16" in note for note in notes)
    bf16 = dataclasses.replace(
        _plan(
            llama8b,
            "autoplan",
            tp=2,
            dp=8,
            zero=0,
            master_dtype="bf16",
            optimizer_state_dtype="bf16",
        ),
        framework="deepspeed",
        estimate=None,
    )
    with pytest.raises(ExportError, match="bf16_master_weights_and_grads"):
        export_plan(bf16, "deepspeed")
