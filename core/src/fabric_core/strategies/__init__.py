"""Strategies: how a model, its optimizers and data are placed and synchronised across processes."""

from fabric_core.strategies.base import BackwardSyncControl, Strategy
from fabric_core.strategies.parallel import ParallelStrategy
from fabric_core.strategies.single_device import SingleDeviceStrategy

__all__ = ["BackwardSyncControl", "ParallelStrategy", "SingleDeviceStrategy", "Strategy"]
