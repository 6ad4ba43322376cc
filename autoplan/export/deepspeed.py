"""DeepSpeed: a ``ds_config.json``, the ``deepspeed.pipe.PipelineModule`` arguments and the
launcher line that run a plan.

DeepSpeed itself (not the Megatron-DeepSpeed fork, whose arguments are Megatron-LM's) is the
target. Names are those of DeepSpeed 0.19.8 (deepspeedai/DeepSpeed, PyPI release):

- ``global_batch_size``, ``micro_batch_size``, ``num_micro_batches`` -> ``train_batch_size``,
  ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``
  (``deepspeed/runtime/config.py``, which checks train = micro x accumulation x data-parallel
  size); under pipeline parallelism the accumulation steps are the pipeline's micro-batches
  (``deepspeed/runtime/pipe/engine.py``).
- ``zero_stage`` -> ``zero_optimization.stage`` (``deepspeed/runtime/zero/config.py``).
- Gradient-sync overlap, as the plan's framework profile prices it (options applied) ->
  ``zero_optimization.overlap_comm`` where DeepSpeed's engine overlaps at all (its profile's
  `EngineBehaviour`: ZeRO 1-3 without pipeline parallelism), so a framework option that asks
  for overlap elsewhere (``megatron-lm:overlap-grad-reduce=on``, ``megatron-lm-2021:ddp=torch``)
  is refused.
- ``dtype`` -> ``bf16.enabled`` / ``fp16.enabled`` (``deepspeed/runtime/precision_config.py``).
- The precision policy (`Plan.precision`): ``grad_reduce_dtype`` -> ``communication_data_type``,
  stated for 16-bit plans because DeepSpeed's default is the model's dtype (engine.py
  ``communication_data_type``: bf16 gradients reduce in bf16 unless told), and from ZeRO-1 on
  ``data_types.grad_accum_dtype`` too (at ZeRO-0 DeepSpeed accumulates in the model's dtype only:
  engine.py ``_do_optimizer_sanity_check`` raises on any other, so a note says so);
  ``master_dtype`` bf16 -> ``bf16.bf16_master_weights_and_grads`` with
  ``bf16.bf16_optimizer_states`` (ZeRO 1-3, ``config.py`` ``_do_error_check``; the Adam moments
  follow the bf16 master).
- ``optimizer_offload`` f -> ``zero_optimization.offload_optimizer`` ``{"device": "cpu",
  "pin_memory": true}`` with ``"ratio": f`` below 1 (``deepspeed/runtime/zero/offload_config.py``:
  offload valid at ZeRO 1-3, a ratio at ZeRO-3 only, as the profile allows).
- ``pp_degree`` and ``stages`` -> ``PipelineModule(num_stages=..., partition_method="uniform")``
  (``deepspeed/runtime/pipe/module.py``) over the layer list embedding, blocks, head.
- ``stages[*].recompute``: ``full`` -> ``PipelineModule(activation_checkpoint_interval=1)`` (the
  model's blocks under ``deepspeed.checkpointing``).
- ``tp_degree`` -> ``tensor_parallel.autotp_size`` (AutoTP training,
  ``deepspeed/runtime/tensor_parallel/config.py``) for a model without pipeline parallelism.
- ``compile`` -> a note: DeepSpeed compiles the model when the training script calls
  ``engine.compile()`` (``DeepSpeedEngine.compile``, ``deepspeed/runtime/engine.py``: the
  engine's module through ``torch.compile`` with inductor); ds_config's ``compile`` section
  configures DeepCompile (``deepspeed/compile/config.py``), a compiler-driven ZeRO, which the
  plan does not price, so the export leaves it out.

- The launch line: DeepSpeed's own launcher, ``deepspeed --num_nodes 1 --num_gpus G`` on one
  node, ``--hostfile --no_ssh --node_rank --master_addr --master_port`` on more (each node starts
  its own processes; `autoplan.export.launch`). Under AutoTP (tp > 1) ``train_batch_size`` is
  left out: ``DeepSpeedConfig`` counts every process (TP ranks too) before AutoTP's groups exist
  and derives it. The config is checked as DeepSpeed checks it (`autoplan.export.
  deepspeed_rules`, each rule cited by file, function and lines).

What DeepSpeed cannot run (tp or ZeRO > 1 with pp, another schedule or cut, sequence, context
or expert parallelism, selective recompute, another rank order, any fp8 recipe: ds_config has
no fp8 section, its fp8 is Transformer Engine in the model code) is its profile's
(`cost_model.frameworks.deepspeed`, each limit cited in ``DEEPSPEED_WORDS``): the export
refuses it in those words (`stack_problems`).
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
from autoplan.export.deepspeed_rules import DeepSpeedRun, check_deepspeed_config
from autoplan.export.launch import deepspeed_command, launch_variables
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
        "bf16": {
            "enabled": plan.dtype == "bf16",
            **(
                {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                if plan.master_dtype == "bf16"
                else {}
            ),
        },
        "fp16": {"enabled": plan.dtype == "fp16"},
    }
    config.update(_precision_config(plan))
    if _can_overlap(plan):
        # reduce gradient buckets during the backward as the plan is priced (or not)
        config["zero_optimization"]["overlap_comm"] = overlaps_grad_sync(plan)
    if plan.optimizer_offload > 0:
        # ZeRO-Offload (DeepSpeedZeroOffloadOptimizerConfig): the optimizer's states and step
        # on the host; a ratio below 1 at ZeRO-3 only (the profile refuses it elsewhere)
        offload: dict[str, Any] = {"device": "cpu", "pin_memory": True}
        if plan.optimizer_offload < 1:
            offload["ratio"] = plan.optimizer_offload
        config["zero_optimization"]["offload_optimizer"] = offload
    if plan.tp_degree > 1:
        config["tensor_parallel"] = {"autotp_size": plan.tp_degree}
        # DeepSpeedConfig divides train_batch_size by every process (AutoTP's groups come
        # later: deepspeed_rules), TP ranks included; left out, it derives micro x steps x
        # world itself, and each TP group still reads one micro-batch a step (a note says so)
        del config["train_batch_size"]
    if uniform_recompute(plan) == "full":
        # deepspeed.checkpointing's settings (deepspeed/runtime/activation_checkpointing/config.py)
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    # the config checked as DeepSpeed checks it when deepspeed.initialize builds the engine
    run = DeepSpeedRun(
        config=config, world_size=_config_world_size(plan), pipeline=plan.pp_degree > 1
    )
    check_deepspeed_config(run)
    return config


def _config_world_size(plan: Plan) -> int:
    """The world_size DeepSpeedConfig divides the batch by (`deepspeed_rules` module doc): the
    PipelineModule's data-parallel size, else every process."""
    return plan.dp_degree if plan.pp_degree > 1 else plan.num_devices


