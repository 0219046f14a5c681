"""Where a process sits in a job, computed in one place for the strategies, the launchers and the CLI.

Ranks are laid out node by node: ``global_rank = node_rank * processes_per_node + local_rank``. The same object
gives the rendezvous variables a started process needs, and the CPU thread budget of each process. Every variable
this project exports into ``os.environ`` for a rendezvous is exported here (:func:`export_variables`,
:func:`export_rendezvous`, :meth:`Topology.export`), so what a process finds there has one source.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

#: The variables a started process of a job finds (what torchrun exports, plus ``NODE_RANK``).
RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
#: Where ``torch.distributed``'s default (env://) rendezvous meets.
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


def export_variables(values: Mapping[str, str]) -> dict[str, str | None]:
    """Set ``values`` in ``os.environ``; returns what each variable was before (``None``: unset), to put back."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    return previous


class _Rendezvous(Protocol):
    """What :func:`export_rendezvous` asks of a :class:`~fabric_core.environments.ClusterEnvironment` (which stands
    above ``utilities``)."""

    @property
    def main_address(self) -> str: ...
    @property
    def main_port(self) -> int: ...


def export_rendezvous(env: _Rendezvous) -> dict[str, str | None]:
    """Export ``MASTER_ADDR``/``MASTER_PORT`` as ``env`` decides them (asked once, so every process started from
    here agrees on a port the environment picks freely); returns the previous values."""
    return export_variables({"MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port)})


def threads_per_process(processes: int) -> int:
    """Intra-op threads for each of ``processes`` processes sharing this machine's cores (at least one).

    Oversubscribing the cores is severe for CPU training: one thread per process was ~15x faster than two on a
    2-core machine with two processes (docs/benchmarks.md).
    """
    return max(1, (os.cpu_count() or 1) // max(1, processes))


@dataclass(frozen=True)
class Topology:
    """``num_nodes`` nodes of ``processes_per_node`` processes; this process is ``local_rank`` on ``node_rank``."""

    num_nodes: int
    processes_per_node: int
    node_rank: int = 0
    local_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.processes_per_node

    @property
    def global_rank(self) -> int:
        return self.node_rank * self.processes_per_node + self.local_rank

    def with_local_rank(self, local_rank: int) -> Topology:
        return replace(self, local_rank=local_rank)

    def export(self, main_address: str, main_port: int, keys: Iterable[str] | None = None) -> dict[str, str | None]:
        """Export :meth:`environment` (only ``keys``, when given) into ``os.environ``; returns the previous values."""
        values = self.environment(main_address, main_port)
        return export_variables({key: values[key] for key in (values if keys is None else keys)})

    def environment(self, main_address: str, main_port: int) -> dict[str, str]:
        """The variables a process of this job is started with (what torchrun exports, plus ``NODE_RANK``)."""
        return {
            "LOCAL_RANK": str(self.local_rank),
            "NODE_RANK": str(self.node_rank),
            "RANK": str(self.global_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.processes_per_node),
            "MASTER_ADDR": main_address,
            "MASTER_PORT": str(main_port),
        }
