"""Where a process sits in a job, computed in one place for the strategies, the launchers and the CLI.

Ranks are laid out node by node: ``global_rank = node_rank * processes_per_node + local_rank``. The same object
gives the rendezvous variables a started process needs, and the CPU thread budget of each process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace


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
