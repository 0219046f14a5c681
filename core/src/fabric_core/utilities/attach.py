"""Hand the Fabric to a model that asks for it (a Lightning ``LightningModule``), as the reference does.

A module with a ``_fabric`` attribute gets the Fabric (and, from :meth:`Fabric.setup`, its set-up optimizers) and
joins the callbacks: inside it, ``self.log(...)`` reaches the Fabric's loggers, ``self.fabric``,
``self.optimizers()`` and ``self.manual_backward(loss)`` work, and ``fabric.call("on_...")`` reaches its hooks. A
user who keeps their LightningModule when moving from the Trainer to Fabric keeps its logging and hooks. The core
never imports ``lightning``: the attribute is the whole contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Module

__all__ = ["callback_complaint", "hand_fabric_to"]


def hand_fabric_to(module: Module, fabric: Any, callbacks: list[Any], optimizers: Sequence[Any] | None = None) -> None:
    """Set ``module._fabric`` (and ``_fabric_optimizers`` when ``optimizers`` is given) if the module has a
    ``_fabric`` attribute, and append it to ``callbacks`` once."""
    if "_fabric" not in vars(module) and not hasattr(type(module), "_fabric"):
        return  # looked up without Module.__getattr__'s search of parameters and submodules
    module._fabric = fabric
    if optimizers is not None:
        module._fabric_optimizers = list(optimizers)
    if not any(callback is module for callback in callbacks):
        callbacks.append(module)


def callback_complaint(callback: Any) -> str | None:
    """Why ``callback`` cannot be a callback, or ``None``. Callbacks are objects whose methods ``fabric.call`` runs by
    name; a string (``callbacks="EarlyStopping"``) has none of them, so ``fabric.call`` would silently do nothing."""
    if isinstance(callback, (str, bytes)):
        return (
            "callbacks are objects whose methods `fabric.call(name)` runs, not names. Pass an instance, e.g."
            f" `callbacks=[{callback!s}(...)]` (any object with the hook methods you call)."
        )
    return None
