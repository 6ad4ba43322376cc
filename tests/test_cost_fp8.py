"""fp8 recipes in the cost model (`cost_model.precision`, `cost_model.parts.fp8`): which linears
run fp8, the GEMMs at the fp8 rate, the casts, the scale syncs, fp8 all-gather, memory, and the
refusals (a device without the tensor cores, a linear fp8 cannot take, fields that do not go
with the dtype)."""

from __future__ import annotations

import dataclasses

import pytest

import autoplan
from autoplan.analysis.whatif import whatif
from autoplan.cli.plan_cmd import ranked_table
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import plan_estimate
from autoplan.planner.search import search_plans
from autoplan.planner.space import ConstraintError
from cost_model.calibration import Calibration
from cost_model.compute import op_time
from cost_model.estimate import CostModel, estimate
from cost_model.frameworks import framework_profile
from cost_model.parts.compute import compute_times
from cost_model.parts.data_parallel import data_parallel_cost
from cost_model.parts.fp8 import (
    cast_cost,
    converted_ops,
    fp8_params,
    fp8_shape_problem,
    scale_sync_counts,
)
from cost_model.precision import fp8_device_problem, precision_text
from cost_model.strategy import Strategy, group_placements
from cost_model.workload import ModelProfile
from tests.cost_profiles import _linear, gpt_profile, round_cluster

H, F, S, VOCAB = 256, 1024, 128, 1024


def _profile() -> ModelProfile:
    return gpt_profile(num_layers=2, s=S, h=H, a=8, vocab=VOCAB, f=F)


def _block(profile: ModelProfile):  # type: ignore[no-untyped-def]
    return next(u for u in profile.units if u.kind == "block")


def test_every_block_linear_converts_and_the_head_stays_bf16_by_default() -> None:
    profile = _profile()
    fp8 = Strategy(dtype="fp8")
    block, head = _block(profile), profile.units[-1]
    names = [op.name for op in converted_ops(block, fp8)]
    assert names == ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    assert list(converted_ops(head, fp8)) == []
    assert [op.name for op in converted_ops(head, dataclasses.replace(fp8, fp8_exclude=()))] == [
        "lm_head"
    ]
    # a module name (dots for the trace's underscores) and a plain dtype convert nothing
    assert "up_proj" not in [
        op.name for op in converted_ops(block, dataclasses.replace(fp8, fp8_exclude=("up.proj",)))
    ]
    assert list(converted_ops(block, Strategy(dtype="bf16"))) == []
    # the weights of the six linears: q, k, v, o (h x h), up and down (h x f)
    assert fp8_params(block, fp8) == 4 * H * H + 2 * H * F
    assert fp8_params(block, dataclasses.replace(fp8, tp_degree=4)) == (4 * H * H + 2 * H * F) / 4


def test_a_converted_gemm_runs_at_the_fp8_rate_and_attention_at_bf16s() -> None:
    cluster = round_cluster()
    block = _block(_profile())
    # a GEMM big enough to be compute-bound at either rate
    up = _linear("up_proj", "column", 1024, 4096, 4096, 2)
    attn = next(op for op in block.ops if op.kind == "attention")
    kwargs = dict(device=cluster.device, calibration=cluster.calibration, micro_batch_size=4)
    bf16 = op_time(up, dtype="bf16", **kwargs)  # type: ignore[arg-type]
    fp8 = op_time(up, dtype="fp8", fp8=Strategy(dtype="fp8").fp8, **kwargs)  # type: ignore[arg-type]
    # round cluster: no overhead, no size penalty; fp8 states 200 TFLOP/s, bf16 100
    assert fp8.forward_s == pytest.approx(bf16.forward_s / 2)
    assert fp8.backward_s == pytest.approx(bf16.backward_s / 2)
    assert op_time(attn, dtype="fp8", **kwargs) == op_time(attn, dtype="bf16", **kwargs)  # type: ignore[arg-type]
    # the ratio scales the fp8 GEMMs' efficiency only
    half = dataclasses.replace(cluster.calibration, fp8_gemm_efficiency_ratio=0.5)
    slow = op_time(
        up, dtype="fp8", fp8=Strategy(dtype="fp8").fp8, **{**kwargs, "calibration": half}
    )  # type: ignore[arg-type]
    assert slow.forward_s == pytest.approx(bf16.forward_s)


