"""torch.compile (issue 43 item 1), everything but running it: the plan field, the fusion groups
the trace records, their pricing, the stacks' refusals, the search's policy, the CLI and the
exports. The runs themselves (compiled against eager, several processes) are in
tests/test_compile_runtime.py.

Fused bytes are worked by hand from the traced shapes: fp32 (4 bytes), per sample.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan, StagePlan, even_stages, split_backward_conflict
from autoplan.export import ExportError, export_plan
from autoplan.planner.space import ConstraintError
from cost_model.compute import op_time
from cost_model.estimate import CostModel, estimate
from cost_model.frameworks import FrameworkError, framework_profile
from cost_model.hardware import Cluster
from cost_model.parts.compute import compute_times
from cost_model.parts.fp8 import cast_cost
from cost_model.parts.fusion import fused_ops
from cost_model.strategy import Strategy
from cost_model.workload import OpProfile, UnitProfile
from passes import apply_compile, is_compiled, split_stages
from tests.conftest import run_cli

SEQ, HIDDEN, FFN = 64, 256, 512


@pytest.fixture(scope="module")
def llama() -> autoplan.ModelGraph:
    model = autoplan.models.llama(
        2, HIDDEN, 4, SEQ, 512, num_kv_heads=2, ffn_hidden_size=FFN, device="cpu"
    )
    return autoplan.trace(model)


def _ops(graph: autoplan.ModelGraph, unit: int) -> dict[str, OpProfile]:
    return {op.name.split("_", 2)[-1] if op.name.startswith("blocks") else op.name: op
            for op in graph.profile.units[unit].ops}  # fmt: skip


# ----------------------------------------------------------------------------- plan field


def test_compile_is_left_out_at_its_default_and_read_back(tmp_path: Path) -> None:
    plan = Plan(
        dp_degree=1,
        tp_degree=1,
        pp_degree=2,
        stages=even_stages(4, 2),
        micro_batch_size=1,
        num_micro_batches=2,
        global_batch_size=2,
    )
    plan.to_yaml(tmp_path / "eager.yaml")
    assert "compile" not in (tmp_path / "eager.yaml").read_text()
    stages = (dataclasses.replace(plan.stages[0], compile=False), plan.stages[1])
    compiled = dataclasses.replace(plan, compile=True, stages=stages)
    compiled.to_yaml(tmp_path / "compiled.yaml")
    text = (tmp_path / "compiled.yaml").read_text()
    assert text.count("compile:") == 2  # the plan's, and stage 0's own
    again = Plan.from_yaml(tmp_path / "compiled.yaml")
    assert again == compiled and again.digest() != plan.digest()
    assert [again.stage_compiled(s) for s in range(2)] == [False, True]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"compile": 1}, "compile: expected true or false, got 1"),
        (
            {"stages": [{"first_unit": 0, "last_unit": 3, "compile": "yes"}]},
            "stages[0].compile: expected true or false, got 'yes'",
        ),
    ],
)
def test_bad_compile_values_are_refused_in_one_line(edit: dict[str, Any], words: str) -> None:
    data = {
        "schema_version": 1,
        "dp_degree": 1,
        "tp_degree": 1,
        "pp_degree": 1,
        "stages": [{"first_unit": 0, "last_unit": 3}],
        "micro_batch_size": 1,
        "num_micro_batches": 1,
        "global_batch_size": 1,
        **edit,
    }
    with pytest.raises(PlanError) as caught:
        Plan.from_data(data)
    assert words in str(caught.value) and "\n" not in str(caught.value)


# ----------------------------------------------------------------------------- fusion groups


def test_llama_block_fusion_groups_and_bytes(llama: autoplan.ModelGraph) -> None:
    """Per sample at fp32: a token row of the residual stream is h = 256 x 4 bytes, of the
    MLP's inner width f = 512 x 4."""
    ops = _ops(llama, 1)
    s, h, f = SEQ, HIDDEN * 4, FFN * 4
    # RMSNorm alone (between the block's input and q/k/v): read x, write its output; eager it
    # moves every intermediate of its pow/mean/rsqrt/mul (7 passes here)
    assert ops["attn_norm"].fused_bytes == 2 * s * h
    assert ops["attn_norm"].activation_bytes > 3 * s * h
    # SwiGLU: silu(gate) * up is one kernel that reads both GEMM outputs and writes once
    silu, product = ops["silu"], ops["mul_4"]
    assert silu.fusion_group == product.fusion_group >= 0
    assert silu.fused_bytes + product.fused_bytes == 3 * s * f
    # the residual add and the MLP's norm: read the attention output and x, write the new
    # residual (the next add reads it) and the normed input of the gate and up projections
    add, norm = ops["add_2"], ops["mlp_norm"]
    assert add.fusion_group == norm.fusion_group
    assert add.fused_bytes + norm.fused_bytes == 4 * s * h
    # the GEMMs and attention are not fused
    assert all(op.fusion_group == -1 for op in ops.values() if op.kind in ("matmul", "attention"))


