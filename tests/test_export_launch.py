"""`autoplan export`: launch lines that run, and every exported option checked as the target
stack checks it.

The torchrun lines (Megatron-LM, torchtitan) are parsed by torch's own launcher parser
(``torch.distributed.run.get_args_parser``): one node runs ``--standalone``, more nodes (or an
unknown count) meet at a c10d rendezvous. DeepSpeed's line uses its runner's flags (the table
below, from ``deepspeed/launcher/runner.py`` 0.19.8 ``parse_args``; parsed by the runner
itself where deepspeed imports). Each rule mirrored from a stack's own validation
(`autoplan.export.megatron_rules`, `torchtitan_rules`, `deepspeed_rules`) refuses the
combination it rejects with one line naming the value, the rule with its source, and the fix;
where the stack's code imports here (megatron-core's ``TransformerConfig``) it is checked to
refuse the same. Plans are built directly: the exporters read only the plan and the model's
sizes.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

import pytest
import torch.distributed.run as torchrun

from autoplan.contract.plan import Plan, even_stages
from autoplan.export import ExportError, export_plan
from autoplan.export.deepspeed_rules import DeepSpeedRun, check_deepspeed_config
from autoplan.export.megatron_rules import check_megatron_args
from autoplan.export.torchtitan_rules import TitanSettings, check_torchtitan_settings
from cost_model.frameworks import framework_profile
from cost_model.frameworks.limits import optimizer_offload_refusal
from cost_model.strategy import Strategy

LLAMA8B = "llama3-8b"  # 32 blocks (34 pipeline units), 32 heads, 8 kv heads

# deepspeed/launcher/runner.py parse_args (DeepSpeed 0.19.8): the flags the export may write
DEEPSPEED_RUNNER_FLAGS = {
    "--hostfile", "--no_ssh", "--node_rank", "--master_addr", "--master_port", "--num_nodes",
    "--num_gpus",
}  # fmt: skip


def _plan(**changes: Any) -> Plan:
    """tp 2 x pp 2 x dp 4 (16 devices), 4 micro-batches of 1, ZeRO-1, unless changed."""
    fields: dict[str, Any] = dict(
        dp_degree=4, tp_degree=2, pp_degree=2, micro_batch_size=1, num_micro_batches=4,
        zero_stage=1, sequence_parallel=True,
    )  # fmt: skip
    fields.update(changes)
    fields["global_batch_size"] = (
        fields["micro_batch_size"] * fields["num_micro_batches"] * fields["dp_degree"]
    )
    stages = even_stages(34, fields["pp_degree"] * fields.get("virtual_stages", 1))
    return Plan(stages=stages, **fields)


def _one_line(error: pytest.ExceptionInfo[ExportError], *fragments: str) -> str:
    """The refusal: one problem, on one line, naming each fragment."""
    message = str(error.value)
    assert len(error.value.problems) == 1, message
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ------------------------------------------------------------------------------ launch lines


# what a node's shell could hold for the line's variables
_VALUES = {
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "JOB_ID": "4242", "NODE_RANK": "1",
    "HOSTFILE": "hostfile", "NNODES": "2", "NPROC_PER_NODE": "8",
}  # fmt: skip


def _expanded(command: tuple[str, ...]) -> list[str]:
    """``command`` as the shell runs it once every variable it names is set."""
    parts = list(command)
    for name, value in _VALUES.items():
        parts = [part.replace(f"${name}", value) for part in parts]
    assert not any("$" in part for part in parts), parts
    return parts


def _torchrun_args(command: tuple[str, ...]) -> Any:
    """The torchrun part of ``command`` parsed by torch's own launcher parser."""
    start = command.index("torchrun")
    assert all(part.startswith(("env", "CUDA_")) for part in command[:start]), command
    return torchrun.get_args_parser().parse_args(_expanded(command)[start + 1 :])


