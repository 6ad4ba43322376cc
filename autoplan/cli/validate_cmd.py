"""`autoplan validate`: check a plan file against a cluster and, optionally, a model."""

from __future__ import annotations

import click

from autoplan.cli.common import emit_json, json_option, trace_spec
from autoplan.plan import Plan
from cost_model.hardware import load_cluster


@click.command()
@click.argument("plan_path", metavar="PLAN.yaml")
@click.option("--cluster", "cluster_spec", required=True, help="Cluster NAME[:k=v,...] or YAML.")
@click.option(
    "--model",
    "model_spec",
    default=None,
    help="Also check against this model NAME[:k=v,...] (units, TP divisibility, fingerprint).",
)
@click.option(
    "--allow-cross-node-tp", is_flag=True, help="Accept tensor-parallel groups that span nodes."
)
@json_option
def validate(
    plan_path: str,
    cluster_spec: str,
    model_spec: str | None,
    allow_cross_node_tp: bool,
    as_json: bool,
) -> None:
    """Check a plan file against a cluster (and a model)."""
    plan = Plan.from_yaml(plan_path)
    target = load_cluster(cluster_spec)
    profile = trace_spec(model_spec).profile if model_spec else None
    plan.validate(profile, target, allow_cross_node_tp=allow_cross_node_tp)
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
            }
        )
    else:
        click.echo(
            f"{plan_path}: valid for {against}: "
            f"dp={plan.dp_degree} tp={plan.tp_degree} pp={plan.pp_degree}"
        )
