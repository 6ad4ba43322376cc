"""Per-step fault tolerance across replica groups, with torchft (``pip install torchft``).

A plan's replicated data-parallel dimension can run as separate *replica groups*: each group is
its own torchrun job of ``plan.num_devices`` processes running the same plan on its own slice of
the global batch, and the groups average their gradients every step through torchft's
`Manager` (a quorum kept by its lighthouse server). A group that dies drops out of the next
quorum and the others keep committing steps: no step is lost and nothing restarts. When it
comes back (torchrun restarts it), it heals: torchft sends it a live peer's model, optimizer,
data position and step, and it rejoins at the current step.

Expects: a torchft lighthouse (``torchft_lighthouse --min_replicas 1``) whose address is given or
in ``TORCHFT_LIGHTHOUSE``; every group started with the same model, plan and arguments.

Guarantees: the optimizer steps only when every group in the step's quorum succeeded
(``should_commit``); the plan inside a group is a pipeline (dp 1, tp 1): the state torchft
transfers to a healing group is then plain tensors. Sharded state (FSDP, tensor-parallel
DTensors) inside a group is refused with a `PlanError` (not supported yet).

Found on this machine (torch 2.13, torchft 0.2.0, gloo): torchft's own
``torchft.DistributedDataParallel`` crashes the surviving group when a peer dies mid all-reduce
(``assert fut._fut`` in its communication hook: the failed wait leaves the future unset), so
autoplan calls ``Manager.allreduce`` itself.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from autoplan.contract.errors import PlanError
from autoplan.contract.plan import Plan
from cost_model.degrees import is_whole
from passes.runtime import DistributedModel, ReplicaSync

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["TorchFTReplicas"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchFTReplicas:
    """This process's replica group and how to reach the others (see the module doc)."""

    replica_group: int  # 0 .. num_replica_groups - 1: this group's slice of the global batch
    num_replica_groups: int
    lighthouse: str | None = None  # e.g. "http://host:29510"; default: $TORCHFT_LIGHTHOUSE
    min_replicas: int = 1  # a step commits only with at least this many groups in its quorum
    timeout_s: float = 60.0  # collectives, quorum and healing

    def __post_init__(self) -> None:
        for name in ("replica_group", "num_replica_groups", "min_replicas"):
            value = getattr(self, name)
            if not is_whole(value, 0):
                raise PlanError(f"{name} = {value!r} must be a whole number >= 0")
        if self.num_replica_groups < 1 or not 0 <= self.replica_group < self.num_replica_groups:
            raise PlanError(
                f"replica_group = {self.replica_group} must be in 0 .. num_replica_groups - 1 "
                f"= {self.num_replica_groups - 1}"
            )
        if not 1 <= self.min_replicas <= self.num_replica_groups:
            raise PlanError(
                f"min_replicas = {self.min_replicas} must be in 1 .. num_replica_groups "
                f"= {self.num_replica_groups}"
            )
        if not self.timeout_s > 0:
            raise PlanError(f"timeout_s = {self.timeout_s!r} must be > 0 seconds")
        if (self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")) is None:
            raise PlanError(
                "no torchft lighthouse: pass lighthouse='http://HOST:29510' or set "
                "TORCHFT_LIGHTHOUSE (start one with `torchft_lighthouse --min_replicas 1`)"
            )

    def check(self, plan: Plan) -> None:
        """Refuse, before any collective, a plan a replica group cannot run."""
        if plan.dp_degree != 1 or plan.tp_degree != 1:
            raise PlanError(
                f"torchft replica groups run a pipeline plan inside each group (dp 1, tp 1), "
                f"got dp {plan.dp_degree} x tp {plan.tp_degree}: a healing group receives its "
                "state from a peer, and sharded state (FSDP, tensor-parallel DTensors) is not "
                "transferred yet; the data-parallel dimension is the replica groups themselves"
            )

    def connect(self, model: DistributedModel) -> TorchFTSync:
        """Join the replica groups: a torchft `Manager` on this process's replica group, with
        ``model``'s state for healing peers; sets ``model.replicas``."""
        self.check(model.plan)
        sync = TorchFTSync(self, model)
        model.replicas = sync
        return sync


class TorchFTSync(ReplicaSync):
    """`ReplicaSync` through a torchft `Manager` (one per process)."""

    def __init__(self, config: TorchFTReplicas, model: DistributedModel) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        self.index = config.replica_group
        self.count = config.num_replica_groups
        self._model = model
        # torchft reads the state from its quorum thread while this one runs the step. The
        # first state_dict() of an optimizer that has not stepped creates its state with a
        # zero-learning-rate step, in place on the parameters, which would break the autograd
        # graph of a step in flight ("modified by an inplace operation"): create it now.
        model.state_dict()
        timeout = datetime.timedelta(seconds=config.timeout_s)
        # torchft's manager keeps its address in a store: one of this start of the group's
        # own, hosted by rank 0 on a free port (the job's store outlives restarts, and a
        # restarted group would read the dead manager's address from it).
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._store_server = (
            TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
            if dist.get_rank() == 0
            else None
        )
        port: list[Any] = [self._store_server.port if self._store_server else None]
        dist.broadcast_object_list(port, src=0)
        cuda = model.device.type == "cuda"
        pg = ProcessGroupNCCL(timeout=timeout) if cuda else ProcessGroupGloo(timeout=timeout)
        self.manager: Manager = Manager(
            pg=pg,
            min_replica_size=config.min_replicas,
            load_state_dict=self._load,
            state_dict=self._state,
            replica_id=f"autoplan_{config.replica_group}",
            lighthouse_addr=config.lighthouse,
            timeout=timeout,
            quorum_timeout=timeout,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=host,
            store_port=int(port[0]),
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=model.device),
        )

    def register(self, key: str, load: Callable[[Any], None], state: Callable[[], Any]) -> None:
        """More state a healing group must receive (e.g. the data position)."""
        self.manager.register_state_dict_fn(key, load, state)

    def _state(self) -> dict[str, Any]:
        return {"model": self._model.state_dict(), "step": self._model.step}

    def _load(self, state: dict[str, Any]) -> None:
        self._model.load_state_dict(state["model"])
        logger.info(
            "replica group %d healed from a peer: step %d -> %d",
            self.index,
            self._model.step,
            state["step"],
        )

    def start_step(self) -> None:
        self.manager.start_quorum()

    @torch.no_grad()
    def average(self, grads: list[torch.Tensor]) -> None:
        works = [self.manager.allreduce(grad) for grad in grads]
        for work in works:
            work.wait()  # an error is recorded by the manager: commit() says no

    def commit(self) -> bool:
        return bool(self.manager.should_commit())

    @property
    def step(self) -> int:
        return int(self.manager.current_step())

    @property
    def participants(self) -> int:
        """Replica groups in the current step's quorum."""
        return int(self.manager.num_participants())
