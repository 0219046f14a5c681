"""Collectives on picklable Python objects that need nothing beyond torch (no numpy).

torch's own ``broadcast_object_list`` / ``all_gather_object`` turn the received bytes back into an object
through ``tensor.numpy()``, and torch does not depend on numpy: in an environment holding only torch and our
distributions they fail with "Numpy is not available". Here the bytes travel in a ``uint8`` tensor that *is* a
view of a ``bytearray`` (``torch.frombuffer``), so pickling in and out needs no third package and no extra copy
on the CPU. Like torch's versions they use two collectives: the payload sizes, then the payloads.

Every rank of ``group`` must call these together, as with any collective. ``device`` is where the tensors
travel: the backend's device (a CUDA device for NCCL, the CPU for gloo).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _to_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    payload = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))  # never empty
    return torch.frombuffer(payload, dtype=torch.uint8).to(device)


def _from_tensor(tensor: torch.Tensor, size: int) -> Any:
    buffer = bytearray(size)
    torch.frombuffer(buffer, dtype=torch.uint8).copy_(tensor[:size])
    return pickle.loads(buffer)


def broadcast_object(obj: Any, src: int = 0, group: Any = None, device: torch.device | None = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank of ``group`` (``src`` is a global rank, as in ``torch.distributed``)."""
    dist = _dist()
    device = device if device is not None else torch.device("cpu")
    is_src = dist.get_rank() == src
    payload = _to_tensor(obj, device) if is_src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.long, device=device)
    dist.broadcast(size, src=src, group=group)
    if payload is not None:
        dist.broadcast(payload, src=src, group=group)
        return obj
    length = int(size.item())
    received = torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(received, src=src, group=group)
    return _from_tensor(received.cpu(), length)


def all_gather_object(obj: Any, group: Any = None, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order within ``group``, on every rank."""
    dist = _dist()
    device = device if device is not None else torch.device("cpu")
    world = dist.get_world_size(group)
    payload = _to_tensor(obj, device)
    size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(received, padded, group=group)
    return [_from_tensor(tensor.cpu(), length) for tensor, length in zip(received, lengths)]
