"""torchtitan: a config module (a function returning ``Trainer.Config``) that runs a plan.

torchtitan 0.3 describes a run by a Python function returning a full ``Trainer.Config``,
selected with ``--module`` and ``--config`` (``torchtitan/config/README.md``;
``ConfigManager._load_config`` in ``torchtitan/config/manager.py`` imports any module path);
the TOML job files of torchtitan 0.1/0.2 are gone. The exported module starts from the
model's baseline in ``torchtitan/models/llama3/config_registry.py`` (``llama3_8b`` ...; data,
optimizer and checkpointing as torchtitan ships them) and sets the plan's fields. Names are
those of torchtitan 0.3.0 (pytorch/torchtitan, PyPI release):

- ``dp_degree`` and ``zero_stage`` -> ``parallelism.data_parallel_replicate_degree`` /
  ``data_parallel_shard_degree`` and ``fsdp_reshard_after_forward``
  (``torchtitan/config/configs.py`` ``ParallelismConfig``): ZeRO-0 replicates (DDP), ZeRO-3 is
  FSDP resharding after forward (``"always"``), ZeRO-2 FSDP keeping parameters gathered
  (``"never"``). torchtitan has no ZeRO-1; it runs as ZeRO-2, as autoplan's own runtime runs it
  under FSDP2 (``Plan.decisions``). HSDP (``dp_shard_degree`` s) -> ``data_parallel_shard_degree
  = s`` and ``data_parallel_replicate_degree = dp / s``: torchtitan's mesh puts ``dp_shard``
  inside ``dp_replicate`` (``parallel_dims.py``), so a shard group is s consecutive dp ranks, the
  plan's, and FSDP2 runs HSDP over its (dp_replicate, fsdp) mesh; its ``ParallelDims._validate``
  asserts that replicate x shard x cp x tp x pp is the world size.
- ``tp_degree`` -> ``tensor_parallel_degree``; ``sequence_parallel`` ->
  ``enable_sequence_parallel``.
- ``tp_comm_overlap`` -> ``compile.enable_async_tensor_parallel`` (``CompileConfig``: torch's
  async TP, inductor's micro-pipeline TP pass over the compiled blocks); ``CompileConfig``
  requires ``compile.enable`` with ``"model"`` in ``compile.components``, which the plan's
  ``compile`` (its profile refuses the overlap without it) writes. Stated false for every other
  TP plan: the ``llama3_405b`` baseline turns it on.
- ``compile`` -> ``compile.enable`` with ``compile.components = ["model", "loss"]``
  (``CompileConfig``, its default components: each ``TransformerBlock`` compiled by
  ``torchtitan/distributed/compile.py`` ``apply_compile``, and the loss); ``compile.enable =
  False`` for an eager plan. One setting for the model: a plan compiling some stages only is
  refused (its profile's ``compile_scope``). The cost model prices the loss eager.
- ``pp_degree`` -> ``pipeline_parallel_degree``; ``stages`` and ``virtual_stages`` ->
  ``module_fqns_per_model_part`` (one list of module names per stage: ``tok_embeddings``,
  ``layers.<i>``, ``norm``, ``lm_head``; ``torchtitan/distributed/pipeline_parallel.py``),
  which states any cut exactly; stage placement (loop, or V for ZBVZeroBubble and DualPipeV)
  is torchtitan's, the same as autoplan's.
- ``schedule`` -> ``pipeline_parallel_schedule``: torch's schedule names
  (``torch.distributed.pipelining.schedules.get_schedule_class``).
- ``micro_batch_size`` / ``num_micro_batches`` / ``global_batch_size`` ->
  ``training.local_batch_size`` (per data-parallel rank per accumulation step; with PP split into
  ``pipeline_parallel_microbatch_size`` micro-batches) and ``training.global_batch_size``
  (``TrainingConfig``; accumulation steps = global / (local x dp)).
- ``stages[*].recompute`` (one mode for all) -> ``activation_checkpoint``: ``SelectiveAC.Config()``,
  ``FullAC.Config()`` or ``None`` (``torchtitan/distributed/activation_checkpoint.py``; the
  llama3 parallelize applies it when not None).
- ``dtype`` -> ``training.mixed_precision_param`` (``"bfloat16"`` or ``"float32"``; fp32
  master weights either way). It has no float16. An fp8 recipe trains in bfloat16 with a model
  converter, passed to ``model_registry(flavor, converters=[...])``
  (``torchtitan/models/llama3/__init__.py``), which swaps each converted ``Linear.Config``
  when the config is built (``torchtitan/components/quantization/``):
  ``fp8-rowwise`` -> ``Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=...)``
  (torchao's rowwise recipe; ``filter_fqns`` keeps in bf16 every linear whose fqn contains an
  entry); ``mxfp8`` -> ``MXFP8LinearConverter.Config(fqns=...)``, which converts only the
  linears whose fqn contains an entry (all when empty), so the export lists the converted ones.
  ``model_compile_enabled`` follows the baseline's ``compile``. A bf16 plan states the
  flavor's converters too (none): the ``llama3_405b`` baseline converts to float8.
- The precision policy (`Plan.precision`): ``master_dtype`` bf16 (with ``optimizer_state_dtype``
  bf16: torchtitan keeps parameters, gradients and optimizer states in one dtype) ->
  ``training.dtype = "bfloat16"`` ("without an extra copy of fp32 weights", ``TrainingConfig``);
  the gradient reduction is ``training.mixed_precision_reduce``, float32 only in 0.3.0, so a
  bf16 reduction and fp32 master weights with bf16 states are refused in the profile's words
  (`cost_model.frameworks.torchtitan`).
- ``dtype`` ``fp8`` (tensor-wise) and ``fp8_all_gather``: torchtitan 0.3.0 has neither; its
  float8 converter's ``recipe_name`` is ``"rowwise"`` or ``"rowwise_with_gw_hp"``, and
  ``enable_fsdp_float8_all_gather`` / ``precompute_float8_dynamic_scale_for_fsdp`` went with
  tensor-wise scaling (pytorch/torchtitan#3127, "quantize on config instead of on model"):
  refused, naming fp8-rowwise and Megatron-LM's ``--fp8-recipe tensorwise``.
- ``fp8_exclude`` -> torchtitan's module names: ``head`` and ``lm_head`` -> ``lm_head``,
  ``blocks.<i>`` -> ``layers.<i>.`` (the dot keeps ``layers.1`` from matching ``layers.10``),
  ``attn.o_proj`` -> ``attention.wo``, ``mlp.gate_proj`` / ``up_proj`` / ``down_proj`` ->
  ``feed_forward.w1`` / ``w3`` / ``w2`` (``w2(silu(w1(x)) * w3(x))``,
  ``models/common/feed_forward.py``); q, k and v are one fused linear
  (``attention.qkv_linear.wqkv``), kept in bf16 together or not at all.
- ``rank_layout``: torchtitan's mesh is ``pp, dp_replicate, dp_shard, cp, tp`` (outermost
  first, ``torchtitan/distributed/parallel_dims.py``): [pp, dp, cp, tp], cp left out when 1.
- ``cp_degree`` -> ``context_parallel_degree`` with ``context_parallel_load_balancer =
  "headtail"`` (``ParallelismConfig``; torch's load-balanced causal split into 2 cp chunks,
  the ring attention autoplan runs). torchtitan then always shards the weights over
  ``dp_shard x cp`` (the ``fsdp`` mesh of ``parallel_dims.py``, "we always assume that when cp
  is used, FSDP is also applied"), as autoplan's ZeRO-2/3 shard over dp x cp; a ZeRO-0 plan,
  whose weights are replicated, has no torchtitan form with cp > 1.
- ``ep_degree``: torchtitan's ``expert_parallel_degree`` (torchtitan 0.3.0 has no
  ``expert_tensor_parallel_degree``) borrows ranks from ``dp_shard x cp x tp``: its sparse
  mesh is ``pp, dp_replicate, efsdp, ep`` over the same ranks, so an ep group is ep
  consecutive ranks of that block, tp innermost, which is autoplan's ``ep_folding``. But it
  applies to torchtitan's own MoE models (``deepseek_v3``, ``qwen3``, ``gpt_oss``, ...), whose
  attention differs from autoplan's zoo MoE models (MLA, QK-norm), and the exported module
  builds a dense llama3 flavor: plans with ep > 1 are refused, naming the option.
- ``model.seq_len`` -> ``training.seq_len`` (at most the flavor's RoPE ``max_seq_len``,
  131072: ``Decoder.Config.update_from_config`` in ``torchtitan/models/common/decoder.py``
  raises above it). With PP, ``training.disable_cuda_graphs`` (the trainer refuses CUDA graphs
  with pipeline parallelism, ``torchtitan/trainer.py``).
- The model itself is a registered flavor, which the module selects by its baseline and
  cannot change: every model arg the zoo spec can set (``llama3-8b:rope_theta=10000``,
  ``norm_eps``, ``tie_embeddings``, ``head_dim``, the sizes) must equal the flavor's
  (``Flavor``), or the plan is refused naming the arg, both values and the fix (register a
  flavor with those args, or export to megatron-lm, whose flags carry them).
- The launch line: ``torchrun ... -m torchtitan.train --module autoplan_torchtitan --config
  autoplan_plan`` (``--standalone`` on one node, a c10d rendezvous on more:
  `autoplan.export.launch`); the module's settings are checked as torchtitan checks them when
  it starts (`autoplan.export.torchtitan_rules`, each rule cited by file, function and lines).
- Gradient sync: torchtitan's FSDP2 and replicate (DDP) reduce during the backward, with no
  setting to defer it; a plan whose framework option prices the reduction after the backward
  (``megatron-lm:overlap-grad-reduce=off``, ``megatron-lm-2021:ddp=local``) is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from autoplan.contract.plan import Plan
from autoplan.export._common import (
    Export,
    ExportError,
    ExportProblem,
    Framework,
    Launch,
    ModelDims,
    cp_sequence_problem,
    expert_problems,
    overlap_option,
    stack_problems,
    stage_layers,
    uniform_recompute,
    units_problem,
)
from autoplan.export.fp8 import HEAD, Fp8Layers, exclude_text, fp8_layers, unknown_problem
from autoplan.export.launch import launch_variables, torchrun_command
from autoplan.export.torchtitan_rules import TitanSettings, check_torchtitan_settings
from cost_model.precision import compute_dtype

FRAMEWORK: Framework = "torchtitan"
MODULE = "autoplan_torchtitan"
CONFIG_FUNCTION = "autoplan_plan"

# torch.distributed.pipelining's names for autoplan's schedules (get_schedule_class)
SCHEDULE_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "interleaved-zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Flavor:
    """A torchtitan llama3 flavor and its baseline config function."""

    name: str
    baseline: str  # function in torchtitan.models.llama3.config_registry
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    # the args every llama3 flavor of torchtitan 0.3.0 shares: ComplexRoPE.Config(theta=500000,
    # max_seq_len=131072), RMSNorm.Config's default eps, no enable_weight_tying (8B, 70B, 405B;
    # only 1B and 3B tie), heads of dim // n_heads (make_gqa_config without head_dim)
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 131072

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# torchtitan 0.3.0 torchtitan/models/llama3/__init__.py (llama3_configs: _8b, _70b, _405b; FFN
# from compute_ffn_hidden_dim) and config_registry.py (llama3_8b, llama3_70b, llama3_405b).
FLAVORS = (
    Flavor(name="8B", baseline="llama3_8b", num_layers=32, hidden_size=4096, num_heads=32,
           num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256),
    Flavor(name="70B", baseline="llama3_70b", num_layers=80, hidden_size=8192, num_heads=64,
           num_kv_heads=8, ffn_hidden_size=28672, vocab_size=128256),
    Flavor(name="405B", baseline="llama3_405b", num_layers=126, hidden_size=16384, num_heads=128,
           num_kv_heads=8, ffn_hidden_size=53248, vocab_size=128256),
)  # fmt: skip

# where each arg lives in torchtitan 0.3.0 (torchtitan/models/llama3/__init__.py, the flavor's
# function) and the Megatron-LM flag that carries it
_FLAVOR_ARGS = {
    "rope_theta": ("ComplexRoPE.Config(theta=...)", "--rotary-base"),
    "norm_eps": ("RMSNorm.Config(eps=...), its default", "--norm-epsilon"),
    "tie_embeddings": ("Llama3Model.Config(enable_weight_tying=...)",
                       "--untie-embeddings-and-output-weights"),
    "head_dim": ("make_gqa_config(head_dim=...), dim // n_heads when unset", "--kv-channels"),
}  # fmt: skip


def flavor_of(dims: ModelDims) -> Flavor | None:
    """The torchtitan llama3 flavor with exactly the model's sizes, if any."""
    for flavor in FLAVORS:
        if (
            dims.family == "llama"
            and dims.moe is None
            and (
                flavor.num_layers,
                flavor.hidden_size,
                flavor.num_heads,
                flavor.num_kv_heads,
                flavor.ffn_hidden_size,
                flavor.vocab_size,
            )
            == (
                dims.num_layers,
                dims.hidden_size,
                dims.num_heads,
                dims.num_kv_heads,
                dims.ffn_hidden_size,
                dims.vocab_size,
            )
        ):
            return flavor
    return None


