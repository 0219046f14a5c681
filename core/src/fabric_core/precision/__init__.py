"""Precision plugins: dtype of weights, what runs under autocast, and how backward/step are wrapped.

The names below are imported on first access, so a run in one precision imports only that precision's module.
"""

from fabric_core.utilities.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "Precision": "fabric_core.precision.base",
        "DoublePrecision": "fabric_core.precision.double",
        "HalfPrecision": "fabric_core.precision.half",
    },
)

__all__ = ["DoublePrecision", "HalfPrecision", "Precision"]