@pytest.mark.parametrize("framework", ["megatron-lm", "torchtitan"])
@pytest.mark.parametrize("per_node", [8, 16, None])
def test_torchrun_lines_parse_and_carry_the_rendezvous(
    framework: str, per_node: int | None
) -> None:
    plan = _plan(zero_stage=1 if framework == "megatron-lm" else 3)
    exported = export_plan(plan, framework, model=LLAMA8B, devices_per_node=per_node)
    parsed = _torchrun_args(exported.command)
    nodes = {8: "2", 16: "1", None: "2"}[per_node]  # $NNODES set to 2
    assert parsed.nnodes == nodes
    assert parsed.nproc_per_node == {8: "8", 16: "16", None: "8"}[per_node]
    if nodes == "1":
        assert parsed.standalone and exported.variables == ()
    else:
        assert not parsed.standalone
        assert (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id) == (
            "c10d", "10.0.0.1:29500", "4242")  # fmt: skip
        names = [v.name for v in exported.variables]
        assert {"MASTER_ADDR", "MASTER_PORT", "JOB_ID"} <= set(names)
        assert ("NNODES" in names) == (per_node is None)
    if framework == "megatron-lm":
        assert parsed.training_script == "pretrain_gpt.py" and not parsed.module
        assert parsed.training_script_args[:2] == ["--num-layers", "32"]
    else:
        assert parsed.module and parsed.training_script == "torchtitan.train"
        assert parsed.training_script_args == ["--module", "autoplan_torchtitan", "--config",
                                               "autoplan_plan"]  # fmt: skip
    # the printed line reads back as the command, placeholders bare for the shell to expand
    assert shlex.split(exported.command_line) == list(exported.command)
    assert "'$" not in exported.command_line


def test_megatron_states_the_environment_it_needs() -> None:
    tp = export_plan(_plan(), "megatron-lm", model=LLAMA8B, devices_per_node=8)
    assert tp.command[:2] == ("env", "CUDA_DEVICE_MAX_CONNECTIONS=1")
    assert any("CUDA_DEVICE_MAX_CONNECTIONS=1" in note for note in tp.notes)
    # Megatron-FSDP asserts the opposite (validate_args L1166-1167): nothing set
    fsdp = export_plan(_plan(pp_degree=1, dp_degree=8, zero_stage=3), "megatron-lm",
                       model=LLAMA8B, devices_per_node=8)  # fmt: skip
    assert fsdp.command[0] == "torchrun"
    assert "--megatron-fsdp-version 1" in fsdp.files["megatron_args.txt"]


@pytest.mark.parametrize("per_node", [8, 16])
def test_deepspeed_line_uses_its_launchers_own_flags(per_node: int) -> None:
    plan = _plan(tp_degree=1, pp_degree=1, dp_degree=16, sequence_parallel=False)
    exported = export_plan(plan, "deepspeed", model=LLAMA8B, devices_per_node=per_node)
    command = exported.command
    assert command[0] == "deepspeed"
    flags = {part.split("=")[0] for part in command[1 : command.index("train.py")]}
    assert flags <= DEEPSPEED_RUNNER_FLAGS, flags - DEEPSPEED_RUNNER_FLAGS
    if per_node == 8:
        assert {"--no_ssh", "--node_rank=$NODE_RANK", "--master_addr=$MASTER_ADDR",
                "--num_nodes=2"} <= set(command)  # fmt: skip
        assert [v.name for v in exported.variables] == [
            "HOSTFILE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"]  # fmt: skip
    else:
        assert "--num_nodes=1" in command and "--hostfile=$HOSTFILE" not in command
    runner = pytest.importorskip("deepspeed.launcher.runner")
    parsed = runner.parse_args(_expanded(command)[1:])
    assert parsed.user_script == "train.py" and parsed.num_gpus == min(per_node, 16)
    assert parsed.no_ssh == (per_node == 8)


# ------------------------------------------------------------------------------ Megatron-LM

_WORLD = 8
_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
# tp 2 x pp 2 on 8 processes: dp 2, global 8 = 4 micro-batches of 1
_VALID: dict[str, str | bool] = {
    "--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "8",
    "--seq-length": "128", "--max-position-embeddings": "128",
    "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
    "--micro-batch-size": "1", "--global-batch-size": "8", "--use-distributed-optimizer": True,
    "--bf16": True,
}  # fmt: skip


def _megatron(changes: dict[str, str | bool | None]) -> list[str]:
    flags = {**_VALID, **changes}
    args: list[str] = []
    for flag, value in flags.items():
        if value is None:
            continue
        args += [flag] if value is True else [flag, str(value)]
    return args


def test_the_valid_megatron_line_passes() -> None:
    check_megatron_args(_megatron({}), world_size=_WORLD, env=_ENV)


