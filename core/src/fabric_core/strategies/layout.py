"""Where the processes of a job are: one axis of a strategy, apart from how they talk (:mod:`.collectives`).

The :class:`~fabric_core.strategies.base.Strategy` itself describes one process (rank 0 of a world of 1).
:class:`ProcessPerDevice` describes one process per device on each of ``num_nodes`` nodes, with ranks from the
cluster environment; it says nothing about how those processes communicate, so it serves a ``torch.distributed``
process group (:class:`~fabric_core.strategies.parallel.ParallelStrategy`) as well as XLA replicas (fabric-xla).

A strategy combines one kind of collectives (listed first, so its methods come before the base class's) and one
layout::

    class ParallelStrategy(ProcessGroupCollectives, ProcessPerDevice): ...
"""

from __future__ import annotations

from typing import Any

import torch

from fabric_core.strategies.base import Binding, Strategy
from fabric_core.utilities import rank_zero
from fabric_core.utilities.topology import Topology


class ProcessPerDevice(Strategy):
    """One process per device of ``parallel_devices``, on each of ``num_nodes`` nodes.

    Ranks and the world size come from :attr:`cluster_environment` (``None`` until the resolver attaches one, or
    for a strategy that creates it when its processes start: then this process is rank 0 of the world that
    ``devices`` x ``num_nodes`` configure). By default the world is one data-parallel axis (every process a
    replica); a strategy that shards the model or splits it over model axes overrides
    :meth:`~fabric_core.strategies.base.Strategy.parallel_axes`.
    """

    def attach(self, binding: Binding) -> None:
        """Keep the devices and the environment set on the strategy itself; take the resolver's otherwise, then
        tell the environment this process's rank and the world size (:meth:`set_world_ranks`)."""
        super().attach(binding)
        if self.parallel_devices is None:
            self.parallel_devices = list(binding.devices)
        if self.cluster_environment is None:
            self.cluster_environment = binding.cluster_environment
        self.set_world_ranks()

    @property
    def num_processes(self) -> int:
        """Processes on this node: one per device of :attr:`parallel_devices`."""
        return len(self.parallel_devices) if self.parallel_devices else 0

    @property
    def root_device(self) -> torch.device:
        """This process's device: the one of its local rank."""
        if not self.parallel_devices:
            return torch.device("cpu")
        return self.parallel_devices[min(self.local_rank, len(self.parallel_devices) - 1)]

    @property
    def global_rank(self) -> int:
        """The environment's rank for this process (0 before there is one)."""
        env = self.cluster_environment
        return env.global_rank() if env is not None else 0

    @property
    def local_rank(self) -> int:
        """The environment's rank of this process on its node (it picks the device)."""
        env = self.cluster_environment
        return env.local_rank() if env is not None else 0

    @property
    def node_rank(self) -> int:
        """The environment's index of this node."""
        env = self.cluster_environment
        return env.node_rank() if env is not None else 0

    @property
    def world_size(self) -> int:
        """The environment's world size; without an environment, what ``devices`` x ``num_nodes`` configure."""
        env = self.cluster_environment
        return env.world_size() if env is not None else self.configured_topology.world_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Shard data over the data-parallel ranks: processes holding the same data-parallel rank get the same
        batches."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def configured_topology(self) -> Topology:
        """The job as ``devices`` and ``num_nodes`` configure it: ``num_nodes`` x :attr:`num_processes`."""
        return Topology(self.num_nodes, max(1, self.num_processes), self.node_rank, self.local_rank)

    @property
    def placement(self) -> Topology:
        """Where this process sits in the running job: the environment's world, split evenly over the nodes.

        Equal to :attr:`configured_topology` unless a launcher outside Fabric (torchrun, SLURM, ...) started a
        different number of processes per node than ``devices`` names (``devices="auto"``).
        """
        per_node = max(1, self.world_size // max(1, self.num_nodes))
        return Topology(self.num_nodes, per_node, self.node_rank, self.local_rank)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's rank and the world size, as ``devices``/``num_nodes`` make them.

        Always, as the reference does, also where something else started the processes: an environment whose
        launcher owns the ranks (torchrun, SLURM, ...) ignores the setters, and a custom one that starts processes
        externally but does not know the world size learns it here.
        """
        env = self.cluster_environment
        if env is None:
            return
        configured = self.configured_topology
        env.set_global_rank(configured.global_rank)
        env.set_world_size(configured.world_size)
        rank_zero.set_rank(env.global_rank())


def declares_data_parallel(strategy: Strategy) -> bool:
    """Whether ``strategy``'s class says which processes share data: it overrides
    :attr:`~fabric_core.strategies.base.Strategy.data_parallel_rank`/``data_parallel_size``, or the sampler arguments
    themselves (:class:`ProcessPerDevice` derives those from the two, so it does not count)."""
    cls = type(strategy)
    return (
        cls.data_parallel_rank is not Strategy.data_parallel_rank
        or cls.data_parallel_size is not Strategy.data_parallel_size
        or cls.parallel_axes is not Strategy.parallel_axes
        or cls.distributed_sampler_kwargs not in (Strategy.distributed_sampler_kwargs, ProcessPerDevice.distributed_sampler_kwargs)
    )
