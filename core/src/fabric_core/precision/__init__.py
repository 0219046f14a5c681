"""Precision plugins: dtype of weights, what runs under autocast, and how backward/step are wrapped.

Part of the plugin SDK: the names in ``__all__`` are the stable contract plugins (ours and third parties') import,
listed in docs/plugins.md; every other module of the core is internal and may change. The names are imported on
first access, so importing this package costs nothing. A run in one precision imports only that precision's module.
"""

from __future__ import annotations

from fabric_core.utilities.lazy import lazy_exports

__all__ = [
    "DefaultDtype",
    "DoublePrecision",
    "FullPrecision",
    "HalfPrecision",
    "LossScaling",
    "Precision",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "DefaultDtype": "fabric_core.precision.base",
        "Precision": "fabric_core.precision.base",
        "DoublePrecision": "fabric_core.precision.double",
        "FullPrecision": "fabric_core.precision.full",
        "HalfPrecision": "fabric_core.precision.half",
        "LossScaling": "fabric_core.precision.loss_scaling",
    },
)
