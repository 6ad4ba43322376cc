"""torchtitan's own checks, restated over the settings an exported config module writes.

torchtitan checks a config when ``torchtitan.train`` builds it and starts: its config
dataclasses' ``__post_init__``, ``ParallelDims._validate``, the model config's
``update_from_config``, the trainer's batch and sequence checks and the pipeline split. The
checks that concern a setting `autoplan.export.torchtitan` writes are mirrored here, each
citing its function and lines in torchtitan 0.3.0 (pytorch/torchtitan, the PyPI wheel).

Expects the settings the module writes (`TitanSettings`) and guarantees one `ExportProblem`
per check they fail, naming the setting and value, torchtitan's rule with its source and the
fix; the exporter raises them as one `ExportError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoplan.export._common import ExportError, ExportProblem

__all__ = ["TitanSettings", "check_torchtitan_settings", "torchtitan_setting_problems"]

_TT = "torchtitan 0.3.0 torchtitan"
# torch.distributed.pipelining's single-stage schedules (PipelineScheduleSingle subclasses):
# one stage a rank; the others are PipelineScheduleMulti (several)
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
# the V schedules place two stages a rank (_get_pp_rank_to_stage_indices_mapping, style "v")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True, kw_only=True, slots=True)
class TitanSettings:
    """What the exported module sets (``config.training``, ``config.parallelism``,
    ``config.compile``) and the flavor's attention, with the launch's world size."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    sequence_parallel: bool
    seq_len: int
    local_batch_size: int
    global_batch_size: int
    pp_microbatch_size: int
    pp_schedule: str  # torch's schedule name
    num_model_parts: int  # entries of module_fqns_per_model_part (1 without PP)
    async_tp: bool
    compile_model: bool  # compile.enable with "model" in compile.components
    n_heads: int
    n_kv_heads: int
    weight_tying: bool
    disable_cuda_graphs: bool


def torchtitan_setting_problems(s: TitanSettings) -> list[ExportProblem]:
    """Every check of torchtitan 0.3.0 (module doc) that ``s`` fails."""
    return [problem for rule in RULES if (problem := rule(s)) is not None]


def check_torchtitan_settings(s: TitanSettings) -> None:
    """Raise `ExportError` naming every check of torchtitan that ``s`` fails."""
    if problems := torchtitan_setting_problems(s):
        raise ExportError("torchtitan", problems)


def _problem(setting: str, value: object, rule: str, where: str, fix: str) -> ExportProblem:
    return ExportProblem(
        field=setting,
        value=str(value),
        option=f"torchtitan {rule} ({_TT}/{where})",
        fix=fix,
    )


def _world_size(s: TitanSettings) -> ExportProblem | None:
    # distributed/parallel_dims.py ParallelDims._validate L170-189
    product = s.dp_replicate * s.dp_shard * s.cp * s.tp * s.pp
    if product == s.world_size:
        return None
    return _problem(
        "parallelism degrees",
        f"replicate {s.dp_replicate} x shard {s.dp_shard} x cp {s.cp} x tp {s.tp} x pp {s.pp} "
        f"= {product}",
        f"needs their product to be the world size {s.world_size}",
        "distributed/parallel_dims.py ParallelDims._validate L170-189",
        f"launch {product} processes, or change the degrees",
    )


def _batches(s: TitanSettings) -> ExportProblem | None:
    # trainer.py Trainer.__init__ L414-433: global % (local x (replicate x shard)) == 0
    per_step = s.local_batch_size * s.dp_replicate * s.dp_shard
    if s.local_batch_size > 0 and s.global_batch_size > 0 and s.global_batch_size % per_step == 0:
        return None
    return _problem(
        "training.global_batch_size",
        s.global_batch_size,
        f"needs a multiple of local_batch_size x data-parallel degree = {per_step}",
        "trainer.py Trainer.__init__ L414-433",
        f"use a global batch that is a multiple of {max(per_step, 1)}",
    )


def _sequence_split(s: TitanSettings) -> ExportProblem | None:
    # trainer.py Trainer.__init__ L306-315: seq_len % ((tp if SP) x (2 cp if cp > 1)) == 0
    divisor = (s.tp if s.sequence_parallel else 1) * (2 * s.cp if s.cp > 1 else 1)
    if s.seq_len % divisor == 0:
        return None
    return _problem(
        "training.seq_len",
        s.seq_len,
        f"needs a multiple of {divisor} (tp under sequence parallelism x 2 cp)",
        "trainer.py Trainer.__init__ L306-315",
        f"use a sequence length that is a multiple of {divisor}",
    )


