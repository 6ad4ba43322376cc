"""Peak bytes of live tensor storages in one process: the measurement behind the memory
benches and tests (issue 16).

`LiveBytes` is a dispatch mode that counts every storage an op returns, once, until the
storage is freed (a weak reference's callback), plus the tensors registered up front with
`track` (weights, gradients, optimizer state that exist before the measured step). Like torch's
own `torch.distributed._tools.mem_tracker.MemTracker` it also follows
``UntypedStorage.resize_``, which no dispatch mode sees and which FSDP2 uses to free and
re-allocate unsharded parameters. It counts what MemTracker counts (a test checks the two agree
to the byte on one step, and on an FSDP2 step), without MemTracker's per-module bookkeeping,
which refuses a module that runs forward more than once per step: every pipeline schedule with
several micro-batches does.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """``current`` and ``peak`` bytes of live storages (meta tensors excluded)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._sizes: dict[int, int] = {}
        self._resize: Any = None
        self.current = 0
        self.peak = 0

    @classmethod
    def after_warm_step(cls, trainer: Any) -> LiveBytes:
        """A count that starts with what a trained `DistributedModel` keeps between steps: its
        parameters, their gradients and its optimizers' state."""
        live = cls()
        for _, param in trainer.named_parameters():
            live.track(param)
            live.track(param.grad)
        for optimizer in trainer.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    live.track(value)
        return live

    def track(self, tensor: object) -> None:
        """Count ``tensor``'s storages (once each) until they are freed; a tensor subclass
        (DTensor, FSDP2's parameters) counts the plain tensors inside it."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        for storage in get_untyped_storages(tensor):
            self._track_storage(storage)

    def _track_storage(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._refs:
            return

        def freed(_: object, key: int = key) -> None:
            if self._refs.pop(key, None) is not None:
                self.current -= self._sizes.pop(key)

        self._refs[key] = weakref.ref(storage, freed)
        self._sizes[key] = storage.nbytes()
        self._add(self._sizes[key])

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __enter__(self) -> LiveBytes:
        original = torch.UntypedStorage.resize_
        self._resize = original

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            if storage.device.type != "meta":
                key = id(storage)
                if key in self._refs:
                    old, self._sizes[key] = self._sizes[key], storage.nbytes()
                    self._add(self._sizes[key] - old)
                else:
                    self._track_storage(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self.track(tensor)
        return out
