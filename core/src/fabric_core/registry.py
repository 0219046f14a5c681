"""Deprecated: moved to :mod:`fabric_core.plugins.registry` (the shim's removal: see :mod:`fabric_core.utilities.deprecation`)."""

from fabric_core.utilities.deprecation import moved_module

__getattr__, __dir__, __all__ = moved_module(
    __name__,
    "fabric_core.plugins.registry",
    {
        "KINDS": ("fabric_core.plugins.kinds", "KINDS"),
        "build_registry": ("fabric_core.plugins.host", "build_registry"),
        "get_registry": ("fabric_core.plugins.host", "get_registry"),
        "reset_registry": ("fabric_core.plugins.host", "reset_registry"),
    },
)