def test_no_group_spans_an_unfused_op() -> None:
    """``relu(x)`` feeds a linear and the add after it: fusing the relu with the add would put
    the linear inside one kernel, so they stay two groups; the add, the multiply and the sum
    after it are one."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(x)
            return ((y + self.lin(y)) * 2.0).sum()

    graph = autoplan.trace(Model(), (torch.randn(4, 8, 64),))
    ops = {op.name: op for op in graph.profile.units[0].ops}
    row = 8 * 64 * 4  # one sample of x
    assert ops["relu"].fusion_group != ops["add"].fusion_group
    assert ops["add"].fusion_group == ops["mul"].fusion_group == ops["sum_1"].fusion_group
    assert ops["relu"].fused_bytes == 2 * row  # read x, write y (the linear and add read it)
    # read y and the linear's output; write one float for the batch of 4 (1 byte a sample)
    group = sum(ops[name].fused_bytes or 0.0 for name in ("add", "mul", "sum_1"))
    assert group == 2 * row + 1


# ----------------------------------------------------------------------------- pricing


def _op(name: str, kind: str, nbytes: float, *, group: int, fused: float) -> OpProfile:
    return OpProfile(
        name=name,
        kind=kind,  # type: ignore[arg-type]
        tp="replicated",
        forward_flops=0.0,
        backward_flops=0.0,
        activation_bytes=nbytes,
        fusion_group=group,
        fused_bytes=fused,
    )


def _unit(kind: str = "block") -> UnitProfile:
    """Two fused ops (one group: a reduction and an add) and a GEMM, numbers by hand."""
    return UnitProfile(
        name="u",
        kind=kind,  # type: ignore[arg-type]
        ops=(
            _op("norm", "reduction", 8e6, group=0, fused=2e6),
            _op("add", "elementwise", 3e6, group=0, fused=1e6),
            OpProfile(
                name="mm",
                kind="matmul",
                tp="replicated",
                forward_flops=1e9,
                backward_flops=2e9,
                activation_bytes=1e6,
            ),
        ),
        num_params=0,
        num_params_tp_sharded=0,
        param_bytes=0,
        saved_bytes_sharded=0.0,
        saved_bytes_replicated=0.0,
        input_bytes=0.0,
        output_bytes=0.0,
    )


def test_a_compiled_unit_moves_its_groups_bytes_once() -> None:
    """Eager: 11 MB forward, 22 MB backward, one launch per op each way. Compiled: the
    group's 3 MB and 6 MB, one launch (one reduction) each way; the GEMM unchanged."""
    cluster = Cluster.preset("dgx-a100-80g")
    cal, device = cluster.calibration, cluster.device
    bandwidth = device.memory_bandwidth_bytes_per_s * cal.memory_efficiency
    eager_s, compiled_s = Strategy(dtype="fp32"), Strategy(dtype="fp32", compile=True)
    eager = compute_times(_unit(), cluster, eager_s, 4)
    compiled = compute_times(_unit(), cluster, compiled_s, 4)
    launch = cal.kernel_overhead_s
    assert eager.forward_s - compiled.forward_s == pytest.approx(8e6 / bandwidth + launch)
    assert eager.backward_s - compiled.backward_s == pytest.approx(16e6 / bandwidth + launch)
    gemm = op_time(_unit().ops[2], device=device, calibration=cal, dtype="fp32",
                   micro_batch_size=1, traced_dtype_bytes=4)  # fmt: skip
    assert [f.kernels for f in fused_ops(_unit(), compiled_s)] == [1.0, 0.0, 1.0]
    assert compiled.gemm_forward_s == eager.gemm_forward_s == gemm.forward_s
    # the embedding and the head stay eager (torchtitan compiles the blocks)
    head = _unit("head")
    assert compute_times(head, cluster, compiled_s, 4) == compute_times(head, cluster, eager_s, 4)