def test_eager_casts_move_33_bytes_an_element_six_times_a_linear() -> None:
    cluster = round_cluster()
    block = _block(_profile())
    strategy = Strategy(dtype="fp8", micro_batch_size=2)
    cost = cast_cost(block, strategy, cluster)
    m = S * 2
    dims = [(H, H)] * 4 + [(H, F), (F, H)]  # (k, n) of q, k, v, o, up, down
    inputs = sum(m * k for k, _ in dims)
    weights = sum(k * n for k, n in dims)
    grads = sum(m * n for _, n in dims)
    bandwidth = 1e12 * cluster.calibration.memory_efficiency
    assert cost.forward_s == pytest.approx(33 * (inputs + weights) / bandwidth)
    assert cost.backward_s == pytest.approx(33 * (2 * grads + inputs + weights) / bandwidth)
    # fused casts (Transformer Engine) move 6 bytes an input forward, 6 a gradient backward, and
    # 8 a weight once a step, whatever the micro-batch count
    te = framework_profile("megatron-lm").cluster_for(_profile(), cluster)
    te_bw = te.device.memory_bandwidth_bytes_per_s * te.calibration.memory_efficiency
    overhead = te.calibration.kernel_overhead_s
    for m in (1, 4):
        fused = cast_cost(block, dataclasses.replace(strategy, num_micro_batches=m), te)
        assert fused.forward_s == pytest.approx(6 * inputs / te_bw + overhead * 6 * 2)
        assert fused.step_s == pytest.approx(8 * weights / te_bw + overhead * 6 * 3)
    # and a compute time carries them
    plain = compute_times(block, cluster, Strategy(dtype="bf16", micro_batch_size=2), 4)
    times = compute_times(block, cluster, strategy, 4)
    assert times.forward_s > plain.forward_s - 1e-12


def test_tensorwise_scales_sync_over_tp_rowwise_do_not() -> None:
    block = _block(_profile())
    tp = Strategy(dtype="fp8", tp_degree=2, dp_degree=1)
    # six TP-sharded weights, cast forward and backward
    assert scale_sync_counts(block, tp) == (6.0, 6.0)
    # sequence parallel adds the column inputs (q, k, v, up) and the row grads (o, down)
    assert scale_sync_counts(block, dataclasses.replace(tp, sequence_parallel=True)) == (10, 8)
    # Transformer Engine scales each weight shard itself
    assert scale_sync_counts(block, tp, shard_weight_scales=True) == (0.0, 0.0)
    assert scale_sync_counts(block, dataclasses.replace(tp, dtype="fp8-rowwise")) == (0.0, 0.0)
    assert scale_sync_counts(block, Strategy(dtype="fp8")) == (0.0, 0.0)


def test_fp8_all_gather_gathers_converted_weights_in_one_byte() -> None:
    cluster = round_cluster()
    block = _block(_profile())
    n, fp8_n = float(block.num_params), fp8_params(block, Strategy(dtype="fp8"))
    base = Strategy(dtype="fp8", dp_degree=8, zero_stage=3)
    groups = group_placements(base, cluster, "dp")
    off = data_parallel_cost(n, base, cluster, groups, forward_window_s=0, backward_window_s=0)
    on = data_parallel_cost(
        n,
        dataclasses.replace(base, fp8_all_gather=True),
        cluster,
        groups,
        forward_window_s=0,
        backward_window_s=0,
        fp8_params=fp8_n,
        fp8_weights=6,
    )
    assert off.param_bytes == 2 * n
    assert on.param_bytes == 2 * n - fp8_n
    assert on.zero3_forward_s < off.zero3_forward_s


def _static_bytes(plan: autoplan.Plan) -> float:
    """The first pipeline rank's weight bytes."""
    return estimate(_PROFILE, round_cluster(), plan).ranks[0].memory.param_bytes


