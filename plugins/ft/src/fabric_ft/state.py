"""What a rejoining replica group receives from a live peer: every module and optimizer given to ``fabric.setup``, as
this process's own part of them.

Inside a replica group the strategy may shard the model (FSDP2: every parameter a ``DTensor`` over the group's
mesh). Process ``r`` of a restarted group copies from process ``r`` of a live group, which holds the same shard (both
groups shard the same model the same way), so what travels is the *local* tensor of every ``DTensor``: no
``DeviceMesh`` is pickled, and nothing is gathered. On arrival each local tensor is copied into this process's
parameter in place (a module) or wrapped back into a ``DTensor`` laid out like the parameter (an optimizer's state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

__all__ = ["module_state", "optimizer_state"]


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _local(value: Any) -> Any:
    """A tensor's own part: the local shard of a ``DTensor``, the tensor itself otherwise."""
    return value.to_local() if _is_dtensor(value) else value


def module_state(module: Module) -> tuple[Callable[[dict[str, Any]], None], Callable[[], dict[str, Any]]]:
    """``(load, save)`` for ``module``: ``save`` gives every parameter and buffer's local tensor, ``load`` copies a
    peer's into them in place (the optimizer keeps pointing at the same parameters)."""

    def save() -> dict[str, Any]:
        return {name: _local(value) for name, value in module.state_dict().items()}

    def load(received: dict[str, Any]) -> None:
        mine = module.state_dict()
        missing = sorted(set(mine) - set(received))
        if missing:
            raise RuntimeError(
                f"The live replica group sent a model without {missing[:5]}: every replica group must set up the same"
                " model in the same order."
            )
        with torch.no_grad():
            for name, value in mine.items():
                target = _local(value)
                source = received[name]
                if tuple(target.shape) != tuple(source.shape):
                    raise RuntimeError(
                        f"The live replica group's `{name}` has shape {tuple(source.shape)} here, this process holds"
                        f" {tuple(target.shape)}: every replica group must shard the model the same way (the same"
                        " number of processes per group and the same strategy)."
                    )
                target.copy_(source)

    return load, save


def _parameters(optimizer: Optimizer) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state(optimizer: Optimizer) -> tuple[Callable[[dict[str, Any]], None], Callable[[], dict[str, Any]]]:
    """``(load, save)`` for ``optimizer``: its ``state_dict()`` with local tensors, and loading one back with every
    state tensor of a ``DTensor`` parameter laid out like that parameter again."""

    def save() -> dict[str, Any]:
        state = optimizer.state_dict()
        return {
            "state": {key: {k: _local(v) for k, v in entry.items()} for key, entry in state["state"].items()},
            "param_groups": state["param_groups"],
        }

    def load(received: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        parameters = _parameters(optimizer)
        state: dict[Any, Any] = {}
        for key, entry in received["state"].items():
            parameter = parameters[int(key)]
            if not _is_dtensor(parameter):
                state[key] = entry
                continue
            local_shape = tuple(parameter.to_local().shape)
            state[key] = {
                name: DTensor.from_local(
                    value, parameter.device_mesh, parameter.placements, shape=parameter.shape, stride=parameter.stride()
                )
                if torch.is_tensor(value) and tuple(value.shape) == local_shape and value.dim() > 0
                else value
                for name, value in entry.items()
            }
        optimizer.load_state_dict({"state": state, "param_groups": received["param_groups"]})

    return load, save