def test_a_unit_without_recorded_dataflow_is_priced_eager() -> None:
    unit = _unit()
    bare = dataclasses.replace(
        unit,
        ops=tuple(dataclasses.replace(op, fusion_group=-1, fused_bytes=None) for op in unit.ops),
    )
    cluster = Cluster.preset("dgx-a100-80g")
    compiled = compute_times(bare, cluster, Strategy(compile=True), 4)
    assert compiled == compute_times(bare, cluster, Strategy(), 4)


def test_compiled_fp8_casts_are_the_fused_casts(llama: autoplan.ModelGraph) -> None:
    """torchao's casts under compile are priced as a fused-cast stack's (Transformer Engine)."""
    cluster = Cluster.preset("dgx-h100-80g")
    fused = dataclasses.replace(
        cluster, calibration=dataclasses.replace(cluster.calibration, fp8_eager_casts=0.0)
    )
    block = llama.profile.units[1]
    eager = Strategy(dtype="fp8-rowwise")
    compiled = dataclasses.replace(eager, compile=True)
    assert cast_cost(block, compiled, cluster) == cast_cost(block, eager, fused)
    assert (
        cast_cost(block, compiled, cluster).forward_s < cast_cost(block, eager, cluster).forward_s
    )


def test_compile_is_faster_keeps_memory_and_a_stage_can_differ() -> None:
    graph = autoplan.trace(autoplan.models.preset("llama3-8b"))
    cluster = Cluster.preset("dgx-h100-80g")
    plan = autoplan.manual_plan(graph, cluster, pp=2, dp=4, global_batch=32, zero=1)
    compiled = dataclasses.replace(plan, compile=True, estimate=None)
    first_only = dataclasses.replace(
        plan, estimate=None, stages=(dataclasses.replace(plan.stages[0], compile=True),
                                     plan.stages[1]),
    )  # fmt: skip
    eager_e, compiled_e, first_e = (estimate(graph.profile, cluster, p)
                                    for p in (plan, compiled, first_only))  # fmt: skip
    assert compiled_e.step_time_s < first_e.step_time_s < eager_e.step_time_s
    assert compiled_e.peak_memory_bytes == eager_e.peak_memory_bytes
    # the stage that compiles computes less; the other as eager
    assert first_e.stages[0].compute_s < eager_e.stages[0].compute_s
    assert first_e.stages[1].compute_s == eager_e.stages[1].compute_s
    # one cost model answers both as fresh ones do (the compute table keys on compile)
    model = CostModel(graph.profile, cluster)
    assert model.estimate(plan).step_time_s == eager_e.step_time_s
    assert model.estimate(compiled).step_time_s == compiled_e.step_time_s


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("framework", ["megatron-lm", "nanotron"])
def test_stacks_without_compile_refuse_it_at_plan_time(framework: str) -> None:
    with pytest.raises(FrameworkError) as caught:
        autoplan.manual_plan(autoplan.models.preset("gpt2-small"), "dgx-a100-80g", dp=8,
                             global_batch=8, framework=framework, compile=True)  # fmt: skip
    message = str(caught.value)
    assert "does not torch.compile the model" in message and "compile: false" in message
    assert "\n" not in message


def test_a_stack_with_one_compile_setting_refuses_a_mix() -> None:
    plan = autoplan.manual_plan(autoplan.models.preset("gpt2-small"), "dgx-a100-80g", pp=2,
                                dp=4, global_batch=8, framework="torchtitan")  # fmt: skip
    mixed = dataclasses.replace(
        plan, stages=(dataclasses.replace(plan.stages[0], compile=True), plan.stages[1])
    )
    refusal = framework_profile("torchtitan").plan_refusal(mixed, _profile("gpt2-small"))
    assert refusal is not None and refusal.limit == "compile-scope"
    assert "compile on 1 of 2 stages" in str(refusal)
    assert framework_profile("autoplan").plan_refusal(mixed, _profile("gpt2-small")) is None