_PROFILE = gpt_profile(num_layers=4, s=1024, h=1024, a=16, vocab=4096)


def test_estimates_price_fp8_and_its_memory() -> None:
    profile, cluster = _PROFILE, round_cluster()

    def plan(dtype: str, framework: str = "autoplan", **fields: object) -> autoplan.Plan:
        made = autoplan.manual_plan(
            profile, cluster, global_batch=16, zero=1, dtype=dtype, framework=framework
        )
        if fields:
            made = dataclasses.replace(made, **fields)
            made = made.with_estimate(plan_estimate(estimate(profile, cluster, made), cluster))
        return made

    bf16, fp8 = plan("bf16"), plan("fp8")
    assert bf16.estimate is not None and fp8.estimate is not None
    # MFU is against the bf16 peak for both (the same model FLOPs)
    assert fp8.estimate.mfu * fp8.estimate.step_time_s == pytest.approx(
        bf16.estimate.mfu * bf16.estimate.step_time_s
    )
    # torchao's eager casts cost more than the fp8 GEMMs save on this small model
    assert fp8.estimate.step_time_s > bf16.estimate.step_time_s
    # FSDP2 keeps ZeRO-1's unsharded weights in fp8 with fp8 all-gather: one byte fewer each
    converted = sum(fp8_params(u, Strategy(dtype="fp8")) for u in profile.units)
    gathered = plan("fp8", fp8_all_gather=True)
    assert _static_bytes(fp8) - _static_bytes(gathered) == pytest.approx(converted)
    # Transformer Engine keeps an fp8 weight and its transpose: 2 bytes a converted weight,
    # and its fused casts make fp8 the faster
    te_bf16, te_fp8 = plan("bf16", "megatron-lm"), plan("fp8", "megatron-lm")
    assert _static_bytes(te_fp8) - _static_bytes(te_bf16) == pytest.approx(2 * converted)
    # with fp8 parameters (--fp8-param-gather) the fp8 weight and its transpose replace bf16's
    te_params = plan("fp8", "megatron-lm", fp8_all_gather=True)
    assert _static_bytes(te_params) == pytest.approx(_static_bytes(te_bf16))


def test_devices_without_fp8_tensor_cores_refuse_in_one_line() -> None:
    a100 = autoplan.Cluster.preset("dgx-a100-80g")
    h100 = autoplan.Cluster.preset("dgx-h100-80g")
    said = a100.device.missing_rate("fp8")
    assert said is not None and "A100" in said and "use dtype bf16" in said and "\n" not in said
    said = h100.device.missing_rate("mxfp8")
    assert said is not None and "MX" in said and "fp8 or fp8-rowwise" in said
    assert h100.device.missing_rate("fp8") is None
    cpu = fp8_device_problem("fp8", "cpu", "cpu", frozenset({"fp32", "bf16"}))
    assert cpu is not None and "CPU has no fp8 tensor cores" in cpu
    profile = _profile()
    with pytest.raises(PlanError, match=r"A100.*has no fp8 tensor cores.*use dtype bf16"):
        autoplan.manual_plan(profile, a100, global_batch=8, dtype="fp8")


