"""Peak bytes of live tensor storages in one process: the measurement behind the memory
benches and tests (issue 16).

`LiveBytes` is a dispatch mode that counts every storage an op returns, once, until the
storage is freed (a weak reference's callback), plus the tensors registered up front with
`track` (weights, gradients, optimizer state that exist before the measured step). It counts
what torch's own `torch.distributed._tools.mem_tracker.MemTracker` counts (a test checks the two
agree to the byte on one step), without MemTracker's per-module bookkeeping, which refuses a
module that runs forward more than once per step: every pipeline schedule with several
micro-batches does.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """``current`` and ``peak`` bytes of live storages (meta tensors excluded)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._live: dict[int, tuple[weakref.ref[Any], int]] = {}
        self.current = 0
        self.peak = 0

    def track(self, tensor: object) -> None:
        """Count ``tensor``'s storage (once) until it is freed."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        size = storage.nbytes()

        def freed(_: object, key: int = key, size: int = size) -> None:
            if self._live.pop(key, None) is not None:
                self.current -= size

        self._live[key] = (weakref.ref(storage, freed), size)
        self.current += size
        self.peak = max(self.peak, self.current)

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
