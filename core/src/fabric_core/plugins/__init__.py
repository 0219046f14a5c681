"""The plugin host: how Fabric finds, names and asks its plugins.

Modules, each importing only those listed above it (imports flow one way, top to bottom)::

    kinds       the kinds of registered objects (accelerator, strategy, ...) and their registration hooks
    hookspecs   every hook a plugin can implement, with its contract; ``hookimpl`` marks an implementation
    registry    the data: names per kind, who provides them, hints about missing distributions, failures
    decisions   asks the decision hooks of one registry: precedence, failure isolation, tracing
    builtin     the core's own plugin: built-in names, first-party reservations, default decisions
    entry_points  the ``fabric.plugins`` entry points of installed distributions, in load order (metadata only)
    discovery   builds a registry: the core's plugin, entry points in load order, switches, validation
    host        the process-wide registry (``get_registry``) every ``Fabric`` of a process uses

What a plugin author imports lives here, imported on first access so ``import fabric_core.plugins`` costs
nothing: ``hookimpl`` for the hook implementations, ``Registrar`` (what a registration hook receives) and
``Registry`` (what a decision hook receives) for type hints, ``get_registry``/``set_registry``/``reset_registry``/
``build_registry`` for programs and tests that install plugin objects themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric_core.plugins.hookspecs import hookimpl
    from fabric_core.plugins.host import build_registry, get_registry, reset_registry, set_registry
    from fabric_core.plugins.kinds import KINDS
    from fabric_core.plugins.registry import FabricPluginWarning, PluginImportError, Registrar, Registry

__all__ = [
    "KINDS",
    "FabricPluginWarning",
    "PluginImportError",
    "Registrar",
    "Registry",
    "build_registry",
    "get_registry",
    "hookimpl",
    "reset_registry",
    "set_registry",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "KINDS": "fabric_core.plugins.kinds",
        "hookimpl": "fabric_core.plugins.hookspecs",
        "FabricPluginWarning": "fabric_core.plugins.registry",
        "PluginImportError": "fabric_core.plugins.registry",
        "Registrar": "fabric_core.plugins.registry",
        "Registry": "fabric_core.plugins.registry",
        "build_registry": "fabric_core.plugins.host",
        "get_registry": "fabric_core.plugins.host",
        "reset_registry": "fabric_core.plugins.host",
        "set_registry": "fabric_core.plugins.host",
    },
)