def test_a_linear_fp8_cannot_take_is_refused_naming_its_shape_and_the_fix() -> None:
    profile = gpt_profile(num_layers=2, s=S, h=H, a=8, vocab=1000, f=F)
    head_kept = Strategy(dtype="fp8")
    assert fp8_shape_problem(profile, head_kept) is None  # the head (vocab 1000) stays bf16
    said = fp8_shape_problem(profile, dataclasses.replace(head_kept, fp8_exclude=()))
    assert said is not None
    assert "'lm_head'" in said and "256 x 1000" in said and "fp8_exclude" in said
    # TP splits a dimension below the multiple
    said = fp8_shape_problem(_profile(), dataclasses.replace(head_kept, tp_degree=32))
    assert said is not None and "on each of 32 TP ranks" in said
    h100 = autoplan.Cluster.preset("dgx-h100-80g")
    plan = autoplan.manual_plan(profile, h100, global_batch=8, dtype="fp8")
    with pytest.raises(PlanError, match="divisible by 16"):
        dataclasses.replace(plan, fp8_exclude=()).validate(profile, h100)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"fp8_all_gather": True, "dtype": "bf16"}, "needs an fp8 dtype"),
        ({"fp8_all_gather": True, "dtype": "fp8-rowwise", "zero_stage": 3}, "tensor-wise"),
        ({"fp8_all_gather": True, "dtype": "fp8", "zero_stage": 0}, "zero_stage >= 1"),
        ({"fp8_exclude": ("",)}, "fp8_exclude"),
    ],
)
def test_fp8_fields_that_do_not_go_with_the_plan_are_refused(
    changes: dict[str, object], match: str
) -> None:
    h100 = autoplan.Cluster.preset("dgx-h100-80g")
    plan = autoplan.manual_plan(_profile(), h100, global_batch=8, dtype="fp8", zero=1)
    with pytest.raises(PlanError, match=match):
        dataclasses.replace(plan, **changes)


def test_an_fp8_plan_round_trips_through_yaml(tmp_path) -> None:  # type: ignore[no-untyped-def]
    h100 = autoplan.Cluster.preset("dgx-h100-80g")
    plan = autoplan.manual_plan(_profile(), h100, global_batch=8, dtype="fp8", zero=3)
    plan = dataclasses.replace(plan, fp8_all_gather=True, fp8_exclude=("head", "blocks.0"))
    plan.to_yaml(tmp_path / "plan.yaml")
    assert autoplan.Plan.from_yaml(tmp_path / "plan.yaml") == plan
    # a bf16 plan writes no fp8 field
    bf16 = autoplan.manual_plan(_profile(), h100, global_batch=8, dtype="bf16")
    assert "fp8_exclude" not in bf16.to_data()


def test_calibration_bounds_its_fp8_fields() -> None:
    with pytest.raises(ValueError, match="fp8_gemm_efficiency_ratio"):
        Calibration(fp8_gemm_efficiency_ratio=5.0)
    with pytest.raises(ValueError, match="fp8_eager_casts"):
        Calibration(fp8_eager_casts=2.0)


def test_the_search_takes_dtype_as_an_axis_and_prices_each_stack_its_way() -> None:
    profile = gpt_profile(num_layers=8, s=2048, h=2048, a=16, vocab=8192)
    h100 = autoplan.Cluster.preset("dgx-h100-80g")
    chosen = {}
    for framework in ("autoplan", "megatron-lm"):
        result = search_plans(
            profile,
            h100,
            global_batch=32,
            budget_s=1.0,
            top_k=8,
            dtype=("bf16", "fp8"),
            framework=framework,
            pp=(1,),
        )
        chosen[framework] = result.plans[0].dtype
    # Transformer Engine's fused casts make fp8 pay; torchao's eager ones do not
    assert chosen == {"autoplan": "bf16", "megatron-lm": "fp8"}
    # and the same search in one dtype gives that dtype's plan
    only = search_plans(
        profile, h100, global_batch=32, budget_s=1.0, dtype="fp8", framework="megatron-lm", pp=(1,)
    )
    assert {plan.dtype for plan in only.plans} == {"fp8"}


def test_a_search_refuses_a_recipe_the_device_or_stack_lacks() -> None:
    profile = _profile()
    with pytest.raises(ConstraintError, match=r"A100.*no fp8 tensor cores"):
        search_plans(profile, autoplan.Cluster.preset("dgx-a100-80g"), global_batch=8, dtype="fp8")
    with pytest.raises(ConstraintError, match="deepspeed has no fp8 recipe"):
        search_plans(
            profile,
            autoplan.Cluster.preset("dgx-h100-80g"),
            global_batch=8,
            dtype=("bf16", "fp8"),
            framework="deepspeed",
        )
    with pytest.raises(ConstraintError, match="dtype='fp9'"):
        search_plans(profile, autoplan.Cluster.preset("dgx-h100-80g"), global_batch=8, dtype="fp9")


