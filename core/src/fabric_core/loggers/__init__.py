"""Experiment loggers: a small interface plus CSV and TensorBoard backends.

Importing this package is cheap: its names are imported on first access (``Fabric`` needs only the interface in
:mod:`fabric_core.loggers.base`), and TensorBoard is only imported when a TensorBoardLogger first writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric_core.loggers.base import Logger, rank_zero_experiment
    from fabric_core.loggers.csv import CSVLogger
    from fabric_core.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger", "rank_zero_experiment"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "CSVLogger": "fabric_core.loggers.csv",
        "Logger": "fabric_core.loggers.base",
        "TensorBoardLogger": "fabric_core.loggers.tensorboard",
        "rank_zero_experiment": "fabric_core.loggers.base",
    },
    submodules=("base",),
)
