"""Strategies: how a model, its optimizers and data are placed and synchronised across processes.

A strategy is a :class:`Strategy` on two axes: where its processes are (the one process of ``Strategy`` itself, or
:class:`ProcessPerDevice`) and how they talk (:class:`OneProcessCollectives`, :class:`ProcessGroupCollectives`).
"""

from fabric_core.strategies.base import BackwardSyncControl, Strategy
from fabric_core.strategies.collectives import Collectives, OneProcessCollectives
from fabric_core.strategies.layout import ProcessPerDevice
from fabric_core.strategies.parallel import ParallelStrategy, ProcessGroupCollectives
from fabric_core.strategies.single_device import SingleDeviceStrategy

__all__ = [
    "BackwardSyncControl",
    "Collectives",
    "OneProcessCollectives",
    "ParallelStrategy",
    "ProcessGroupCollectives",
    "ProcessPerDevice",
    "SingleDeviceStrategy",
    "Strategy",
]
