"""Registration hooks of fabric-ft: names only, as import strings, so discovering them imports neither torch nor
torchft.

The ``fabric.plugins`` entry point of this distribution points here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar

_STRATEGY = "fabric_ft.strategy:FTDDPStrategy"


@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    registrar.add(
        "ft_ddp",
        _STRATEGY,
        description="fault-tolerant data parallel over replica groups (torchft): training goes on when a group dies",
    )


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_ft": "library", "torchft": "library"}


@hookimpl
def fabric_report_packages() -> list[str]:
    """What ``fabric env`` reports for this plugin (its dependency), installed or not."""
    return ["torchft"]
