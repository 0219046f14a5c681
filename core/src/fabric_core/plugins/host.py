"""The process-wide registry: built from the installed plugins on first use, shared by every ``Fabric`` of a process.

This module sits on top of the plugin host (it is the only one that imports :mod:`~fabric_core.plugins.discovery`),
so the modules below it never reach up to it: the registry's data types, the decisions and discovery each work on
a :class:`~fabric_core.plugins.registry.Registry` they are given.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from fabric_core.plugins.discovery import build_registry
from fabric_core.utilities.lazy import collection_paused

if TYPE_CHECKING:
    from fabric_core.plugins.registry import Registry

__all__ = ["build_registry", "get_registry", "reset_registry", "set_registry"]

_lock = threading.RLock()
_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                with collection_paused():
                    _registry = build_registry()
    return _registry


def set_registry(registry: Registry | None) -> Registry | None:
    """Make ``registry`` the process-wide one (``None``: rebuild on next use); returns the previous one.

    For a program or a test that registers plugin objects of its own without installing a distribution:
    ``set_registry(build_registry(extra_plugins=(MyPlugin(),)))``. Every process of a job must do the same
    (a launcher that re-runs the script does, since the script runs again).
    """
    global _registry
    with _lock:
        previous, _registry = _registry, registry
    return previous


def reset_registry() -> None:
    """Forget the process-wide registry (tests, or after installing a plugin in a running process)."""
    set_registry(None)
