"""A copy of a checkpoint's state taken in the foreground, so an asynchronous save can write it while training goes on.

After ``fabric.save(path, state, async_save=True)`` returns, training may change the model, the optimizer and every
other object in ``state``: the background writes this snapshot, not the live objects.

Cost: the snapshot holds a CPU copy of every tensor in the state (1x the state's tensor bytes; containers and plain
values are copied too, they are small). Allocating that memory is the slow part of a copy (page faults), so the
buffers are kept and reused by the next snapshot of the same shapes once the save that used them has finished: from
the second asynchronous save on, taking the snapshot is a memory copy (measured in docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def _tensors(obj: Any, out: dict[int, Tensor]) -> None:
    """The distinct tensors of ``obj`` in traversal order (a tensor that appears twice, e.g. tied weights, once)."""
    if isinstance(obj, Tensor):
        out.setdefault(id(obj), obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, out)


def _rebuild(obj: Any, take: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return take(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping type (OrderedDict, ...) and its attributes
        for key, value in obj.items():
            out[key] = _rebuild(value, take)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_rebuild(v, take) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, take) for v in obj)
    if isinstance(obj, (int, float, str, bytes, bool, type(None))):
        return obj
    return copy.deepcopy(obj)


class SnapshotBuffers:
    """CPU buffers for snapshots, reused across saves while the tensors keep their shapes and dtypes."""

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        self._in_use = threading.Event()

    def __reduce__(self) -> tuple[Any, tuple]:
        return SnapshotBuffers, ()  # a strategy sent to spawned processes starts with no buffers there

    def take(self, state: Any) -> tuple[Any, Callable[[], None]]:
        """``(snapshot of state, release)``; call ``release()`` once the snapshot has been written."""
        found: dict[int, Tensor] = {}
        _tensors(state, found)
        tensors = list(found.values())
        reuse = (
            not self._in_use.is_set()
            and len(self._buffers) == len(tensors)
            and all(b.shape == t.shape and b.dtype == t.dtype for b, t in zip(self._buffers, tensors))
        )
        if reuse:
            buffers = self._buffers
        else:
            buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in tensors]
        keep = not self._in_use.is_set()  # a busy set stays with the save that uses it; this one may be kept next
        by_id = {id(t): b for t, b in zip(tensors, buffers)}
        copied: set[int] = set()

        def take_tensor(tensor: Tensor) -> Tensor:
            buffer = by_id[id(tensor)]
            if id(tensor) not in copied:  # shared tensors stay shared in the snapshot (and in the file)
                with torch.no_grad():
                    buffer.copy_(tensor.detach())
                copied.add(id(tensor))
            return buffer

        snapshot = _rebuild(state, take_tensor)
        if keep:
            self._buffers = buffers
            self._in_use.set()

        def release() -> None:
            if keep:
                self._in_use.clear()

        return snapshot, release
