"""Experiment loggers: a small interface plus CSV and TensorBoard backends.

Importing this package is cheap: TensorBoard is only imported when a TensorBoardLogger first writes.
"""

from __future__ import annotations

from fabric_core.loggers.base import Logger, rank_zero_experiment
from fabric_core.loggers.csv import CSVLogger
from fabric_core.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger", "rank_zero_experiment"]
