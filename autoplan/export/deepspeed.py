"""DeepSpeed: a ``ds_config.json``, the ``deepspeed.pipe.PipelineModule`` arguments and the
launcher line that run a plan.

DeepSpeed itself (not the Megatron-DeepSpeed fork, whose arguments are Megatron-LM's) is the
target. Names are those of DeepSpeed 0.19.8 (deepspeedai/DeepSpeed, PyPI release):

- ``global_batch_size``, ``micro_batch_size``, ``num_micro_batches`` -> ``train_batch_size``,
  ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``
  (``deepspeed/runtime/config.py``, which checks train = micro x accumulation x data-parallel
  size); under pipeline parallelism the accumulation steps are the pipeline's micro-batches
  (``deepspeed/runtime/pipe/engine.py``).
- ``zero_stage`` -> ``zero_optimization.stage`` (``deepspeed/runtime/zero/config.py``). With
  pipeline parallelism only 0 and 1: ``PipelineEngine`` asserts "ZeRO-2 and ZeRO-3 are
  incompatible with pipeline parallelism" (``deepspeed/runtime/pipe/engine.py``).
- Gradient-sync overlap, as the plan's framework profile prices it (options applied) ->
  ``zero_optimization.overlap_comm`` at ZeRO 1-3 without pipeline parallelism, where
  DeepSpeed's hooks reduce gradient buckets during the backward (at ZeRO-1 during the last
  micro-batch's, ``stage_1_and_2.py`` ``process_gradients``; its default: true at ZeRO-3 only,
  ``overlap_comm_valid``). Without ZeRO the engine all-reduces after the backward
  (``DeepSpeedEngine.allreduce_gradients``), and with a ``PipelineModule`` it turns
  ``overlap_comm`` off and reduces after the schedule, so a framework option that asks for
  overlap there (``megatron-lm:overlap-grad-reduce=on``, ``megatron-lm-2021:ddp=torch``) is
  refused.
- ``dtype`` -> ``bf16.enabled`` / ``fp16.enabled`` (``deepspeed/runtime/precision_config.py``).
- ``pp_degree`` and ``stages`` -> ``PipelineModule(num_stages=..., partition_method="uniform")``
  (``deepspeed/runtime/pipe/module.py``) over the layer list embedding, blocks, head: DeepSpeed
  places layers by rule (``uniform``, ``parameters``, ``type:<regex>``), and ``uniform``
  (``partition_uniform`` in ``deepspeed/runtime/utils.py``) is autoplan's even split, so only
  that cut is expressible. One schedule, ``TrainSchedule`` (1F1B, one stage per rank,
  ``deepspeed/runtime/pipe/schedule.py``).
- ``stages[*].recompute``: ``full`` -> ``PipelineModule(activation_checkpoint_interval=1)`` (the
  model's blocks under ``deepspeed.checkpointing``); DeepSpeed has no selective recompute.
- ``tp_degree`` -> ``tensor_parallel.autotp_size`` (AutoTP training,
  ``deepspeed/runtime/tensor_parallel/config.py``) for a model without pipeline parallelism;
  AutoTP shards a Hugging Face-style model in ``DeepSpeedEngine`` and ``PipelineEngine`` has no
  path for it. No Megatron-style sequence parallelism (DeepSpeed's ``sequence_parallel_size``
  is Ulysses, which splits attention heads, a different technique).
- ``rank_layout``: ``PipeModelDataParallelTopology`` orders ``pipe, data, model`` (outermost
  first, ``deepspeed/runtime/pipe/topology.py``): [pp, dp, tp].
- ``cp_degree``: refused. DeepSpeed's context parallelism is Ulysses sequence parallelism
  (``sequence_parallel_size``, ``deepspeed/sequence/layer.py`` ``DistributedAttention``): an
  all-to-all that gives each rank whole sequences for a share of the attention heads, not
  autoplan's ring attention, which passes key/value chunks around a ring; the two differ in
  communication, memory and head-count limits, so one is not exported as the other.
- ``ep_degree``: refused. DeepSpeed's expert parallelism is a model-code argument
  (``deepspeed.moe.layer.MoE(ep_size=...)``, which builds its expert and expert-data groups in
  ``deepspeed/utils/groups.py``), not a ``ds_config`` field: nothing the export writes would
  carry it, and DeepSpeed-MoE's layer is not the zoo model's MoE block.
"""

from __future__ import annotations

import json
from typing import Any

from autoplan.contract.plan import Plan
from autoplan.export._common import (
    Export,
    ExportError,
    ExportProblem,
    Framework,
    Launch,
    ModelDims,
    overlap_option,
    overlaps_grad_sync,
    stack_problems,
    uniform_recompute,
    units_problem,
)
from cost_model.frameworks import framework_profile
from cost_model.strategy import Strategy

