"""Registration hooks of fabric-wandb: the logger name only, no ``wandb`` import (that happens when it is used)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar


@hookimpl
def fabric_register_loggers(registrar: Registrar) -> None:
    registrar.add("wandb", "fabric_wandb.logger:WandbLogger", description="Weights & Biases runs (rank 0)")


@hookimpl
def fabric_report_packages() -> list[str]:
    """What ``fabric env`` reports for this plugin, installed or not."""
    return ["wandb"]


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_wandb": "library", "wandb": "library"}
