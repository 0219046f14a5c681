"""The interface every experiment logger implements, plus helpers shared by the loggers (built-in and plugins)."""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import re
import sys
from abc import ABC, abstractmethod
from argparse import Namespace
from collections.abc import Callable, Mapping
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any

from fabric_core.utilities.exceptions import guarded
from fabric_core.utilities.rank_zero import get_rank, rank_zero_warn

if TYPE_CHECKING:
    from fabric_core.io.location import CheckpointLocation

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
        """Called once at the end of a run so nothing buffered is lost.

        ``status`` is ``"success"`` (``fabric.teardown()``, a normal exit) or ``"failed"`` (the function given to
        ``fabric.launch`` raised, or, for loggers that use :func:`finalize_at_exit`, the script ended with an
        uncaught exception). A tracker marks the run accordingly.
        """
        self.save()

    def checkpoint_saved(self, location: CheckpointLocation) -> None:  # noqa: B027 (optional hook)
        """``fabric.save`` wrote a checkpoint at ``location`` (a :class:`~fabric_core.io.CheckpointLocation`: a local
        path, ``location.path``, or a URL, ``location.is_url``); called on every rank.

        Called right after the save returned on this rank: an asynchronous save (``async_save=True``) may still be
        writing in the background, so work on the checkpoint belongs in :class:`CheckpointUploads`, which runs it
        after the save. Trackers upload checkpoints as artifacts here when asked to; the default does nothing. Only
        subclasses of this class receive it: loggers accepted by interface get the reference's calls only.
        """


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


def add_prefix(metrics: Mapping[str, Any], prefix: str, separator: str) -> dict[str, Any]:
    """Prefix every key so several loggers (or phases) can share one backend without name clashes."""
    if not prefix:
        return dict(metrics)
    return {f"{prefix}{separator}{key}": value for key, value in metrics.items()}


def params_to_dict(params: Mapping[str, Any] | Namespace | Any) -> dict[str, Any]:
    """Accept the common ways people hold a config: a dict, an argparse Namespace, a dataclass, or nothing."""
    if params is None:
        return {}
    if isinstance(params, Namespace):
        return vars(params).copy()
    if is_dataclass(params) and not isinstance(params, type):
        return asdict(params)
    return dict(params)



#: What ``Fabric(loggers=...)`` requires of a logger: the abstract members of the reference's ``Logger`` interface.
#: Everything else it may call (``finalize``, ``save``, ...) is optional and skipped when absent.
REQUIRED_MEMBERS = ("name", "version", "log_metrics", "log_hyperparams")
_REQUIRED_METHODS = ("log_metrics", "log_hyperparams")


def missing_members(obj: Any) -> list[str]:
    """The members of :data:`REQUIRED_MEMBERS` that ``obj`` lacks (methods must be callable).

    Looked up without running properties, so checking a logger never starts its experiment. A member the class does
    not define is asked of the object when its class answers names dynamically (``__getattr__``: a
    ``unittest.mock.Mock``, a proxy), as the reference accepts any object.
    """
    missing = []
    dynamic = _answers_dynamically(obj)
    for member in REQUIRED_MEMBERS:
        try:
            inspect.getattr_static(obj, member)
        except AttributeError:
            if not (dynamic and _has_dynamic(obj, member)):
                missing.append(member)
                continue
        if member in _REQUIRED_METHODS and not callable(getattr(obj, member, None)):
            missing.append(member)
    return missing


def _answers_dynamically(obj: Any) -> bool:
    try:
        inspect.getattr_static(type(obj), "__getattr__")
    except AttributeError:
        return False
    return True


def _has_dynamic(obj: Any, member: str) -> bool:
    try:
        getattr(obj, member)
    except Exception:  # a proxy's __getattr__ may raise anything for a name it does not have
        return False
    return True


def notify_checkpoint_saved(loggers: list[Any], location: CheckpointLocation) -> None:
    """``checkpoint_saved(location)`` to the loggers of our base class (an optional hook that loggers by interface
    lack)."""
    for logger in loggers:
        if isinstance(logger, Logger):
            logger.checkpoint_saved(location)


def finalize_loggers(loggers: list[Any], status: str) -> list[Exception]:
    """:func:`finalize_logger` for each of ``loggers``, all of them even when one fails; returns their errors."""
    errors = [finalize_logger(logger, status) for logger in loggers]
    return [err for err in errors if err is not None]