FRAMEWORK: Framework = "deepspeed"
CONFIG_FILE = "ds_config.json"
PIPELINE_FILE = "pipeline_module.json"


def _problems(plan: Plan, dims: ModelDims) -> list[ExportProblem]:
    """DeepSpeed's limits (its profile, `cost_model.frameworks.deepspeed`), and a gradient
    sync the plan is priced to overlap where DeepSpeed's engine cannot."""
    if (units := units_problem(plan, dims)) is not None:
        return [units]
    problems = stack_problems(plan, dims, FRAMEWORK)
    overlap = overlap_option(plan)
    if overlap is not None and overlap[1] and plan.dp_degree > 1 and not _can_overlap(plan):
        problems.append(
            ExportProblem(
                field="framework",
                value=plan.framework,
                option=(
                    f"{overlap[0]} prices the gradient reduction during the backward, and "
                    f"deepspeed at zero_stage {plan.zero_stage} with pp_degree "
                    f"{plan.pp_degree} reduces after it (DeepSpeedEngine.allreduce_gradients; "
                    "zero_optimization.overlap_comm acts from ZeRO-1, and not under a "
                    "PipelineModule)"
                ),
                fix=(
                    "use zero_stage 1-3 (overlap_comm), or export to megatron-lm "
                    "(--overlap-grad-reduce)"
                    if plan.pp_degree == 1
                    else "export to megatron-lm (--overlap-grad-reduce)"
                ),
            )
        )
    return problems


def _can_overlap(plan: Plan) -> bool:
    """Whether DeepSpeed can reduce this plan's gradients during the backward (with a ZeRO
    optimizer's overlap_comm and no PipelineModule): its profile's engine behaviour."""
    return framework_profile(FRAMEWORK).overlaps_dp_sync(Strategy.of(plan))


def deepspeed_config(plan: Plan, dims: ModelDims) -> dict[str, Any]:
    """The ``ds_config.json`` of ``plan``; raises `ExportError` listing every problem."""
    problems = _problems(plan, dims)
    if problems:
        raise ExportError(FRAMEWORK, problems)
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "zero_optimization": {"stage": plan.zero_stage},
        "bf16": {"enabled": plan.dtype == "bf16"},
        "fp16": {"enabled": plan.dtype == "fp16"},
    }
    if _can_overlap(plan):
        # reduce gradient buckets during the backward as the plan is priced (or not)
        config["zero_optimization"]["overlap_comm"] = overlaps_grad_sync(plan)
    if plan.tp_degree > 1:
        config["tensor_parallel"] = {"autotp_size": plan.tp_degree}
    if uniform_recompute(plan) == "full":
        # deepspeed.checkpointing's settings (deepspeed/runtime/activation_checkpointing/config.py)
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    return config


def pipeline_module_args(plan: Plan) -> dict[str, Any]:
    """Keyword arguments of ``deepspeed.pipe.PipelineModule`` (besides ``layers`` and
    ``loss_fn``): the layer list is the embedding, each block, then the final norm and head."""
    return {
        "num_stages": plan.pp_degree,
        "partition_method": "uniform",
        "activation_checkpoint_interval": 1 if uniform_recompute(plan) == "full" else 0,
    }


def export_deepspeed(plan: Plan, dims: ModelDims, launch: Launch) -> Export:
    config = deepspeed_config(plan, dims)
    files = {CONFIG_FILE: json.dumps(config, indent=2) + "\n"}
    notes = [
        "replace train.py with your training script; it calls deepspeed.initialize(..., "
        f"config='{CONFIG_FILE}') and adds the optimizer and data",
    ]
    if plan.pp_degree > 1:
        files[PIPELINE_FILE] = json.dumps(pipeline_module_args(plan), indent=2) + "\n"
        notes.append(
            f"build the model as deepspeed.pipe.PipelineModule(layers=[embedding, "
            f"{dims.num_layers} blocks, norm + head], loss_fn=..., **{PIPELINE_FILE})"
        )
    elif uniform_recompute(plan) == "full":
        notes.append(
            "recompute: run each block under deepspeed.checkpointing.checkpoint (configured by "
            "the activation_checkpointing section)"
        )
    # the DeepSpeed launcher (deepspeed/launcher/runner.py: --num_nodes, --num_gpus)
    command = (
        "deepspeed",
        f"--num_nodes={launch.nodes}",
        f"--num_gpus={launch.procs_per_node}",
        "train.py",
        "--deepspeed",
        "--deepspeed_config",
        CONFIG_FILE,
    )
    return Export(framework=FRAMEWORK, files=files, command=command, notes=tuple(notes))
