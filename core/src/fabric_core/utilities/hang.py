"""Deprecated: moved to :mod:`fabric_core.runtime.hang` (the shim's removal: see :mod:`fabric_core.utilities.deprecation`)."""

from fabric_core.utilities.deprecation import moved_module

__getattr__, __dir__, __all__ = moved_module(__name__, "fabric_core.runtime.hang")
