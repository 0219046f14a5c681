"""The one ``__init__`` idiom of every plugin package: public names imported on first access (PEP 562).

A plugin's package ``__init__`` is imported whenever its registration module is, that is by every ``Fabric()``
and every ``fabric plugins``, so it must cost nothing: its classes (and ``torch.distributed`` or heavier
frameworks behind them) are imported only when a user touches them, and ``__version__`` is read from the
installed distribution's metadata only when asked for::

    __getattr__, __dir__ = lazy_exports(__name__, "fabric-mything", {"MyStrategy": "fabric_mything.strategy"})

A package may also name ``submodules`` that are imported when first read as attributes, so that a caller names the
dependency once at the top of its file (``from fabric_core import io`` ... ``io.background.wait_for_save(path)``) and still
pays for the module only in the call that uses it (``Fabric`` does this for checkpoints and loggers).
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any


def lazy_exports(
    package: str, distribution: str, names: Mapping[str, str], submodules: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps a public name to the module that defines it;
    ``submodules`` are the package's modules that reading ``package.<name>`` imports."""
    submodules = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name == "__version__":
            from importlib.metadata import PackageNotFoundError
            from importlib.metadata import distribution as find

            try:
                value: Any = name_and_version(find(distribution))[1]
            except PackageNotFoundError:  # a source tree on sys.path that is not installed
                value = "0+unknown"
        elif name in names:
            with collection_paused():
                value = getattr(importlib.import_module(names[name]), name)
        elif name in submodules:
            with collection_paused():
                value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names, *submodules, "__version__"})

    return __getattr__, __dir__


@contextmanager
def collection_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a burst of long-lived objects is made: modules, their classes
    and functions, the plugin registry. Every 700 allocations the collector scans the young objects, and after
    ``import torch`` it would scan these again and again while they are created (about a tenth of ``from fabric_core
    import Fabric; Fabric()``); they are looked at once when it resumes. Leaves the collector as it was, also when
    the caller (or another thread) had switched it off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_HEADERS: dict[str, tuple[str, str]] = {}


def name_and_version(dist: Any) -> tuple[str, str]:
    """A distribution's ``Name`` and ``Version``, read from the first lines of its metadata file.

    ``importlib.metadata``'s ``dist.name``/``dist.version`` parse the whole file with the ``email`` package, long
    description included: about 1 ms each, and every ``Fabric()`` asks for each installed plugin distribution. The
    header block ends at the first empty line; a file without both fields falls back to ``importlib.metadata``.
    Cached per metadata folder.
    """
    key = str(getattr(dist, "_path", "")) or None
    if key is not None and key in _HEADERS:
        return _HEADERS[key]
    found: dict[str, str] = {}
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    for line in text.splitlines():
        if not line:
            break
        field, _, value = line.partition(": ")
        if field in ("Name", "Version") and field not in found:
            found[field] = value.strip()
    result = (found["Name"], found["Version"]) if len(found) == 2 else (dist.name, dist.version)
    if key is not None:
        _HEADERS[key] = result
    return result
