"""DTensors (``torch.distributed.tensor``) where the core meets them: parameters a strategy sharded, a gradient norm
computed over shards, state to write whole.

Nothing here imports ``torch.distributed.tensor`` unless it is already imported: no tensor can be a DTensor
before that, so the checks cost nothing for strategies that never shard.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

_MODULE = "torch.distributed.tensor"


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(value, module.DTensor)


def has_dtensor_parameters(module: Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (a strategy sharded it over processes)."""
    return _MODULE in sys.modules and any(is_dtensor(p) for p in module.parameters())


def to_full_tensor(value: Any) -> Any:
    """A DTensor as the whole tensor it represents (every rank of its mesh must call this); anything else as is."""
    return value.full_tensor() if is_dtensor(value) else value


def clip_grad_norm(params: Iterable[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool) -> Tensor:
    """Clip the gradients of ``params`` by their total norm, over every shard on every rank; returns that norm as a
    plain tensor.

    Gradients may be plain tensors, DTensors, or DTensors on different meshes (tensor parallel over one mesh,
    FSDP over another): the norm of each group is computed apart, made whole, and combined, so a model is clipped by
    the norm of all its gradients. One group is clipped by ``torch.nn.utils.clip_grad_norm_`` itself.
    """
    params = [p for p in params if p.grad is not None]
    groups: dict[int, list[Tensor]] = {}
    for p in params:
        groups.setdefault(id(p.grad.device_mesh) if is_dtensor(p.grad) else 0, []).append(p)  # type: ignore[union-attr]
    if len(groups) <= 1:
        total = torch.nn.utils.clip_grad_norm_(
            params, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
        return to_full_tensor(total)
    norms = [
        to_full_tensor(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type))
        for group in groups.values()
    ]
    stacked = torch.stack([n.float().cpu() for n in norms])
    total = stacked.max() if norm_type == float("inf") else torch.linalg.vector_norm(stacked, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped. To disable"
            " this error and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`."
        )
    coefficient = min(1.0, max_norm / (float(total) + 1e-6))
    with torch.no_grad():
        for p in params:
            p.grad.mul_(coefficient)  # type: ignore[union-attr]
    return total


def full_state(state: Any) -> Any:
    """``state`` (a state dict, possibly nested like an optimizer's) with every DTensor replaced by the whole tensor it
    represents. Collective when there are DTensors: call it on every rank of their mesh."""
    if _MODULE not in sys.modules:
        return state
    if isinstance(state, dict):
        return {key: full_state(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_state(value) for value in state)
    return to_full_tensor(state)


def shard_like(value: Any, like: Any) -> Any:
    """A whole tensor ``value`` laid out as the DTensor ``like`` is (same mesh and placements); this rank keeps its
    part, without communication (every rank holds the whole ``value``). Anything else is returned as it is."""
    if not is_dtensor(like) or not isinstance(value, Tensor) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(
            f"A checkpoint tensor of shape {tuple(value.shape)} cannot be loaded into a sharded tensor of shape"
            f" {tuple(like.shape)}."
        )
    return distribute_tensor(value.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def shard_module_state(module: Module, state: dict[str, Any]) -> dict[str, Any]:
    """A full module state dict with the entries whose counterpart in ``module`` is a DTensor laid out like it."""
    if not has_dtensor_parameters(module) and not any(is_dtensor(b) for b in module.buffers()):
        return state
    current = module.state_dict()
    return {key: shard_like(value, current.get(key)) for key, value in state.items()}


def shard_optimizer_state(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict (``optimizer.state_dict()`` layout) with each parameter's state tensors of the
    parameter's shape laid out like that parameter, when it is a DTensor."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(is_dtensor(p) for p in params) or "state" not in state:
        return state
    # state_dict() numbers the parameters in param_groups order; a loaded dict keeps the numbers it was saved with.
    numbers = [n for group in state.get("param_groups", []) for n in group.get("params", [])]
    by_number = dict(zip(numbers, params)) if len(numbers) == len(params) else dict(enumerate(params))
    sharded = {}
    for number, entries in state["state"].items():
        param = by_number.get(number)
        sharded[number] = {
            name: shard_like(value, param) if isinstance(value, Tensor) and tuple(value.shape) == tuple(getattr(param, "shape", ())) else value
            for name, value in entries.items()
        }
    return {**state, "state": sharded}
