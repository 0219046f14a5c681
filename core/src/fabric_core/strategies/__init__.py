"""Strategies: how a model, its optimizers and data are placed and synchronised across processes."""

from fabric_core.strategies.base import BackwardSyncControl, Strategy
from fabric_core.strategies.parallel import ParallelStrategy
from fabric_core.strategies.single_device import OneProcessCollectives, SingleDeviceStrategy

__all__ = ["BackwardSyncControl", "OneProcessCollectives", "ParallelStrategy", "SingleDeviceStrategy", "Strategy"]
