"""The fallback environment: a single machine, processes started by us or by a generic launcher."""

from __future__ import annotations

import os
from typing import ClassVar

from fabric_core.environments.base import ClusterEnvironment, env_int, find_free_port
from fabric_core.utilities.rank_zero import set_rank


class PlainEnvironment(ClusterEnvironment):
    """Used when no scheduler is detected.

    If ``LOCAL_RANK`` is set, some launcher (ours, in the child processes, or a hand-rolled one) already started
    the processes and exported the usual torch variables, so ranks come from ``WORLD_SIZE``/``RANK``. Otherwise
    the library launches the processes itself and tells this object the world size and rank via the setters.
    """

    name: ClassVar[str] = "plain"
    detect_priority: ClassVar[int | None] = 1000

    def __init__(self) -> None:
        self._world_size: int | None = None
        self._global_rank: int | None = None
        self._free_port: int | None = None

    @property
    def creates_processes_externally(self) -> bool:
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR") or "127.0.0.1"

    @property
    def main_port(self) -> int:
        # The env var wins so that every process agrees on it; otherwise pick one free port and keep it, since
        # the launcher reads this once per child and all of them must see the same value.
        if os.environ.get("MASTER_PORT"):
            return env_int("MASTER_PORT")
        if self._free_port is None:
            self._free_port = find_free_port()
        return self._free_port

    @classmethod
    def detect(cls) -> bool:
        return True

    def world_size(self) -> int:
        if self._world_size is not None:
            return self._world_size
        if self.creates_processes_externally:
            return env_int("WORLD_SIZE", default=1)
        return 1

    def set_world_size(self, size: int) -> None:
        self._world_size = int(size)

    def global_rank(self) -> int:
        if self._global_rank is not None:
            return self._global_rank
        if self.creates_processes_externally:
            return env_int("RANK", default=0)
        return 0

    def set_global_rank(self, rank: int) -> None:
        self._global_rank = int(rank)
        # Keep rank-zero-only printing/logging in step with the rank the strategy settled on.
        set_rank(self._global_rank)

    def local_rank(self) -> int:
        return env_int("LOCAL_RANK", default=0)

    def node_rank(self) -> int:
        # NODE_RANK is ours/Lightning-style; GROUP_RANK is what torch's elastic agent exports.
        for key in ("NODE_RANK", "GROUP_RANK"):
            if os.environ.get(key):
                return env_int(key)
        return 0

    def teardown(self) -> None:
        """Drop ``WORLD_SIZE``: our launcher exports it in the parent, and a later run in the same interpreter
        must not inherit the old job's size."""
        os.environ.pop("WORLD_SIZE", None)
