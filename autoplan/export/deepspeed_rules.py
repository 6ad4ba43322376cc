"""DeepSpeed's own checks, restated over the ``ds_config.json`` an export writes.

DeepSpeed checks a config when ``deepspeed.initialize`` builds its engine: ``DeepSpeedConfig``
(``_batch_assertion``, ``_do_error_check``), the ZeRO offload config's fields, the pipeline
engine and the engine's optimizer sanity check. The checks that concern a key
`autoplan.export.deepspeed` writes are mirrored here, each citing its function and lines in
DeepSpeed 0.19.8 (deepspeedai/DeepSpeed, the PyPI sdist).

Expects the config (the exported dict), the ``world_size`` DeepSpeed divides the batch by and
whether a ``PipelineModule`` runs: ``deepspeed.initialize`` builds the config with the
``PipelineModule``'s ``mpu`` (its data-parallel size; ``deepspeed/__init__.py`` L581-584), else
with none, and then ``DeepSpeedConfig`` counts every process (``config.py`` L456-474), TP ranks
included: AutoTP makes its groups later, in the engine. Guarantees one `ExportProblem` per check the
config fails, naming the key and value, DeepSpeed's rule with its source and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from autoplan.export._common import ExportError, ExportProblem

__all__ = ["DeepSpeedRun", "check_deepspeed_config", "deepspeed_config_problems"]

_DS = "DeepSpeed 0.19.8 deepspeed/runtime"


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedRun:
    """A ds_config as DeepSpeed reads it, with what the run around it sets."""

    config: Mapping[str, Any]
    world_size: int
    pipeline: bool  # a deepspeed.pipe.PipelineModule (PipelineEngine)

    @property
    def stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @property
    def bf16(self) -> Mapping[str, Any]:
        return dict(self.config.get("bf16", {}))

    @property
    def model_dtype(self) -> str:
        """engine.py get_data_types: fp16, else bf16, else fp32."""
        if self.config.get("fp16", {}).get("enabled"):
            return "fp16"
        return "bf16" if self.bf16.get("enabled") else "fp32"


def deepspeed_config_problems(run: DeepSpeedRun) -> list[ExportProblem]:
    """Every check of DeepSpeed 0.19.8 (module doc) that ``run`` fails."""
    return [problem for rule in RULES if (problem := rule(run)) is not None]


def check_deepspeed_config(run: DeepSpeedRun) -> None:
    """Raise `ExportError` naming every check of DeepSpeed that ``run`` fails."""
    if problems := deepspeed_config_problems(run):
        raise ExportError("deepspeed", problems)


def _problem(key: str, value: object, rule: str, where: str, fix: str) -> ExportProblem:
    return ExportProblem(
        field=key,
        value=str(value),
        option=f"DeepSpeed {rule} ({_DS}/{where})",
        fix=fix,
    )


def _batch(run: DeepSpeedRun) -> ExportProblem | None:
    # config.py DeepSpeedConfig._set_batch_related_parameters L607-653 (train_batch_size left
    # out: micro x steps x world_size) and _batch_assertion L590-605: positive sizes and
    # train_batch_size == micro x accumulation steps x world_size
    micro = int(run.config.get("train_micro_batch_size_per_gpu", 0))
    steps = int(run.config.get("gradient_accumulation_steps", 0))
    train = int(run.config.get("train_batch_size", micro * steps * run.world_size))
    if min(train, micro, steps) > 0 and train == micro * steps * run.world_size:
        return None
    return _problem(
        "train_batch_size",
        train,
        f"needs train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size = "
        f"{micro} x {steps} x {run.world_size}, each positive",
        "config.py DeepSpeedConfig._batch_assertion L590-605",
        "make the global batch micro-batch x micro-batches x dp_degree",
    )


def _stage(run: DeepSpeedRun) -> ExportProblem | None:
    # config.py DeepSpeedConfig._do_error_check L689-692: ZeRO stage at most 3
    # (ZeroStageEnum.max_stage); pipe/engine.py PipelineEngine.__init__ L76-77: below 2 under
    # a PipelineModule
    most = 1 if run.pipeline else 3
    if 0 <= run.stage <= most:
        return None
    where = "pipe/engine.py PipelineEngine.__init__ L76-77" if run.pipeline else (
        "config.py DeepSpeedConfig._do_error_check L689-692"
    )  # fmt: skip
    return _problem(
        "zero_optimization.stage",
        run.stage,
        f"runs ZeRO {most} at most{' under a PipelineModule' if run.pipeline else ''}",
        where,
        f"use zero_stage {most} or lower",
    )


def _bf16_master(run: DeepSpeedRun) -> ExportProblem | None:
    # config.py DeepSpeedConfig._do_error_check L706-714: bf16 master weights and bf16
    # optimizer states only at ZeRO 1-3; the states need the master
    master = bool(run.bf16.get("bf16_master_weights_and_grads"))
    states = bool(run.bf16.get("bf16_optimizer_states"))
    if (not master and not states) or (run.stage >= 1 and (master or not states)):
        return None
    return _problem(
        "bf16.bf16_master_weights_and_grads",
        f"{str(master).lower()} (bf16_optimizer_states {str(states).lower()}, ZeRO {run.stage})",
        "keeps bf16 master weights and states only at ZeRO 1-3, the states only with the master",
        "config.py DeepSpeedConfig._do_error_check L706-714",
        "use zero_stage 1 or more with master_dtype bf16",
    )


def _offload_ratio(run: DeepSpeedRun) -> ExportProblem | None:
    # zero/offload_config.py DeepSpeedZeroOffloadOptimizerConfig.ratio L99-100: in [0, 1],
    # "Only valid with ZeRO Stage 3"
    offload = run.config.get("zero_optimization", {}).get("offload_optimizer")
    if offload is None or "ratio" not in offload:
        return None
    ratio = float(offload["ratio"])
    if 0.0 <= ratio <= 1.0 and run.stage == 3:
        return None
    return _problem(
        "zero_optimization.offload_optimizer.ratio",
        f"{ratio:g} at ZeRO {run.stage}",
        "offloads a share (ratio in [0, 1]) of the optimizer at ZeRO-3 only",
        "zero/offload_config.py DeepSpeedZeroOffloadOptimizerConfig L99-100",
        "use zero_stage 3 for a partial offload, or optimizer_offload 1",
    )


def _accumulation_dtype(run: DeepSpeedRun) -> ExportProblem | None:
    # engine.py DeepSpeedEngine._do_optimizer_sanity_check L2294-2323: without ZeRO, gradients
    # accumulate in the model's dtype only (another raises NotImplementedError)
    accum = run.config.get("data_types", {}).get("grad_accum_dtype")
    if run.stage >= 1 or accum is None or accum == run.model_dtype:
        return None
    return _problem(
        "data_types.grad_accum_dtype",
        f"{accum} (model {run.model_dtype}, ZeRO 0)",
        "accumulates gradients in the model's dtype without ZeRO",
        "engine.py DeepSpeedEngine._do_optimizer_sanity_check L2294-2323",
        "leave grad_accum_dtype out at ZeRO-0, or use zero_stage 1 or more",
    )


RULES: tuple[Callable[[DeepSpeedRun], ExportProblem | None], ...] = (
    _batch,
    _stage,
    _bf16_master,
    _offload_ratio,
    _accumulation_dtype,
)
