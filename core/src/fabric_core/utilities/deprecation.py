"""Modules that moved: the old import path keeps working for a deprecation period, with one warning.

A module that moved leaves a shim at its old path, so third-party plugins and scripts written against it keep
working (``from fabric_core.hookspecs import hookimpl``)::

    __getattr__, __dir__, __all__ = moved_module(__name__, "fabric_core.plugins.hookspecs")

The shim hands out the new module's objects themselves (``old.hookimpl is new.hookimpl``), so markers, classes and
``isinstance`` checks behave as with the new path. Importing it warns once (a module runs once per process) with a
:class:`FabricDeprecationWarning` that names the new path and the release that removes the old one. The shims and
their removal plan are listed in ``docs/decisions.md``.
"""

from __future__ import annotations

import importlib
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

#: The release that removes the shims of modules moved during 0.1 (see docs/decisions.md).
REMOVAL_RELEASE = "0.3"


class FabricDeprecationWarning(DeprecationWarning):
    """A deprecated import path or call of fabric-core or one of its plugins; it says what to use instead."""


def moved_module(
    old: str, new: str, elsewhere: Mapping[str, tuple[str, str]] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for the shim module ``old`` of the module now at ``new``.

    ``elsewhere`` maps names the old module had that now live in another module (or under another name) to
    ``(module, name)``. Called at the shim's top level, it warns once, attributed to the code that imported the shim.
    """
    target = importlib.import_module(new)
    moved = dict(elsewhere or {})
    warnings.warn(
        f"`{old}` moved to `{new}`: import from `{new}` instead. The old path keeps working until fabric-core"
        f" {REMOVAL_RELEASE}, which removes it.",
        FabricDeprecationWarning,
        stacklevel=3,  # moved_module, the shim's top level, then whoever imported the shim (import machinery skipped)
    )
    public = getattr(target, "__all__", None) or [
        name
        for name, value in vars(target).items()
        if not name.startswith("_") and name != "annotations" and not isinstance(value, types.ModuleType)
    ]
    names = sorted({*public, *moved})

    def __getattr__(name: str) -> Any:
        if name in moved:
            module, attribute = moved[name]
            return getattr(importlib.import_module(module), attribute)
        try:
            return getattr(target, name)
        except AttributeError:
            raise AttributeError(f"module {old!r} (moved to {new!r}) has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__, names
