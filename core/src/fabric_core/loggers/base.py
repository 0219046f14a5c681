"""The interface every experiment logger implements, plus helpers shared by the built-in loggers."""

from __future__ import annotations

import functools
import os
import re
from abc import ABC, abstractmethod
from argparse import Namespace
from collections.abc import Callable, Mapping
from typing import Any

from fabric_core.utilities.rank_zero import get_rank

_VERSION_DIR = re.compile(r"version_(\d+)")


class Logger(ABC):
    """Base class for experiment loggers.

    The training loop only talks to this interface, so any backend (files, TensorBoard, a tracking service) can be
    swapped in by implementing the four abstract members. Everything else has a harmless default so a minimal
    logger stays minimal.
    """

    @property
    @abstractmethod
    def name(self) -> str | None:
        """Experiment name; groups runs that belong together."""

    @property
    @abstractmethod
    def version(self) -> int | str | None:
        """Identifies one run inside the experiment so runs do not overwrite each other."""

    @property
    def root_dir(self) -> str | None:
        """Folder that holds all experiments; None for loggers that do not write locally."""
        return None

    @property
    def log_dir(self) -> str | None:
        """Folder of this run; None for loggers that do not write locally."""
        return None

    @property
    def group_separator(self) -> str:
        """Separator a UI uses to group metric names into sections."""
        return "/"

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Record numeric values for ``step``."""

    @abstractmethod
    def log_hyperparams(self, params: dict[str, Any] | Namespace | None, *args: Any, **kwargs: Any) -> None:
        """Record the configuration of the run."""

    def log_graph(self, model: Any, input_array: Any = None) -> None:  # noqa: B027 (optional hook)
        """Record the model graph. Most backends cannot, so the default does nothing."""

    def save(self) -> None:  # noqa: B027 (optional hook)
        """Persist buffered data. Loggers that write immediately have nothing to do."""

    def finalize(self, status: str) -> None:
        """Called once at the end of a run so nothing buffered is lost."""
        self.save()


class _DummyExperiment:
    """Stand-in experiment for ranks > 0: any attribute is a no-op callable and indexing returns itself.

    It lets user code call ``logger.experiment.whatever(...)`` on every rank without rank checks.
    """

    def _nop(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, _: str) -> Callable[..., None]:
        return self._nop

    def __getitem__(self, _: Any) -> _DummyExperiment:
        return self

    def __setitem__(self, *_: Any) -> None:
        pass


def rank_zero_experiment(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Decorate an ``experiment`` getter so only rank 0 creates the real backend object.

    Other ranks get a :class:`_DummyExperiment`, which keeps them from creating files or connections.
    """

    @functools.wraps(fn)
    def experiment(self: Any) -> Any:
        if get_rank() > 0:
            return _DummyExperiment()
        return fn(self)

    return experiment


def _next_version(folder: str) -> int:
    """One more than the highest ``version_<n>`` directory in ``folder``; 0 if there is none or no folder."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return 0
    found = []
    for entry in entries:
        match = _VERSION_DIR.fullmatch(entry)
        if match and os.path.isdir(os.path.join(folder, entry)):
            found.append(int(match.group(1)))
    return max(found) + 1 if found else 0


def _version_folder(version: int | str) -> str:
    """Integers get the ``version_`` prefix so they sort and are found by :func:`_next_version`; strings are used as given."""
    return version if isinstance(version, str) else f"version_{version}"


def _add_prefix(metrics: Mapping[str, Any], prefix: str, separator: str) -> dict[str, Any]:
    """Prefix every key so several loggers (or phases) can share one backend without name clashes."""
    if not prefix:
        return dict(metrics)
    return {f"{prefix}{separator}{key}": value for key, value in metrics.items()}


def _params_to_dict(params: dict[str, Any] | Namespace | None) -> dict[str, Any]:
    """Accept the common ways people hold a config (argparse Namespace, dict, nothing)."""
    if params is None:
        return {}
    if isinstance(params, Namespace):
        return vars(params).copy()
    return dict(params)
