"""Semi-synchronous training across replica groups: torchft's LocalSGD and DiLoCo.

Each group trains on its own for ``sync_every`` steps (the inner optimizer, every step, with no communication
between groups), then the groups of the quorum synchronise: LocalSGD averages the weights, DiLoCo averages the
*pseudo-gradients* (how far each group moved from the last synchronised weights) and steps an outer optimizer with
them. Only the synchronisation asks the lighthouse for a quorum, so a group that dies between two of them costs its
own steps since the last one (at most ``sync_every``), and the others go on at the next synchronisation without it.

torchft implements both as hooks on the inner optimizer's ``step``; this module builds them for the model and
optimizer ``fabric.setup`` received, and decides what a restarted group does (see :func:`join_at_next_sync`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

__all__ = ["METHODS", "build", "default_outer_optimizer", "join_at_next_sync"]

#: The semi-synchronous methods, by the name ``semi_sync=`` takes.
METHODS = ("local_sgd", "diloco")


def default_outer_optimizer(parameters: Any) -> Optimizer:
    """DiLoCo's outer optimizer of the paper (and torchtitan's default): Nesterov SGD, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(parameters, lr=0.7, momentum=0.9, nesterov=True)


def build(
    method: str,
    manager: Any,
    module: Module,
    optimizer: Optimizer,
    sync_every: int,
    outer_optimizer: Callable[[Any], Optimizer] | None,
) -> Any:
    """torchft's ``LocalSGD`` or ``DiLoCo`` over ``module`` and its inner ``optimizer``, entered (its hooks are on the
    optimizer from now on); leave it with ``__exit__``."""
    from torchft.local_sgd import DiLoCo, LocalSGD

    if method == "local_sgd":
        algorithm: Any = LocalSGD(manager, module, optimizer, sync_every=sync_every)
    else:
        parameters = [p for p in module.parameters() if p.requires_grad]
        outer = (outer_optimizer or default_outer_optimizer)(parameters)
        if not isinstance(outer, Optimizer):
            raise TypeError(
                f"`outer_optimizer` must build a `torch.optim.Optimizer` from the parameters, got {type(outer).__name__}."
            )
        algorithm = DiLoCo(manager, [module], optimizer, outer, sync_every=sync_every)
    algorithm.__enter__()
    return algorithm


def join_at_next_sync(algorithm: Any, sync_every: int) -> None:
    """Make the next inner step end with a synchronisation.

    A process starts one step before a synchronisation, whether it starts with the others or restarts alone: all
    groups then synchronise after their first step (and every ``sync_every`` steps from there), and a restarted group
    asks for a quorum at once, which the lighthouse forms at the others' next synchronisation. It heals there (the
    live weights and outer optimizer) and goes on in step with them, instead of training ``sync_every`` steps on
    weights nobody else has before asking.
    """
    algorithm._local_step = sync_every - 1  # torchft 0.2.0: the inner steps since the last synchronisation