def flavor_arg_problems(dims: ModelDims, flavor: Flavor) -> list[ExportProblem]:
    """Each model arg of ``dims`` (the zoo spec's overrides) that differs from the flavor's:
    the config module selects a flavor by its baseline and cannot set its model args."""
    ours = {
        "rope_theta": float(dims.rope_theta or 0.0),
        "norm_eps": dims.norm_eps,
        "tie_embeddings": dims.tie_embeddings,
        "head_dim": dims.attention_head_dim,
    }
    problems = []
    for name, value in ours.items():
        theirs = getattr(flavor, name)
        if value == theirs:
            continue
        where, flag = _FLAVOR_ARGS[name]
        problems.append(
            ExportProblem(
                field=f"model {name}",
                value=f"{_text(value)} ({dims.spec})",
                option=(
                    f"torchtitan's flavor {flavor.name} ({flavor.baseline}) has {name} "
                    f"{_text(theirs)} ({where}), and the exported module selects a registered "
                    "flavor: it cannot set the flavor's model args"
                ),
                fix=(
                    f"register a llama3 flavor with {name} {_text(value)} in torchtitan "
                    "(torchtitan/models/llama3/__init__.py) and point the module's baseline at "
                    f"it, or export to megatron-lm ({flag})"
                ),
            )
        )
    if dims.seq_len > flavor.max_seq_len:
        problems.append(
            ExportProblem(
                field="model seq_len",
                value=f"{dims.seq_len} ({dims.spec})",
                option=(
                    f"torchtitan's flavor {flavor.name} has RoPE tables of max_seq_len "
                    f"{flavor.max_seq_len}, and training.seq_len may not exceed them "
                    "(Decoder.Config.update_from_config, torchtitan/models/common/decoder.py)"
                ),
                fix=(
                    f"use a model of at most {flavor.max_seq_len} tokens, or register a flavor "
                    "with a longer ComplexRoPE.Config(max_seq_len=...)"
                ),
            )
        )
    return problems


