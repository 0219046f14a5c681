"""The cluster-environment contract and the helpers every environment shares.

A cluster environment answers "who am I and where is rank 0?" for one kind of launcher (torchrun, SLURM, LSF,
MPI, Kubeflow, or our own launcher). Strategies ask it for ranks and the rendezvous address instead of reading
environment variables themselves, so a new scheduler only needs a new environment class.

Only the standard library is imported here: environments are detected before any process group exists, and
importing them must stay cheap.
"""

from __future__ import annotations

import logging
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

log = logging.getLogger(__name__)

_MISSING = object()


class MissingEnvironmentVariable(KeyError):
    """A variable the launcher should have exported is absent.

    A ``KeyError`` because it is a failed lookup, but with a readable message (``KeyError`` normally shows the
    repr of its argument).
    """

    def __init__(self, name: str, hint: str = "", message: str | None = None) -> None:
        self.name = name
        if message is None:
            message = f"The environment variable `{name}` is not set."
        if hint:
            message = f"{message} {hint}"
        super().__init__(message)

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidEnvironmentVariable(MissingEnvironmentVariable, ValueError):
    """A launcher variable is missing or empty where the reference raises ``ValueError`` (the LSF environment).

    Both ``except ValueError`` (the reference's type) and ``except KeyError`` (ours for a missing variable) catch it.
    """


def env_int(name: str, default: object = _MISSING, hint: str = "") -> int:
    """Read an integer environment variable, naming the variable when it is missing or malformed.

    Without ``default`` a missing variable raises :class:`MissingEnvironmentVariable`; ``hint`` tells the user
    which launcher should have set it.
    """
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        if default is _MISSING:
            raise MissingEnvironmentVariable(name, hint)
        return default  # type: ignore[return-value]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"The environment variable `{name}` must be an integer, got {value!r}.") from None


def env_str(name: str, hint: str = "") -> str:
    """Read a required string environment variable, naming it when it is missing."""
    value = os.environ.get(name)
    if value is None or value == "":
        raise MissingEnvironmentVariable(name, hint)
    return value


def find_free_port() -> int:
    """``STANDALONE_PORT`` when it is set, else a TCP port the OS says is free right now.

    Used only when nothing fixes the rendezvous port (single machine, our own launcher). ``STANDALONE_PORT``
    pins it (as in the reference), e.g. where only some ports are open. There is a small race between closing
    the probe socket and the process group binding the port, which is acceptable locally.
    """
    if os.environ.get("STANDALONE_PORT", "").strip():
        return env_int("STANDALONE_PORT")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class ClusterEnvironment(ABC):
    """Where ranks and the rendezvous address come from for one kind of launcher.

    Subclasses set ``name`` (the registry name) and ``detect_priority``: :func:`select_environment` tries the
    classes in ascending priority, so specific launchers (torchrun, SLURM, ...) win over the generic fallback.
    ``None`` means the environment is never auto-detected and must be passed explicitly.
    """

    name: ClassVar[str]
    detect_priority: ClassVar[int | None] = None
    #: Whether the world size and global rank this environment reports are the ones the strategy sets from
    #: ``devices``/``num_nodes`` (``PlainEnvironment``), rather than a launcher's own (torchrun, SLURM, ...).
    #: Fabric checks an external launcher's counts against ``devices="auto"`` only where this is true: "auto" is
    #: no statement about the count, while a launcher's world size is.
    ranks_follow_devices: ClassVar[bool] = False

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """Whether something outside the library (torchrun, srun, mpirun, ...) already started every process.

        When true, the library must not launch workers itself; it only joins the process group.
        """

    @property
    @abstractmethod
    def main_address(self) -> str:
        """Host of global rank 0, used for the process-group rendezvous."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """Port on :attr:`main_address` used for the process-group rendezvous."""

    @classmethod
    @abstractmethod
    def detect(cls) -> bool:
        """Whether the current process runs under this environment (read from the environment only)."""

    @abstractmethod
    def world_size(self) -> int:
        """Total number of processes in the job."""

    @abstractmethod
    def set_world_size(self, size: int) -> None:
        """Record the world size when the library itself decides it (ignored where the launcher owns it)."""

    @abstractmethod
    def global_rank(self) -> int:
        """Rank of this process among all processes."""

    @abstractmethod
    def set_global_rank(self, rank: int) -> None:
        """Record the global rank when the library itself decides it (ignored where the launcher owns it)."""

    @abstractmethod
    def local_rank(self) -> int:
        """Rank of this process among the processes on its node (selects the device)."""

    @abstractmethod
    def node_rank(self) -> int:
        """Index of this process's node."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:  # noqa: B027 (optional hook)
        """Fail early when the user's ``devices``/``num_nodes`` contradict what the launcher set up.

        The default accepts anything; environments with an external launcher override it, because a mismatch
        there otherwise shows up as a hang in the rendezvous.
        """

    def teardown(self) -> None:  # noqa: B027 (optional hook)
        """Undo anything this environment changed, so a later run in the same process starts clean."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ExternallyLaunched(ClusterEnvironment):
    """An environment whose processes a launcher outside the library started (mpirun, Ray Train, ...):
    :attr:`creates_processes_externally` is true and rank 0's host is ``MASTER_ADDR`` (``127.0.0.1`` without it).
    A subclass says the rest: ranks, the port and how it is detected."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR") or "127.0.0.1"


def select_environment(classes: Iterable[type[ClusterEnvironment]]) -> ClusterEnvironment:
    """Instantiate the first class, by ascending ``detect_priority``, whose ``detect()`` is true.

    Classes with ``detect_priority = None`` are skipped (they must be passed explicitly). Equal priorities keep
    the given order. Raises ``RuntimeError`` when nothing detects, which cannot happen if the always-detecting
    fallback (``PlainEnvironment``) is among ``classes``.
    """
    # getattr: a plugin may register a class that does not declare a priority; treat it as explicit-only.
    candidates = [cls for cls in classes if getattr(cls, "detect_priority", None) is not None]
    candidates.sort(key=lambda cls: cls.detect_priority)  # type: ignore[arg-type, return-value]
    for cls in candidates:
        if cls.detect():
            log.debug("Detected cluster environment %s", cls.__name__)
            return cls()
    names = ", ".join(cls.__name__ for cls in candidates) or "none"
    raise RuntimeError(
        f"No cluster environment detected among the auto-detectable ones ({names}). "
        "Include PlainEnvironment as the fallback, or pass an environment explicitly via `plugins=[...]`."
    )