def _profile(name: str) -> Any:
    return autoplan.trace(autoplan.models.preset(name)).profile


def test_split_backward_schedules_refuse_compile() -> None:
    message = split_backward_conflict("zbv", 0, ("none", "none"), compiled=True)
    assert message is not None and "interleaved-1f1b" in message
    plan = Plan(
        dp_degree=1,
        tp_degree=1,
        pp_degree=2,
        virtual_stages=2,
        stages=(*even_stages(4, 4)[:3], StagePlan(first_unit=3, last_unit=3, compile=True)),
        micro_batch_size=1,
        num_micro_batches=2,
        global_batch_size=2,
        schedule="zbv",
        dtype="fp32",
    )
    with pytest.raises(PlanError, match="compile with schedule 'zbv'"):
        plan.validate(None, Cluster.local(num_devices=2))


def test_the_search_takes_compile_as_a_policy() -> None:
    model = autoplan.models.gpt(4, 256, 4, 256, 1024)
    plan = autoplan.search(model, "dgx-a100-80g", global_batch=32, compile=True, pp=2, budget_s=2)
    assert plan.compile and plan.schedule in ("gpipe", "1f1b", "interleaved-1f1b")
    with pytest.raises(ConstraintError, match="compile with schedule 'zbv'"):
        autoplan.search(model, "dgx-a100-80g", global_batch=32, compile=True, schedules=["zbv"])
    with pytest.raises(ConstraintError, match="megatron-lm does not torch"):
        autoplan.search(model, "dgx-a100-80g", global_batch=32, compile=True,
                        framework="megatron-lm")  # fmt: skip


# ----------------------------------------------------------------------------- CLI


def test_cli_estimate_and_plan_take_compile(tmp_path: Path) -> None:
    model = "gpt:num_layers=4,hidden_size=256,num_heads=4,seq_len=256,vocab_size=1024"
    done = run_cli("estimate", "--model", model, "--cluster", "dgx-a100-80g", "--dp", "8",
                   "--global-batch", "8", "--compile")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "compiled" in done.stdout and "compile: torch.compile of each block" in done.stdout
    done = run_cli("estimate", "--model", model, "--cluster", "dgx-a100-80g", "--dp", "8",
                   "--global-batch", "8", "--compile", "--json")  # fmt: skip
    assert json.loads(done.stdout)["plan"]["compile"] is True
    done = run_cli("plan", "--model", model, "--cluster", "dgx-a100-80g", "--global-batch", "32",
                   "--compile", "--framework", "megatron-lm")  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "megatron-lm does not torch.compile the model" in done.stderr


# ----------------------------------------------------------------------------- exports


def _llama8b_plan(**changes: Any) -> Plan:
    plan = autoplan.manual_plan(autoplan.models.preset("llama3-8b"), "dgx-h100-80g", dp=8,
                                global_batch=16, micro_batch=2, zero=3, recompute="full",
                                compile=True)  # fmt: skip
    return dataclasses.replace(plan, **changes)


def test_torchtitan_export_compiles_the_model_and_the_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torchtitan.trainer", exc_type=ImportError)  # imports triton
    from torchtitan.config import ConfigManager

    for compile_, expected in ((True, (True, ["loss", "model"])), (False, (False, None))):
        exported = export_plan(_llama8b_plan(compile=compile_), "torchtitan")
        name = exported.command[-3]
        (tmp_path / f"{name}.py").write_text(exported.files[f"{name}.py"])
        monkeypatch.syspath_prepend(str(tmp_path))
        sys.modules.pop(name, None)
        config = ConfigManager().parse_args(["--module", name, "--config", exported.command[-1]])
        sys.modules.pop(name, None)
        assert config.compile.enable is expected[0]
        if expected[1] is not None:
            assert sorted(config.compile.components) == expected[1]


def test_megatron_refuses_and_deepspeed_notes_compile() -> None:
    with pytest.raises(ExportError) as caught:
        export_plan(_llama8b_plan(), "megatron-lm")
    message = str(caught.value)
    assert "compile = true" in message and "no option compiles it" in message
    assert "\n" not in message
    notes = export_plan(_llama8b_plan(zero_stage=1), "deepspeed").notes
    assert any("engine.compile()" in note for note in notes)
    assert not any("engine.compile()" in n for n in export_plan(
        _llama8b_plan(zero_stage=1, compile=False), "deepspeed").notes)  # fmt: skip


