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

    Gradients may be DTensors (sharded parameters), plain tensors, or both: the norm of each kind is computed
    apart and combined, so a model with some unsharded parameters is clipped by the norm of all of them.
    """
    params = [p for p in params if p.grad is not None]
    sharded = [p for p in params if is_dtensor(p.grad)]
    if not sharded or len(sharded) == len(params):
        total = torch.nn.utils.clip_grad_norm_(
            params, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
        return to_full_tensor(total)
    plain = [p for p in params if not is_dtensor(p.grad)]
    norms = [
        to_full_tensor(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type))
        for group in (sharded, plain)
        if group
    ]
    if not norms:
        return torch.tensor(0.0)
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
