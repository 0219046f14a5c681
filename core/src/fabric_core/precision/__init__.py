"""Precision plugins: dtype of weights, what runs under autocast, and how backward/step are wrapped."""

from fabric_core.precision.base import Precision
from fabric_core.precision.double import DoublePrecision
from fabric_core.precision.half import HalfPrecision

__all__ = ["DoublePrecision", "HalfPrecision", "Precision"]
