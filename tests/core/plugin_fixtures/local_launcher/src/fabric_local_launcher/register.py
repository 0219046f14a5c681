"""Registers the ``local_procs`` launcher (an import string: nothing is imported until it is used)."""

from __future__ import annotations

from fabric_core.plugins import hookimpl


@hookimpl
def fabric_register_launchers(registrar) -> None:
    registrar.add(
        "local_procs",
        "fabric_local_launcher.launcher:LocalProcessesLauncher",
        description="every process of a `fabric run` job as a child of this machine's command",
    )
