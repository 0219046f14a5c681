"""A dependency-free logger that writes metrics to a CSV file and hyperparameters to JSON."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

import torch

from fabric_core.loggers.base import (
    Logger,
    _next_version,
    _version_folder,
    add_prefix,
    params_to_dict,
    rank_zero_experiment,
)
from fabric_core.utilities.exceptions import on_failure
from fabric_core.utilities.rank_zero import rank_zero_only, rank_zero_warn

METRICS_FILE = "metrics.csv"
HPARAMS_FILE = "hparams.json"


def _atomic_write(path: str, write: Any) -> None:
    """Write through a temporary file and rename it, so a crash never leaves a half-written file behind."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_", suffix=os.path.basename(path))
    with on_failure(lambda: os.path.exists(tmp) and os.remove(tmp)):
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as handle:
            write(handle)
        os.replace(tmp, path)


class _CSVWriter:
    """Buffers metric rows in memory and appends them to ``metrics.csv`` on :meth:`save`.

    The file is only rewritten when a new column appears, because CSV has a single header; that is rare, so
    normal flushes are pure appends and never read the file back.
    """

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, METRICS_FILE)
        self.hparams_file_path = os.path.join(log_dir, HPARAMS_FILE)
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = []
        self.hparams: dict[str, Any] = {}

        if os.path.isdir(log_dir) and os.listdir(log_dir):
            rank_zero_warn(
                f"Experiment logs directory {log_dir} exists and is not empty."
                " Previous log files in this directory will be deleted when the new ones are saved!"
            )
        # A leftover file from an earlier run would have a different header; start clean.
        for path in (self.metrics_file_path, self.hparams_file_path):
            if os.path.isfile(path):
                os.remove(path)
        os.makedirs(log_dir, exist_ok=True)

    def log_metrics(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """Merge and rewrite the whole file: hyperparameters are small and logged rarely."""
        self.hparams.update(params)
        _atomic_write(
            self.hparams_file_path,
            lambda handle: json.dump(self.hparams, handle, indent=2, sort_keys=True, default=_json_default),
        )

    def save(self) -> None:
        if not self.rows:
            return
        new_columns = {key for row in self.rows for key in row} - set(self.columns)
        file_exists = os.path.isfile(self.metrics_file_path)
        if new_columns:
            self.columns = sorted(set(self.columns) | new_columns)
            if file_exists:
                self._rewrite_with_header()
        with open(self.metrics_file_path, "a", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.columns, restval="")
            if not file_exists:
                writer.writeheader()
            writer.writerows(self.rows)
        self.rows = []

    def _rewrite_with_header(self) -> None:
        """Re-emit the rows already on disk under the widened header; old rows get empty cells."""
        with open(self.metrics_file_path, newline="", encoding="utf-8") as handle:
            old_rows = list(csv.DictReader(handle))

        def write(out: Any) -> None:
            writer = csv.DictWriter(out, fieldnames=self.columns, restval="")
            writer.writeheader()
            writer.writerows(old_rows)

        _atomic_write(self.metrics_file_path, write)


def _json_default(value: Any) -> Any:
    """Make common non-JSON values readable instead of failing the whole file."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Namespace):
        return vars(value)
    if hasattr(value, "item") and getattr(value, "size", None) == 1:  # numpy scalars and 1-element arrays
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class CSVLogger(Logger):
    """Log metrics to ``<root_dir>/<name>/version_<n>/metrics.csv``.

    Useful when nothing else is installed or when results should be read with a spreadsheet or pandas.
    Only rank 0 writes. Rows are buffered and appended every ``flush_logs_every_n_steps`` steps, on
    :meth:`save` and on :meth:`finalize`, which keeps the per-step cost to a dict append.

    Differences from Lightning Fabric's ``CSVLogger`` (on purpose):

    * :meth:`log_hyperparams` works: it merges the parameters into ``<log_dir>/hparams.json`` (JSON, so there is
      no YAML dependency) instead of raising ``NotImplementedError``.
    * When ``step`` is not given, the automatic step keeps counting across flushes (0, 1, 2, ...) rather than
      restarting at 0 after every flush, so the ``step`` column stays monotonic.
    * The buffer is also flushed once it holds ``flush_logs_every_n_steps`` rows, so explicit steps that never
      hit the flush interval cannot grow memory without bound.

    Args:
        root_dir: Folder for all experiments. Not expanded (``~`` and env vars are taken literally).
        name: Experiment folder below ``root_dir``; ``None`` or ``""`` logs directly into ``root_dir``.
        version: An int gives ``version_<int>``, a str is used as the folder name, None picks the next free int.
        prefix: Put in front of every metric key, joined with ``"-"``.
        flush_logs_every_n_steps: How often buffered rows are written to disk.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        name: str | None = "fabric_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__()
        if flush_logs_every_n_steps < 1:
            raise ValueError(
                f"`flush_logs_every_n_steps` must be at least 1, got {flush_logs_every_n_steps}."
            )
        self._root_dir = os.fspath(root_dir)
        self._name = name or ""
        self._version = version
        self._prefix = prefix
        self._flush_logs_every_n_steps = flush_logs_every_n_steps
        self._experiment: _CSVWriter | None = None
        self._auto_step = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        """Resolved on first use, so creating the logger does not touch the file system."""
        if self._version is None:
            self._version = _next_version(os.path.join(self._root_dir, self._name))
        return self._version

    @property
    def root_dir(self) -> str:
        return self._root_dir

    @property
    def log_dir(self) -> str:
        return os.path.join(self._root_dir, self._name, _version_folder(self.version))

    @property
    @rank_zero_experiment
    def experiment(self) -> _CSVWriter:
        """The file writer, created (with its folder) on first use so idle loggers leave no trace."""
        if self._experiment is None:
            os.makedirs(self._root_dir or ".", exist_ok=True)
            self._experiment = _CSVWriter(self.log_dir)
        return self._experiment

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace | None, *args: Any, **kwargs: Any) -> None:
        """Merge ``params`` into ``hparams.json`` (see the class docstring for why this differs from Lightning)."""
        self.experiment.log_hparams(params_to_dict(params))

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        metrics = add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR)
        if step is None:
            step = self._auto_step
        self._auto_step += 1
        row = {
            key: value.item() if isinstance(value, torch.Tensor) else value for key, value in metrics.items()
        }
        row["step"] = step
        experiment = self.experiment
        experiment.log_metrics(row)
        if (step + 1) % self._flush_logs_every_n_steps == 0 or len(
            experiment.rows
        ) >= self._flush_logs_every_n_steps:
            self.save()

    @rank_zero_only
    def save(self) -> None:
        super().save()
        if self._experiment is not None:
            self._experiment.save()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Flush what is left; a logger that never logged has nothing to write."""
        if self._experiment is None:
            return
        self.save()
