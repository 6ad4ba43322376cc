"""`autoplan validate`: check a plan file against a cluster and the model it was made for.

Without ``--cluster`` the cluster the plan file records is used (``estimate.cluster`` with the
plan's device count), as `autoplan explain` does, and the output says so.

Memory is checked as `autoplan.parallelize` checks it (`Estimate.require_fits`: the upper end
of the predicted per-rank peak's range against the device's memory less the memory headroom:
``--memory-headroom``, else the plan file's ``memory_headroom``, else the default) whenever the
model is known: ``--model``, or the plan file's ``model.name`` when that is a model spec.
``--allow-over-memory`` turns the failure into a warning; without a model the output says that
memory was not checked. The plan's precision policy is priced as the file states it, or as
``--master-dtype``, ``--grad-reduce-dtype`` and ``--optimizer-state-dtype`` restate it (a run that
kept its weights and AdamW states in bf16, checked with the plan it ran)."""

from __future__ import annotations

import dataclasses

import click

from autoplan._format import fmt_headroom
from autoplan.analysis.explain import ExplainInputError, plan_cluster, plan_model_spec
from autoplan.cli.common import (
    console,
    echo_err,
    emit_json,
    json_option,
    memory_headroom_option,
    precision_fields,
    precision_options,
    trace_spec,
)
from autoplan.cli.progress import progress_enabled, progress_option, status_reporter
from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from autoplan.export.checks import MemoryCheck, check_memory
from cost_model.hardware import load_cluster
from cost_model.messages import shown
from cost_model.precision import precision_text
from cost_model.results import MemoryCapacityError


@click.command()
@click.argument("plan_path", metavar="PLAN.yaml")
@click.option(
    "--cluster",
    "cluster_spec",
    default=None,
    help="Cluster NAME[:k=v,...] or YAML [the plan's estimate.cluster, its device count].",
)
@click.option(
    "--model",
    "model_spec",
    default=None,
    help="Also check against this model NAME[:k=v,...] (units, TP divisibility, fingerprint).",
)
@click.option(
    "--allow-cross-node-tp", is_flag=True, help="Accept tensor-parallel groups that span nodes."
)
@click.option(
    "--allow-over-memory",
    is_flag=True,
    help="Warn instead of failing when the predicted peak memory exceeds the device's.",
)
@memory_headroom_option
@click.option(
    "--checkpoint",
    "checkpointed",
    is_flag=True,
    help="The job saves checkpoints: refuse plans whose state cannot be saved (ZeRO-1 on DDP).",
)
@precision_options
@progress_option
@json_option
def validate(
    plan_path: str,
    cluster_spec: str | None,
    model_spec: str | None,
    allow_cross_node_tp: bool,
    allow_over_memory: bool,
    memory_headroom: float | None,
    checkpointed: bool,
    master_dtype: str | None,
    grad_reduce_dtype: str | None,
    optimizer_state_dtype: str | None,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Check a plan file against a cluster and its model (memory included)."""
    plan = Plan.from_yaml(plan_path)
    stated = precision_fields(
        {
            "master_dtype": master_dtype,
            "grad_reduce_dtype": grad_reduce_dtype,
            "optimizer_state_dtype": optimizer_state_dtype,
        }
    )
    if stated:
        try:
            plan = dataclasses.replace(plan, **stated)  # type: ignore[arg-type]
        except PlanError as error:
            raise PlanError(f"{plan_path} with {_options(stated)}: {error}") from None
    if checkpointed and (problem := plan.checkpoint_problem()) is not None:
        raise PlanError(f"--checkpoint: {problem}")
    cluster_note = ""
    if cluster_spec is not None:
        target = load_cluster(cluster_spec)
    else:
        target, cluster_note = plan_cluster(plan, plan_path)
    memory_note = ""
    if model_spec is None:
        try:
            model_spec, _ = plan_model_spec(plan, plan_path)
        except ExplainInputError as error:
            memory_note = f"memory not checked ({error})"
    profile = None
    if model_spec:
        # progress on stderr (`autoplan.cli.progress`): torch's import and a trace take seconds
        with status_reporter("validate", enabled=progress_enabled(progress, as_json)) as status:
            status.update(f"tracing {shown(model_spec, quoted=False)}")
            profile = trace_spec(model_spec).profile
    plan.validate(profile, target, allow_cross_node_tp=allow_cross_node_tp)
    peak = None
    memory: MemoryCheck | None = None
    if profile is not None:
        try:
            memory = check_memory(
                plan,
                profile,
                target,
                allow_over_memory=allow_over_memory,
                memory_headroom=memory_headroom,
            )
        except MemoryCapacityError as error:
            notes = []
            if memory_headroom is None and plan.memory_headroom is not None:
                notes.append(
                    f"the headroom is the plan file's memory_headroom, {plan.memory_headroom:g}, "
                    "which it was made with; --memory-headroom checks it with another"
                )
            recorded = plan.estimate.memory_capacity_bytes if plan.estimate else 0
            if recorded and recorded != target.device.memory_bytes:
                gib = 2.0**30
                notes.append(
                    f"the plan was made for devices of {recorded / gib:g} GiB, its "
                    f"estimate.memory_capacity_bytes, and {target.name} has "
                    f"{target.device.memory_bytes / gib:g} GiB: pass --cluster with the "
                    "overrides it was made with, e.g. memory=..."
                )
            if not notes:
                raise
            raise MemoryCapacityError(f"{error} ({'; '.join(notes)})") from None
        peak = memory.peak_memory_bytes
        if not memory.fits:
            memory_note = f"WARNING (--allow-over-memory): {memory.problem}"
            echo_err(memory_note)
        else:
            gib = 2.0**30
            memory_note = (
                f"peak memory {peak / gib:.1f} GiB of {memory.capacity_bytes / gib:.1f} GiB, "
                + fmt_headroom(
                    peak, memory.capacity_bytes, memory.memory_headroom, memory.usable_bytes
                )
            )
    against = f"{target.name} ({target.num_devices} devices)"
    if profile is not None:
        against += f" and model {profile.name}"
    if as_json:
        emit_json(
            {
                "valid": True,
                "plan": plan_path,
                "cluster": target.name,
                "model": profile.name if profile else None,
                "peak_memory_bytes": peak,
                "memory_headroom": memory.memory_headroom if memory else None,
                "usable_memory_bytes": memory.usable_bytes if memory else None,
                "memory": memory_note,
                "cluster_note": cluster_note or None,
                "precision": dataclasses.asdict(plan.precision),
            }
        )
    else:
        out = console()
        out.print(
            f"{plan_path}: valid for {against}: "
            f"dp={plan.dp_degree} tp={plan.tp_degree} pp={plan.pp_degree}"
            + (f" cp={plan.cp_degree}" if plan.cp_degree > 1 else "")
            + (f" ep={plan.ep_degree}" if plan.ep_degree > 1 else ""),
            markup=False,  # wrapped at the console's words (scripts read --json)
        )
        out.print(f"  {memory_note}", markup=False)  # wrapped at the console's words
        if cluster_note:
            out.print(f"using {cluster_note}", style="dim", markup=False)
        precision = precision_text(
            plan.dtype, plan.fp8_exclude, plan.fp8_all_gather, plan.precision
        )
        if precision is not None:
            out.print(f"precision: {precision}", markup=False)


def _options(stated: dict[str, str]) -> str:
    """``--master-dtype bf16 --optimizer-state-dtype bf16``."""
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in stated.items())
