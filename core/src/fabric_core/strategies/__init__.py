"""Strategies: how a model, its optimizers and data are placed and synchronised across processes.

A strategy is a :class:`Strategy` on two axes: where its processes are (the one process of ``Strategy`` itself, or
:class:`ProcessPerDevice`) and how they talk (:class:`OneProcessCollectives`, :class:`ProcessGroupCollectives`).
Where a process sits in the job, along every named axis, is one :class:`Topology` (``strategy.topology``).

Part of the plugin SDK: the names in ``__all__`` are the stable contract plugins (ours and third parties') import,
listed in docs/plugins.md; every other module of the core is internal and may change. The names are imported on
first access, so importing this package costs nothing. A one-process run imports nothing of the process-group side.
"""

from __future__ import annotations

from fabric_core.utilities.lazy import lazy_exports

__all__ = [
    "Axis",
    "BackwardSyncControl",
    "Binding",
    "Collectives",
    "DATA_REPLICATE",
    "DATA_SHARD",
    "ForwardBackward",
    "NothingToSync",
    "OneProcessCollectives",
    "PIPELINE",
    "ParallelOptions",
    "ParallelStrategy",
    "ProcessGroupCollectives",
    "ProcessPerDevice",
    "SEQUENCE",
    "SingleDeviceStrategy",
    "Strategy",
    "TENSOR",
    "Topology",
    "check_broadcast_src",
    "check_reduce_op",
    "collective_timeout",
    "release_process_group",
    "require_precision_type",
    "split_parallel_options",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "release_process_group": "fabric_core.runtime.process_group",
        "BackwardSyncControl": "fabric_core.strategies.base",
        "Binding": "fabric_core.strategies.base",
        "NothingToSync": "fabric_core.strategies.base",
        "Strategy": "fabric_core.strategies.base",
        "check_reduce_op": "fabric_core.strategies.base",
        "require_precision_type": "fabric_core.strategies.base",
        "Collectives": "fabric_core.strategies.collectives",
        "ForwardBackward": "fabric_core.strategies.forward_backward",
        "OneProcessCollectives": "fabric_core.strategies.collectives",
        "check_broadcast_src": "fabric_core.strategies.collectives",
        "ProcessPerDevice": "fabric_core.strategies.layout",
        "ParallelOptions": "fabric_core.strategies.parallel",
        "ParallelStrategy": "fabric_core.strategies.parallel",
        "ProcessGroupCollectives": "fabric_core.strategies.parallel",
        "collective_timeout": "fabric_core.strategies.parallel",
        "split_parallel_options": "fabric_core.strategies.parallel",
        "SingleDeviceStrategy": "fabric_core.strategies.single_device",
        "Axis": "fabric_core.utilities.topology",
        "Topology": "fabric_core.utilities.topology",
        "DATA_REPLICATE": "fabric_core.utilities.topology",
        "DATA_SHARD": "fabric_core.utilities.topology",
        "TENSOR": "fabric_core.utilities.topology",
        "PIPELINE": "fabric_core.utilities.topology",
        "SEQUENCE": "fabric_core.utilities.topology",
    },
    submodules=('layout',),
)