def _microbatches(s: TitanSettings) -> ExportProblem | None:
    # distributed/pipeline_parallel.py pipeline_llm L306-310: local % pp microbatch == 0
    if s.pp == 1 or s.local_batch_size % s.pp_microbatch_size == 0:
        return None
    return _problem(
        "parallelism.pipeline_parallel_microbatch_size",
        s.pp_microbatch_size,
        f"splits training.local_batch_size {s.local_batch_size} into micro-batches of this "
        "size, which must divide it",
        "distributed/pipeline_parallel.py pipeline_llm L306-310",
        "use a micro-batch size that divides the local batch",
    )


def _stages_per_rank(s: TitanSettings) -> ExportProblem | None:
    # distributed/pipeline_parallel.py _get_pp_rank_to_stage_indices_mapping L563-575 (parts a
    # multiple of pp; V schedules two a rank) and _get_pipeline_metadata L244-258 (a
    # single-stage schedule one a rank, a multi-stage one at least two)
    if s.pp == 1:
        return None
    per_rank, extra = divmod(s.num_model_parts, s.pp)
    if s.pp_schedule in SINGLE_STAGE_SCHEDULES:
        wanted, rule = (1, 1), "runs one stage a rank"
    elif s.pp_schedule in V_SCHEDULES:
        wanted, rule = (2, 2), "places two stages a rank"
    else:
        wanted, rule = (2, max(2, per_rank)), "runs at least two stages a rank"
    if not extra and wanted[0] <= per_rank <= wanted[1]:
        return None
    return _problem(
        "parallelism.module_fqns_per_model_part",
        f"{s.num_model_parts} parts on pp {s.pp}",
        f"pipeline_parallel_schedule {s.pp_schedule} {rule}, the parts a multiple of pp",
        "distributed/pipeline_parallel.py _get_pp_rank_to_stage_indices_mapping L563-575, "
        "_get_pipeline_metadata L244-258",
        f"use {wanted[0] * s.pp} stages for {s.pp_schedule}",
    )


def _heads(s: TitanSettings) -> ExportProblem | None:
    # models/common/decoder.py Decoder.Config.update_from_config L139-158: no weight tying with
    # PP; tp divides n_heads and n_kv_heads
    if s.weight_tying and s.pp > 1:
        return _problem(
            "model enable_weight_tying", "true", f"ties no weights under pp {s.pp}",
            "models/common/decoder.py Decoder.Config.update_from_config L139-142",
            "use an untied flavor, or pp_degree 1",
        )  # fmt: skip
    if s.n_heads % s.tp == 0 and s.n_kv_heads % s.tp == 0:
        return None
    return _problem(
        "parallelism.tensor_parallel_degree",
        f"{s.tp} ({s.n_heads} heads, {s.n_kv_heads} kv heads)",
        "splits attention heads over TP ranks: tensor_parallel_degree must divide n_heads "
        "and n_kv_heads",
        "models/common/decoder.py Decoder.Config.update_from_config L143-158",
        "use a tp_degree that divides the kv heads",
    )


def _async_tp(s: TitanSettings) -> ExportProblem | None:
    # config/configs.py CompileConfig.__post_init__ L303-310
    if not s.async_tp or s.compile_model:
        return None
    return _problem(
        "compile.enable_async_tensor_parallel",
        "true",
        "runs async TP only with compile.enable and 'model' in compile.components",
        "config/configs.py CompileConfig.__post_init__ L303-310",
        "set compile: true in the plan, or tp_comm_overlap false",
    )


def _cuda_graphs(s: TitanSettings) -> ExportProblem | None:
    # trainer.py Trainer.Config._validate_cuda_graphs L179-187
    if s.pp == 1 or s.disable_cuda_graphs:
        return None
    return _problem(
        "training.disable_cuda_graphs",
        "false",
        f"runs no CUDA graphs under pp {s.pp}",
        "trainer.py Trainer.Config._validate_cuda_graphs L179-187",
        "set training.disable_cuda_graphs = True",
    )


RULES: tuple[Callable[[TitanSettings], ExportProblem | None], ...] = (
    _world_size,
    _batches,
    _sequence_split,
    _microbatches,
    _stages_per_rank,
    _heads,
    _async_tp,
    _cuda_graphs,
)