# (changes, world size, env, what the refusal names: value, rule and source, fix)
MEGATRON_REJECTS = {
    "world size": ({}, 6, _ENV, ("tp 2 x pp 2 x cp 1 = 4", "world size 6", "L424-434")),
    "global batch": ({"--global-batch-size": "7"}, _WORLD, _ENV,
                     ("= 7", "micro x data-parallel size = 1 x 2", "multiple of 2")),
    "layout stages": ({"--pipeline-model-parallel-layout": "Et|t|ttL"}, _WORLD, _ENV,
                      ("3 stages", "multiple of --pipeline-model-parallel-size 2", "L941-949")),
    "even layers": ({"--num-layers": "5"}, _WORLD, _ENV, ("= 5", "divide them", "L985-998")),
    "virtual stages need pp": (
        {"--pipeline-model-parallel-size": "1", "--pipeline-model-parallel-layout": "Ett|ttL"},
        _WORLD, _ENV, ("2 stages on pp 1", "size > 1", "L1000-1009")),
    "interleaved groups": (
        {"--pipeline-model-parallel-layout": "Et|t|t|tL",
         "--microbatch-group-size-per-virtual-pipeline-stage": "3"},
        _WORLD, _ENV, ("3 (m = 4 micro-batches, pp = 2)", "schedules.py", "L1160-1180")),
    "tp comm overlap": ({"--tp-comm-overlap": True}, _WORLD, _ENV,
                        ("sequence parallel false", "L1433-1442", "sequence_parallel")),
    "selective method": ({"--recompute-granularity": "selective",
                          "--recompute-method": "uniform"}, _WORLD, _ENV,
                         ("= uniform", "L1425-1428", "leave out --recompute-method")),
    "full recompute settings": ({"--recompute-granularity": "full"}, _WORLD, _ENV,
                                ("full (method unset, layers unset)",
                                 "TransformerConfig.__post_init__ L1901-1931")),
    "one half dtype": ({"--fp16": True}, _WORLD, _ENV, ("with --bf16", "L1195-1207")),
    "head width": ({"--hidden-size": "66"}, _WORLD, _ENV,
                   ("--hidden-size 66", "L1331-1332", "--kv-channels")),
    "heads over tp": ({"--num-attention-heads": "6", "--hidden-size": "60",
                       "--tensor-model-parallel-size": "4"}, _WORLD, _ENV,
                      ("4 (6 heads, 6 query groups)", "TransformerConfig.__post_init__",
                       "divides the heads")),
    "context split": ({"--context-parallel-size": "2", "--seq-length": "126",
                       "--global-batch-size": "4"}, _WORLD, _ENV,
                      ("126 (cp 2", "2 x --context-parallel-size", "L1335-1338")),
    "tp without one connection": ({}, _WORLD, {},
                                  ("= unset", "CUDA_DEVICE_MAX_CONNECTIONS=1", "L1453-1481")),
    "fsdp with one connection": (
        {"--use-megatron-fsdp": True, "--ckpt-format": "fsdp_dtensor"}, _WORLD, _ENV,
        ("CUDA_DEVICE_MAX_CONNECTIONS = 1", "L1166-1167", "unset")),
    "fsdp checkpoints": ({"--use-megatron-fsdp": True}, _WORLD, {},
                         ("= torch_dist", "fsdp_dtensor", "L1169-1170")),
    "fp8 param gather": ({"--fp8-param-gather": True, "--use-distributed-optimizer": None},
                         _WORLD, _ENV, ("without --use-distributed-optimizer", "L1095-1097")),
    "expert split": ({"--expert-model-parallel-size": "2", "--num-experts": "3"}, _WORLD, _ENV,
                     ("2 (3 experts)", "L1655-1659", "divides the experts")),
    "cpu offload": ({"--optimizer-cpu-offload": True}, _WORLD, _ENV,
                    ("without --use-precision-aware-optimizer", "L1884-1892")),
    "cpu offload beside fp8 gather": (
        {"--optimizer-cpu-offload": True, "--use-precision-aware-optimizer": True,
         "--fp8-param-gather": True, "--fp8-recipe": "tensorwise"}, _WORLD, _ENV,
        ("--fp8-recipe tensorwise", "L1884-1892", "optimizer_offload 0")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MEGATRON_REJECTS))
def test_megatron_rules_refuse_what_validate_args_rejects(case: str) -> None:
    changes, world, env, fragments = MEGATRON_REJECTS[case]
    with pytest.raises(ExportError) as error:
        check_megatron_args(_megatron(changes), world_size=world, env=env)
    _one_line(error, *fragments)


