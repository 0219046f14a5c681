"""fabric-amp: automatic mixed precision (``precision="16-mixed"`` / ``"bf16-mixed"``) for fabric-core.

Importing this package is cheap (the registration module is imported while plugins are discovered);
:class:`MixedPrecision` and ``torch`` are imported on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_amp.precision import MixedPrecision

__all__ = ["MixedPrecision"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "MixedPrecision":
        value = importlib.import_module("fabric_amp.precision").MixedPrecision
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fabric_amp' has no attribute {name!r}")
