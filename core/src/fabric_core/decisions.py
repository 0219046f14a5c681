"""Deprecated: moved to :mod:`fabric_core.plugins.decisions` (this shim is removed in fabric-core 0.3; see docs/decisions.md)."""

from fabric_core.utilities.deprecation import moved_module

__getattr__, __dir__, __all__ = moved_module(__name__, "fabric_core.plugins.decisions")
