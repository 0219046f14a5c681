"""Processes started by IBM Spectrum LSF's ``jsrun`` (e.g. on Summit-style machines)."""

from __future__ import annotations

import logging
import os
import socket
from typing import ClassVar

from fabric_core.environments.base import ClusterEnvironment, env_int, env_str

log = logging.getLogger(__name__)

_HINT = "LSF/jsrun exports it for every task; run the script through `jsrun` inside an LSF job."
_DETECT_VARS = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE")


class LSFEnvironment(ClusterEnvironment):
    """Ranks come from the ``JSM_NAMESPACE_*`` variables; hosts from the LSF rankfile.

    The rankfile lists one host per slot and starts with the launch node, which runs no task, so it is
    dropped; the first remaining host is rank 0's machine, and this machine's position among the distinct
    hosts is its node rank. The file is read once, at construction, so a broken job fails immediately.
    """

    name: ClassVar[str] = "lsf"
    detect_priority: ClassVar[int | None] = 30

    def __init__(self) -> None:
        self._hosts = self._read_hosts()

    @staticmethod
    def _read_hosts() -> list[str]:
        path = env_str("LSB_DJOB_RANKFILE", hint=_HINT)
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

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR") or self._hosts[0]

    @property
    def main_port(self) -> int:
        if os.environ.get("MASTER_PORT"):
            return env_int("MASTER_PORT")
        # Derived from the job id so every task agrees without communicating.
        return env_int("LSB_JOBID", hint=_HINT) % 1000 + 10000

    @classmethod
    def detect(cls) -> bool:
        return all(var in os.environ for var in _DETECT_VARS)

    def world_size(self) -> int:
        return env_int("JSM_NAMESPACE_SIZE", hint=_HINT)

    def set_world_size(self, size: int) -> None:
        log.debug("LSFEnvironment.set_world_size(%s) ignored: LSF sets the world size.", size)

    def global_rank(self) -> int:
        return env_int("JSM_NAMESPACE_RANK", hint=_HINT)

    def set_global_rank(self, rank: int) -> None:
        log.debug("LSFEnvironment.set_global_rank(%s) ignored: LSF sets the global rank.", rank)

    def local_rank(self) -> int:
        return env_int("JSM_NAMESPACE_LOCAL_RANK", hint=_HINT)

    def node_rank(self) -> int:
        hostname = socket.gethostname()
        try:
            return self._hosts.index(hostname)
        except ValueError:
            raise ValueError(
                f"This host ({hostname!r}) is not among the compute hosts of the LSF rankfile {self._hosts}."
            ) from None