def _precision_config(plan: Plan) -> dict[str, Any]:
    """The plan's precision policy as ds_config sections (module doc); none for fp32."""
    policy = plan.precision
    if policy.compute == "fp32":
        return {}
    config: dict[str, Any] = {"communication_data_type": policy.grad_reduce}
    if plan.zero_stage >= 1:
        config["data_types"] = {"grad_accum_dtype": policy.grad_reduce}
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
    policy = plan.precision
    if plan.zero_stage == 0 and policy.compute != "fp32" and policy.grad_reduce != policy.compute:
        notes.append(
            f"DeepSpeed at ZeRO-0 accumulates micro-batches' gradients in {policy.compute} "
            "(its engine refuses another data_types.grad_accum_dtype there); they reduce in "
            f"{policy.grad_reduce} (communication_data_type) as the plan is priced"
        )
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
    if plan.compile:
        notes.append(
            "compile: call engine.compile() after deepspeed.initialize (DeepSpeedEngine.compile: "
            "torch.compile of the model with inductor); leave ds_config's compile section out "
            "(it configures DeepCompile)"
        )
    if plan.tp_degree > 1:
        notes.append(
            f"train_batch_size is left out: under AutoTP DeepSpeedConfig counts the "
            f"{plan.tp_degree} TP ranks of a group as data-parallel ranks and derives "
            f"{plan.micro_batch_size} x {plan.num_micro_batches} x {plan.num_devices} itself; "
            f"feed each TP group the same micro-batches (the plan's global batch is "
            f"{plan.global_batch_size})"
        )
    # DeepSpeed's own launcher (deepspeed/launcher/runner.py), the same line on every node
    program = ("train.py", "--deepspeed", "--deepspeed_config", CONFIG_FILE)
    command = deepspeed_command(launch, program)
    if launch.nodes != "1":
        notes.append(
            "multi-node: --no_ssh starts this node's processes only; write the hostfile "
            "($HOSTFILE, one 'HOST slots=GPUS' line per node, the first node first) on every "
            "node"
        )
    return Export(
        framework=FRAMEWORK,
        files=files,
        command=command,
        notes=tuple(notes),
        variables=launch_variables(command),
    )
