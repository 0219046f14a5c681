"""fabric-wandb: a Weights & Biases logger for fabric-core (``Fabric(loggers="wandb")``).

Importing this package is cheap (the registration module is imported while plugins are discovered);
:class:`WandbLogger` and ``wandb`` are imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_wandb.logger import WandbLogger

__all__ = ["WandbLogger"]

__getattr__, __dir__ = lazy_exports(__name__, "fabric-wandb", {"WandbLogger": "fabric_wandb.logger"})