def _text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def module_fqns(plan: Plan, dims: ModelDims) -> list[list[str]]:
    """``module_fqns_per_model_part``: the module names of each stage, in stage order."""
    parts = []
    for stage in stage_layers(plan, dims):
        names = ["tok_embeddings"] if stage.embedding else []
        names += [
            f"layers.{i}" for i in range(stage.first_layer, stage.first_layer + stage.num_layers)
        ]
        names += ["norm", "lm_head"] if stage.head else []
        parts.append(names)
    return parts


# autoplan's linears (after ``blocks.<i>.``) -> torchtitan 0.3.0's (after ``layers.<i>.``), as
# llama3_configs builds them (a Llama3Model.Config traversed for Linear.Config)
_LINEARS = {
    "attn.q_proj": "attention.qkv_linear.wqkv",
    "attn.k_proj": "attention.qkv_linear.wqkv",
    "attn.v_proj": "attention.qkv_linear.wqkv",
    "attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
# the converter classes of torchtitan.components.quantization for autoplan's recipes it runs
_CONVERTERS = {"fp8-rowwise": "Float8LinearConverter", "mxfp8": "MXFP8LinearConverter"}


def torchtitan_linear(name: str) -> str:
    """torchtitan's fqn of autoplan's linear ``name`` in a llama3 flavor."""
    if name == HEAD:
        return "lm_head"
    _, block_idx, rest = name.split(".", 2)
    return f"layers.{block_idx}.{_LINEARS[rest]}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Linears:
    """An fp8 plan's linears in torchtitan's names: those converted and those kept in bf16,
    and torchtitan linears whose autoplan parts the plan splits (q, k, v of one ``wqkv``)."""

    converted: tuple[str, ...]
    kept: tuple[str, ...]
    split: tuple[str, ...]


def fp8_linears(layers: Fp8Layers) -> Fp8Linears:
    """The plan's fp8 layers in torchtitan's names."""
    states: dict[str, set[bool]] = {}
    for name in layers.linears:
        states.setdefault(torchtitan_linear(name), set()).add(name in layers.kept)
    return Fp8Linears(
        converted=tuple(n for n, kept in states.items() if kept == {False}),
        kept=tuple(n for n, kept in states.items() if kept == {True}),
        split=tuple(n for n, kept in states.items() if len(kept) == 2),
    )


def fqn_patterns(names: tuple[str, ...], num_blocks: int) -> list[str]:
    """The fewest entries that a torchtitan fqn list (``filter_fqns``, ``fqns``: an fqn matches
    when it contains an entry) needs to match exactly ``names``: a whole block as
    ``layers.<i>.``, every block as ``layers.``."""
    chosen = set(names)
    per_block = len(set(_LINEARS.values()))
    whole = [
        idx
        for idx in range(num_blocks)
        if sum(n.startswith(f"layers.{idx}.") for n in chosen) == per_block
    ]
    patterns = ["lm_head"] if "lm_head" in chosen else []
    if len(whole) == num_blocks:
        return [*patterns, "layers."]
    patterns += [f"layers.{idx}." for idx in whole]
    whole_prefixes = tuple(f"layers.{idx}." for idx in whole)
    return patterns + [n for n in names if n != "lm_head" and not n.startswith(whole_prefixes)]


def _fp8_problems(plan: Plan, dims: ModelDims) -> list[ExportProblem]:
    """What of an fp8 plan torchtitan 0.3.0's converters cannot run as the plan states it."""
    layers = fp8_layers(plan, dims)
    if layers is None:
        return []
    if layers.recipe.name == "fp8":
        # the profile refuses it (TORCHTITAN_WORDS["dtype:fp8"]): no fp8 recipe to write
        return []
    problems = [p for p in (unknown_problem(plan, layers, dims),) if p is not None]
    linears = fp8_linears(layers)
    if linears.split:
        problems.append(
            ExportProblem(
                field="fp8_exclude",
                value=exclude_text(plan),
                option=(
                    "torchtitan's llama3 computes q, k and v in one linear "
                    f"(attention.qkv_linear.wqkv), and the plan keeps some of them in bf16 in "
                    f"{', '.join(linears.split)}"
                ),
                fix="keep q_proj, k_proj and v_proj of a block in bf16 together or not at all",
            )
        )
    if not linears.converted and layers.recipe.name == "mxfp8":
        problems.append(
            ExportProblem(
                field="fp8_exclude",
                value=exclude_text(plan),
                option=(
                    "the plan keeps every linear in bf16, and torchtitan's MXFP8LinearConverter "
                    "converts every linear when its fqns list is empty"
                ),
                fix="use dtype bf16",
            )
        )
    return problems


def _problems(plan: Plan, dims: ModelDims) -> list[ExportProblem]:
    if (units := units_problem(plan, dims)) is not None:
        return [units]
    problems: list[ExportProblem] = []
    flavor = flavor_of(dims)
    if flavor is not None:
        problems += flavor_arg_problems(dims, flavor)
        problems += _fp8_problems(plan, dims)
    else:
        sizes = ", ".join(
            f"{f.name} ({f.num_layers} layers, hidden {f.hidden_size}, {f.num_heads} heads)"
            for f in FLAVORS
        )
        problems.append(
            ExportProblem(
                field="model",
                value=dims.spec,
                option=(
                    "torchtitan builds a registered model flavor (model_registry in "
                    f"torchtitan/models/llama3/__init__.py); none has this model's sizes: {sizes}"
                ),
                fix=(
                    "export a plan made for llama3-8b, llama3-70b or llama3-405b, or register a "
                    "flavor with these sizes in torchtitan and adapt the exported module"
                ),
            )
        )
    problems += stack_problems(plan, dims, FRAMEWORK)
    if (cp := cp_sequence_problem(plan, dims, "context_parallel_degree")) is not None:
        problems.append(cp)
    overlap = overlap_option(plan)
    if overlap is not None and not overlap[1] and plan.dp_degree > 1:
        problems.append(
            ExportProblem(
                field="framework",
                value=plan.framework,
                option=(
                    f"{overlap[0]} prices the gradient reduction after the backward, and "
                    "torchtitan's FSDP2 and replicate (DDP) reduce during it, with no setting "
                    "to defer it"
                ),
                fix=(
                    f"drop the option (framework {plan.framework.partition(':')[0]}), or export "
                    "to megatron-lm (without --overlap-grad-reduce)"
                ),
            )
        )
    problems += expert_problems(plan, dims)
    if plan.ep_degree > 1 and dims.moe is not None:
        problems.append(
            ExportProblem(
                field="ep_degree",
                value=str(plan.ep_degree),
                option=(
                    "torchtitan's expert_parallel_degree (ep borrowing ranks from dp_shard x cp "
                    "x tp, as ep_folding) runs its own MoE models (deepseek_v3, qwen3, gpt_oss: "
                    f"other attention than {dims.spec!r}), and the exported module builds a "
                    "dense llama3 flavor"
                ),
                fix=(
                    "export to megatron-lm, or set ep_degree 1 and port the model to a "
                    "torchtitan MoE model by hand (then set expert_parallel_degree with "
                    "ep_folding's layout)"
                ),
            )
        )
    return problems


def torchtitan_module(plan: Plan, dims: ModelDims) -> str:
    """The text of the config module; raises `ExportError` listing every problem."""
    problems = _problems(plan, dims)
    if problems:
        raise ExportError(FRAMEWORK, problems)
    flavor = flavor_of(dims)
    assert flavor is not None  # checked in _problems
    if plan.pp_degree > 1:
        local_batch = plan.micro_batch_size * plan.num_micro_batches
    else:
        local_batch = plan.micro_batch_size  # the micro-batches are accumulation steps
    replicate, shard = (plan.dp_degree, 1) if plan.zero_stage == 0 else (1, plan.dp_degree)
    if plan.dp_shard_degree is not None:  # HSDP (zero_stage >= 1, checked by the plan)
        shard = plan.dp_shard_degree
        replicate = plan.dp_degree // shard
    reshard = {0: "default", 1: "never", 2: "never", 3: "always"}[plan.zero_stage]
    # torchtitan's default (True) is harmless without TP
    sequence_parallel = plan.sequence_parallel or plan.tp_degree == 1
    recompute = uniform_recompute(plan)
    activation_checkpoint = {
        "none": "None",
        "selective": "SelectiveAC.Config()",
        "full": "FullAC.Config()",
    }[recompute or "none"]
    settings = TitanSettings(
        world_size=plan.num_devices,
        dp_replicate=replicate,
        dp_shard=shard,
        cp=plan.cp_degree,
        tp=plan.tp_degree,
        pp=plan.pp_degree,
        sequence_parallel=sequence_parallel,
        seq_len=dims.seq_len,
        local_batch_size=local_batch,
        global_batch_size=plan.global_batch_size,
        pp_microbatch_size=plan.micro_batch_size,
        pp_schedule=SCHEDULE_NAMES[plan.schedule],
        num_model_parts=plan.num_stages,
        async_tp=plan.tp_degree > 1 and plan.tp_comm_overlap,
        compile_model=plan.compile,  # _compile_lines: "model" among the components
        n_heads=flavor.num_heads,
        n_kv_heads=flavor.num_kv_heads,
        weight_tying=flavor.tie_embeddings,
        disable_cuda_graphs=plan.pp_degree > 1,  # written below with PP
    )
    # the module's settings checked as torchtitan checks them when it starts
    check_torchtitan_settings(settings)
    converter = _CONVERTERS.get(plan.dtype)
    converter_import = (
        [f"from torchtitan.components.quantization import {converter}"] if converter else []
    )
    lines = [
        f'"""torchtitan config for an autoplan plan (digest {plan.digest()}) of {dims.spec}.',
        "",
        "Written by `autoplan export --to torchtitan`; run it with",
        f"    torchrun ... -m torchtitan.train --module {MODULE} --config {CONFIG_FUNCTION}",
        "from the directory holding this file (or with it on PYTHONPATH).",
        '"""',
        "",
        *converter_import,
        "from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC",
        "from torchtitan.models.llama3 import model_registry",
        f"from torchtitan.models.llama3.config_registry import {flavor.baseline}",
        "from torchtitan.trainer import Trainer",
        "",
        "",
        f"def {CONFIG_FUNCTION}() -> Trainer.Config:",
        f"    config = {flavor.baseline}()  # model flavor {flavor.name}: data, optimizer, ...",
        f"    config.training.seq_len = {dims.seq_len}",
        f"    config.training.local_batch_size = {local_batch}",
        f"    config.training.global_batch_size = {plan.global_batch_size}",
        f"    config.training.mixed_precision_param = "
        f'"{"bfloat16" if compute_dtype(plan.dtype) == "bf16" else "float32"}"',
        # a bf16 master: parameters, gradients and AdamW states in bf16, no fp32 copy
        *(['    config.training.dtype = "bfloat16"'] if plan.master_dtype == "bf16" else []),
        # before the model spec: an fp8 converter reads whether the model compiles
        *_compile_lines(plan),
        *_model_spec_lines(plan, dims, flavor),
        "    parallelism = config.parallelism",
        f"    parallelism.data_parallel_replicate_degree = {replicate}",
        f"    parallelism.data_parallel_shard_degree = {shard}",
        f'    parallelism.fsdp_reshard_after_forward = "{reshard}"',
        f"    parallelism.tensor_parallel_degree = {plan.tp_degree}",
        f"    parallelism.enable_sequence_parallel = {sequence_parallel}",
        f"    parallelism.pipeline_parallel_degree = {plan.pp_degree}",
    ]
    if plan.cp_degree > 1:
        lines += [
            f"    parallelism.context_parallel_degree = {plan.cp_degree}",
            '    parallelism.context_parallel_load_balancer = "headtail"',
        ]
    if plan.pp_degree > 1:
        lines += [
            # Trainer.Config._validate_cuda_graphs (torchtitan/trainer.py): "CUDA graphs do
            # not support pipeline parallelism yet"
            "    config.training.disable_cuda_graphs = True",
            f'    parallelism.pipeline_parallel_schedule = "{SCHEDULE_NAMES[plan.schedule]}"',
            f"    parallelism.pipeline_parallel_microbatch_size = {plan.micro_batch_size}",
            "    parallelism.pipeline_parallel_layers_per_stage = None",
            "    parallelism.module_fqns_per_model_part = [",
            *(f"        {names!r}," for names in module_fqns(plan, dims)),
            "    ]",
        ]
    lines += _async_tp_lines(plan)
    lines += [
        f"    config.activation_checkpoint = {activation_checkpoint}",
        "    return config",
        "",
    ]
    return "\n".join(lines)


def _async_tp_lines(plan: Plan) -> list[str]:
    """``config.compile``'s async TP (``enable_async_tensor_parallel``) for a TP plan: the
    plan's ``tp_comm_overlap`` (the llama3_405b baseline turns it on); unstated without TP (it
    needs a TP mesh). A plan with it compiles (its profile refuses it otherwise), so
    `_compile_lines` gives it the ``compile.enable`` and ``"model"`` CompileConfig requires."""
    if plan.tp_degree == 1:
        return []
    return [f"    config.compile.enable_async_tensor_parallel = {plan.tp_comm_overlap}"]


def _compile_lines(plan: Plan) -> list[str]:
    """``config.compile``: torch.compile of each TransformerBlock and of the loss (torchtitan's
    default components) for a compiled plan, off for an eager one (a baseline may turn it on:
    llama3_405b's does). The profile refused a plan that compiles some stages only."""
    if not plan.compile:
        return ["    config.compile.enable = False"]
    return [
        "    config.compile.enable = True",
        '    config.compile.components = ["model", "loss"]',
    ]


def _model_spec_lines(plan: Plan, dims: ModelDims, flavor: Flavor) -> list[str]:
    """``config.model_spec``: the flavor with the plan's converter (none for bf16 and fp32)."""
    layers = fp8_layers(plan, dims)
    if layers is None:
        return [
            "    # the flavor without converters (llama3_405b's baseline converts to float8)",
            f'    config.model_spec = model_registry("{flavor.name}")',
        ]
    linears = fp8_linears(layers)
    if layers.recipe.name == "mxfp8":
        # MXFP8LinearConverter converts the linears whose fqn contains an entry of fqns
        listed = _list_lines("fqns", fqn_patterns(linears.converted, dims.num_layers))
    else:
        # Float8LinearConverter keeps in bf16 the linears whose fqn contains an entry
        listed = _list_lines("filter_fqns", fqn_patterns(linears.kept, dims.num_layers))
        listed = ['                recipe_name="rowwise",', *listed]
    return [
        '    compiled = config.compile.enable and "model" in config.compile.components',
        "    config.model_spec = model_registry(",
        f'        "{flavor.name}",',
        "        converters=[",
        f"            {_CONVERTERS[plan.dtype]}.Config(",
        *listed,
        "                model_compile_enabled=compiled,",
        "            ),",
        "        ],",
        "    )",
    ]


def _list_lines(name: str, entries: list[str], indent: int = 16) -> list[str]:
    """``name=[...],`` at ``indent``: on one line when it fits 100 columns, else one entry a
    line."""
    pad = " " * indent
    one_line = f"{pad}{name}={json.dumps(entries)},"
    if len(one_line) <= 100:
        return [one_line]
    return [f"{pad}{name}=[", *(f"{pad}    {json.dumps(e)}," for e in entries), f"{pad}],"]


def export_torchtitan(plan: Plan, dims: ModelDims, launch: Launch) -> Export:
    text = torchtitan_module(plan, dims)
    # torchtitan needs no environment of its own (its run_train.sh sets PYTORCH_ALLOC_CONF=
    # expandable_segments:True against fragmentation: a choice, not a requirement)
    program = ("-m", "torchtitan.train", "--module", MODULE, "--config", CONFIG_FUNCTION)
    command = torchrun_command(launch, program)
    notes: tuple[str, ...] = (
        f"put {MODULE}.py on PYTHONPATH (the launch line imports it by name)",
        "the baseline's hf_assets_path and dataset are torchtitan's defaults: point them at "
        "your tokenizer and data",
    )
    if plan.dtype in _CONVERTERS:
        gpu = "NVIDIA SM100 (Blackwell)" if plan.dtype == "mxfp8" else "NVIDIA SM89 or later"
        notes += (
            f"the {_CONVERTERS[plan.dtype]} needs torchao and an {gpu} GPU, and torch.compile "
            "for its speed (config.compile.enable with 'model' in config.compile.components; "
            "torchtitan/components/quantization/float8.md)",
        )
    if plan.zero_stage == 1:
        notes += (
            "zero_stage 1 runs as ZeRO-2 (FSDP, parameters kept gathered): torchtitan has no "
            "ZeRO-1, and autoplan's own runtime does the same (Plan.decisions)",
        )
    return Export(
        framework=FRAMEWORK,
        files={f"{MODULE}.py": text},
        command=command,
        notes=notes,
        variables=launch_variables(command),
    )
