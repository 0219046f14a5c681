"""Processes started by IBM Spectrum LSF's ``jsrun`` (e.g. on Summit-style machines)."""

from __future__ import annotations

import logging
import os
import socket
from typing import ClassVar

from fabric_core.environments.base import ClusterEnvironment, InvalidEnvironmentVariable, env_int

log = logging.getLogger(__name__)

_JSRUN = "Make sure you run your executable with `jsrun`."
_HINT = "LSF exports it for every job; run the script through `jsrun` inside an LSF job."
_DETECT_VARS = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE")


def _jsm_int(name: str, what: str) -> int:
    if not os.environ.get(name, "").strip():
        raise InvalidEnvironmentVariable(
            name, message=f"Cannot determine {what}. Environment variable `{name}` not found. {_JSRUN}"
        )
    return env_int(name)


class LSFEnvironment(ClusterEnvironment):
    """Ranks come from the ``JSM_NAMESPACE_*`` variables; hosts from the LSF rankfile.

    The rankfile lists one host per slot and starts with the launch node, which runs no task, so it is
    dropped; the first remaining host is rank 0's machine, and this machine's position among the distinct
    hosts is its node rank. Construction reads the rankfile and decides the rendezvous (``MASTER_ADDR`` if set,
    else the first compute host; ``MASTER_PORT`` if set, else derived from ``LSB_JOBID``) and exports both, as the
    reference does, so a broken job fails immediately. Missing or empty variables raise
    :class:`InvalidEnvironmentVariable`, a ``ValueError`` (the reference's type) and a ``KeyError``.
    """

    name: ClassVar[str] = "lsf"
    detect_priority: ClassVar[int | None] = 30

    def __init__(self) -> None:
        self._hosts = self._read_hosts()
        self._main_address = os.environ.get("MASTER_ADDR") or self._hosts[0]
        self._main_port = self._find_main_port()
        os.environ["MASTER_ADDR"] = self._main_address
        os.environ["MASTER_PORT"] = str(self._main_port)
        log.debug("MASTER_ADDR: %s, MASTER_PORT: %s", self._main_address, self._main_port)

    @staticmethod
    def _read_hosts() -> list[str]:
        path = os.environ.get("LSB_DJOB_RANKFILE")
        if path is None:
            raise InvalidEnvironmentVariable(
                "LSB_DJOB_RANKFILE", _HINT, message="Did not find the environment variable `LSB_DJOB_RANKFILE`."
            )
        if not path:
            raise InvalidEnvironmentVariable(
                "LSB_DJOB_RANKFILE", _HINT, message="The environment variable `LSB_DJOB_RANKFILE` is empty."
            )
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except OSError as err:
            raise ValueError(f"Cannot read the LSF rankfile LSB_DJOB_RANKFILE={path!r}: {err}") from err
        lines = [line for line in lines if line]
        if not lines:
            raise ValueError(f"The LSF rankfile LSB_DJOB_RANKFILE={path!r} is empty.")
        hosts = list(dict.fromkeys(lines[1:]))  # distinct, in first-seen order
        if not hosts:
            raise ValueError(
                f"The LSF rankfile LSB_DJOB_RANKFILE={path!r} lists only the launch node ({lines[0]!r}); "
                "no compute host is available."
            )
        return hosts

    @staticmethod
    def _find_main_port() -> int:
        if os.environ.get("MASTER_PORT"):
            return env_int("MASTER_PORT")
        if not os.environ.get("LSB_JOBID", "").strip():
            raise InvalidEnvironmentVariable(
                "LSB_JOBID",
                message="Could not find job id in environment variable LSB_JOBID. LSF sets it for every job; without"
                " it, set MASTER_PORT to a port every task can use.",
            )
        # Derived from the job id so every task agrees without communicating.
        return env_int("LSB_JOBID") % 1000 + 10000

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self._main_address

    @property
    def main_port(self) -> int:
        return self._main_port

    @classmethod
    def detect(cls) -> bool:
        return all(var in os.environ for var in _DETECT_VARS)

    def world_size(self) -> int:
        return _jsm_int("JSM_NAMESPACE_SIZE", "world size")

    def set_world_size(self, size: int) -> None:
        log.debug("LSFEnvironment.set_world_size(%s) ignored: setting world size is not allowed.", size)

    def global_rank(self) -> int:
        return _jsm_int("JSM_NAMESPACE_RANK", "global rank")

    def set_global_rank(self, rank: int) -> None:
        log.debug("LSFEnvironment.set_global_rank(%s) ignored: setting global rank is not allowed.", rank)

    def local_rank(self) -> int:
        return _jsm_int("JSM_NAMESPACE_LOCAL_RANK", "local rank")

    def node_rank(self) -> int:
        hostname = socket.gethostname()
        try:
            return self._hosts.index(hostname)
        except ValueError:
            raise ValueError(
                f"This host ({hostname!r}) is not among the compute hosts of the LSF rankfile {self._hosts}."
            ) from None
