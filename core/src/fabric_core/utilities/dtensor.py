"""DTensors (``torch.distributed.tensor``) where the core meets them: parameters a strategy sharded, a gradient norm
computed over shards, state to write whole.

Nothing here imports ``torch.distributed.tensor`` unless it is already imported: no tensor can be a DTensor
before that, so the checks cost nothing for strategies that never shard.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
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


def reshard(module: Module) -> None:
    """Put every FSDP2 module in ``module`` back in its sharded state, so ``module.parameters()`` are the sharded
    parameters that the optimizer steps and the next forward gathers from.

    After a forward, FSDP2 keeps the root module's gathered parameters (and every module's, with
    ``reshard_after_forward=False``) registered in their place until the backward: code that reads or writes the
    parameters between a forward and the next backward (an EMA swapping weights in for an evaluation) would otherwise
    see plain tensors, and a write there would be lost at the next gather (or never gathered at all).
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return  # nothing was sharded by FSDP2 in this process
    for submodule in module.modules():
        if isinstance(submodule, fsdp_module):
            submodule.reshard()


def to_full_tensor(value: Any) -> Any:
    """A DTensor as the whole tensor it represents (every rank of its mesh must call this); anything else as is."""
    return value.full_tensor() if is_dtensor(value) else value


def clip_grad_norm(
    params: Iterable[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool, group: Any = None
) -> Tensor:
    """Clip the gradients of ``params`` by their total norm, over every shard on every rank; returns that norm as a
    plain tensor.

    Gradients may be plain tensors, DTensors, or DTensors on different meshes (tensor parallel over one mesh,
    FSDP over another): the norm of each group is computed apart, made whole, and combined, so a model is clipped by
    the norm of all its gradients. One group is clipped by ``torch.nn.utils.clip_grad_norm_`` itself. ``group``: a
    process group whose ranks hold *other* parameters of the same model (pipeline stages); their norms are combined
    too, so every stage clips by the whole model's norm (call it on every rank of ``group``).
    """
    params = [p for p in params if p.grad is not None]
    groups: dict[int, list[Tensor]] = {}
    for p in params:
        groups.setdefault(id(p.grad.device_mesh) if is_dtensor(p.grad) else 0, []).append(p)  # type: ignore[union-attr]
    if len(groups) <= 1 and group is None:
        total = torch.nn.utils.clip_grad_norm_(
            params, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
        return to_full_tensor(total)
    norms = [
        to_full_tensor(torch.nn.utils.get_total_norm([p.grad for p in part], norm_type=norm_type))
        for part in groups.values()
    ]
    device = norms[0].device if norms else torch.device("cpu")
    stacked = torch.stack([n.float().to(device) for n in norms]) if norms else torch.zeros(1, device=device)
    infinite = norm_type == float("inf")
    total = stacked.max() if infinite else torch.linalg.vector_norm(stacked, norm_type)
    if group is not None:
        import torch.distributed as dist

        if infinite:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total**norm_type
            dist.all_reduce(total, group=group)
            total = total ** (1.0 / norm_type)
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


@contextlib.contextmanager
def shard_full_tensors_on_load(root: Module) -> Iterator[None]:
    """While ``root.load_state_dict(full_state)`` runs: the whole tensor under each key of a DTensor parameter or
    buffer becomes a DTensor laid out like it, this rank keeping its part (every rank holds the whole tensor, so no
    communication is needed).

    Done by a last ``load_state_dict`` pre-hook on each module holding DTensors, so hooks its layers registered run
    first: adapter layers (LoRA) rename keys there (``qkv.weight`` -> ``qkv.linear.weight``), and a plain model's
    checkpoint still loads into them.
    """
    if _MODULE not in sys.modules:
        yield
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    def shard_own_entries(module: Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, current in [*module._parameters.items(), *module._buffers.items()]:
            key = prefix + name
            value = state_dict.get(key)
            if (
                isinstance(current, DTensor)
                and isinstance(value, Tensor)
                and not isinstance(value, DTensor)
                and value.shape == current.shape  # else load_state_dict reports the size mismatch itself
            ):
                state_dict[key] = distribute_tensor(value.detach(), current.device_mesh, current.placements, src_data_rank=None)

    handles = [
        module.register_load_state_dict_pre_hook(shard_own_entries)
        for module in root.modules()
        if any(isinstance(t, DTensor) for t in [*module._parameters.values(), *module._buffers.values()])
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
