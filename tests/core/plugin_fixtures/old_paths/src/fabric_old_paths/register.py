"""Written against the old paths (``fabric_core.hookspecs``, ``fabric_core.registry``, before they moved into
``fabric_core.plugins``): it must keep registering and deciding, with a deprecation warning naming the new paths."""

from fabric_core.hookspecs import hookimpl
from fabric_core.registry import Registrar, Registry

ASKED: list[str] = []  # the precisions this plugin's decision hook was asked about

@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    registrar.add("old_paths_single", "fabric_old_paths.strategy:OldPathsStrategy")


@hookimpl
def fabric_select_precision(registry: Registry, precision: str):
    ASKED.append(precision)
    return None  # declines: the core's default decides
