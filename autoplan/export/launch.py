"""The launch line of an export: the launcher, its rendezvous and the environment the stack needs.

Expects the `Launch` (how many processes where), the stack's environment (name -> value) and
the program with its arguments. Guarantees a line that runs as printed, the same on every node,
once the variables it names (`LaunchVariable`, ``$MASTER_ADDR`` ...) are set:

- torchrun (``torch/distributed/run.py``; Megatron-LM's ``pretrain_gpt.py`` and torchtitan's
  ``torchtitan.train`` both run under it): one node -> ``--standalone`` (a c10d rendezvous on a
  free local port); several nodes, or an unknown count (``$NNODES``) -> ``--nnodes N
  --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id
  $JOB_ID``: every node's agent meets at the first node's c10d store (torch's elastic
  rendezvous), so no node rank is needed. The line parses with
  ``torch.distributed.run.get_args_parser()``.
- DeepSpeed's runner (``deepspeed/launcher/runner.py`` at 0.19.8, ``parse_args``): one node
  -> ``deepspeed --num_nodes 1 --num_gpus G`` (no hostfile: ``localhost``, ``main``); several
  -> ``--hostfile $HOSTFILE --no_ssh --node_rank $NODE_RANK --master_addr $MASTER_ADDR
  --master_port $MASTER_PORT --num_nodes N --num_gpus G`` on every node: ``--no_ssh`` starts
  this node's processes only (``main`` asserts ``0 <= node_rank < len(active_resources)``),
  where the default would start every node over pdsh and ssh from the first.
- Environment the stack needs goes in front as ``env NAME=value`` (the workers inherit it);
  nothing else is set (NCCL's defaults serve every plan exported here).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from autoplan.export._common import Launch, LaunchVariable

__all__ = ["deepspeed_command", "launch_variables", "torchrun_command"]

_MEANINGS = {
    "MASTER_ADDR": "hostname or IP address of the first node, reachable from every node",
    "MASTER_PORT": "a free TCP port on the first node, e.g. 29500",
    "JOB_ID": "one id for this job, the same on every node, e.g. $SLURM_JOB_ID",
    "NODE_RANK": "this node's index, 0 on the first node, then 1, 2, ... (e.g. $SLURM_NODEID)",
    "HOSTFILE": "a file listing one 'HOST slots=GPUS' line per node, the first node first",
    "NNODES": "the number of nodes",
    "NPROC_PER_NODE": "the number of GPUs per node (one process each)",
}
_VARIABLE = re.compile(r"\$([A-Z_]+)")


def torchrun_command(
    launch: Launch, program: Sequence[str], *, env: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """``[env NAME=value ...] torchrun <rendezvous> <program>`` for ``launch``."""
    if launch.nodes == "1":
        rendezvous: tuple[str, ...] = ("--standalone",)
    else:
        rendezvous = (
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT",
            "--rdzv-id=$JOB_ID",
        )
    return (
        *_env_prefix(env),
        "torchrun",
        f"--nnodes={launch.nodes}",
        f"--nproc-per-node={launch.procs_per_node}",
        *rendezvous,
        *program,
    )


def deepspeed_command(
    launch: Launch, program: Sequence[str], *, env: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """``[env NAME=value ...] deepspeed <nodes> <program>`` for ``launch`` (module doc)."""
    nodes: tuple[str, ...] = ()
    if launch.nodes != "1":
        nodes = (
            "--hostfile=$HOSTFILE",
            "--no_ssh",
            "--node_rank=$NODE_RANK",
            "--master_addr=$MASTER_ADDR",
            "--master_port=$MASTER_PORT",
        )
    return (
        *_env_prefix(env),
        "deepspeed",
        *nodes,
        f"--num_nodes={launch.nodes}",
        f"--num_gpus={launch.procs_per_node}",
        *program,
    )


def launch_variables(command: Sequence[str]) -> tuple[LaunchVariable, ...]:
    """The ``$NAME`` placeholders of ``command``, in order, each with what to set it to."""
    names: dict[str, None] = {}
    for part in command:
        names.update(dict.fromkeys(_VARIABLE.findall(part)))
    return tuple(LaunchVariable(name=name, meaning=_MEANINGS[name]) for name in names)


def _env_prefix(env: Mapping[str, str] | None) -> tuple[str, ...]:
    if not env:
        return ()
    return ("env", *(f"{name}={value}" for name, value in env.items()))