def test_whatif_compares_dtypes_side_by_side() -> None:
    profile = gpt_profile(num_layers=4, s=2048, h=2048, a=16, vocab=8192)
    result = whatif(
        profile,
        "dgx-h100-80g",
        num_devices=[8],
        global_batch=16,
        budget_s=0.5,
        workers=1,
        dtype="bf16,fp8",
        framework="megatron-lm",
        pp=(1,),
    )
    assert [row.cluster for row in result.rows] == ["dgx-h100-80g bf16", "dgx-h100-80g fp8"]
    assert [row.plan.dtype for row in result.rows if row.plan] == ["bf16", "fp8"]


def test_plan_output_names_the_dtype_and_what_stays_in_which_precision() -> None:
    h100 = autoplan.Cluster.preset("dgx-h100-80g")
    plans = tuple(
        autoplan.manual_plan(_profile(), h100, global_batch=8, dtype=dtype, zero=1)  # type: ignore[arg-type]
        for dtype in ("fp8", "bf16")
    )
    table = ranked_table(plans)
    headers = [column.header for column in table.columns]
    assert "dtype" in headers and "range" in headers  # 100 columns hold both
    # at 80 the narrow layout leaves the range out (the caption says so), never the dtype
    narrow = ranked_table(plans, width=80)
    assert "dtype" in [c.header for c in narrow.columns]
    assert "range" not in [c.header for c in narrow.columns]
    assert "not shown at 80 columns: " in str(narrow.caption)
    assert list(table.columns[headers.index("dtype")].cells) == ["fp8", "bf16"]
    # one dtype, no recipe: no column
    assert "dtype" not in [c.header for c in ranked_table(plans[1:]).columns]
    said = precision_text("fp8", ("head",), True)
    assert said is not None
    assert said.startswith("fp8 (dynamic tensor-wise scaling") and "but head" in said
    assert "fp32 master weights" in said and "all-gathered in fp8" in said
    assert precision_text("bf16", ("head",), False) is None


def test_sequence_parallel_casts_the_gathered_tensors_on_the_ranks_share() -> None:
    cluster = round_cluster()
    block = _block(_profile())
    tp = Strategy(dtype="fp8", tp_degree=2)
    sp = dataclasses.replace(tp, sequence_parallel=True)
    bandwidth = 1e12 * cluster.calibration.memory_efficiency
    # q, k, v, up: column inputs (S x H each) cast on half the sequence, forward and backward
    column_inputs = 4 * S * H
    saved = 33 * (column_inputs / 2) / bandwidth
    assert cast_cost(block, tp, cluster).forward_s - cast_cost(block, sp, cluster).forward_s == (
        pytest.approx(saved)
    )
    # o, down: row outputs' gradients (S x H each, twice) on half the sequence, plus the
    # column inputs' backward cast
    row_grads = 2 * S * H
    saved_backward = 33 * (2 * row_grads / 2 + column_inputs / 2) / bandwidth
    assert cast_cost(block, tp, cluster).backward_s - cast_cost(block, sp, cluster).backward_s == (
        pytest.approx(saved_backward)
    )


def test_one_cost_model_prices_each_fp8_strategy_as_a_fresh_one() -> None:
    """The cost model's compute table keys on the fp8 fields (which linears convert, whether
    weights are gathered in fp8): strategies that differ only in them get their own compute."""
    profile = gpt_profile(num_layers=2, s=1024, h=1024, a=16, vocab=4096)
    cluster = round_cluster()
    shared = CostModel(profile, cluster)
    base = Strategy(dtype="fp8", dp_degree=8, zero_stage=3)
    for strategy in (
        base,
        dataclasses.replace(base, fp8_all_gather=True),
        dataclasses.replace(base, fp8_exclude=()),
    ):
        fresh = CostModel(profile, cluster)
        for unit in range(profile.num_units):
            assert shared.compute_times(strategy, unit) == fresh.compute_times(strategy, unit)
