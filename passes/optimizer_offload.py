"""Optimizer-offload pass: keep the plan's share of a rank's optimizer step on the host
(`Plan.optimizer_offload` f, Megatron-Core's ``--optimizer-cpu-offload
--optimizer-offload-fraction f``).

Expects the parameters one optimizer of the runtime updates (a stage's, or ZeRO-1's partition of
them: plain tensors under DDP, DTensors under FSDP2 ``fully_shard``/``replicate`` or tensor
parallelism, whose local shards are what this rank updates), the user's `OptimizerFactory`, the
share f and the device.

Guarantees (`OffloadedOptimizer`):

- the split (`offloaded_params`): whole local parameter shards, in the optimizer's parameter
  order, each to the host while the elements already offloaded are below f x the local total
  (Megatron-Core's rule, ``HybridDeviceOptimizer._get_sub_optimizer_param_groups``,
  megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py), so the host may take up to one
  parameter more than f; f = 1 puts every parameter there;
- each offloaded parameter's master copy lives in host memory (``cpu``, pinned when the device
  is CUDA) in the parameter's own dtype, the plan's master dtype (the runtime's parameters are
  the master weights: fp32 unless ``master_dtype: bf16``, passes/data_parallel.py), as a
  DTensor over the host copy of the local shard where the parameter is one; the user's optimizer
  class (the factory, called once on the device's parameters and once on the host copies) keeps
  their states beside them, in the dtype it keeps states in (AdamW: the parameter's);
- `OffloadedOptimizer.step`, in this order: gradients of the offloaded shards copied to host
  buffers (``non_blocking`` into pinned memory on CUDA, then a wait on an event recorded after
  the copies, not on the whole stream), the device's optimizer step launched (it runs on the
  GPU while the host steps), the host's optimizer step over the host copies, the updated
  values copied back into the device parameters' local shards (cast to their dtype;
  ``non_blocking`` from pinned memory on the current stream, which orders them before the next
  forward and FSDP2's all-gathers, whose streams wait on it: `cost_model.parts.offload`
  prices it this way, "blocking"). The host copies are rewritten only after the next step's
  gradient copies completed, which the stream orders after this step's copies back;
- a device parameter changed outside the optimizer (a checkpoint loaded into the model, DCP's
  zero-gradient first step) is seen by its version counter and its host copy refreshed from it
  before the next step, so the host never writes stale values back;
- ``state_dict``/``load_state_dict`` speak of the device parameters (as any optimizer over
  them): torch.distributed.checkpoint saves the host states under the model's names, as
  DTensors where the parameters are, and loads them back in place, bit for bit.

Not torchao's ``CPUOffloadOptimizer`` (torchao/optim/cpu_offload.py): it offloads every
parameter above a size, on one CUDA or XPU device (it asserts so), with no share and no
DTensor shards; nor FSDP2's ``CPUOffloadPolicy``, which keeps the parameters and gradients on
the host too (another technique, priced otherwise).

On a CPU worker the device is the host: the copies are CPU-to-CPU, but the code path (separate
host tensors, a separate optimizer, the copies each way) is the one a GPU runs; pinning, the
non-blocking copies and the event are CUDA's only.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["OffloadedOptimizer", "offloaded_params", "offloading_factory"]

OptimizerFactory = Callable[[Iterable[Any]], torch.optim.Optimizer]


def offloaded_params(numels: Sequence[int], share: float) -> tuple[bool, ...]:
    """Which parameters (their local element counts, in the optimizer's order) go to the host
    under ``share``: each, in order, while those already offloaded hold fewer than ``share`` x
    the total elements (Megatron-Core's rule: whole parameters, the last may overshoot)."""
    threshold = share * sum(numels)
    moved = 0
    chosen = []
    for numel in numels:
        take = share > 0.0 and moved < threshold
        moved += numel if take else 0
        chosen.append(take)
    return tuple(chosen)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(kw_only=True, slots=True, eq=False)
class _HostCopy:
    """One offloaded parameter: the device parameter, its master copy and gradient buffer in
    host memory (DTensors over host local shards where the parameter is a DTensor)."""

    device_param: torch.Tensor
    master: torch.Tensor
    grad: torch.Tensor
    version: int  # the device local shard's version counter after our last write (-1: stale)


def _on_host(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a host tensor) as ``like`` is: a DTensor of the same spec (mesh, placements,
    global shape, stride and dtype) over ``local`` where ``like`` is one.

    Built as FSDP2 builds its CPU-offloaded shards (``_from_local_no_grad``, torch/distributed/
    fsdp/_fully_shard/_fsdp_common.py), not with ``DTensor.from_local``, which moves a local
    tensor to the mesh's device type (torch/distributed/tensor/_api.py): on a CUDA mesh the
    host copy would land back on the GPU."""
    if not isinstance(like, DTensor):
        return local
    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[no-untyped-call]


@torch.no_grad()
def _host_copy(param: torch.Tensor, pin: bool) -> _HostCopy:
    local = _local(param.detach())
    master = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
    master.copy_(local)
    grad = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
    return _HostCopy(
        device_param=param,
        master=_on_host(param, master),
        grad=_on_host(param, grad),
        version=local._version,
    )


def _groups_of(params: Iterable[Any]) -> list[dict[str, Any]]:
    """``params`` (tensors or param-group dicts, as torch optimizers take) as group dicts."""
    items = list(params)
    if items and isinstance(items[0], dict):
        return [{**group, "params": list(group["params"])} for group in items]
    return [{"params": items}]


class OffloadedOptimizer(torch.optim.Optimizer):
    """The user's optimizer over ``params``, ``share`` of it stepped on the host (module doc).

    Its ``param_groups`` are the groups it was given (the device parameters, in their order);
    each group's device part and host part are groups of the device and host optimizers, which
    take the group's hyperparameters (``lr`` from a scheduler) before every step. ``state``
    maps each device parameter to its state in whichever optimizer holds it.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        factory: OptimizerFactory,
        share: float,
        device: torch.device,
    ) -> None:
        self._built = False
        groups = _groups_of(params)
        flat = [p for group in groups for p in group["params"]]
        chosen = offloaded_params([_local(p).numel() for p in flat], share)
        on_host = {id(p) for p, take in zip(flat, chosen, strict=True) if take}
        self._cuda = device.type == "cuda"
        self._copies: dict[int, _HostCopy] = {
            id(p): _host_copy(p, pin=self._cuda) for p in flat if id(p) in on_host
        }
        self._by_master = {id(c.master): c for c in self._copies.values()}
        if not flat:
            raise ValueError("optimizer got an empty parameter list")
        # one group of parameters only, no hyperparameters: the factory gets tensors
        plain = len(groups) == 1 and len(groups[0]) == 1
        device_parts = [[p for p in g["params"] if id(p) not in on_host] for g in groups]
        host_parts = [
            [self._copies[id(p)].master for p in g["params"] if id(p) in on_host] for g in groups
        ]
        on_device = _sub_optimizer(factory, groups, device_parts, plain)
        on_host_part = _sub_optimizer(factory, groups, host_parts, plain)
        self._parts = [part for part in (on_device, on_host_part) if part is not None]
        self._device_optimizer = on_device.optimizer if on_device is not None else None
        self._host_optimizer = on_host_part.optimizer if on_host_part is not None else None
        first = self._parts[0].optimizer
        super().__init__(groups, dict(first.defaults))
        self._built = True
        self._collect_state()

    @property
    def offloaded(self) -> tuple[torch.Tensor, ...]:
        """The device parameters whose step runs on the host, in the optimizer's order."""
        return tuple(copy.device_param for copy in self._copies.values())

    @property
    def host_optimizer(self) -> torch.optim.Optimizer | None:
        """The user's optimizer over the host copies (None: nothing offloaded)."""
        return self._host_optimizer

    @property
    def device_optimizer(self) -> torch.optim.Optimizer | None:
        """The user's optimizer over the device's share (None: everything offloaded)."""
        return self._device_optimizer

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._built:
            raise NotImplementedError(
                "OffloadedOptimizer splits its parameters between device and host when built; "
                "give every parameter to the optimizer factory"
            )
        super().add_param_group(param_group)

    def _device_param(self, param: torch.Tensor) -> torch.Tensor:
        copy = self._by_master.get(id(param))
        return param if copy is None else copy.device_param

    def _collect_state(self) -> None:
        """``state``: each device parameter's state, in the optimizer that holds it."""
        state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for part in self._parts:
            for param, entry in part.optimizer.state.items():
                state[self._device_param(param)] = entry
        self.state = state

    def _sync_hyperparameters(self) -> None:
        """Each group's hyperparameters (a scheduler's ``lr``) into its parts' groups."""
        for part in self._parts:
            for group, index in zip(part.optimizer.param_groups, part.origins, strict=True):
                for key, value in self.param_groups[index].items():
                    if key != "params":
                        group[key] = value

    @torch.no_grad()
    def _refresh_stale(self) -> None:
        """Host copies of device parameters changed outside this optimizer, read again."""
        for copy in self._copies.values():
            local = _local(copy.device_param)
            if local._version != copy.version:
                _local(copy.master).copy_(local)
                copy.version = local._version

    @torch.no_grad()
    def _grads_to_host(self) -> torch.cuda.Event | None:
        """Each offloaded gradient into its host buffer; the event after the copies (CUDA)."""
        for copy in self._copies.values():
            grad = copy.device_param.grad
            if grad is None:
                copy.master.grad = None
                continue
            _local(copy.grad).copy_(_local(grad), non_blocking=self._cuda)
            copy.master.grad = copy.grad
        if not self._cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    @torch.no_grad()
    def _params_to_device(self) -> None:
        """The updated host copies back into the device parameters' local shards."""
        for copy in self._copies.values():
            local = _local(copy.device_param)
            local.copy_(_local(copy.master), non_blocking=self._cuda)
            copy.version = local._version

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self._refresh_stale()
        copied = self._grads_to_host()
        if self._device_optimizer is not None:
            self._device_optimizer.step()  # on CUDA: runs while the host steps
        if copied is not None:
            copied.synchronize()  # the gradient copies, not the device's step
        if self._host_optimizer is not None:
            self._host_optimizer.step()
        self._params_to_device()
        self._collect_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for copy in self._copies.values():
            copy.master.grad = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` (this optimizer's `state_dict` format: states by position in
        ``param_groups``) into the device and host optimizers; the host copies are read again
        from the device parameters before the next step."""
        saved_groups = state_dict["param_groups"]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        own_sizes = [len(g["params"]) for g in self.param_groups]
        if saved_sizes != own_sizes:
            raise ValueError(
                f"loaded state dict's parameter groups hold {saved_sizes} parameters; this "
                f"optimizer's {own_sizes}: load a state dict of the same optimizer"
            )
        # each device parameter's saved key, by position
        saved_key = {
            id(param): key
            for saved, own in zip(saved_groups, self.param_groups, strict=True)
            for key, param in zip(saved["params"], own["params"], strict=True)
        }
        for part in self._parts:
            part.optimizer.load_state_dict(
                part.state_dict_from(state_dict["state"], saved_groups, saved_key, self)
            )
        for saved, own in zip(saved_groups, self.param_groups, strict=True):
            own.update({k: v for k, v in saved.items() if k != "params"})
        for copy in self._copies.values():
            copy.version = -1  # the model may have been loaded too: read it again
        self._collect_state()


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Part:
    """A sub-optimizer (the device's or the host's) and, for each of its groups, the index of
    the `OffloadedOptimizer` group it came from."""

    optimizer: torch.optim.Optimizer
    origins: tuple[int, ...]

    def state_dict_from(
        self,
        saved_state: dict[Any, Any],
        saved_groups: list[dict[str, Any]],
        saved_key: dict[int, Any],
        owner: OffloadedOptimizer,
    ) -> dict[str, Any]:
        """This sub-optimizer's state dict (states by its own positions) from the owner's."""
        groups: list[dict[str, Any]] = []
        state: dict[int, Any] = {}
        counter = itertools.count()
        for group, index in zip(self.optimizer.param_groups, self.origins, strict=True):
            ids = []
            for param in group["params"]:
                position = next(counter)
                ids.append(position)
                key = saved_key[id(owner._device_param(param))]
                if key in saved_state:
                    state[position] = saved_state[key]
            hyper = {k: v for k, v in saved_groups[index].items() if k != "params"}
            groups.append({**hyper, "params": ids})
        return {"state": state, "param_groups": groups}


def _sub_optimizer(
    factory: OptimizerFactory,
    groups: list[dict[str, Any]],
    parts: list[list[torch.Tensor]],
    plain: bool,
) -> _Part | None:
    """The user's optimizer over ``parts`` (each group's share), or None if they are empty:
    given the tensors alone where the groups were (one group), else group dicts with each
    group's hyperparameters."""
    origins = tuple(i for i, part in enumerate(parts) if part)
    if not origins:
        return None
    if plain:
        assert len(groups) == 1
        return _Part(optimizer=factory(parts[0]), origins=origins)
    sub_groups = [
        {**{k: v for k, v in groups[i].items() if k != "params"}, "params": parts[i]}
        for i in origins
    ]
    return _Part(optimizer=factory(sub_groups), origins=origins)


def offloading_factory(
    factory: OptimizerFactory, share: float, device: torch.device
) -> OptimizerFactory:
    """``factory`` with ``share`` of each optimizer's step on the host (`OffloadedOptimizer`);
    ``factory`` itself where nothing is offloaded."""
    if share <= 0.0:
        return factory
    return functools.partial(_offloaded, factory=factory, share=share, device=device)


def _offloaded(
    params: Iterable[nn.Parameter],
    *,
    factory: OptimizerFactory,
    share: float,
    device: torch.device,
) -> torch.optim.Optimizer:
    return OffloadedOptimizer(params, factory=factory, share=share, device=device)