def test_the_heads_rule_is_megatron_cores_own() -> None:
    """megatron-core's TransformerConfig refuses the split the mirror refuses."""
    config = pytest.importorskip("megatron.core.transformer.transformer_config")
    with pytest.raises(ValueError, match="multiple of tensor_model_parallel_size"):
        config.TransformerConfig(num_layers=2, hidden_size=60, num_attention_heads=6,
                                 tensor_model_parallel_size=4)  # fmt: skip


def test_the_recompute_rule_is_megatron_cores_own() -> None:
    """megatron-core's TransformerConfig refuses full recompute without a method, as mirrored."""
    config = pytest.importorskip("megatron.core.transformer.transformer_config")
    with pytest.raises(ValueError, match='recompute_method must be "block" or "uniform"'):
        config.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8,
                                 recompute_granularity="full")  # fmt: skip


def test_megatron_refuses_an_offloaded_optimizer_beside_fp8_gather() -> None:
    """validate_args L1884-1892: the offload beside fp8 all-gather needs --fp8-recipe delayed,
    which no autoplan recipe is; the megatron-lm profile states it, so the search, validate and
    export refuse it alike (the mirrored rule is the export's second check)."""
    plan = _plan(pp_degree=1, dp_degree=8, dtype="fp8", fp8_all_gather=True,
                 optimizer_offload=0.5)  # fmt: skip
    with pytest.raises(ExportError) as error:
        export_plan(plan, "megatron-lm", model=LLAMA8B)
    _one_line(error, "optimizer_offload = 0.5", "fp8 all-gathered weights", "L1884-1892",
              "set fp8_all_gather: false")  # fmt: skip
    refusal = optimizer_offload_refusal(framework_profile("megatron-lm"), Strategy.of(plan))
    assert refusal is not None and refusal.limit == "optimizer-offload"
    without = dataclasses.replace(plan, fp8_all_gather=False)
    assert "--optimizer-cpu-offload" in export_plan(without, "megatron-lm", model=LLAMA8B).files[
        "megatron_args.txt"]  # fmt: skip


def test_megatron_refuses_megatron_fsdp_with_pipeline_parallelism() -> None:
    """Megatron-FSDP (ZeRO 2-3) with pp > 1 is not shown to run (the megatron-lm profile's
    "pipeline-zero" words cite why); ZeRO-1 (the distributed optimizer) is the fix."""
    for zero in (2, 3):
        with pytest.raises(ExportError) as error:
            export_plan(_plan(zero_stage=zero), "megatron-lm", model=LLAMA8B)
        _one_line(error, f"zero_stage = {zero}", "Megatron-FSDP", "pipeline-model-parallel-size 2",
                  "use zero_stage 1")  # fmt: skip
    assert "--use-distributed-optimizer" in export_plan(
        _plan(zero_stage=1), "megatron-lm", model=LLAMA8B).files["megatron_args.txt"]  # fmt: skip


# ------------------------------------------------------------------------------ torchtitan

_TITAN = TitanSettings(
    world_size=16, dp_replicate=1, dp_shard=4, cp=1, tp=2, pp=2, sequence_parallel=True,
    seq_len=8192, local_batch_size=8, global_batch_size=32, pp_microbatch_size=1,
    pp_schedule="1F1B", num_model_parts=2, async_tp=False, compile_model=False, n_heads=32,
    n_kv_heads=8, weight_tying=False, disable_cuda_graphs=True,
)  # fmt: skip

TITAN_REJECTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "world size": ({"world_size": 12}, ("= 16", "world size 12", "ParallelDims._validate")),
    "global batch": ({"global_batch_size": 20}, ("= 20", "local_batch_size x data-parallel",
                                                 "Trainer.__init__ L414-433")),
    "sequence split": ({"seq_len": 8191}, ("= 8191", "multiple of 2", "L306-315")),
    "pp micro-batches": ({"pp_microbatch_size": 3}, ("= 3", "local_batch_size 8",
                                                     "pipeline_llm L306-310")),
    "one stage a rank": ({"num_model_parts": 4}, ("4 parts on pp 2", "1F1B runs one stage",
                                                  "use 2 stages")),
    "two stages a rank": ({"pp_schedule": "Interleaved1F1B"},
                          ("2 parts on pp 2", "at least two stages", "use 4 stages")),
    "V schedules": ({"pp_schedule": "ZBVZeroBubble", "num_model_parts": 6},
                    ("6 parts on pp 2", "places two stages a rank", "L563-575")),
    "tied weights": ({"weight_tying": True}, ("enable_weight_tying = true", "L139-142")),
    "heads": ({"tp": 3, "dp_shard": 1, "world_size": 6, "global_batch_size": 8,
               "sequence_parallel": False},
              ("3 (32 heads, 8 kv heads)", "n_kv_heads", "L143-158")),
    "async tp": ({"async_tp": True}, ("compile.enable_async_tensor_parallel = true",
                                      "CompileConfig.__post_init__", "compile: true")),
    "cuda graphs": ({"disable_cuda_graphs": False}, ("under pp 2", "L179-187")),
}  # fmt: skip


