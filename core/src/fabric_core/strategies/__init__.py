"""Strategies: how a model, its optimizers and data are placed and synchronised across processes.

A strategy is a :class:`Strategy` on two axes: where its processes are (the one process of ``Strategy`` itself, or
:class:`ProcessPerDevice`) and how they talk (:class:`OneProcessCollectives`, :class:`ProcessGroupCollectives`).
The names below are imported on first access, so a one-process run imports nothing of the process-group side.
"""

from fabric_core.utilities.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "BackwardSyncControl": "fabric_core.strategies.base",
        "NothingToSync": "fabric_core.strategies.base",
        "Strategy": "fabric_core.strategies.base",
        "Collectives": "fabric_core.strategies.collectives",
        "OneProcessCollectives": "fabric_core.strategies.collectives",
        "ProcessPerDevice": "fabric_core.strategies.layout",
        "ParallelStrategy": "fabric_core.strategies.parallel",
        "ProcessGroupCollectives": "fabric_core.strategies.parallel",
        "SingleDeviceStrategy": "fabric_core.strategies.single_device",
    },
    submodules=("layout",),
)

__all__ = [
    "BackwardSyncControl",
    "Collectives",
    "NothingToSync",
    "OneProcessCollectives",
    "ParallelStrategy",
    "ProcessGroupCollectives",
    "ProcessPerDevice",
    "SingleDeviceStrategy",
    "Strategy",
]
