"""Typing protocols user code annotates with, as the reference's ``lightning.fabric.utilities.types`` offers them.

Structural types: any object with the members matches, nothing needs to subclass them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol, runtime_checkable

from torch import Tensor
from torch.distributed import ReduceOp

__all__ = ["CollectibleGroup", "Optimizable", "ReduceOp", "Steppable"]


@runtime_checkable
class Steppable(Protocol):
    """Anything with ``step(closure=None)``: an optimizer, a DeepSpeed engine."""

    def step(self, closure: Any = ...) -> Any: ...


@runtime_checkable
class Optimizable(Steppable, Protocol):
    """An optimizer by its members (``torch.optim.Optimizer`` and Fabric's wrapped optimizers match)."""

    param_groups: list[dict[Any, Any]]
    defaults: dict[Any, Any]
    state: defaultdict[Tensor, Any]

    def state_dict(self) -> dict[str, dict[Any, Any]]: ...

    def load_state_dict(self, state_dict: dict[str, dict[Any, Any]]) -> None: ...


class CollectibleGroup(Protocol):
    """A process group as the collectives see it (``torch.distributed.ProcessGroup`` matches)."""

    def size(self) -> int: ...

    def rank(self) -> int: ...
