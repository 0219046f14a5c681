"""Experiment loggers: a small interface plus CSV and TensorBoard backends.

Part of the plugin SDK: the names in ``__all__`` are the stable contract plugins (ours and third parties') import,
listed in docs/plugins.md; every other module of the core is internal and may change. The names are imported on
first access, so importing this package costs nothing. ``Fabric`` needs only the interface in
:mod:`fabric_core.loggers.base`, and TensorBoard is only imported when
a TensorBoardLogger first writes.
"""

from __future__ import annotations

from fabric_core.utilities.lazy import lazy_exports

__all__ = [
    "CSVLogger",
    "CheckpointUploads",
    "Logger",
    "TensorBoardLogger",
    "add_prefix",
    "finalize_at_exit",
    "flatten_params",
    "params_to_dict",
    "rank_zero_experiment",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "CheckpointUploads": "fabric_core.loggers.base",
        "Logger": "fabric_core.loggers.base",
        "add_prefix": "fabric_core.loggers.base",
        "finalize_at_exit": "fabric_core.loggers.base",
        "flatten_params": "fabric_core.loggers.base",
        "params_to_dict": "fabric_core.loggers.base",
        "rank_zero_experiment": "fabric_core.loggers.base",
        "CSVLogger": "fabric_core.loggers.csv",
        "TensorBoardLogger": "fabric_core.loggers.tensorboard",
    },
    submodules=('base',),
)