def finalize_logger(logger: Any, status: str) -> Exception | None:
    """Call ``logger.finalize(status)`` if it has one; returns what it raised instead of raising it.

    Every logger of a run gets finalized even when one of them fails, and the run's own outcome (often an exception
    in flight) stays what is reported; the caller decides what to do with the error.
    """
    finalize = getattr(logger, "finalize", None)
    if not callable(finalize):
        return None
    return guarded(finalize, status)[1]  # a tracker's client may raise anything


def _warn_failed_finalize(logger: Any, status: str, err: Exception) -> None:
    rank_zero_warn(f"`{type(logger).__name__}.finalize({status!r})` failed: {type(err).__name__}: {err}")


def _exit_status() -> str:
    """``"failed"`` when the interpreter is ending because of an uncaught exception, else ``"success"``."""
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return "failed" if last is not None else "success"


def finalize_at_exit(logger: Logger) -> None:
    """Make sure ``logger.finalize`` runs when this process ends, for a run that nobody finalized.

    Trackers call this when they open a run, so a script that never calls ``finalize`` (or ``fabric.teardown()``)
    still closes it: ``"failed"`` after an uncaught exception, ``"success"`` otherwise. It runs at interpreter exit
    and also at the end of a process started by ``multiprocessing`` (spawn/fork strategies), where ``atexit`` does
    not run. The logger is kept alive until then (a script may drop it without finalizing: its run is still open),
    so its ``finalize`` must be idempotent (the trackers' are). A process killed by a signal runs neither: its run
    stays open on the server.
    """
    import multiprocessing.util

    done = []

    def run() -> None:  # registered twice (atexit, multiprocessing's exit): runs once
        if done:
            return
        done.append(True)
        status = _exit_status()
        err = finalize_logger(logger, status)
        if err is not None:
            _warn_failed_finalize(logger, status, err)

    atexit.register(run)
    multiprocessing.util.Finalize(None, run, exitpriority=10)


def flatten_params(params: Mapping[str, Any], separator: str = "/", parent: str = "") -> dict[str, Any]:
    """Flatten a nested config into ``a/b/c`` keys, for backends whose parameters are flat (TensorBoard, MLflow).

    Dicts, Namespaces and dataclass instances are descended into; lists and tuples only when they contain such
    containers (their items get the index as key, e.g. ``layers/0/width``).
    """
    flat: dict[str, Any] = {}
    for key, value in params.items():
        full_key = f"{parent}{separator}{key}" if parent else str(key)
        value = _as_mapping(value)
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, separator, full_key))
        elif isinstance(value, (list, tuple)) and any(isinstance(_as_mapping(v), Mapping) for v in value):
            flat.update(flatten_params({str(i): v for i, v in enumerate(value)}, separator, full_key))
        else:
            flat[full_key] = value
    return flat


def _as_mapping(value: Any) -> Any:
    if isinstance(value, Namespace):
        return vars(value)
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return value


class CheckpointUploads:
    """A tracker's checkpoint uploads, each run after the save of its path is durable, off the training loop.

    ``submit(location, upload)`` queues ``upload(location)`` behind the pending work of that checkpoint in the
    checkpoint background thread (``fabric_core.io.background``): it sees the committed checkpoint, and the loop does
    not wait for the network. ``location`` is the :class:`~fabric_core.io.CheckpointLocation` ``checkpoint_saved``
    received (a path or a URL string is taken too). A failed upload is a warning (the checkpoint itself is safe on disk). ``wait()`` blocks until
    every upload submitted so far is done; trackers call it before closing the run.
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def submit(self, location: CheckpointLocation | str, upload: Callable[[CheckpointLocation], None]) -> None:
        from fabric_core.io import background
        from fabric_core.io.location import CheckpointLocation

        location = CheckpointLocation.of(location)

        def work() -> None:
            try:
                upload(location)
            except Exception as err:  # a tracker's client may raise anything; the checkpoint itself is safe
                rank_zero_warn(f"Uploading the checkpoint {str(location)!r} failed: {type(err).__name__}: {err}")

        self._handles.append(background.submit(location, work))

    def wait(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()

    def __getstate__(self) -> dict[str, Any]:
        return {"_handles": []}  # uploads in flight belong to this process
