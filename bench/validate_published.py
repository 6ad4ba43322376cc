"""Predicted vs published training throughput for every published run autoplan can express.

Reads bench/data/published_runs.yaml (measured runs with citations) and
bench/data/validation_assumptions.yaml (how each run maps to a plan, what its row leaves out,
and whether the presets' constants were fitted to it). For each run it builds the model from the
zoo on the meta device, traces it (`autoplan.trace`), makes the plan (`autoplan.manual_plan`
for the framework that ran it, whose profile cuts the pipeline stages as that stack does:
`cost_model.stage_splits`) and compares the cost model's step time with the published one.

    python bench/validate_published.py            # every row, then median / max |error|
    python bench/validate_published.py --json     # machine-readable
    python bench/validate_published.py --fit      # re-fit each fitted constant on its rows
    python bench/validate_published.py --techniques  # issue 43's techniques, with and without

Error = predicted throughput / published throughput - 1 (= published step / predicted step - 1).
Rows that trained in fp8 are priced with the plan dtype of their recipe (`plan_dtype`;
bench/data/validation_assumptions_fp8.yaml) and reported apart (median and max |error|), with
the predicted and published fp8/bf16 speed-up of each fp8 row that has a bf16 row of the same
configuration (`fp8_pairs`). Each device type's rows (the bench's GPU names, `gpu_presets`) are
reported apart, scored and unscored, with the shipped presets no predicted row runs on
(`device_rows`, `presets_without_rows`; issue 42). The report ends with the published rows that
contradict a sibling in their own table by a rule any cost model obeys (`source_contradictions`),
found from the published numbers alone. ``--techniques`` rolls up the rows that use each of
issue 43's techniques (compile, TP overlap, precision policy, partial recompute, HSDP, expert
TP, offload), each priced with and without it (`technique_rows`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table
from torch import nn

from autoplan.api import manual_plan
from autoplan.contract.plan import Plan
from cost_model.calibration import Calibration
from cost_model.estimate import Estimate, estimate
from cost_model.frameworks import DEFAULT_FRAMEWORK, FRAMEWORKS, framework_profile
from cost_model.hardware import Cluster, preset_names
from cost_model.precision import (
    DEFAULT_MASTER_DTYPE,
    DEFAULT_OPTIMIZER_STATE_DTYPE,
    fp8_recipe,
)
from cost_model.strategy import folded_ep_factors
from cost_model.uncertainty import (
    MIN_ROWS,
    RESIDUALS_PATH,
    Residual,
    ResidualModel,
    write_residuals,
)
from cost_model.workload import ModelProfile

DATA = Path(__file__).resolve().parent / "data"
A100_PEAK_FLOPS = 312e12  # the peak the papers divide by (Korthikanti et al. 2022, Sec. 6)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelDims:
    """A row's model: gpt, llama, or (with num_experts) a mixture-of-experts decoder built by
    `autoplan.models.moe` (Llama attention; families qwen3-moe, mixtral)."""

    family: str  # gpt | llama | qwen3-moe | mixtral | ...
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int | None
    ffn_hidden_size: int | None
    seq_len: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size / num_heads
    # mixture of experts (model.moe of published_runs_moe.yaml); None for a dense model
    num_experts: int | None = None
    top_k: int | None = None
    moe_ffn_hidden_size: int | None = None
    num_shared_experts: int = 0
    num_dense_layers: int = 0

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One published run, ready to predict."""

    run_id: str
    source: str  # the table the row is from (its citation)
    source_id: str  # the publication (a family's `source`): the unit of leave-one-source-out
    compiled: bool  # the run used torch.compile
    status: str  # fit | held_out | unscored
    note: str
    gpu: str
    num_gpus: int
    dims: ModelDims
    plan_args: dict[str, Any]
    cluster: Cluster
    published_step_s: float
    # the peak memory the source prints (torchtitan: max_reserved, the caching allocator's
    # segments), in bytes, if it prints one
    published_memory_bytes: float | None = None
    # why the run fits although the prediction does not (from its source), if it does not
    memory_note: str = ""
    # what the run shares with the same configuration in another precision: its family (one
    # publication's release or table set), GPU, model, stack and whole stated config but the
    # precision (`fp8_pairs`)
    pair_key: tuple[Any, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    case: Case
    estimate: Estimate
    step_time_s: float  # the estimate's, or its adaptation to the run's training stack
    num_params: int = 0  # the model's

    @property
    def error(self) -> float:
        """Predicted / published throughput - 1."""
        return self.case.published_step_s / self.step_time_s - 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Skipped:
    run_id: str
    reason: str
    gpu: str = ""  # the row's GPU, as the bench names it (`gpu_presets`)


# ------------------------------------------------------------------------------- inputs


def _read_yaml(path: Path) -> Any:
    """A data file, through libyaml's safe loader where PyYAML has it (the data files are
    large: the pure-Python parser takes seconds)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(), Loader=loader)


def load() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every row of `published_runs*.yaml` and the merged `validation_assumptions*.yaml`.

    Each source's rows may live in a file of their own (`published_runs_<name>.yaml`, with its
    `validation_assumptions_<name>.yaml`); a run id or family defined twice is an error.
    """
    rows: list[dict[str, Any]] = []
    for path in sorted(DATA.glob("published_runs*.yaml")):
        rows.extend(_read_yaml(path) or [])
    ids = [r["id"] for r in rows]
    if dupes := sorted({i for i in ids if ids.count(i) > 1}):
        raise ValueError(f"run ids defined twice in {DATA}: {dupes}")
    assumptions: dict[str, Any] = {
        "gpu_presets": {},
        "families": {},
        "rows": {},
        "fitted_constants": [],
    }
    for path in sorted(DATA.glob("validation_assumptions*.yaml")):
        part = _read_yaml(path) or {}
        for key, table in part.items():
            if key not in assumptions:
                raise ValueError(f"{path.name}: unknown section {key!r}")
            if isinstance(assumptions[key], list):
                assumptions[key].extend(table)
                continue
            if twice := sorted(set(table) & set(assumptions[key])):
                raise ValueError(f"{path.name}: {key} {twice} already defined in another file")
            assumptions[key].update(table)
    return rows, assumptions


def _family(run_id: str, families: dict[str, Any]) -> str | None:
    return next((f for f in sorted(families, key=len, reverse=True) if run_id.startswith(f)), None)


def eq3_flops(dims: ModelDims, batch: int) -> float:
    """Narayanan et al. 2021, eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (with recompute)."""
    b, s, l, h, v = batch, dims.seq_len, dims.num_layers, dims.hidden_size, dims.vocab_size  # noqa: E741
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def eq7_flops(dims: ModelDims, batch: int) -> float:
    """Korthikanti et al. 2022, eq. 7: 72 B l s h^2 (1 + s/(6h) + V/(12 h l)) (model FLOPs)."""
    b, s, l, h, v = batch, dims.seq_len, dims.num_layers, dims.hidden_size, dims.vocab_size  # noqa: E741
    return 72.0 * b * l * s * h * h * (1 + s / (6 * h) + v / (12 * h * l))


def megatron_flops(dims: ModelDims, batch: int) -> float:
    """Megatron-LM's num_floating_point_operations for one global batch of a GQA (or MHA) model,
    dense or MoE, without MTP (megatron/training/training.py, `transformer_flops`, read at
    NVIDIA/Megatron-LM d98e8a64dd):

        F = 6 B s [h (3 f n_dense + 3 (f_moe k + f_shared) n_moe) + l (2 h q + 2 h kv) + h V]
            + 6 B s^2 q l,

    q = heads x kv_channels, kv = query_groups x kv_channels; 3 for SwiGLU (every model here);
    the router GEMM not counted; causal core attention counted half; V the padded vocabulary
    (each row's vocab_size is already a multiple of Megatron's padding)."""
    b, s, h, v = batch, dims.seq_len, dims.hidden_size, dims.vocab_size
    layers = dims.num_layers
    q = dims.num_heads * dims.kv_channels
    kv = (dims.num_kv_heads or dims.num_heads) * dims.kv_channels
    if dims.num_experts is None:
        assert dims.ffn_hidden_size is not None
        mlp = 3 * dims.ffn_hidden_size * layers
    else:
        assert dims.top_k is not None and dims.moe_ffn_hidden_size is not None
        n_moe = layers - dims.num_dense_layers
        shared = dims.num_shared_experts * dims.moe_ffn_hidden_size
        mlp = (
            3 * (dims.ffn_hidden_size or 0) * dims.num_dense_layers
            + 3 * (dims.moe_ffn_hidden_size * dims.top_k + shared) * n_moe
        )
    linear = h * mlp + layers * (2 * h * q + 2 * h * kv) + h * v
    return 6.0 * b * s * linear + 6.0 * b * s * s * q * layers


def published_step_s(how: str, row: dict[str, Any], dims: ModelDims, batch: int) -> float:
    measured = row["measured"]
    gpus = int(row["num_gpus"])
    if how == "step":
        return float(measured["step_time_s"])
    if how == "eq3":
        tflops = measured.get("tflops_per_gpu") or measured.get("derived_tflops_per_gpu")
        return eq3_flops(dims, batch) / (float(tflops) * 1e12 * gpus)
    if how == "eq7_mfu":
        return eq7_flops(dims, batch) / (float(measured["mfu"]) * A100_PEAK_FLOPS * gpus)
    if how == "eq3_model":
        # eq. 3 without the recompute forward (3/4 of it): the model FLOPs of the same count
        tflops = measured.get("tflops_per_gpu") or measured.get("derived_tflops_per_gpu")
        return 0.75 * eq3_flops(dims, batch) / (float(tflops) * 1e12 * gpus)
    if how == "eq7_tflops":
        return eq7_flops(dims, batch) / (float(measured["tflops_per_gpu"]) * 1e12 * gpus)
    if how == "tokens_aggregate":
        return batch * dims.seq_len / float(measured["aggregate_tokens_per_s"])
    if how == "samples_per_gpu":
        return batch / (float(measured["samples_per_s_per_gpu"]) * gpus)
    if how == "tokens_per_gpu":
        return batch * dims.seq_len / (float(measured["tokens_per_s"]) * gpus)
    if how == "megatron_tflops":
        return megatron_flops(dims, batch) / (float(measured["tflops_per_gpu"]) * 1e12 * gpus)
    raise ValueError(f"unknown throughput kind {how!r}")


# What a family or row may say of its cluster: the hardware its source states (sizes, links,
# a link's achieved rate). Calibration constants come only from `fitted_constants`.
STATED_HARDWARE_KEYS = frozenset(
    {
        # the devices of one scale-up (NVLink) domain, where the run's launcher states it (a
        # GB200 NVL72 job's Slurm segment)
        "scale_up_devices",
        "memory",
        "memory_bandwidth",
        "peak_flops_fp16",
        "peak_flops_bf16",
        "intra_node_bandwidth",
        "inter_node_bandwidth",
        "inter_node_comm_efficiency",
    }
)


# The precision policy a family or a row's entry may state, as its source states the run's
# (`autoplan.Plan.master_dtype`, ...; `cost_model.precision`): absent, the plan's defaults.
POLICY_KEYS = ("master_dtype", "grad_reduce_dtype", "optimizer_state_dtype")

# What a family may say: its publication, default status, how it reports throughput, its dtype,
# the framework profile that ran it, stated hardware, a note on memory, the plan dtype its
# runs' delayed-scaling fp8 is priced as (`fp8_delayed_as`, with the assumption stated beside
# it), and its runs' precision policy (`POLICY_KEYS`).
FAMILY_KEYS = frozenset(
    {
        "source",
        "status",
        "throughput",
        "dtype",
        "framework",
        "cluster",
        "memory_note",
        "fp8_delayed_as",
        *POLICY_KEYS,
    }
)

# The fp8 recipes the sources name (a row's `config.fp8_recipe`; torchtitan's rows say
# `float8_recipe`), as plan dtypes (`cost_model.precision`): dynamic tensor-wise scaling
# (Transformer Engine's current scaling, Megatron-LM's --fp8-recipe tensorwise, torchao's
# "tensorwise"), torchao's row-wise scaling, and OCP MX blocks (Blackwell).
FP8_RECIPE_DTYPES = {"tensorwise": "fp8", "rowwise": "fp8-rowwise", "mxfp8": "mxfp8"}
# The recipes no plan dtype names, and why (their rows are skipped with this reason, or, for
# delayed scaling, priced as the family's `fp8_delayed_as` with the assumption stated there).
FP8_UNNAMED_RECIPES = {
    "delayed": "Transformer Engine's delayed scaling (scales from an amax history) has no "
    "autoplan name",
    "blockwise": "blockwise fp8 (128 x 128 weight and 1 x 128 activation scales) has no "
    "autoplan name",
}


def plan_dtype(dtype: str, recipe: str | None, family: dict[str, Any], run_id: str) -> str:
    """The plan dtype of a row that trained in ``dtype`` (its source's word: fp8 for any fp8
    recipe) with the fp8 ``recipe`` its source or assumptions state. Raises if an fp8 row's
    recipe is not stated or has no autoplan name (its assumptions entry must then say skip,
    with the reason), unless it is delayed scaling and its family prices that as a stated
    plan dtype (`fp8_delayed_as`)."""
    if dtype != "fp8":
        if recipe is not None:
            raise ValueError(f"{run_id}: fp8_recipe {recipe!r} on a {dtype} row")
        return dtype
    if recipe is None:
        raise ValueError(
            f"{run_id}: fp8 training with its recipe not stated; state config.fp8_recipe "
            f"(one of {sorted(FP8_RECIPE_DTYPES) + sorted(FP8_UNNAMED_RECIPES)}) in the row "
            "or its assumptions entry (an assumed one says so), or give it status skip"
        )
    if recipe in FP8_RECIPE_DTYPES:
        return FP8_RECIPE_DTYPES[recipe]
    if recipe == "delayed" and family.get("fp8_delayed_as"):
        return str(family["fp8_delayed_as"])
    why = FP8_UNNAMED_RECIPES.get(recipe, f"unknown fp8 recipe {recipe!r}")
    raise ValueError(
        f"{run_id}: not expressible as an autoplan plan ({why}); give it status skip with "
        "this reason"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class FittedConstant:
    """A calibration constant the bench fits: its name, the GPUs it applies to, its shipped
    value and the rows it was fitted to. With ``framework``: a field of that training stack's
    profile (`cost_model.frameworks`), which ships the value, for that stack's rows on any GPU."""

    name: str
    gpus: tuple[str, ...]
    value: float
    rows: tuple[str, ...]
    low: float
    high: float
    framework: str | None = None

    @property
    def key(self) -> str:
        return f"{self.name}[{self.framework or ','.join(self.gpus)}]"

    def applies(self, case: Case) -> bool:
        if self.framework is not None:
            return str(case.plan_args["framework"]).partition(":")[0] == self.framework
        return case.gpu in self.gpus


# the profiles as the product ships them (`profile_constants` patches FRAMEWORKS for re-fits)
_SHIPPED_PROFILES = dict(FRAMEWORKS)


def fitted_constants(assumptions: dict[str, Any]) -> tuple[FittedConstant, ...]:
    """The assumptions' fitted constants; a profile's constant must be the value the product's
    profile ships (what the bench knows, the product knows)."""
    constants = tuple(
        FittedConstant(
            name=c["name"],
            gpus=tuple(c.get("gpus", ())),
            value=float(c["value"]),
            rows=tuple(c["rows"]),
            low=float(c["range"][0]),
            high=float(c["range"][1]),
            framework=c.get("framework"),
        )
        for c in assumptions.get("fitted_constants", [])
    )
    for c in constants:
        if c.framework is None:
            continue
        shipped = getattr(_SHIPPED_PROFILES[c.framework], c.name)
        if shipped != c.value:
            raise ValueError(
                f"fitted constant {c.key} = {c.value}, but cost_model/frameworks/'s "
                f"{c.framework} profile ships {shipped}: make them agree"
            )
    return constants


def constant_overrides(
    gpu: str, constants: Iterable[FittedConstant], values: dict[str, float] | None = None
) -> dict[str, float]:
    """The cluster overrides of the GPU constants that apply to ``gpu`` (``values`` by key
    replace the shipped ones); a profile's constants are set by `profile_constants`."""
    values = values or {}
    return {
        c.name: values.get(c.key, c.value)
        for c in constants
        if c.framework is None and gpu in c.gpus
    }


@contextlib.contextmanager
def profile_constants(values: dict[str, float]) -> Iterator[None]:
    """The profiles of `FITTED`'s stack constants with ``values`` (by key) in place of the
    shipped ones, for the bench's re-fits; restored on exit."""
    saved = dict(FRAMEWORKS)
    try:
        for c in FITTED:
            if c.framework is not None and c.key in values:
                FRAMEWORKS[c.framework] = dataclasses.replace(
                    FRAMEWORKS[c.framework], **{c.name: values[c.key]}
                )
        yield
    finally:
        FRAMEWORKS.clear()
        FRAMEWORKS.update(saved)


def build_case(
    row: dict[str, Any], assumptions: dict[str, Any], values: dict[str, float] | None = None
) -> Case | Skipped:
    """``row`` as a plan on its stated cluster, with the fitted constants (``values`` by
    `FittedConstant.key` replace the shipped values)."""
    run_id = row["id"]
    extra = dict(assumptions["rows"].get(run_id) or {})
    family = _family(run_id, assumptions["families"])
    fam = assumptions["families"][family] if family is not None else {}
    if unknown := sorted(set(fam) - FAMILY_KEYS):
        raise ValueError(f"family {family}: unknown keys {unknown}; known: {sorted(FAMILY_KEYS)}")
    # A family may give its rows a default status (the row's own entry overrides it).
    status = extra.pop("status", fam.get("status"))
    if status is None:
        return Skipped(run_id=run_id, reason=_default_skip_reason(row), gpu=row["gpu"])
    if status == "skip":
        return Skipped(run_id=run_id, reason=extra.get("reason", "see assumptions"), gpu=row["gpu"])
    assert family is not None, run_id
    model, config = row["model"], dict(row["config"])
    framework = fam.get("framework", DEFAULT_FRAMEWORK)
    # where the stack that ran the row puts its ep groups (Megatron-Core folds them over
    # tp x cp x dp): the profile's, part of how the row ran
    stack = framework_profile(framework)
    folded = stack.expert_layout == "folded"
    check_expressible(row, folded=folded, expert_tp=stack.expert_tensor_parallel)
    moe = model.get("moe") or {}
    dims = ModelDims(
        family=model["family"],
        num_layers=model["num_layers"],
        hidden_size=model["hidden_size"],
        num_heads=model["num_heads"],
        num_kv_heads=model.get("num_kv_heads"),
        ffn_hidden_size=extra.pop("ffn_hidden_size", model.get("ffn_hidden_size")),
        seq_len=model["seq_len"],
        vocab_size=extra.pop("vocab_size", model.get("vocab_size")),
        head_dim=model.get("head_dim"),
        num_experts=moe.get("num_experts"),
        top_k=moe.get("top_k"),
        moe_ffn_hidden_size=moe.get("moe_ffn_hidden_size"),
        num_shared_experts=moe.get("num_shared_experts") or 0,
        num_dense_layers=moe.get("num_dense_layers") or 0,
    )
    # A row whose GPU the source does not name may be assumed to run on one (unscored rows).
    gpu_name = extra.pop("gpu", row["gpu"])
    gpu = assumptions["gpu_presets"][gpu_name]
    overrides = dict(gpu.get("overrides", {}))
    stated = {**fam.get("cluster", {}), **extra.pop("cluster", {})}
    if unstated := sorted(set(stated) - STATED_HARDWARE_KEYS):
        raise ValueError(
            f"{run_id}: cluster keys {unstated} are not stated hardware; a calibration constant "
            "belongs in fitted_constants (per GPU, named with its rows)"
        )
    overrides.update(stated)
    overrides.update(constant_overrides(gpu_name, fitted_constants(assumptions), values))
    base = Cluster.preset(gpu["preset"])
    per_node = min(base.devices_per_node, row["num_gpus"])
    cluster = Cluster.preset(
        gpu["preset"],
        nodes=row["num_gpus"] // per_node,
        devices_per_node=per_node,
        **overrides,
    )
    options = extra.pop("framework_options", None)
    if options:
        framework = f"{framework}:{options}"
    how = extra.pop("throughput", fam["throughput"])
    reason = extra.pop("reason", "")
    memory_note = extra.pop("memory_note", fam.get("memory_note", ""))
    published_gib = row["measured"].get("peak_memory_gib")
    merged = {**{k: v for k, v in config.items() if v is not None}, **extra}
    recipe = merged.get("fp8_recipe", merged.get("float8_recipe"))
    dtype = plan_dtype(merged.get("dtype") or fam["dtype"], recipe, fam, run_id)
    tp, pp = merged.get("tp", 1), merged.get("pp", 1)
    cp, ep = merged.get("cp") or 1, merged.get("ep") or 1
    dp = row["num_gpus"] // (tp * pp * cp)
    micro_batch = merged.get("micro_batch", 1)
    v = merged.get("virtual_stages") or 1
    schedule = merged.get("schedule") or ("interleaved-1f1b" if v > 1 else "1f1b")
    plan_args = dict(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=ep,
        ep_folding=folded and ep > 1,
        etp=row_etp(row),
        micro_batch=micro_batch,
        global_batch=merged["global_batch"],
        recompute=merged.get("recompute") or "none",
        zero=merged.get("zero") or 0,
        schedule=schedule,
        virtual_stages=v,
        sequence_parallel=bool(merged.get("sequence_parallel")),
        dtype=dtype,
        # the training stack that ran the row, with the flags the run states
        # (cost_model.frameworks; e.g. megatron-lm-2021:ddp=torch)
        framework=framework,
        # the plan's fp8_all_gather: the run gathered its fp8 weights in fp8 (torchao's
        # enable_fsdp_float8_all_gather, NeMo's fp8_params with the distributed optimizer)
        fp8_all_gather=bool(merged.get("fp8_all_gather")),
        # the plan's compile: the run compiled its blocks (torchtitan's compile.enable; the
        # row's torch_compile)
        compile=bool(merged.get("torch_compile")),
        # the run's precision policy where its source states one (row entry, else family)
        **{
            key: merged[key] if key in merged else fam[key]
            for key in POLICY_KEYS
            if key in merged or key in fam
        },
    )
    # the plan's tp_comm_overlap: the run overlapped its TP all-gathers and reduce-scatters with
    # the GEMMs, as its source states (`tp_overlap`)
    plan_args["tp_comm_overlap"] = tp_overlap(
        merged, framework, compiled=bool(plan_args.get("compile"))
    )
    # the plan's dp_shard_degree: the run sharded its weights within groups and replicated them
    # across (`hsdp_shard`)
    plan_args["dp_shard"] = hsdp_shard(merged, devices_per_node=per_node, dp=dp)
    # the plan's stages[*].activation_offload: the run kept the saved activations of that many
    # blocks on the host (Megatron-LM's --cpu-offloading-num-layers, which Megatron-Core allows
    # only without pipeline parallelism: one stage; `predict` sets it)
    plan_args["activation_offload"] = int(merged.get("activation_offload_layers") or 0)
    return Case(
        run_id=run_id,
        source=row["source"],
        source_id=fam.get("source", family),
        compiled=bool(merged.get("torch_compile")),
        status=status,
        note=reason,
        gpu=gpu_name,
        num_gpus=row["num_gpus"],
        dims=dims,
        plan_args=plan_args,
        cluster=cluster,
        published_step_s=published_step_s(how, row, dims, merged["global_batch"]),
        published_memory_bytes=None if published_gib is None else float(published_gib) * 2**30,
        memory_note=memory_note,
        pair_key=(
            family,
            gpu_name,
            row["num_gpus"],
            dims,
            framework,
            tuple(sorted((k, repr(v)) for k, v in merged.items() if k not in PRECISION_KEYS)),
        ),
    )


def tp_overlap(config: dict[str, Any], framework: str, *, compiled: bool) -> bool:
    """Whether a row's plan overlaps its TP communication (`Plan.tp_comm_overlap`): its
    source's ``tp_comm_overlap`` (NeMo's ub_tp_comm_overlap, Megatron-LM's --tp-comm-overlap:
    Transformer Engine's userbuffers), or ``async_tp`` (torchtitan's async TP) where the plan
    is ``compiled``, as torch's async TP needs (its profile refuses it otherwise)."""
    if config.get("tp_comm_overlap"):
        return True
    stack = framework_profile(framework)
    needs_compile = stack.tp_comm_overlap is not None and stack.tp_comm_overlap.needs_compile
    return bool(config.get("async_tp")) and (compiled or not needs_compile)


def hsdp_shard(config: dict[str, Any], *, devices_per_node: int, dp: int) -> int | None:
    """A row's HSDP shard group (`Plan.dp_shard_degree`; None: sharded over all of dp): its
    ``dp_shard`` where the source states the size, else one node's devices where it states
    ``sharding: hsdp`` (PyTorch FSDP's ShardingStrategy.HYBRID_SHARD: "shard within a node,
    replicate across nodes", torch/distributed/fsdp/api.py, the group FSDP builds when given
    none, as fms-fsdp's runs do)."""
    stated = config.get("dp_shard")
    if stated is None and config.get("sharding") == "hsdp":
        stated = devices_per_node
    if stated is None or int(stated) >= dp:
        return None
    return int(stated)


# The config keys that say a row's precision (the rest of its config is its layout).
PRECISION_KEYS = frozenset({"dtype", "fp8_recipe", "float8_recipe", "fp8_all_gather", *POLICY_KEYS})


def row_etp(row: dict[str, Any]) -> int:
    """The row's expert tensor parallel size (`Plan.etp_degree`): stated, else Megatron-LM's
    default, the dense tp (megatron/training/arguments.py at d98e8a64dd: "if
    args.expert_tensor_parallel_size is None: args.expert_tensor_parallel_size =
    args.tensor_model_parallel_size"); 1 for a dense model."""
    config = row["config"]
    if not row["model"].get("moe"):
        return 1
    return int(config.get("etp") or config.get("tp") or 1)


def check_expressible(
    row: dict[str, Any], *, folded: bool = False, expert_tp: bool = False
) -> None:
    """Raise if a row that is to be predicted needs what autoplan's zoo or plan cannot say (its
    assumptions entry must then be `skip`, with the reason). ``folded``: the row's stack folds
    ep over tp x cp x dp (`Plan.ep_folding`); ``expert_tp``: it splits experts over TP ranks
    (`Plan.etp_degree`, `FrameworkProfile.expert_tensor_parallel`)."""
    model, config = row["model"], row["config"]
    why = []
    if model.get("mla"):
        why.append("multi-head latent attention (model.mla)")
    if model.get("attention_window") or model.get("attention_sinks"):
        why.append("sliding-window attention / attention sinks")
    moe = model.get("moe") or {}
    if moe.get("capacity_factor") is not None:
        why.append("a capacity factor (token dropping / padding)")
    ep = config.get("ep") or 1
    # (`row_etp`: stated, else Megatron-LM's default, the dense tp)
    etp = row_etp(row)
    tp, cp = config.get("tp") or 1, config.get("cp") or 1
    if etp != 1 and not expert_tp:
        why.append(
            f"expert tensor parallelism etp = {etp} (the row's stack profile does not split "
            "experts over TP ranks)"
        )
    elif tp % etp:
        why.append(f"expert tensor parallelism etp = {etp} does not divide tp = {tp}")
    dp = row["num_gpus"] // (tp * (config.get("pp") or 1) * cp)
    if ep > 1 and folded and folded_ep_factors(ep, tp // etp, cp, dp) is None:
        why.append(f"ep = {ep} does not fold over tp {tp} / etp {etp} x cp {cp} x dp {dp}")
    elif ep > 1 and not folded and dp % ep:
        why.append(
            f"ep = {ep} does not divide dp = {dp} (Megatron-LM folds tp (etp 1) and cp ranks into "
            "the expert-parallel group; autoplan keeps ep inside dp)"
        )
    if why:
        raise ValueError(
            f"{row['id']}: not expressible as an autoplan plan ({'; '.join(why)}); "
            "give it status skip with this reason"
        )


def _default_skip_reason(row: dict[str, Any]) -> str:
    config, model = row["config"], row["model"]
    if config.get("dtype") == "fp8":
        return "fp8 training with no assumptions entry mapping its recipe to a plan dtype"
    if row["gpu"] == "other":
        return "GPU model not stated"
    if not model.get("num_layers") or not model.get("vocab_size"):
        return "model dimensions not stated"
    return "parallel config incomplete (micro-batch / virtual stages / degrees not stated)"


# ------------------------------------------------------------------------------- predicting


@contextlib.contextmanager
def _no_meta_init() -> Iterator[None]:
    """Skip the torch modules' own initialisation while the bench builds zoo models on meta:
    meta tensors hold no values, so it only costs time (0.85 of a 96-layer GPT's 1.06 s). The
    bench is one thread and builds nothing else meanwhile."""
    classes = (nn.Linear, nn.Embedding)
    saved = {cls: cls.reset_parameters for cls in classes}
    try:
        for cls in classes:
            cls.reset_parameters = _skip  # type: ignore[method-assign]
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method  # type: ignore[method-assign]


def _skip(self: nn.Module) -> None:
    return None


@cache
def profile_for(dims: ModelDims) -> ModelProfile:
    """Trace the zoo model with these dimensions (built on meta: no memory)."""
    with _no_meta_init():
        return _profile_for(dims)


def _profile_for(dims: ModelDims) -> ModelProfile:
    from autoplan import models
    from autoplan.tracing import trace

    if dims.num_experts is not None:
        assert dims.top_k is not None and dims.moe_ffn_hidden_size is not None
        model: Any = models.moe(
            dims.num_layers,
            dims.hidden_size,
            dims.num_heads,
            dims.seq_len,
            dims.vocab_size,
            dims.num_experts,
            dims.top_k,
            dims.moe_ffn_hidden_size,
            num_kv_heads=dims.num_kv_heads,
            ffn_hidden_size=dims.ffn_hidden_size,
            num_shared_experts=dims.num_shared_experts,
            num_dense_layers=dims.num_dense_layers,
            head_dim=dims.head_dim,
        )
    elif dims.family == "llama":
        model = models.llama(
            dims.num_layers,
            dims.hidden_size,
            dims.num_heads,
            dims.seq_len,
            dims.vocab_size,
            num_kv_heads=dims.num_kv_heads,
            ffn_hidden_size=dims.ffn_hidden_size,
            head_dim=dims.head_dim,
        )
    else:
        assert dims.head_dim is None, "gpt rows have hidden / num_heads heads"
        model = models.gpt(
            dims.num_layers,
            dims.hidden_size,
            dims.num_heads,
            dims.seq_len,
            dims.vocab_size,
            ffn_hidden_size=dims.ffn_hidden_size,
        )
    profile: ModelProfile = trace(model).profile
    return profile


def predict(case: Case, cluster: Cluster | None = None) -> Result:
    cluster = cluster or case.cluster
    profile = profile_for(case.dims)
    args = dict(case.plan_args)
    fp8_all_gather = bool(args.pop("fp8_all_gather", False))
    activation_offload = int(args.pop("activation_offload", 0))
    plan: Plan = manual_plan(profile, cluster, **args)
    if fp8_all_gather:
        # a Plan field manual_plan does not take: the plan with it, validated again
        plan = dataclasses.replace(plan, fp8_all_gather=True, estimate=None)
    if activation_offload:
        # a stage field manual_plan does not take (`Case.plan_args`' activation_offload)
        (stage,) = plan.stages
        stages = (dataclasses.replace(stage, activation_offload=activation_offload),)
        plan = dataclasses.replace(plan, stages=stages, estimate=None)
    est = estimate(profile, cluster, plan)
    return Result(
        case=case, estimate=est, step_time_s=est.step_time_s, num_params=profile.num_params
    )


# ------------------------------------------------------------------------------- reporting


def summarize(results: Iterable[Result], status: Iterable[str]) -> tuple[int, float, float]:
    errors = [abs(r.error) for r in results if r.case.status in set(status)]
    if not errors:
        return 0, math.nan, math.nan
    return len(errors), statistics.median(errors), max(errors)


# ------------------------------------------------------------------ the sources' own consistency

# Run-to-run spread of one configuration: llm-foundry's development branch repeats each H100
# configuration three times (scripts/train/benchmarking/h100.md, commit beb8dee), within 2%.
# A contradiction must exceed it more than twice over to be reported.
SOURCE_NOISE = 0.05


@dataclass(frozen=True, kw_only=True, slots=True)
class Contradiction:
    """Two published rows of one source table that contradict each other: ``slower`` does no
    more work and moves no more bytes per GPU and token than ``faster`` (``rule``; the pipeline
    rule bounds how much more), yet its published throughput per GPU is ``gap`` lower, beyond
    what the rule allows. A cost model that respects the rule cannot match both rows."""

    slower: str
    faster: str
    rule: str
    gap: float  # slower's tokens/s per GPU over faster's, minus 1


def tokens_per_s_per_gpu(case: Case) -> float:
    """Published throughput per GPU, from the published step time."""
    tokens = float(case.plan_args["global_batch"] * case.dims.seq_len)
    return tokens / (case.published_step_s * case.num_gpus)


def accumulation_steps(case: Case) -> int:
    a = case.plan_args
    return int(a["global_batch"] // (a["dp"] * a["micro_batch"]))


# The plan arguments two rows must share to be compared (with the model, bar its sequence).
_LAYOUT_KEYS = (
    "tp",
    "pp",
    "cp",
    "ep",
    "recompute",
    "zero",
    "dtype",
    "schedule",
    "virtual_stages",
    "sequence_parallel",
)


def _rule_between(a: Case, b: Case) -> str:
    """The rule by which ``a`` (same source, model and layout as ``b``) cannot be slower per
    GPU than ``b``, or "" if none applies."""
    mb_a, mb_b = a.plan_args["micro_batch"], b.plan_args["micro_batch"]
    if (
        a.dims.seq_len == b.dims.seq_len
        and mb_a == mb_b
        and a.num_gpus < b.num_gpus
        and accumulation_steps(a) >= accumulation_steps(b)
    ):
        return f"weak scaling ({a.num_gpus} vs {b.num_gpus} GPUs)"
    if (
        a.num_gpus == b.num_gpus
        and a.dims.seq_len < b.dims.seq_len
        and mb_a * a.dims.seq_len == mb_b * b.dims.seq_len
        and accumulation_steps(a) == accumulation_steps(b)
    ):
        return f"sequence ({a.dims.seq_len} vs {b.dims.seq_len})"
    return ""


def _layer_and_vocab_params(dims: ModelDims) -> tuple[float, float]:
    """A dense decoder layer's weight count (attention and MLP; norms and biases left out) and
    one vocabulary matrix's (V x h)."""
    h = dims.hidden_size
    q = dims.num_heads * dims.kv_channels
    kv = (dims.num_kv_heads or dims.num_heads) * dims.kv_channels
    ffn = dims.ffn_hidden_size or 4 * h  # GPT's default
    gated = 3 if dims.family != "gpt" else 2  # SwiGLU for every family but GPT
    return float(2 * h * q + 2 * h * kv + gated * h * ffn), float(dims.vocab_size * h)


# The plan arguments two rows must share for the pipeline rule: the layout but the stages
# it trades for data parallelism (one stage per rank: virtual_stages 1), and the batching.
_PIPELINE_KEYS = (
    *(k for k in _LAYOUT_KEYS if k not in ("pp", "virtual_stages")),
    "micro_batch",
    "global_batch",
)


def pipeline_allowance(a: Case, b: Case) -> tuple[float, float]:
    """How much slower ``a`` may be than ``b`` when both run the same model, batch, micro-batch
    and layout on the same GPUs and ``a`` has fewer pipeline stages (so more data parallelism),
    one stage per GPU: (factor, seconds), ``T_a <= factor x T_b + seconds``.

    Let W be one layer's work per micro-batch, E the embedding and loss head's, m the
    micro-batches per pipeline (m_a = m_b pp_a / pp_b). Any pipeline schedule of the busiest
    stage's work takes at most (m_a + pp_a - 1)(ceil(L / pp_a) W + E) on ``a``; ``b``'s takes at
    least m_b (L W + E) / pp_b, its average stage. Their ratio is the factor; it grows as W
    shrinks against E, so W is taken as the layer's weight GEMMs alone (6 FLOPs per weight and
    token: attention's and recompute's work left out) and E as the head's (6 h V). Per-micro-
    batch costs (p2p sends, host work) are fewer on ``a``. What ``a`` has more of is the data-
    parallel gradient sync and the optimizer step over its larger stage: at most 8 bytes per
    weight of its busiest stage over the slowest link the job uses (an fp32 ring all-reduce, or
    ZeRO's reduce-scatter and all-gather) plus 32 bytes per weight at the device's memory
    bandwidth (the Adam step), the seconds."""
    layers = a.dims.num_layers
    pp_a, pp_b = a.plan_args["pp"], b.plan_args["pp"]
    m_a, m_b = accumulation_steps(a), accumulation_steps(b)
    layer_w, vocab_w = _layer_and_vocab_params(a.dims)
    work_a = (m_a + pp_a - 1) * (math.ceil(layers / pp_a) * layer_w + vocab_w)
    work_b = m_b * (layers * layer_w + vocab_w) / pp_b
    stage_weights = math.ceil(layers / pp_a) * layer_w + 2 * vocab_w
    cluster = a.cluster
    link = cluster.intra_node if a.num_gpus <= cluster.devices_per_node else cluster.inter_node
    link_bw = min(link.bandwidth_bytes_per_s, cluster.intra_node.bandwidth_bytes_per_s)
    seconds = stage_weights * (8.0 / link_bw + 32.0 / cluster.device.memory_bandwidth_bytes_per_s)
    return work_a / work_b, seconds


def source_contradictions(
    cases: Iterable[Case], noise: float = SOURCE_NOISE
) -> list[Contradiction]:
    """Pairs of rows from one source table that contradict each other, by three rules
    that hold for any cost model, checked on the published numbers alone:

    - weak scaling: same model, sequence, layout and micro-batch, so the same work per GPU
      and micro-batch. The row on fewer GPUs, with at least as many accumulation steps, has
      no more communication per GPU and token (a ring moves (N-1)/N of the bytes; more
      micro-batches share the per-step costs), so it cannot be slower per GPU. (Sharded
      optimizer states give each of N GPUs 1/N of the Adam step, a memory-bound pass of
      about 30 bytes per parameter (the cost model's ADAM_TRAFFIC_BYTES_PER_PARAM): about a
      millisecond in the reported pairs, under 0.1% of their steps.)
    - sequence: same model, GPUs, layout, tokens per micro-batch and accumulation steps. The
      row at the shorter sequence runs the same GEMMs, element-wise passes and communication
      per token and less attention (its work per token grows with the sequence), so it cannot
      be slower per GPU.
    - pipeline depth: same model, batch, micro-batch, GPUs and layout but for fewer pipeline
      stages and more data parallelism, one stage per GPU: the row with fewer stages may be
      slower only by `pipeline_allowance` (its stage's larger embedding share and gradient
      sync, bounded from the published config and the stated hardware).

    A pair is reported when the row that cannot be slower (by more than its allowance) is
    slower by more than ``noise``.
    """
    cases = list(cases)
    by_source: dict[tuple[Any, ...], list[Case]] = {}
    for case in cases:
        args = case.plan_args
        layout = (*(args[k] for k in _LAYOUT_KEYS), case.compiled)
        model = dataclasses.replace(case.dims, seq_len=0)
        by_source.setdefault((case.source, case.gpu, model, layout), []).append(case)
    found = []
    for group in by_source.values():
        for a in group:
            for b in group:
                rule = _rule_between(a, b)
                if not rule:
                    continue
                gap = tokens_per_s_per_gpu(a) / tokens_per_s_per_gpu(b) - 1.0
                if gap < -noise:
                    found.append(
                        Contradiction(slower=a.run_id, faster=b.run_id, rule=rule, gap=gap)
                    )
    by_model: dict[tuple[Any, ...], list[Case]] = {}
    for case in cases:
        args = case.plan_args
        if case.dims.num_experts is not None or (args["virtual_stages"] or 1) != 1:
            continue
        key = (case.source, case.gpu, case.dims, case.num_gpus, case.compiled)
        by_model.setdefault((*key, *(args[k] for k in _PIPELINE_KEYS)), []).append(case)
    for group in by_model.values():
        for a in group:
            for b in group:
                pp_a, pp_b = a.plan_args["pp"], b.plan_args["pp"]
                if pp_a >= pp_b:
                    continue
                factor, seconds = pipeline_allowance(a, b)
                if a.published_step_s > (factor * b.published_step_s + seconds) * (1 + noise):
                    rule = (
                        f"pipeline depth (p{pp_a} x d{a.plan_args['dp']} vs p{pp_b} x "
                        f"d{b.plan_args['dp']}: at most {factor - 1:.0%} + {seconds:.2f} s slower)"
                    )
                    gap = tokens_per_s_per_gpu(a) / tokens_per_s_per_gpu(b) - 1.0
                    found.append(
                        Contradiction(slower=a.run_id, faster=b.run_id, rule=rule, gap=gap)
                    )
    return sorted(found, key=lambda x: x.gap)


def _config(case: Case) -> str:
    a = case.plan_args
    return (
        f"t{a['tp']} p{a['pp']} d{a['dp']}"
        + (f" c{a['cp']}" if a["cp"] > 1 else "")
        + (f" e{a['ep']}" if a["ep"] > 1 else "")
        + f" mb{a['micro_batch']} v{a['virtual_stages']} "
        f"{a['recompute'][:4]}{' sp' if a['sequence_parallel'] else ''}"
        + (" ov" if a.get("tp_comm_overlap") else "")
        + (f" hs{a['dp_shard']}" if a.get("dp_shard") else "")
        + f" z{a['zero']}"
        + (f" {a['dtype']}" if is_fp8(case) else "")
    )


# ------------------------------------------------------------------------------- fp8


def is_fp8(case: Case) -> bool:
    """Whether the row is priced with an fp8 recipe (`cost_model.precision`)."""
    return fp8_recipe(str(case.plan_args["dtype"])) is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Pair:
    """An fp8 row and the bf16 row of the same configuration from the same publication: the
    speed-up a user asks of fp8 is the bf16 step over the fp8 one."""

    fp8: Result
    bf16: Result

    @property
    def published(self) -> float:
        return self.bf16.case.published_step_s / self.fp8.case.published_step_s

    @property
    def predicted(self) -> float:
        return self.bf16.step_time_s / self.fp8.step_time_s

    @property
    def error(self) -> float:
        """Predicted / published speed-up - 1."""
        return self.predicted / self.published - 1.0

    @property
    def scored(self) -> bool:
        return {self.fp8.case.status, self.bf16.case.status} <= {"fit", "held_out"}


def fp8_pairs(results: Iterable[Result]) -> list[Fp8Pair]:
    """Each fp8 row with its bf16 partner: the row of the same family, GPU, GPUs, model, stack
    and stated config but the precision (`Case.pair_key`), from the same table if several
    are; none when that leaves more than one."""
    groups: dict[tuple[Any, ...], list[Result]] = {}
    for r in results:
        groups.setdefault(r.case.pair_key, []).append(r)
    pairs = []
    for group in groups.values():
        bf16 = [r for r in group if r.case.plan_args["dtype"] == "bf16"]
        for r in group:
            if not is_fp8(r.case):
                continue
            partners = [b for b in bf16 if b.case.source == r.case.source] or bf16
            if len(partners) == 1:
                pairs.append(Fp8Pair(fp8=r, bf16=partners[0]))
    return sorted(pairs, key=lambda p: p.fp8.case.run_id)


def fp8_report(results: list[Result]) -> list[str]:
    """The fp8 rows' errors apart from the rest, and the fp8 / bf16 speed-ups of the pairs."""
    fp8 = [r for r in results if is_fp8(r.case)]
    lines = ["", "fp8 rows (priced with an fp8 recipe; issue 41), apart from the rest:"]
    for label, rows, statuses in (
        ("fp8 scored", fp8, ("fit", "held_out")),
        ("fp8 unscored", fp8, ("unscored",)),
        ("not fp8, scored", [r for r in results if not is_fp8(r.case)], ("fit", "held_out")),
    ):
        n, median, worst = summarize(rows, statuses)
        lines.append(
            f"  {label:16s} rows {n:3d}: median |error| {median:6.1%}, max |error| {worst:6.1%}"
        )
    pairs = fp8_pairs(results)
    lines.append("")
    lines.append(
        "fp8 / bf16 pairs (the same publication, model, GPUs and stated config): speed-up = "
        "bf16 step / fp8 step"
    )
    lines.append(
        f"  {'fp8 row':44s} {'status':9s} {'published':>9s} {'predicted':>9s} {'error':>7s}"
        "  bf16 row"
    )
    for pair in pairs:
        status = "scored" if pair.scored else "unscored"
        lines.append(
            f"  {pair.fp8.case.run_id:44s} {status:9s} {pair.published:8.3f}x "
            f"{pair.predicted:8.3f}x {pair.error:+7.1%}  {pair.bf16.case.run_id}"
        )
    for label, chosen in (
        ("scored", [p for p in pairs if p.scored]),
        ("unscored", [p for p in pairs if not p.scored]),
    ):
        if chosen:
            errors = [abs(p.error) for p in chosen]
            lines.append(
                f"  {label} pairs {len(chosen)}: median |speed-up error| "
                f"{statistics.median(errors):.1%}, max {max(errors):.1%}; published speed-ups "
                f"{min(p.published for p in chosen):.2f}-{max(p.published for p in chosen):.2f}x"
                f", predicted {min(p.predicted for p in chosen):.2f}-"
                f"{max(p.predicted for p in chosen):.2f}x"
            )
    return lines


# ------------------------------------------------------------------------------- device types


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceRows:
    """One device type's rows (the bench's GPU name, `gpu_presets`): the preset it is priced on,
    its scored and unscored errors, and how many of its rows are not predicted."""

    gpu: str
    preset: str  # "" where the bench maps the GPU to no preset
    scored: list[float]  # |error| of the fit and held-out rows
    unscored: list[float]  # |error| of the unscored rows
    skipped: int

    def figures(self, which: str) -> dict[str, float | int | None]:
        errors = self.scored if which == "scored" else self.unscored
        return {
            "rows": len(errors),
            "median": statistics.median(errors) if errors else None,
            "max": max(errors) if errors else None,
        }


def device_rows(
    results: Iterable[Result], skipped: Iterable[Skipped], gpu_presets: dict[str, Any]
) -> list[DeviceRows]:
    """Each device type's rows, scored and unscored apart, with its not-predicted count (issue
    42: every GPU's figures, so a new part is read on its own rows, not in the overall median)."""
    scored: dict[str, list[float]] = {}
    unscored: dict[str, list[float]] = {}
    counted: dict[str, int] = {}
    for r in results:
        table = scored if r.case.status in ("fit", "held_out") else unscored
        table.setdefault(r.case.gpu, []).append(abs(r.error))
    for s in skipped:
        counted[s.gpu] = counted.get(s.gpu, 0) + 1
    return [
        DeviceRows(
            gpu=gpu,
            preset=str((gpu_presets.get(gpu) or {}).get("preset", "")),
            scored=sorted(scored.get(gpu, [])),
            unscored=sorted(unscored.get(gpu, [])),
            skipped=counted.get(gpu, 0),
        )
        for gpu in sorted({*scored, *unscored, *counted})
    ]


def presets_without_rows(devices: Iterable[DeviceRows]) -> dict[str, int]:
    """The shipped presets (`cost_model.hardware.preset_names`) no predicted published row runs
    on, each with the number of its rows the bench does not predict (skipped)."""
    predicted: set[str] = set()
    skipped: dict[str, int] = {}
    for d in devices:
        if d.scored or d.unscored:
            predicted.add(d.preset)
        skipped[d.preset] = skipped.get(d.preset, 0) + d.skipped
    return {name: skipped.get(name, 0) for name in preset_names() if name not in predicted}


def device_report(devices: list[DeviceRows]) -> list[str]:
    """Median and max |error| per device type, scored and unscored apart; then the presets that
    no predicted row runs on."""

    def cell(errors: list[float]) -> str:
        if not errors:
            return f"{0:5d} {'-':>7s} {'-':>7s}"
        return f"{len(errors):5d} {statistics.median(errors):7.1%} {max(errors):7.1%}"

    lines = [
        "",
        "per device type (the bench's GPU and the preset it is priced on), |error| of its rows:",
        f"  {'':11s} {'':14s}  {'scored':^21s}  {'unscored':^21s}",
        f"  {'gpu':11s} {'preset':14s}  {'rows  median     max':>21s}  "
        f"{'rows  median     max':>21s}  skipped",
    ]
    for d in devices:
        lines.append(
            f"  {d.gpu:11s} {d.preset or '-':14s}  {cell(d.scored)}  {cell(d.unscored)}"
            f"  {d.skipped:7d}"
        )
    missing = presets_without_rows(devices)
    lines.append(
        "presets no predicted published row runs on: "
        + (
            ", ".join(
                name + (f" ({n} rows, all skipped)" if n else "") for name, n in missing.items()
            )
            or "none"
        )
    )
    return lines


def report(
    results: list[Result], skipped: list[Skipped], gpu_presets: dict[str, Any] | None = None
) -> str:
    lines = [
        f"{'run':44s} {'status':9s} {'gpu':9s} {'gpus':>5s}  {'config':32s} "
        f"{'published':>10s} {'predicted':>10s} {'error':>7s}  mem",
    ]
    for r in results:
        c = r.case
        lines.append(
            f"{c.run_id:44s} {c.status:9s} {c.gpu:9s} {c.num_gpus:5d}  {_config(c):32s} "
            f"{c.published_step_s:9.3f}s {r.step_time_s:9.3f}s {r.error:+7.1%}  "
            f"{r.estimate.peak_memory_bytes / 2**30:.0f}GiB{' (!)' if over_capacity(r) else ''}"
            + (f"  [{c.note}]" if c.note else "")
        )
    lines.append("")
    for label, statuses in (
        ("fitted", ("fit",)),
        ("held-out", ("held_out",)),
        ("all scored", ("fit", "held_out")),
        ("unscored", ("unscored",)),
    ):
        n, median, worst = summarize(results, statuses)
        lines.append(
            f"{label:11s} rows {n:3d}: median |error| {median:6.1%}, max |error| {worst:6.1%}"
        )
    # Scored rows by source (the run id's first word), then by GPU.
    for key, width in ((lambda r: r.case.run_id.split("-")[0], 11), (lambda r: r.case.gpu, 9)):
        groups: dict[str, list[Result]] = {}
        for r in results:
            groups.setdefault(key(r), []).append(r)
        for name in sorted(groups):
            n, median, worst = summarize(groups[name], ("fit", "held_out"))
            if n:
                lines.append(
                    f"  {name:{width}s} rows {n:3d}: median |error| {median:6.1%}, "
                    f"max |error| {worst:6.1%}"
                )
    contradictions = source_contradictions(r.case for r in results)
    contradicted = {pair.slower for pair in contradictions}
    beyond = [r for r in results if r.case.status == "held_out" and abs(r.error) > 0.25]
    lines.append("")
    lines.append(f"held-out rows beyond 25% ({len(beyond)}; docs/cost-model.md discusses them):")
    for r in sorted(beyond, key=lambda r: -abs(r.error)):
        flag = "  contradicts its own table (below)" if r.case.run_id in contradicted else ""
        lines.append(f"  {r.case.run_id:44s} {r.error:+7.1%}{flag}")
    lines.append("")
    lines.append(
        f"published rows slower per GPU than a sibling in their own table allows, by a rule on"
        f" their work and communication per GPU and token ({len(contradictions)} pairs beyond the"
        f" {SOURCE_NOISE:.0%} run-to-run noise; a cost model that respects the rule cannot match"
        f" both rows of a pair):"
    )
    for pair in contradictions:
        lines.append(f"  {pair.slower:44s} {pair.gap:+6.1%} vs {pair.faster}  [{pair.rule}]")
    lines.extend(fp8_report(results))
    if gpu_presets is not None:
        lines.extend(device_report(device_rows(results, skipped, gpu_presets)))
    lines.extend(memory_report(results))
    lines.append("")
    lines.append(f"not predicted ({len(skipped)} rows):")
    for s in skipped:
        lines.append(f"  {s.run_id:44s} {s.reason}")
    return "\n".join(lines)


def allocator_peak_bytes(r: Result) -> float:
    """The predicted peak as the caching allocator sees it (`torch.cuda.max_memory_reserved`):
    the tensors plus the allocator margin, without the framework reserve (the CUDA context and
    library buffers live outside the allocator)."""
    return r.estimate.peak_memory_bytes - r.case.cluster.calibration.reserved_memory_bytes


def over_capacity(r: Result) -> bool:
    """Whether the predicted peak itself is over the device (the product's ``fits`` also keeps
    a headroom and the peak's range free: a plan it would not choose, not a run that could not
    have run)."""
    return r.estimate.peak_memory_bytes > r.estimate.memory_capacity_bytes


def memory_errors(results: Iterable[Result]) -> list[tuple[Result, float]]:
    """Scored rows with a published peak: (row, predicted / published - 1)."""
    return [
        (r, allocator_peak_bytes(r) / r.case.published_memory_bytes - 1.0)
        for r in results
        if r.case.published_memory_bytes and r.case.status in ("fit", "held_out")
    ]


def memory_report(results: list[Result]) -> list[str]:
    gib = 2.0**30
    lines = ["", "peak memory where the source prints it (its allocator's max reserved):"]
    for r in results:
        if r.case.published_memory_bytes:
            published = r.case.published_memory_bytes
            error = allocator_peak_bytes(r) / published - 1.0
            lines.append(
                f"  {r.case.run_id:44s} {r.case.status:9s} published {published / gib:5.1f} GiB, "
                f"predicted {allocator_peak_bytes(r) / gib:5.1f} GiB ({error:+.1%})"
                + ("" if r.case.status in ("fit", "held_out") else f"  [{r.case.note}]")
            )
    scored = [abs(e) for _, e in memory_errors(results)]
    if scored:
        lines.append(
            f"  scored rows {len(scored)}: median |error| {statistics.median(scored):.1%}, "
            f"max {max(scored):.1%}"
        )
    over = [r for r in results if over_capacity(r)]
    # the product's own edge rule (`Estimate.fits_without_margin`), not a per-row note
    edge = [r for r in over if not r.case.memory_note and r.estimate.fits_without_margin]
    unexplained = [r for r in over if not r.case.memory_note and r not in edge]
    lines.append("")
    lines.append(
        f"runs that ran but are predicted over their device's memory ({len(over)}; "
        f"{len(edge)} over only by the allocator margin; {len(unexplained)} without an "
        "explanation):"
    )
    for r in over:
        m = r.estimate.peak_rank.memory
        why = r.case.memory_note or (
            f"AT THE EDGE: tensors + reserve {(m.total_bytes - m.margin_bytes) / gib:.1f} GiB "
            "fit; over by the allocator margin, which the caching allocator gives back "
            "(flush and retry) before it fails"
            if r in edge
            else "UNEXPLAINED"
        )
        lines.append(
            f"  {r.case.run_id:44s} {r.estimate.peak_memory_bytes / gib:5.1f} GiB of "
            f"{r.estimate.memory_capacity_bytes / gib:.0f} GiB  {why}"
        )
    return lines


def fit_constant(constant: FittedConstant, cases: list[Case], values: dict[str, float]) -> float:
    """The value of ``constant`` within its range that minimises the largest |error| over
    ``cases`` (the other constants at ``values``): golden-section search, as each row's
    |error| is V-shaped in one constant, so their maximum has one minimum."""

    def worst(x: float) -> float:
        trial = {**values, constant.key: x}
        errs = []
        with profile_constants(trial):
            for case in cases:
                overrides = {
                    c.name: trial[c.key]
                    for c in FITTED
                    if c.framework is None and c.key in trial and c.applies(case)
                }
                cluster = case.cluster.with_overrides(**overrides)
                errs.append(abs(predict(case, cluster).error))
        return max(errs)

    lo, hi = constant.low, constant.high
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = worst(a), worst(b)
    while hi - lo > 1e-3 * max(1.0, abs(hi)):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = worst(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = worst(b)
    return (lo + hi) / 2


# set by main(): the constants of the assumptions being run
FITTED: tuple[FittedConstant, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldOutSource:
    """One source scored with the constants fitted without it."""

    source_id: str
    values: dict[str, float]  # refitted constants (key -> value); the rest as shipped
    results: list[Result]


def held_out_values(source_id: str, cases: dict[str, Case]) -> dict[str, float]:
    """The constants whose fit rows include ``source_id``'s, re-fitted on their other rows (one
    left without rows takes Calibration's default), by key; ``cases`` by run id holds every
    fit row."""
    defaults = Calibration()
    values: dict[str, float] = {}
    for constant in FITTED:
        own = [cases[i].source_id == source_id for i in constant.rows]
        if not any(own):
            continue
        others = [cases[i] for i, mine in zip(constant.rows, own, strict=True) if not mine]
        if others:
            values[constant.key] = fit_constant(constant, others, values)
        else:
            values[constant.key] = float(getattr(defaults, constant.name))
    return values


def leave_one_source_out(
    rows: list[dict[str, Any]], assumptions: dict[str, Any], results: list[Result]
) -> list[HeldOutSource]:
    """For each source: re-fit the constants whose fit rows include it on their other rows
    (a constant left without rows takes Calibration's default), then score every scored row
    of the source (its fit rows too) with those values."""
    cases = {r.case.run_id: r.case for r in results}
    row_of = {row["id"]: row for row in rows}
    scored = [r for r in results if r.case.status in ("fit", "held_out")]
    out = []
    for source_id in sorted({r.case.source_id for r in scored}):
        values = held_out_values(source_id, cases)
        refitted = [c for c in FITTED if c.key in values]
        mine = []
        for r in scored:
            if r.case.source_id != source_id:
                continue
            if not any(c.applies(r.case) for c in refitted):
                mine.append(r)
                continue
            case = build_case(row_of[r.case.run_id], assumptions, values)
            assert isinstance(case, Case)
            with profile_constants(values):
                mine.append(predict(case))
        out.append(HeldOutSource(source_id=source_id, values=values, results=mine))
    return out


def loso_report(held: list[HeldOutSource], results: list[Result]) -> str:
    scored = [r for r in results if r.case.status in ("fit", "held_out")]
    total = len(scored)
    lines = [
        "",
        "leave-one-source-out (constants re-fitted without the source, then its rows scored):",
        f"  {'source':16s} {'rows':>4s} {'share':>6s} {'in-sample':>10s} {'held out':>9s} "
        f"{'max':>7s}  re-fitted constants",
    ]
    for h in held:
        mine_in = [abs(r.error) for r in scored if r.case.source_id == h.source_id]
        mine_out = [abs(r.error) for r in h.results]
        refit = ", ".join(f"{k} {v:.3g}" for k, v in h.values.items()) or "-"
        lines.append(
            f"  {h.source_id:16s} {len(mine_out):4d} {len(mine_out) / total:6.1%} "
            f"{statistics.median(mine_in):10.1%} {statistics.median(mine_out):9.1%} "
            f"{max(mine_out):7.1%}  {refit}"
        )
    every = [abs(r.error) for h in held for r in h.results]
    lines.append(
        f"  all {len(every)} rows: median |error| {statistics.median(every):.1%}, max "
        f"{max(every):.1%}; worst source median "
        f"{max(statistics.median([abs(r.error) for r in h.results]) for h in held):.1%}; "
        f"largest source {max(len(h.results) for h in held) / total:.0%} of the rows"
    )
    # A row its own table contradicts cannot be matched by a model that matches its sibling:
    # the max without them is printed beside the max, never instead of it.
    contradicted = {c.slower for c in source_contradictions(r.case for r in results)}
    consistent = [
        abs(r.error) for h in held for r in h.results if r.case.run_id not in contradicted
    ]
    lines.append(
        f"  the {len(consistent)} rows their own table does not contradict (the pairs above): "
        f"median |error| {statistics.median(consistent):.1%}, max {max(consistent):.1%}"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------- residuals and coverage

ORIGIN = "bench/validate_published.py"


def step_residuals(held: list[HeldOutSource]) -> list[dict[str, Any]]:
    """Each scored row's leave-one-source-out residual, log(published / predicted step), with
    its plan's features and what the MFU check needs (`cost_model.uncertainty`)."""
    rows = []
    for h in held:
        for r in h.results:
            rows.append(
                {
                    "id": r.case.run_id,
                    "source": r.case.source_id,
                    "features": list(r.estimate.features),
                    "residual": round(math.log(r.case.published_step_s / r.step_time_s), 6),
                    "device": r.case.cluster.device.name,
                    "params": r.num_params,
                    # the run's MFU in autoplan's FLOP count: predicted MFU x predicted/published
                    "measured_mfu": round(
                        r.estimate.mfu * r.step_time_s / r.case.published_step_s, 6
                    ),
                }
            )
    return sorted(rows, key=lambda row: row["id"])


def memory_residuals(results: Iterable[Result]) -> list[dict[str, Any]]:
    """Each scored row with a published peak: log(published / predicted allocator peak)."""
    return [
        {
            "id": r.case.run_id,
            "source": r.case.source_id,
            "features": list(r.estimate.features),
            "residual": round(-math.log1p(error), 6),
        }
        for r, error in memory_errors(results)
    ]


def staleness(rows: list[dict[str, Any]]) -> str:
    """Whether the shipped step residuals (what the product's ranges are sized by) are this
    run's: a cost-model change moves them, and ``--write-residuals`` ships the new ones."""
    shipped_rows = {
        (r["id"], r["residual"], tuple(r["features"]))
        for r in json.loads(RESIDUALS_PATH.read_text())["step"]
    }
    mine = {(r["id"], r["residual"], tuple(r["features"])) for r in rows}
    if shipped_rows == mine:
        return f"  the shipped residuals ({RESIDUALS_PATH.name}) are this run's"
    return (
        f"  the shipped residuals differ from this run's in {len(shipped_rows ^ mine)} entries: "
        "re-run with --write-residuals"
    )


def _model(rows: Iterable[dict[str, Any]]) -> ResidualModel:
    return ResidualModel(
        Residual(
            run_id=r["id"], source=r["source"], features=tuple(r["features"]), value=r["residual"]
        )
        for r in rows
    )


def coverage_report(rows: list[dict[str, Any]]) -> str:
    """The 80% intervals' calibration: each scored row against the interval sized from the
    other sources' residuals (its own source's are never used), overall, per source and per
    feature; then the features with fewer than MIN_ROWS rows."""
    model = _model(rows)
    inside, total, per = model.coverage()
    lines = [
        "",
        "80% ranges, leave-one-source-out (each row's range sized without its own source):",
        f"  coverage {inside} of {total} rows = {inside / total:.1%} (nominal 80%); "
        f"feature spread tau {model.tau:.3f}",
    ]
    for source, (i, n) in per.items():
        lines.append(f"  {source:22s} {i:4d} of {n:4d} inside ({i / n:.0%})")
    by_feature: dict[str, list[bool]] = {}
    for source in per:
        others = model.without_source(source)
        for r in model.residuals:
            if r.source != source:
                continue
            iv = others.interval(r.features)
            hit = math.log(iv.low) <= r.value <= math.log(iv.high)
            for f in r.features:
                by_feature.setdefault(f, []).append(hit)
    lines.append("  by feature (rows, coverage):")
    for f, hits in sorted(by_feature.items()):
        flag = "" if len(hits) >= MIN_ROWS else "  (unvalidated: fewer than 5 rows)"
        lines.append(f"    {f:44s} {len(hits):4d} {sum(hits) / len(hits):6.0%}{flag}")
    return "\n".join(lines)


# ------------------------------------------------------------- techniques (issue 43, item 8)

# The training techniques of issue 43, in its order, each by the name the roll-up prints.
TECHNIQUES = (
    "torch.compile",
    "TP comm overlap",
    "precision policy",
    "partial recompute",
    "HSDP",
    "expert TP",
    "offload",
)
# A precision policy's fields at their defaults (`autoplan.Plan`: fp32 master weights and
# AdamW moments, gradients reduced in the dtype's default): a row stating one of them otherwise
# uses a policy.
_POLICY_DEFAULTS = {
    "master_dtype": DEFAULT_MASTER_DTYPE,
    "grad_reduce_dtype": None,
    "optimizer_state_dtype": DEFAULT_OPTIMIZER_STATE_DTYPE,
}


def stated_techniques(row: dict[str, Any], assumptions: dict[str, Any]) -> frozenset[str]:
    """The techniques of `TECHNIQUES` the row's source states its run used: its config, its
    assumptions entry (which completes the config from the source) and its family (a family's
    precision policy)."""
    extra = assumptions["rows"].get(row["id"]) or {}
    family = _family(row["id"], assumptions["families"])
    fam = assumptions["families"][family] if family is not None else {}
    merged = {**{k: v for k, v in row["config"].items() if v is not None}, **extra}
    policy = {k: merged.get(k, fam.get(k, default)) for k, default in _POLICY_DEFAULTS.items()}
    found = {
        "torch.compile": bool(merged.get("torch_compile")),
        "TP comm overlap": bool(merged.get("tp_comm_overlap") or merged.get("async_tp")),
        "precision policy": policy != _POLICY_DEFAULTS,
        # every k-th block checkpointed (k > 1, or k not stated: `per_layer_ac`), or a count
        "partial recompute": bool(
            merged.get("per_layer_ac")
            or (merged.get("checkpoint_every_k_blocks") or 1) > 1
            or merged.get("recompute_units") is not None
        ),
        "HSDP": merged.get("sharding") == "hsdp" or bool(merged.get("dp_shard")),
        "expert TP": row_etp(row) > 1,
        "offload": bool(merged.get("activation_offload_layers") or merged.get("optimizer_offload")),
    }
    return frozenset(name for name, used in found.items() if used)


def plan_techniques(case: Case) -> frozenset[str]:
    """The techniques of `TECHNIQUES` the row's plan states (`Case.plan_args`)."""
    a = case.plan_args
    found = {
        "torch.compile": bool(a.get("compile")),
        "TP comm overlap": bool(a.get("tp_comm_overlap")),
        "precision policy": any(a.get(k, d) != d for k, d in _POLICY_DEFAULTS.items()),
        "partial recompute": a.get("recompute_units") is not None,
        "HSDP": a.get("dp_shard") is not None,
        "expert TP": int(a.get("etp") or 1) > 1,
        "offload": bool(a.get("optimizer_offload") or a.get("activation_offload")),
    }
    return frozenset(name for name, used in found.items() if used)


def without_technique(case: Case, technique: str) -> Case:
    """``case`` priced without ``technique`` (the "before" of the roll-up): eager, TP
    collectives exposed, the default precision policy, every block recomputed, ZeRO over all
    of dp, experts whole, nothing offloaded. Without compile, an overlap that needs it (torch's
    async TP: `TpCommOverlap.needs_compile`) goes too, as the stack cannot run it eager."""
    args = dict(case.plan_args)
    if technique == "torch.compile":
        args["compile"] = False
        overlap = framework_profile(str(args["framework"])).tp_comm_overlap
        if overlap is not None and overlap.needs_compile:
            args["tp_comm_overlap"] = False
    elif technique == "TP comm overlap":
        args["tp_comm_overlap"] = False
    elif technique == "precision policy":
        for key in POLICY_KEYS:
            args.pop(key, None)
    elif technique == "partial recompute":
        args.pop("recompute_units", None)
    elif technique == "HSDP":
        args["dp_shard"] = None
    elif technique == "expert TP":
        args["etp"] = 1
    elif technique == "offload":
        args["optimizer_offload"] = 0.0
        args["activation_offload"] = 0
    else:
        raise ValueError(f"unknown technique {technique!r}; known: {', '.join(TECHNIQUES)}")
    return dataclasses.replace(case, plan_args=args)


@dataclass(frozen=True, kw_only=True, slots=True)
class TechniqueRow:
    """One published row that uses ``technique`` (its source says so), priced with the
    technique in its plan ("after") and without it ("before"): each |error| of the step time,
    and of the peak memory where the source prints one. Scored rows are priced with the
    constants re-fitted without their source (leave-one-source-out), and with the shipped ones
    (``*_in_sample``); unscored rows with the shipped ones; skipped rows not at all (``reason``
    says why)."""

    technique: str
    run_id: str
    source_id: str
    status: str  # fit | held_out | unscored | skip
    reason: str
    in_plan: bool  # the row's plan states the technique (False: the mapping drops it)
    after: float | None = None
    before: float | None = None
    memory_after: float | None = None
    memory_before: float | None = None
    after_in_sample: float | None = None
    before_in_sample: float | None = None

    @property
    def scored(self) -> bool:
        return self.status in ("fit", "held_out")


def _memory_error(r: Result) -> float | None:
    published = r.case.published_memory_bytes
    return None if not published else allocator_peak_bytes(r) / published - 1.0


def technique_rows(
    rows: list[dict[str, Any]], assumptions: dict[str, Any], prefixes: tuple[str, ...] = ()
) -> list[TechniqueRow]:
    """Every published row (of those whose id starts with one of ``prefixes``, if any) that
    uses one of `TECHNIQUES`, once per technique it uses, priced after and before
    (`TechniqueRow`). ``rows`` are all the rows (the constants' fit rows among them). Needs
    `FITTED` set."""
    built = {row["id"]: build_case(row, assumptions) for row in rows}
    cases = {i: c for i, c in built.items() if isinstance(c, Case)}
    values_of: dict[str, dict[str, float]] = {}
    out: list[TechniqueRow] = []
    for row in rows:
        if prefixes and not row["id"].startswith(prefixes):
            continue
        stated = stated_techniques(row, assumptions)
        case = built[row["id"]]
        if not stated:
            continue
        if isinstance(case, Skipped):
            out.extend(
                TechniqueRow(
                    technique=t,
                    run_id=case.run_id,
                    source_id="",
                    status="skip",
                    reason=case.reason,
                    in_plan=False,
                )
                for t in sorted(stated, key=TECHNIQUES.index)
            )
            continue
        scored = case.status in ("fit", "held_out")
        if scored and case.source_id not in values_of:
            values_of[case.source_id] = held_out_values(case.source_id, cases)
        values = values_of[case.source_id] if scored else {}
        shipped = case
        if values:
            rebuilt = build_case(row, assumptions, values)
            assert isinstance(rebuilt, Case)
            case = rebuilt
        in_plan = plan_techniques(case)
        techniques = sorted(stated, key=TECHNIQUES.index)
        # at the shipped constants: the same as below where the source refits none
        in_sample = {t: _with_and_without(shipped, t, in_plan) for t in techniques if values}
        with profile_constants(values):
            after = predict(case)
            for t in techniques:
                before = predict(without_technique(case, t)) if t in in_plan else after
                out.append(
                    TechniqueRow(
                        technique=t,
                        run_id=case.run_id,
                        source_id=case.source_id,
                        status=case.status,
                        reason=case.note,
                        in_plan=t in in_plan,
                        after=after.error,
                        before=before.error,
                        memory_after=_memory_error(after),
                        memory_before=_memory_error(before),
                        after_in_sample=in_sample[t][0] if values else after.error,
                        before_in_sample=in_sample[t][1] if values else before.error,
                    )
                )
    return out


def _with_and_without(case: Case, technique: str, in_plan: frozenset[str]) -> tuple[float, float]:
    """``case``'s errors with and without ``technique``, at the shipped constants."""
    after = predict(case).error
    before = predict(without_technique(case, technique)).error if technique in in_plan else after
    return after, before


def technique_summary(found: list[TechniqueRow], technique: str) -> dict[str, Any]:
    """One technique's figures: its rows, how many are scored, unscored, skipped and dropped by
    the row-to-plan mapping, and median / max |error| after and before, scored (leave-one-
    source-out) and unscored (shipped constants) apart, step time and peak memory."""
    mine = [r for r in found if r.technique == technique]
    priced = [r for r in mine if r.status != "skip"]
    scored = [r for r in priced if r.scored]
    unscored = [r for r in priced if not r.scored]

    def errors(chosen: list[TechniqueRow], field: str) -> list[float]:
        return [abs(v) for r in chosen if (v := getattr(r, field)) is not None]

    reasons: dict[str, int] = {}
    for r in mine:
        if not r.scored:
            key = f"{r.status}: {r.reason or '-'}"
            reasons[key] = reasons.get(key, 0) + 1
    return {
        "technique": technique,
        "rows": len(mine),
        "scored": len(scored),
        "unscored": len(unscored),
        "skipped": len(mine) - len(priced),
        "dropped_by_mapping": sorted(r.run_id for r in priced if not r.in_plan),
        **{
            f"{group}_{field}": _figures(errors(chosen, field))
            for group, chosen in (("scored", scored), ("unscored", unscored))
            for field in (
                "after",
                "before",
                "after_in_sample",
                "before_in_sample",
                "memory_after",
                "memory_before",
            )
        },
        "not_scored_reasons": reasons,
        # the scored rows by source: (rows, median |error| after, before; in-sample after, before)
        "scored_by_source": {
            source: [
                len(group),
                *(
                    statistics.median(errors(group, field))
                    for field in ("after", "before", "after_in_sample", "before_in_sample")
                ),
            ]
            for source in sorted({r.source_id for r in scored})
            if (group := [r for r in scored if r.source_id == source])
        },
    }


def _figures(errors: list[float]) -> dict[str, float | int | None]:
    return {
        "rows": len(errors),
        "median": statistics.median(errors) if errors else None,
        "max": max(errors) if errors else None,
    }


def _cell(figures: dict[str, Any]) -> str:
    if not figures["rows"]:
        return "-"
    return f"{figures['median']:.1%} / {figures['max']:.1%}"


def technique_table(summaries: list[dict[str, Any]]) -> Table:
    """The roll-up as a table: per technique, its rows and the median / max |error| with the
    technique stated (after) and priced without it (before)."""
    table = Table(
        title="Issue 43's techniques on the published rows that use them: median / max |error| "
        "with the technique in the plan (after) and priced without it (before); scored rows "
        "leave-one-source-out (step) and with the shipped constants (in-sample), unscored rows "
        "with the shipped constants",
        title_justify="left",
    )
    for name in (
        "technique",
        "rows",
        "scored",
        "step after",
        "step before",
        "in-sample after",
        "in-sample before",
        "memory after",
        "memory before",
        "unscored",
        "unscored after",
        "unscored before",
        "skipped",
    ):
        table.add_column(name, justify="left" if name == "technique" else "right")
    for s in summaries:
        memory_rows = s["scored_memory_after"]["rows"]
        table.add_row(
            s["technique"],
            str(s["rows"]),
            str(s["scored"]),
            _cell(s["scored_after"]),
            _cell(s["scored_before"]),
            _cell(s["scored_after_in_sample"]),
            _cell(s["scored_before_in_sample"]),
            _cell(s["scored_memory_after"]) + (f" ({memory_rows})" if memory_rows else ""),
            _cell(s["scored_memory_before"]),
            str(s["unscored"]),
            _cell(s["unscored_after"]),
            _cell(s["unscored_before"]),
            str(s["skipped"]),
        )
    return table


def technique_report(summaries: list[dict[str, Any]]) -> None:
    """Print the roll-up table, then each technique's rows that are not scored with why, and
    any row whose plan drops a technique its source states."""
    console = Console(width=200)
    console.print(technique_table(summaries))
    for s in summaries:
        if not s["rows"]:
            console.print(f"{s['technique']}: no published row (of those chosen) uses it")
            continue
        for source, (n, after, before, after_in, before_in) in s["scored_by_source"].items():
            console.print(
                f"{s['technique']}: {n} scored row(s) of {source}: median |error| after "
                f"{after:.1%}, before {before:.1%} (in-sample {after_in:.1%}, {before_in:.1%})",
                highlight=False,
            )
        for reason, n in sorted(s["not_scored_reasons"].items(), key=lambda kv: -kv[1]):
            console.print(f"{s['technique']}: {n} row(s) {reason}", highlight=False)
        if s["dropped_by_mapping"]:
            console.print(
                f"{s['technique']}: the plan of {', '.join(s['dropped_by_mapping'])} does not "
                "state it",
                highlight=False,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--fit", action="store_true", help="re-fit every fitted constant on its own rows"
    )
    parser.add_argument("--only", default="", help="comma-separated run-id prefixes")
    parser.add_argument(
        "--write-residuals",
        action="store_true",
        help="write the step and memory residuals the product's ranges are sized by "
        "(cost_model/validation/residuals.json)",
    )
    parser.add_argument(
        "--scored", action="store_true", help="predict only the scored rows (fit, held out)"
    )
    parser.add_argument(
        "--techniques",
        action="store_true",
        help="issue 43's roll-up: each technique's rows priced with it and without it",
    )
    args = parser.parse_args(argv)
    rows, assumptions = load()
    global FITTED
    FITTED = fitted_constants(assumptions)
    if args.techniques:
        found = technique_rows(rows, assumptions, tuple(p for p in args.only.split(",") if p))
        summaries = [technique_summary(found, t) for t in TECHNIQUES]
        if args.json:
            rows_json = [dataclasses.asdict(r) for r in found]
            print(json.dumps({"techniques": summaries, "rows": rows_json}, indent=2))
        else:
            technique_report(summaries)
        return 0
    prefixes = tuple(p for p in args.only.split(",") if p)
    cases: list[Case] = []
    skipped: list[Skipped] = []
    for row in rows:
        if prefixes and not row["id"].startswith(prefixes):
            continue
        built = build_case(row, assumptions)
        (skipped if isinstance(built, Skipped) else cases).append(built)  # type: ignore[arg-type]
    if args.fit:
        by_id = {c.run_id: c for c in cases}
        fitted = {
            c.key: fit_constant(c, [by_id[i] for i in c.rows if i in by_id], {})
            for c in FITTED
            if any(i in by_id for i in c.rows)
        }
        print(json.dumps(fitted, indent=2))
        return 0
    # the published numbers' own contradictions need every row, scored or not
    contradictions = source_contradictions(cases)
    if args.scored:
        cases = [c for c in cases if c.status in ("fit", "held_out")]
    results = [predict(c) for c in cases]
    devices = device_rows(results, skipped, assumptions["gpu_presets"])
    if args.json:
        print(
            json.dumps(
                {
                    "rows": [
                        {
                            "id": r.case.run_id,
                            "status": r.case.status,
                            "dtype": r.case.plan_args["dtype"],
                            "published_step_s": r.case.published_step_s,
                            "predicted_step_s": r.step_time_s,
                            "error": r.error,
                            "fits": r.estimate.fits,
                            "published_memory_bytes": r.case.published_memory_bytes,
                            "predicted_memory_bytes": allocator_peak_bytes(r),
                        }
                        for r in results
                    ],
                    "skipped": [dataclasses.asdict(s) for s in skipped],
                    "devices": {
                        d.gpu: {
                            "preset": d.preset,
                            "scored": d.figures("scored"),
                            "unscored": d.figures("unscored"),
                            "skipped": d.skipped,
                        }
                        for d in devices
                    },
                    "presets_without_rows": presets_without_rows(devices),
                    "contradictions": [dataclasses.asdict(c) for c in contradictions],
                    "fp8_pairs": [
                        {
                            "fp8": p.fp8.case.run_id,
                            "bf16": p.bf16.case.run_id,
                            "scored": p.scored,
                            "published_speedup": p.published,
                            "predicted_speedup": p.predicted,
                        }
                        for p in fp8_pairs(results)
                    ],
                },
                indent=2,
            )
        )
    else:
        print(report(results, skipped, assumptions["gpu_presets"]))
        if not prefixes and not args.scored:
            held = leave_one_source_out(rows, assumptions, results)
            print(loso_report(held, results))
            step_rows = step_residuals(held)
            print(coverage_report(step_rows))
            print(staleness(step_rows))
            if args.write_residuals:
                write_residuals("step", step_rows, ORIGIN)
                write_residuals("memory", memory_residuals(results), ORIGIN)
                print("wrote the residuals to cost_model/validation/residuals.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
