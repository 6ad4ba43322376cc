"""Overlapped TP communication (issue 43 item 2, `Plan.tp_comm_overlap`): the plan field, its
price against numbers worked by hand (`cost_model.tp_overlap`, `parts.tensor_parallel`), the
stacks that have it and those that refuse it, and the search's policy."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import autoplan
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.export import ExportError, export_plan, model_dims
from autoplan.export.megatron import megatron_args
from autoplan.planner.search import _space_for
from autoplan.planner.space import ConstraintError
from autoplan.planner.stack_filter import StackChoices
from cost_model.communication import collective_time_s
from cost_model.estimate import CostModel
from cost_model.frameworks import FrameworkError, framework_profile
from cost_model.frameworks.megatron import TE_RING_SLOWDOWN, TE_SM_SLOWDOWN, TE_USERBUFFERS
from cost_model.frameworks.torch_async_tp import TORCH_ASYNC_TP
from cost_model.hardware import as_cluster
from cost_model.parts.tensor_parallel import tp_cost
from cost_model.strategy import Strategy, group_placements
from cost_model.tp_overlap import OverlapSplit, exposed_s
from passes import async_tp_refusal
from tests.conftest import run_cli
from tests.cost_profiles import gpt_profile, round_cluster
from tests.dist_utils import run_distributed
from tests.numerics import make_plan, refused_plan_worker

# ------------------------------------------------------------------------------- the splits


def test_split_arithmetic_by_hand() -> None:
    """Communication c beside a GEMM w (module docstring of `cost_model.tp_overlap`)."""
    ring, bulk = OverlapSplit(method="ring"), OverlapSplit(method="bulk")
    pipeline = OverlapSplit(method="pipeline", chunks=4)
    # a ring of 4 steps: (tp - 1) / tp of the GEMM hides the transfers
    assert ring.hidden_s(3.0, 8.0, 4) == pytest.approx(3.0)  # all of c under 6 of w
    assert ring.hidden_s(9.0, 8.0, 4) == pytest.approx(6.0)  # 3 of it exposed
    # 4 pipelined pieces: the last piece's communication follows the GEMM
    assert pipeline.hidden_s(4.0, 8.0, 8) == pytest.approx(3.0)
    assert pipeline.hidden_s(12.0, 8.0, 8) == pytest.approx(6.0)
    # bulk: beside an independent GEMM, all of it up to the GEMM's length
    assert bulk.hidden_s(4.0, 8.0, 8) == pytest.approx(4.0)
    assert bulk.hidden_s(12.0, 8.0, 8) == pytest.approx(8.0)
    # what is hidden slows the GEMM beside it; half achieved hides half
    slowed = OverlapSplit(method="bulk", slowdown=0.25)
    assert exposed_s(slowed, 4.0, 8.0, 8, 1.0) == pytest.approx(0.0 + 0.25 * 4.0)
    assert exposed_s(bulk, 4.0, 8.0, 8, 0.5) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="chunks >= 2"):
        OverlapSplit(method="pipeline", chunks=1)


@pytest.mark.parametrize(
    "split", [TE_USERBUFFERS.forward_reduce_scatter, TORCH_ASYNC_TP.forward_all_gather]
)
@pytest.mark.parametrize(("comm", "gemm"), [(0.0, 1.0), (1.0, 0.0), (1.0, 1.0), (3.0, 1.0)])
def test_exposed_never_exceeds_the_collective(
    split: OverlapSplit, comm: float, gemm: float
) -> None:
    exposed = exposed_s(split, comm, gemm, 8, 1.0)
    assert 0.0 <= exposed <= comm


# ----------------------------------------------------------------------- a block, by hand

# gpt_profile's block on the round cluster (100 TFLOP/s bf16 at 0.5; 100 GB/s at 0.5, 10 us):
# s = 1024, h = 1024, f = 4h, tp 2, one micro-batch of one sample, bf16
S, H, TP = 1024, 1024, 2
GEMM_RATE = 100e12 * 0.5
# a projection h x h on one TP rank: 2 s h h / tp FLOPs forward, as much for each of its
# input- and weight-gradient GEMMs
PROJ_S = 2 * S * H * H / TP / GEMM_RATE
# the sequence-parallel all-gather and reduce-scatter of (s, h) in bf16 on 2 ranks of one node:
# half the bytes over 100 GB/s at 0.5, plus the 10 us latency
COMM_S = 0.5 * S * H * 2 / 50e9 + 10e-6


def _block_tp(framework: str, overlap: bool) -> tuple[float, float]:
    profile = gpt_profile(num_layers=2, s=S, h=H, a=8, e=2)
    cluster = framework_profile(framework).cluster_for(profile, round_cluster())
    strategy = Strategy(tp_degree=TP, dp_degree=4, sequence_parallel=True, tp_comm_overlap=overlap)
    cost = tp_cost(
        profile.units[1],
        strategy,
        cluster,
        2,
        group_placements(strategy, cluster, "tp"),
        "none",
        overlap=framework_profile(framework).tp_comm_overlap,
    )
    return cost.forward_s, cost.backward_s


def test_the_hand_numbers_are_the_model_s() -> None:
    plain_forward, plain_backward = _block_tp("autoplan", False)
    # two regions (attention, MLP), each an all-gather and a reduce-scatter either way
    assert plain_forward == pytest.approx(4 * COMM_S)
    assert plain_backward == pytest.approx(4 * COMM_S)
    assert pytest.approx(3.097152e-05) == COMM_S
    assert pytest.approx(2.147483648e-05) == PROJ_S


def test_torch_async_tp_block_by_hand() -> None:
    """Ring splits of tp = 2 steps hide up to half of the GEMM beside them. Attention: q, k, v
    (3 PROJ_S) beside the input's all-gather, o (PROJ_S) beside its reduce-scatter; backward o's
    input gradient (PROJ_S) beside the gradient's all-gather, but the input gradient of q, k and
    v is their sum, which inductor does not fuse with the reduce-scatter: exposed whole. The
    MLP (one column-parallel linear, up: 4 PROJ_S) hides all of its four."""
    forward, backward = _block_tp("autoplan", True)
    row_exposed = COMM_S - min(COMM_S, PROJ_S / 2)  # o_proj's half: 1.07e-5 of 3.10e-5
    columns_exposed = COMM_S - min(COMM_S, 3 * PROJ_S / 2)  # 0
    assert columns_exposed == 0.0
    assert forward == pytest.approx(row_exposed + columns_exposed)
    assert backward == pytest.approx(row_exposed + COMM_S)
    assert forward == pytest.approx(2.02341e-05, rel=1e-5)  # 3.0972e-5 - 1.0737e-5


def test_transformer_engine_block_by_hand() -> None:
    """Megatron-LM's userbuffers: ring all-gathers (1 SM), 4-piece pipelined forward
    reduce-scatters and bulk backward reduce-scatters beside the weight gradients (16 SMs)."""
    forward, backward = _block_tp("megatron-lm", True)

    def slowed(hidden: float, slowdown: float) -> float:
        return COMM_S - hidden + slowdown * hidden

    # attention: q/k/v forward (3 PROJ_S) and o forward (PROJ_S)
    attention_forward = slowed(min(COMM_S, 3 * PROJ_S / 2), TE_RING_SLOWDOWN) + slowed(
        0.75 * min(COMM_S, PROJ_S), TE_SM_SLOWDOWN
    )
    # MLP: up (4 PROJ_S) and down (4 PROJ_S)
    mlp_forward = slowed(min(COMM_S, 4 * PROJ_S / 2), TE_RING_SLOWDOWN) + slowed(
        0.75 * min(COMM_S, 4 * PROJ_S), TE_SM_SLOWDOWN
    )
    assert forward == pytest.approx(attention_forward + mlp_forward)
    # backward: o's input gradient (PROJ_S) beside the all-gather; q/k/v's weight gradients
    # (3 PROJ_S) beside the reduce-scatter; the MLP's 4 PROJ_S each
    attention_backward = slowed(min(COMM_S, PROJ_S / 2), TE_RING_SLOWDOWN) + slowed(
        min(COMM_S, 3 * PROJ_S), TE_SM_SLOWDOWN
    )
    mlp_backward = slowed(min(COMM_S, 4 * PROJ_S / 2), TE_RING_SLOWDOWN) + slowed(
        min(COMM_S, 4 * PROJ_S), TE_SM_SLOWDOWN
    )
    assert backward == pytest.approx(attention_backward + mlp_backward)
    assert pytest.approx(16 / 116) == TE_SM_SLOWDOWN


def test_only_blocks_overlap_and_never_cost_more() -> None:
    """The embedding's and the head's collectives stay exposed (no stack overlaps them); every
    block costs less; so does the step."""
    graph = autoplan.trace(autoplan.models.gpt(4, 256, 8, 512, 1024))
    cluster = autoplan.Cluster.preset("dgx-h100-80g")
    kwargs = dict(tp=8, global_batch=8, sequence_parallel=True, framework="megatron-lm")
    plain = autoplan.manual_plan(graph, cluster, **kwargs)
    overlapped = autoplan.manual_plan(graph, cluster, tp_comm_overlap=True, **kwargs)
    model = CostModel(graph.profile, cluster, framework="megatron-lm")
    costs = {
        flag: model.unit_costs(Strategy.of(p), "none") for flag, p in ((0, plain), (1, overlapped))
    }
    for before, after in zip(costs[0], costs[1], strict=True):
        if before.kind == "block":
            assert after.tp_forward_s < before.tp_forward_s
            assert after.tp_backward_s < before.tp_backward_s
        else:
            assert (after.tp_forward_s, after.tp_backward_s) == (
                before.tp_forward_s,
                before.tp_backward_s,
            )
    assert overlapped.estimate is not None and plain.estimate is not None
    assert overlapped.estimate.step_time_s < plain.estimate.step_time_s
    assert overlapped.estimate.peak_memory_bytes == plain.estimate.peak_memory_bytes


def test_a_cpu_overlaps_nothing() -> None:
    """On CPU workers nothing overlaps (one core moves the bytes and computes): priced as
    without the overlap."""
    profile = gpt_profile(num_layers=2, s=S, h=H, a=8, e=2)
    cpu = round_cluster()
    cpu = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, kind="cpu"))
    strategy = Strategy(tp_degree=TP, dp_degree=4, sequence_parallel=True, tp_comm_overlap=True)
    groups = group_placements(strategy, cpu, "tp")
    with_overlap = tp_cost(
        profile.units[1], strategy, cpu, 2, groups, "none", overlap=TORCH_ASYNC_TP
    )
    without = tp_cost(profile.units[1], strategy, cpu, 2, groups, "none")
    assert with_overlap == without
    assert collective_time_s("all_gather", S * H * 2, groups, cpu) > 0


def test_its_range_is_sized_by_the_scored_overlapping_runs() -> None:
    """Published rows that overlap TP communication are scored (bench/validate_published.py,
    the achieved fraction the stack's): an overlapped plan has the feature, which those rows
    validate, and its range is sized by their residuals, not widened as an unseen feature's."""
    from cost_model.uncertainty import plan_features, shipped, step_interval

    plain = _plan(framework="megatron-lm")
    overlapped = _plan(framework="megatron-lm", tp_comm_overlap=True)
    features = plan_features(overlapped, "megatron-lm")
    assert "TP communication overlap" in features
    assert "TP communication overlap" not in plan_features(plain, "megatron-lm")
    step, _ = shipped()
    scored = [r for r in step.residuals if "TP communication overlap" in r.features]
    assert len({r.source for r in scored}) >= 2 and len(scored) >= 10, scored
    wide, narrow = step_interval(features), step_interval(plan_features(plain, "megatron-lm"))
    assert wide.unvalidated == () and wide != narrow


# ------------------------------------------------------------------------------- the plan


def _plan(**changes: object) -> Plan:
    graph = autoplan.trace(autoplan.models.gpt(2, 128, 4, 256, 512))
    kwargs: dict[str, object] = dict(
        tp=2, global_batch=4, sequence_parallel=True, framework="megatron-lm"
    )
    kwargs.update(changes)
    return autoplan.manual_plan(graph, as_cluster("dgx-h100-80g:devices_per_node=2"), **kwargs)  # type: ignore[arg-type]


def test_plan_file_round_trip(tmp_path: Path) -> None:
    """Written only when true; read back equal; a plan without it reads as before."""
    plain, overlapped = _plan(), _plan(tp_comm_overlap=True)
    plain.to_yaml(tmp_path / "plain.yaml")
    overlapped.to_yaml(tmp_path / "overlap.yaml")
    assert "tp_comm_overlap" not in (tmp_path / "plain.yaml").read_text()
    assert "tp_comm_overlap: true" in (tmp_path / "overlap.yaml").read_text()
    assert Plan.from_yaml(tmp_path / "overlap.yaml") == overlapped
    assert Plan.from_yaml(tmp_path / "plain.yaml") == plain
    assert not Plan.from_yaml(tmp_path / "plain.yaml").tp_comm_overlap


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        (
            dict(sequence_parallel=False),
            "tp_comm_overlap: true with tp_degree = 2 needs sequence_parallel: true",
        ),
        (dict(tp=1, sequence_parallel=False), "tp_comm_overlap: true needs tp_degree > 1"),
        (
            dict(framework="megatron-lm-2021"),
            "megatron-lm-2021 does not overlap its tensor-parallel communication",
        ),
        (
            dict(framework="torchtitan"),
            "tp_comm_overlap without compile: torchtitan's overlap is torch's async TP",
        ),
        (dict(framework="autoplan"), "set compile: true on every stage, or tp_comm_overlap: false"),
    ],
)
def test_bad_plans_are_refused_in_one_line(changes: dict[str, object], words: str) -> None:
    with pytest.raises((PlanError, FrameworkError)) as info:
        _plan(tp_comm_overlap=True, **changes)
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_a_plan_file_with_a_bad_value_names_it(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    _plan().to_yaml(path)
    path.write_text(path.read_text() + "tp_comm_overlap: maybe\n")
    with pytest.raises(PlanError) as info:
        Plan.from_yaml(path)
    assert "tp_comm_overlap: expected true or false, got 'maybe'" in str(info.value)
    with pytest.raises(PlanError, match=r"tp_comm_overlap = 'maybe' must be true or false"):
        dataclasses.replace(_plan(), tp_comm_overlap="maybe")  # type: ignore[arg-type]


def test_across_scale_up_domains_it_is_refused() -> None:
    """Peer memory is shared inside one NVLink domain only, even where cross-node TP is
    allowed."""
    graph = autoplan.trace(autoplan.models.gpt(2, 128, 4, 256, 512))
    cluster = as_cluster("dgx-h100-80g:devices_per_node=2,nodes=2")
    plan = autoplan.manual_plan(
        graph,
        cluster,
        tp=4,
        global_batch=4,
        sequence_parallel=True,
        framework="megatron-lm",
        allow_cross_node_tp=True,
    )
    with pytest.raises(PlanError, match="tp_comm_overlap with tp_degree = 4 across scale-up"):
        dataclasses.replace(plan, tp_comm_overlap=True, estimate=None).validate(
            graph, cluster, allow_cross_node_tp=True
        )


# ------------------------------------------------------------------------------- the search


def _members(framework: str, cluster_spec: str, **constraints: object) -> list[Strategy]:
    profile = gpt_profile(num_layers=4, s=512, h=256, a=8, e=2)
    cluster = as_cluster(cluster_spec)
    space = _space_for(profile, cluster, 8, framework, {"tp": (2,), "pp": (1,), **constraints})
    choices = StackChoices(space, framework_profile(framework), profile, cluster, 8)
    return [
        strategy
        for shape in choices.shapes()
        for strategy, refusal in choices.choices(shape)
        if refusal is None
    ]


def test_search_takes_it_where_the_stack_runs_it() -> None:
    """Every sequence-parallel member overlaps on Megatron-LM; none without sequence
    parallelism; none on a stack without it, or whose overlap needs compile the plan lacks."""
    members = _members("megatron-lm", "dgx-h100-80g:devices_per_node=2")
    assert members and {s.tp_comm_overlap for s in members if s.sequence_parallel} == {True}
    assert not any(s.tp_comm_overlap for s in members if not s.sequence_parallel)
    for framework in ("megatron-lm-2021", "torchtitan"):
        found = _members(framework, "dgx-h100-80g:devices_per_node=2")
        assert found and not any(s.tp_comm_overlap for s in found), framework
    off = _members("megatron-lm", "dgx-h100-80g:devices_per_node=2", tp_comm_overlap=False)
    assert off and not any(s.tp_comm_overlap for s in off)
    # torch's async TP where the search compiles (its --compile policy)
    for framework in ("torchtitan", "autoplan"):
        compiled = _members(framework, "dgx-h100-80g:devices_per_node=2", compile=True)
        assert {s.tp_comm_overlap for s in compiled if s.sequence_parallel} == {True}, framework


def test_search_on_a_cpu_never_overlaps() -> None:
    cpu = "local:devices_per_node=2"
    assert not any(s.tp_comm_overlap for s in _members("autoplan", cpu))
    with pytest.raises(ConstraintError, match=r"tp_comm_overlap=True on .*GPUs only"):
        _members("autoplan", cpu, tp_comm_overlap=True)


def test_search_constraints_refused_in_one_line() -> None:
    with pytest.raises(ConstraintError, match="tp_comm_overlap=True: megatron-lm-2021 does not"):
        _members("megatron-lm-2021", "dgx-h100-80g:devices_per_node=2", tp_comm_overlap=True)
    with pytest.raises(ConstraintError, match="sequence_parallel=False"):
        _members(
            "megatron-lm",
            "dgx-h100-80g:devices_per_node=2",
            tp_comm_overlap=True,
            sequence_parallel=False,
        )


# ------------------------------------------------------------------------------- CLI

_CLI_MODEL = "gpt:num_layers=4,hidden_size=256,num_heads=8,seq_len=512,vocab_size=1024"
_CLI_PLAN = ("--cluster", "dgx-h100-80g", "--tp", "8", "--global-batch", "8")


def test_cli_estimate_prices_it_and_refuses_bad_input_in_one_line() -> None:
    args = ("estimate", "--model", _CLI_MODEL, *_CLI_PLAN, "--framework", "megatron-lm")
    plain = run_cli(*args, "--sequence-parallel", "--json")
    overlapped = run_cli(*args, "--sequence-parallel", "--tp-comm-overlap", "--json")
    assert plain.returncode == overlapped.returncode == 0, overlapped.stderr
    before, after = json.loads(plain.stdout), json.loads(overlapped.stdout)
    assert after["plan"]["tp_comm_overlap"] is True and "tp_comm_overlap" not in before["plan"]
    assert after["step_time_s"] < before["step_time_s"]
    text = run_cli(*args, "--sequence-parallel", "--tp-comm-overlap")
    assert "TP communication: sequence-parallel all-gathers and reduce-scatters" in text.stdout
    refused = run_cli(*args, "--tp-comm-overlap")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "needs sequence_parallel: true" in refused.stderr


# ------------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def llama8b() -> Any:
    return autoplan.trace(autoplan.models.preset("llama3-8b"))


def _export_plan(graph: Any, **options: Any) -> Plan:
    return autoplan.manual_plan(
        graph, "dgx-h100-80g:nodes=2", tp=8, global_batch=16, sequence_parallel=True, **options
    )


def test_megatron_export_and_megatron_core_take_it(llama8b: Any) -> None:
    plan = _export_plan(llama8b, framework="megatron-lm", tp_comm_overlap=True)
    args = megatron_args(plan, model_dims("llama3-8b"))
    assert "--tp-comm-overlap" in args and "--sequence-parallel" in args
    exported = export_plan(plan, "megatron-lm", devices_per_node=8)
    assert any("Transformer Engine's userbuffers" in note for note in exported.notes)
    plain = _export_plan(llama8b, framework="megatron-lm")
    assert "--tp-comm-overlap" not in megatron_args(plain, model_dims("llama3-8b"))
    # the flag is ModelParallelConfig's field of the same name (Megatron-LM's
    # ArgumentGroupFactory), which megatron-core takes with sequence parallelism
    pytest.importorskip("megatron.core.model_parallel_config")
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(
        tensor_model_parallel_size=plan.tp_degree,
        sequence_parallel=True,
        tp_comm_overlap=True,
    )
    assert config.tp_comm_overlap and config.sequence_parallel


def test_torchtitan_export_loads_with_its_own_config_manager(
    llama8b: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torchtitan.trainer", exc_type=ImportError)
    from torchtitan.config import CompileConfig, ConfigManager

    plan = _export_plan(llama8b, framework="torchtitan", compile=True, tp_comm_overlap=True)
    exported = export_plan(plan, "torchtitan")
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(text: str) -> Any:
        (tmp_path / "autoplan_torchtitan.py").write_text(text)
        sys.modules.pop("autoplan_torchtitan", None)
        return ConfigManager().parse_args(
            ["--module", "autoplan_torchtitan", "--config", "autoplan_plan"]
        )

    try:
        config = load(exported.files["autoplan_torchtitan.py"])
        plain = export_plan(_export_plan(llama8b, framework="torchtitan"), "torchtitan")
        plain_config = load(plain.files["autoplan_torchtitan.py"])
    finally:
        sys.modules.pop("autoplan_torchtitan", None)  # other tests load a module of that name
    compiled = config.compile
    assert compiled.enable_async_tensor_parallel and compiled.enable
    # torchtitan's own rule for it (CompileConfig.__post_init__), on the loaded values
    CompileConfig(
        enable=compiled.enable,
        components=list(compiled.components),
        enable_async_tensor_parallel=True,
    )
    # a TP plan without it says so: llama3_405b's baseline turns async TP on
    assert not plain_config.compile.enable_async_tensor_parallel


def test_stacks_without_it_refuse_the_export(llama8b: Any) -> None:
    plan = _export_plan(llama8b, framework="megatron-lm", tp_comm_overlap=True)
    with pytest.raises(ExportError) as deepspeed:
        export_plan(plan, "deepspeed")
    assert "tp_comm_overlap = true: deepspeed's ds_config has no overlap" in str(deepspeed.value)
    assert "Domino" in str(deepspeed.value)
    with pytest.raises(ExportError) as torchtitan:
        export_plan(plan, "torchtitan")  # priced for megatron-lm: no compile
    message = str(torchtitan.value)
    assert "compile = false" in message and "CompileConfig refuses it without compile" in message


# ------------------------------------------------------------------------------- runtime


@pytest.mark.slow
def test_parallelize_refuses_it_on_cpu_on_every_rank(tmp_path: Path) -> None:
    """torch's async TP needs CUDA and NCCL: on CPU/gloo every rank refuses the plan in one
    line, before anything is built (nothing hangs)."""
    plan = make_plan(tp=2, sequence_parallel=True, compile=True, tp_comm_overlap=True)
    results = run_distributed(refused_plan_worker, plan.to_data(), world_size=2, tmp_path=tmp_path)
    for result in results:
        message = result["message"]
        assert message.startswith("tp_comm_overlap: true on cpu with the gloo backend"), message
        assert "needs CUDA devices and NCCL" in message and "\n" not in message
        assert result["meta"]
    assert async_tp_refusal(torch.device("cuda"), "nccl") is None
