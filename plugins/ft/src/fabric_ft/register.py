"""Registration hooks of fabric-ft: names only, as import strings, so discovering them imports neither torch nor
torchft.

The ``fabric.plugins`` entry point of this distribution points here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar

_ONE_PROCESS = "fabric_ft.strategy:FTDDPStrategy"
_COMPOSED = "fabric_ft.strategy:FaultTolerant"


@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    registrar.add(
        "ft_ddp",
        _ONE_PROCESS,
        description="fault-tolerant data parallel over replica groups of one process (torchft): training goes on when a"
        " group dies",
    )
    registrar.add(
        "ft_fsdp",
        _COMPOSED,
        description="HSDP with fault-tolerant replicas: FSDP2 inside each replica group, torchft across groups",
        strategy="fsdp",
    )


@hookimpl
def fabric_register_launchers(registrar: Registrar) -> None:
    registrar.add(
        "ft",
        "fabric_ft.launcher:ReplicaGroupsLauncher",
        description="a lighthouse and N replica groups on this machine, a group restarted when it loses a process"
        " (fabric run --launcher ft --ft-groups N)",
    )


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_ft": "library", "torchft": "library"}


@hookimpl
def fabric_report_packages() -> list[str]:
    """What ``fabric env`` reports for this plugin (its dependency), installed or not."""
    return ["torchft"]


@hookimpl
def fabric_report_services() -> dict[str, str]:
    """For ``fabric env``: the lighthouse of ``$TORCHFT_LIGHTHOUSE``, whether it answers, and its current quorum."""
    from fabric_ft.probe import lighthouse_state

    return {"torchft lighthouse": lighthouse_state()}
