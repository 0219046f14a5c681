"""``32-true``: the default; nothing is converted."""

from __future__ import annotations

from fabric_core.precision.base import Precision


class FullPrecision(Precision):
    precision = "32-true"
