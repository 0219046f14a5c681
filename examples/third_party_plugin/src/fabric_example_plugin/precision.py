"""Implementation module of ``precision="example-64"``; imported only when that name is resolved."""

from __future__ import annotations

from fabric_core.precision import DoublePrecision


class ExampleDoublePrecision(DoublePrecision):
    """float64 weights and math, under the example plugin's own name."""

    precision = "example-64"
