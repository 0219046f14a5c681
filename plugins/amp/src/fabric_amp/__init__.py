"""fabric-amp: automatic mixed precision (``precision="16-mixed"`` / ``"bf16-mixed"``) for fabric-core.

Importing this package is cheap (the registration module is imported while plugins are discovered);
:class:`MixedPrecision` and ``torch`` are imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_amp.precision import MixedPrecision

__all__ = ["MixedPrecision"]

__getattr__, __dir__ = lazy_exports(__name__, "fabric-amp", {"MixedPrecision": "fabric_amp.precision"})
