"""fabric-ao: float8 training with torchao (``Float8Precision``, ``precision="float8"``) and the Transformer Engine
names (``precision="transformer-engine"``) for fabric-core.

Importing this package is cheap (the registration module is imported while plugins are discovered);
torchao and transformer_engine are imported when a precision is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_ao.precision import Float8Precision
    from fabric_ao.transformer_engine import TransformerEnginePrecision

__all__ = ["Float8Precision", "TransformerEnginePrecision"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-ao",
    {"Float8Precision": "fabric_ao.precision", "TransformerEnginePrecision": "fabric_ao.transformer_engine"},
)