# ----------------------------------------------------------------------------- the pass


def test_the_pass_compiles_the_blocks_of_the_stages_that_say_so(
    llama: autoplan.ModelGraph,
) -> None:
    """Lazily (nothing compiles before a forward): each stage's blocks, as the stage says;
    the embedding and the head never."""
    plan = Plan(
        dp_degree=1,
        tp_degree=1,
        pp_degree=2,
        stages=(
            StagePlan(first_unit=0, last_unit=1, compile=True),
            StagePlan(first_unit=2, last_unit=3),
        ),
        micro_batch_size=1,
        num_micro_batches=2,
        global_batch_size=2,
        dtype="fp32",
    )
    split = split_stages(llama, plan, stage_indices=(0, 1))
    counts = [
        apply_compile(
            stage, plan.stage_compiled(stage.stage_idx), plan.decisions.compiled_unit_kinds
        )
        for stage in split.stages
    ]
    assert counts == [1, 0]
    compiled = {
        unit.profile.name: is_compiled(stage.unit_module(unit))
        for stage in split.stages
        for unit in stage.units
    }
    assert compiled == {"embedding": False, "blocks.0": True, "blocks.1": False, "head": False}


def test_a_compiled_plans_range_is_sized_by_the_scored_compiled_runs() -> None:
    """Compiled published rows are scored (bench/validate_published.py): a plan with one
    compiled stage has the feature, which those rows validate, and their residuals (compiled
    rows came out further from their measurements than eager ones) widen its range's upper end."""
    from cost_model.uncertainty import plan_features, shipped, step_interval

    plan = _llama8b_plan(compile=False)
    stage_only = dataclasses.replace(
        plan, stages=(dataclasses.replace(plan.stages[0], compile=True),)
    )
    eager, compiled = (step_interval(plan_features(p, "autoplan")) for p in (plan, stage_only))
    assert "torch.compile" in plan_features(stage_only, "autoplan")
    assert "torch.compile" not in plan_features(plan, "autoplan")
    step, _ = shipped()
    scored = [r for r in step.residuals if "torch.compile" in r.features]
    assert len({r.source for r in scored}) >= 2 and len(scored) >= 5, scored
    assert compiled.unvalidated == () and compiled.high > eager.high


_SIZED = {
    # large enough that bytes, not launches, decide (a context-parallel rank's share of them)
    "llama": lambda: autoplan.models.llama(2, 2048, 16, 4096, 32000, num_kv_heads=4),
    "moe": lambda: autoplan.models.moe(2, 1024, 8, 4096, 32000, num_experts=8, top_k=2,
                                       moe_ffn_hidden_size=512, num_shared_experts=1),
}  # fmt: skip


@pytest.mark.parametrize("model", list(_SIZED))
def test_compiling_never_slows_a_unit(model: str) -> None:
    """Under every split the cost model applies to a unit (TP with and without sequence
    parallelism, a context-parallel rank's share of the sequence), fusing moves fewer bytes
    and launches fewer kernels than eager, never more."""
    graph = autoplan.trace(_SIZED[model]())
    cluster = Cluster.preset("dgx-h100-80g")
    model_costs = CostModel(graph.profile, cluster)
    for tp, sp, cp in ((1, False, 1), (2, False, 1), (2, True, 1), (1, False, 4)):
        eager = Strategy(tp_degree=tp, sequence_parallel=sp, cp_degree=cp,
                         rank_layout=("pp", "dp", "cp", "tp"))  # fmt: skip
        compiled = dataclasses.replace(eager, compile=True)
        for index, unit in enumerate(graph.profile.units):
            before = model_costs.compute_times(eager, index)
            after = model_costs.compute_times(compiled, index)
            assert after.forward_s <= before.forward_s, (unit.name, tp, sp, cp)
            assert after.backward_s <= before.backward_s, (unit.name, tp, sp, cp)
            if unit.kind == "block":
                assert after.forward_s < before.forward_s, (unit.name, tp, sp, cp)
