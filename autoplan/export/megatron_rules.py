"""Megatron-LM's own argument checks, restated over the flags an export writes.

Megatron-LM checks its arguments when ``pretrain_gpt.py`` starts: ``validate_args`` in
``megatron/training/arguments.py``, then megatron-core's ``TransformerConfig.__post_init__``,
the micro-batch calculator and the interleaved schedule. ``megatron.training`` is not on PyPI
(megatron-core is), so the checks that concern a flag `autoplan.export.megatron` writes are
mirrored here, each citing its function and lines at NVIDIA/Megatron-LM d98e8a6 (2026-08-22).

Expects the exported arguments, the launch's world size and the environment the launch line
sets. `megatron_arg_problems` reads the arguments back as Megatron's argparse does (its
defaults for the flags left out) and returns one `ExportProblem` per check they fail, naming
the flag and value, Megatron's rule with its source and the fix; the exporter raises them as
one `ExportError`. Checks that depend on the GPU (``get_device_arch_version``) are taken for
Hopper and earlier, the stricter side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from autoplan.export._common import ExportError, ExportProblem

__all__ = ["MegatronArgs", "check_megatron_args", "megatron_arg_problems", "read_megatron_args"]

_ARGS = "NVIDIA/Megatron-LM d98e8a6 megatron/training/arguments.py validate_args"


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronArgs:
    """The arguments the checks read, with Megatron's defaults for flags left out."""

    flags: Mapping[str, str | bool]
    world_size: int
    env: Mapping[str, str]

    def value(self, flag: str, default: str | None = None) -> str | None:
        found = self.flags.get(flag)
        return default if found is None or found is True else str(found)

    def number(self, flag: str, default: int) -> int:
        found = self.value(flag)
        return default if found is None else int(found)

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def tp(self) -> int:
        return self.number("--tensor-model-parallel-size", 1)

    @property
    def pp(self) -> int:
        return self.number("--pipeline-model-parallel-size", 1)

    @property
    def cp(self) -> int:
        return self.number("--context-parallel-size", 1)

    @property
    def dp(self) -> int:
        """validate_args: data_parallel_size = world_size // (tp x pp x cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def layout_stages(self) -> int | None:
        """Stages of --pipeline-model-parallel-layout (``|``-separated entries), if given."""
        layout = self.value("--pipeline-model-parallel-layout")
        return None if layout is None else layout.count("|") + 1

    @property
    def virtual_stages(self) -> int:
        """validate_args: entries of the layout / pp (1 without a layout)."""
        stages = self.layout_stages
        return 1 if stages is None or stages % self.pp else stages // self.pp

    @property
    def fsdp(self) -> bool:
        return self.has("--use-megatron-fsdp")


def read_megatron_args(
    args: Sequence[str], *, world_size: int, env: Mapping[str, str] | None = None
) -> MegatronArgs:
    """``--flag value`` pairs and ``--switch`` flags of ``args`` (values never start with
    ``--``)."""
    flags: dict[str, str | bool] = {}
    for idx, arg in enumerate(args):
        if arg.startswith("--"):
            following = args[idx + 1] if idx + 1 < len(args) else "--"
            flags[arg] = True if following.startswith("--") else following
    return MegatronArgs(flags=flags, world_size=world_size, env=dict(env or {}))


def megatron_arg_problems(
    args: Sequence[str], *, world_size: int, env: Mapping[str, str] | None = None
) -> list[ExportProblem]:
    """Every check of Megatron-LM (module doc) that ``args`` fail on ``world_size`` processes
    launched with ``env``."""
    read = read_megatron_args(args, world_size=world_size, env=env)
    return [problem for rule in RULES if (problem := rule(read)) is not None]


def check_megatron_args(
    args: Sequence[str], *, world_size: int, env: Mapping[str, str] | None = None
) -> None:
    """Raise `ExportError` naming every check of Megatron-LM that ``args`` fail."""
    if problems := megatron_arg_problems(args, world_size=world_size, env=env):
        raise ExportError("megatron-lm", problems)


def _problem(flag: str, value: object, rule: str, where: str, fix: str) -> ExportProblem:
    return ExportProblem(
        field=flag,
        value=str(value),
        option=f"Megatron-LM {rule} ({where})",
        fix=fix,
    )


def _world_size(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L424-434: world_size % (tp x pp x cp) == 0
    model = a.tp * a.pp * a.cp
    if a.world_size % model == 0:
        return None
    return _problem(
        "--tensor/pipeline/context-parallel-size",
        f"tp {a.tp} x pp {a.pp} x cp {a.cp} = {model}",
        f"needs the world size {a.world_size} to be a multiple of tp x pp x cp",
        f"{_ARGS} L424-434",
        "launch a multiple of tp x pp x cp processes, or change the degrees",
    )


def _batch_sizes(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L694 and L705: micro and global batch > 0; megatron/core/
    # num_microbatches_calculator.py ConstantNumMicroBatchesCalculator.__init__ L381-391:
    # global % (micro x dp) == 0 and at least one micro-batch
    micro = a.number("--micro-batch-size", 0)
    global_batch = a.number("--global-batch-size", micro * a.dp)
    if micro > 0 and global_batch > 0 and global_batch % (micro * a.dp) == 0:
        return None
    return _problem(
        "--global-batch-size",
        global_batch,
        f"needs a positive --micro-batch-size ({micro}) and a global batch that is a "
        f"multiple of micro x data-parallel size = {micro} x {a.dp}",
        f"{_ARGS} L694-705; megatron/core/num_microbatches_calculator.py "
        "ConstantNumMicroBatchesCalculator.__init__ L381-391",
        f"use a global batch that is a multiple of {max(micro, 1) * a.dp}",
    )


def _layout_stages(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L941-949: the layout's stages are a multiple of pp (vpp = stages / pp)
    stages = a.layout_stages
    if stages is None or stages % a.pp == 0:
        return None
    return _problem(
        "--pipeline-model-parallel-layout",
        f"{stages} stages",
        f"needs a layout whose stage count is a multiple of --pipeline-model-parallel-size {a.pp}",
        f"{_ARGS} L941-949",
        f"give {a.pp} x virtual stages entries",
    )


def _even_layers(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L985-998: without a layout (or uneven first/last stage), num_layers % pp
    layers = a.number("--num-layers", 0)
    if a.layout_stages is not None or layers % a.pp == 0:
        return None
    return _problem(
        "--num-layers",
        layers,
        f"splits the layers evenly without a layout, so --pipeline-model-parallel-size {a.pp} "
        "must divide them",
        f"{_ARGS} L985-998",
        "state the stages with --pipeline-model-parallel-layout",
    )


def _interleaved_pp(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1000-1009: virtual stages need pp > 1 (p2p overlap on, its default:
    # --no-overlap-p2p-communication is store_false, _add_distributed_args)
    if a.virtual_stages == 1 or a.pp > 1:
        return None
    return _problem(
        "--pipeline-model-parallel-layout",
        f"{a.layout_stages} stages on pp {a.pp}",
        "runs virtual stages (the interleaved schedule) only with pipeline-model-parallel size > 1",
        f"{_ARGS} L1000-1009",
        "use one layout entry per pipeline rank, or pp > 1",
    )


def _interleaved_groups(a: MegatronArgs) -> ExportProblem | None:
    # megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving
    # L1160-1180: pp <= group <= m, and the last group m % group is 0 or >= pp
    if a.virtual_stages == 1:
        return None
    micro = max(1, a.number("--micro-batch-size", 1))
    m = a.number("--global-batch-size", micro * a.dp) // (micro * a.dp)
    group = a.number("--microbatch-group-size-per-virtual-pipeline-stage", a.pp)
    last = m % group if group else 0
    if a.pp <= group <= m and not 0 < last < a.pp:
        return None
    return _problem(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        f"{group} (m = {m} micro-batches, pp = {a.pp})",
        "runs virtual stages in groups of pp to m micro-batches, the last one empty or at least pp",
        "megatron/core/pipeline_parallel/schedules.py "
        "forward_backward_pipelining_with_interleaving L1160-1180",
        f"use at least {a.pp} micro-batches and a group that divides them",
    )


def _tp_comm_overlap(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1433-1442: tp 1 turns --sequence-parallel off, then --tp-comm-overlap
    # asserts sequence parallelism
    if not a.has("--tp-comm-overlap") or (a.has("--sequence-parallel") and a.tp > 1):
        return None
    return _problem(
        "--tp-comm-overlap",
        f"with tp {a.tp}, sequence parallel {str(a.has('--sequence-parallel')).lower()}",
        "overlaps TP communication only under --sequence-parallel, which it turns off at tp 1",
        f"{_ARGS} L1433-1442",
        "set sequence_parallel with tp_degree > 1, or tp_comm_overlap false",
    )


def _selective_method(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1425-1428: selective granularity takes no recompute method
    if a.value("--recompute-granularity") != "selective" or not a.has("--recompute-method"):
        return None
    return _problem(
        "--recompute-method",
        a.value("--recompute-method"),
        "takes no --recompute-method with --recompute-granularity selective",
        f"{_ARGS} L1425-1428",
        "leave out --recompute-method for selective recompute",
    )


def _recompute_settings(a: MegatronArgs) -> ExportProblem | None:
    # megatron-core TransformerConfig.__post_init__ (megatron/core/transformer/
    # transformer_config.py L1901-1931): full granularity needs --recompute-method block or
    # uniform and --recompute-num-layers; selective takes no --recompute-num-layers
    granularity = a.value("--recompute-granularity")
    method, layers = a.value("--recompute-method"), a.value("--recompute-num-layers")
    if granularity is None or (
        (granularity == "full" and method in ("block", "uniform") and layers is not None)
        or (granularity == "selective" and layers is None)
    ):
        return None
    return _problem(
        "--recompute-granularity",
        f"{granularity} (method {method or 'unset'}, layers {layers or 'unset'})",
        "needs --recompute-method block or uniform and --recompute-num-layers under full "
        "granularity, and no --recompute-num-layers under selective",
        "megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__ "
        "L1901-1931",
        "write the method and the layer count with full recompute only",
    )


def _one_half_dtype(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1195-1207: --fp16 and --bf16 exclude each other
    if not (a.has("--fp16") and a.has("--bf16")):
        return None
    return _problem(
        "--fp16", "with --bf16", "takes one of --fp16 and --bf16", f"{_ARGS} L1195-1207",
        "keep the plan's dtype only",
    )  # fmt: skip


def _head_width(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1331-1332: without --kv-channels, hidden % heads == 0
    hidden, heads = a.number("--hidden-size", 0), a.number("--num-attention-heads", 1)
    if a.has("--kv-channels") or hidden % heads == 0:
        return None
    return _problem(
        "--num-attention-heads",
        heads,
        f"needs --hidden-size {hidden} to be a multiple of the heads without --kv-channels",
        f"{_ARGS} L1331-1332",
        "state the head width with --kv-channels",
    )


def _heads_over_tp(a: MegatronArgs) -> ExportProblem | None:
    # megatron-core TransformerConfig.__post_init__ (megatron/core/transformer/
    # transformer_config.py L1446-1468): tp divides the heads; the query groups are a multiple
    # or a divisor of tp
    heads = a.number("--num-attention-heads", 1)
    groups = a.number("--num-query-groups", heads)
    if heads % a.tp == 0 and (groups % a.tp == 0 or a.tp % groups == 0):
        return None
    return _problem(
        "--tensor-model-parallel-size",
        f"{a.tp} ({heads} heads, {groups} query groups)",
        "splits attention heads over TP ranks: tp must divide the heads, and the query groups "
        "be a multiple or a divisor of tp",
        "megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__ "
        "L1446-1468",
        "use a tp_degree that divides the heads and the query groups",
    )


def _context_split(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1335-1338: seq_length % (2 x cp) == 0 when cp > 1; L1353-1356:
    # max_position_embeddings >= seq_length
    seq = a.number("--seq-length", 0)
    positions = a.number("--max-position-embeddings", seq)
    if (a.cp == 1 or seq % (2 * a.cp) == 0) and positions >= seq:
        return None
    return _problem(
        "--seq-length",
        f"{seq} (cp {a.cp}, max positions {positions})",
        "needs a multiple of 2 x --context-parallel-size and at most --max-position-embeddings",
        f"{_ARGS} L1335-1338 and L1353-1356",
        "use a sequence length that is a multiple of 2 x cp_degree",
    )


def _max_connections(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1453-1481: TP or CP without an FSDP asserts CUDA_DEVICE_MAX_CONNECTIONS=1
    # (before Blackwell); L1166-1167: Megatron-FSDP asserts it is not 1
    connections = a.env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if a.fsdp and connections == "1":
        return _problem(
            "env CUDA_DEVICE_MAX_CONNECTIONS", connections,
            "needs it unset or above 1 under --use-megatron-fsdp", f"{_ARGS} L1166-1167",
            "leave CUDA_DEVICE_MAX_CONNECTIONS unset",
        )  # fmt: skip
    if (a.tp > 1 or a.cp > 1) and not a.fsdp and connections != "1":
        return _problem(
            "env CUDA_DEVICE_MAX_CONNECTIONS",
            connections or "unset",
            f"asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tp {a.tp} / cp {a.cp} on GPUs before "
            "Blackwell",
            f"{_ARGS} L1453-1481",
            "launch with env CUDA_DEVICE_MAX_CONNECTIONS=1",
        )
    return None


def _fsdp_checkpoints(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1169-1170: Megatron-FSDP requires --ckpt-format fsdp_dtensor; L1675-1676:
    # fsdp_dtensor requires Megatron-FSDP
    ckpt = a.value("--ckpt-format", "torch_dist")
    if a.fsdp == (ckpt == "fsdp_dtensor"):
        return None
    return _problem(
        "--ckpt-format",
        ckpt,
        "pairs --use-megatron-fsdp with --ckpt-format fsdp_dtensor, each needing the other",
        f"{_ARGS} L1169-1170 and L1675-1676",
        "write both or neither",
    )


def _param_gather(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1095-1097: --fp8-param-gather needs the distributed optimizer or an FSDP
    if not a.has("--fp8-param-gather") or a.fsdp or a.has("--use-distributed-optimizer"):
        return None
    return _problem(
        "--fp8-param-gather",
        "without --use-distributed-optimizer or --use-megatron-fsdp",
        "gathers fp8 parameters only from a distributed optimizer or Megatron-FSDP",
        f"{_ARGS} L1095-1097",
        "use zero_stage 1 or more with fp8_all_gather",
    )


def _expert_split(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1655-1659: ep > 1 needs experts, ep dividing them
    ep = a.number("--expert-model-parallel-size", 1)
    experts = a.number("--num-experts", 0)
    if ep == 1 or (experts and experts % ep == 0):
        return None
    return _problem(
        "--expert-model-parallel-size",
        f"{ep} ({experts} experts)",
        "splits experts evenly: --num-experts must be a multiple of it",
        f"{_ARGS} L1655-1659",
        "use an ep_degree that divides the experts",
    )


def _cpu_offload(a: MegatronArgs) -> ExportProblem | None:
    # validate_args L1884-1892: --optimizer-cpu-offload asserts --use-precision-aware-optimizer,
    # and --fp8-param-gather beside it only with --fp8-recipe delayed (its default)
    if not a.has("--optimizer-cpu-offload"):
        return None
    recipe = a.value("--fp8-recipe", "delayed")
    if a.has("--use-precision-aware-optimizer") and (
        not a.has("--fp8-param-gather") or recipe == "delayed"
    ):
        return None
    if not a.has("--use-precision-aware-optimizer"):
        value, fix = "without --use-precision-aware-optimizer", "add it"
    else:
        value = f"with --fp8-param-gather and --fp8-recipe {recipe}"
        fix = (
            "set fp8_all_gather false or optimizer_offload 0 (autoplan's fp8 recipes are "
            "tensorwise and mxfp8, not delayed)"
        )
    return _problem(
        "--optimizer-cpu-offload",
        value,
        "offloads the optimizer only with --use-precision-aware-optimizer, and beside "
        "--fp8-param-gather only with --fp8-recipe delayed",
        f"{_ARGS} L1884-1892",
        fix,
    )


RULES: tuple[Callable[[MegatronArgs], ExportProblem | None], ...] = (
    _world_size,
    _batch_sizes,
    _layout_stages,
    _even_layers,
    _interleaved_pp,
    _interleaved_groups,
    _tp_comm_overlap,
    _selective_method,
    _recompute_settings,
    _one_half_dtype,
    _head_width,
    _heads_over_tp,
    _context_split,
    _max_connections,
    _fsdp_checkpoints,
    _param_gather,
    _expert_split,
    _cpu_offload,
)