def test_the_valid_torchtitan_settings_pass() -> None:
    check_torchtitan_settings(_TITAN)


@pytest.mark.parametrize("case", list(TITAN_REJECTS))
def test_torchtitan_rules_refuse_what_torchtitan_rejects(case: str) -> None:
    changes, fragments = TITAN_REJECTS[case]
    with pytest.raises(ExportError) as error:
        check_torchtitan_settings(dataclasses.replace(_TITAN, **changes))
    _one_line(error, *fragments)


def test_the_world_size_rule_is_torchtitans_own() -> None:
    parallel_dims = pytest.importorskip(
        "torchtitan.distributed.parallel_dims", exc_type=ImportError
    )
    with pytest.raises(AssertionError, match="Invalid parallel dims"):
        parallel_dims.ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=2, pp=2, ep=1,
                                   world_size=12)  # fmt: skip


# ------------------------------------------------------------------------------ DeepSpeed

_DS_CONFIG: dict[str, Any] = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "fp16": {"enabled": False},
}  # fmt: skip


def _ds(changes: dict[str, Any], *, pipeline: bool = False) -> DeepSpeedRun:
    return DeepSpeedRun(config={**_DS_CONFIG, **changes}, world_size=16, pipeline=pipeline)


DEEPSPEED_REJECTS: dict[str, tuple[DeepSpeedRun, tuple[str, ...]]] = {
    "batch": (_ds({"train_batch_size": 60}), ("= 60", "4 x 1 x 16", "_batch_assertion")),
    "zero under a pipeline": (_ds({"zero_optimization": {"stage": 2}}, pipeline=True),
                              ("stage = 2", "under a PipelineModule", "PipelineEngine.__init__")),
    "zero stage": (_ds({"zero_optimization": {"stage": 4}}), ("stage = 4", "ZeRO 3 at most")),
    "bf16 master at ZeRO-0": (
        _ds({"zero_optimization": {"stage": 0},
             "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}),
        ("true (bf16_optimizer_states false, ZeRO 0)", "_do_error_check L706-714")),
    "bf16 states without master": (
        _ds({"bf16": {"enabled": True, "bf16_optimizer_states": True}}),
        ("false (bf16_optimizer_states true, ZeRO 1)", "only with the master")),
    "offload ratio": (
        _ds({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                     "ratio": 0.5}}}),
        ("0.5 at ZeRO 2", "ZeRO-3 only", "offload_config.py")),
    "accumulation dtype": (
        _ds({"zero_optimization": {"stage": 0}, "data_types": {"grad_accum_dtype": "fp32"}}),
        ("fp32 (model bf16, ZeRO 0)", "_do_optimizer_sanity_check")),
}  # fmt: skip


def test_the_valid_deepspeed_config_passes() -> None:
    check_deepspeed_config(_ds({}))


@pytest.mark.parametrize("case", list(DEEPSPEED_REJECTS))
def test_deepspeed_rules_refuse_what_deepspeed_rejects(case: str) -> None:
    run, fragments = DEEPSPEED_REJECTS[case]
    with pytest.raises(ExportError) as error:
        check_deepspeed_config(run)
    _one_line(error, *fragments)


def test_deepspeed_autotp_leaves_the_batch_to_deepspeed() -> None:
    """DeepSpeedConfig counts every process (TP ranks too) before AutoTP makes its groups, so
    the plan's global batch (micro x steps x dp) would fail its _batch_assertion: left out,
    with a note."""
    plan = _plan(pp_degree=1, dp_degree=8, zero_stage=1, sequence_parallel=False)
    exported = export_plan(plan, "deepspeed", model=LLAMA8B, devices_per_node=8)
    assert '"train_batch_size"' not in exported.files["ds_config.json"]
    assert any("train_batch_size is left out" in note for note in exported.notes)
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    # outside a process group DeepSpeedConfig takes world size 1
    config = ds_config.DeepSpeedConfig(json.loads(exported.files["ds_config.json"]))
    assert config.gradient_accumulation_steps == plan.num_micro_batches
