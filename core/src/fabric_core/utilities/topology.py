"""Where a process sits in a job, computed in one place for the strategies, the launchers, the CLI and every part
that asks "which rank along which axis".

A :class:`Topology` has two halves. The *placement*: ``num_nodes`` nodes of ``processes_per_node`` processes, ranks
laid out node by node (``global_rank = node_rank * processes_per_node + local_rank``), which gives the rendezvous
variables a started process needs and the CPU thread budget of each process. The *axes*: the named dimensions a
strategy splits its world along (data-parallel replicas and shards, tensor, pipeline, sequence, and fault-tolerant
replica groups), each with its size and this process's coordinate, outermost first. Samplers, ``is_global_zero``,
loggers, checkpoint formats, collectives and ``fabric env`` ask the same object (``fabric.topology``).

A topology is an immutable snapshot, and a strategy makes a new one every time it is asked
(``Strategy.topology``): a fault-tolerant replica axis changes with every quorum, and sizes change at restarts, so
read it again rather than keep one.

Every variable this project exports into ``os.environ`` for a rendezvous is exported here (:func:`export_variables`,
:func:`export_rendezvous`, :meth:`Topology.export`), so what a process finds there has one source.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from math import prod
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


#: The roles of an axis. Along a data axis processes train on different samples (``DATA_REPLICATE``: each holds
#: the whole model, as DDP; ``DATA_SHARD``: each holds a shard of it, as FSDP and ZeRO). Along a model axis they
#: train on the same samples and hold different parts of the model (``TENSOR``, ``PIPELINE``) or of each sample's
#: sequence (``SEQUENCE``).
DATA_REPLICATE = "data_replicate"
DATA_SHARD = "data_shard"
TENSOR = "tensor"
PIPELINE = "pipeline"
SEQUENCE = "sequence"
ROLES = (DATA_REPLICATE, DATA_SHARD, TENSOR, PIPELINE, SEQUENCE)
DATA_ROLES = (DATA_REPLICATE, DATA_SHARD)


@dataclass(frozen=True)
class Axis:
    """One named dimension of a job: ``size`` processes (or replica groups) along it, this one at ``coordinate``.

    ``name`` is the strategy's own (its ``DeviceMesh`` dimension where it has one); ``role`` says what the axis
    splits (see :data:`ROLES`). A ``fault_tolerant`` axis runs along separately started jobs (torchft's replica
    groups): its members come and go while the others train, so besides the configured ``size``/``coordinate`` it
    has ``live_size`` (members in the current quorum) and ``live_coordinate`` (this member's index among them,
    ``None`` while it is not taking part, healing). On any other axis they equal ``size``/``coordinate``.
    """

    name: str
    size: int
    coordinate: int
    role: str = DATA_REPLICATE
    fault_tolerant: bool = False
    live_size: int | None = None
    live_coordinate: int | None = field(default=None)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Axis {self.name!r}: role {self.role!r} is not one of {ROLES}.")
        if self.size < 1 or not 0 <= self.coordinate < self.size:
            raise ValueError(f"Axis {self.name!r}: coordinate {self.coordinate} is not in 0..{self.size - 1}.")
        if not self.fault_tolerant:
            object.__setattr__(self, "live_size", self.size)
            object.__setattr__(self, "live_coordinate", self.coordinate)
        elif self.live_size is None:
            object.__setattr__(self, "live_size", self.size)
            if self.live_coordinate is None:
                object.__setattr__(self, "live_coordinate", self.coordinate)

    @property
    def splits_data(self) -> bool:
        """Whether processes at different coordinates train on different samples."""
        return self.role in DATA_ROLES


@dataclass(frozen=True)
class Topology:
    """``num_nodes`` nodes of ``processes_per_node`` processes, this one ``local_rank`` on ``node_rank``, and the
    named ``axes`` the world is split along (outermost first; see the module's docstring).

    The sizes of the axes that are not fault-tolerant multiply to the world size, and ranks are laid out over them
    row-major (the last axis varies fastest), as ``init_device_mesh`` lays out a mesh. A fault-tolerant axis lies
    outside this world (each of its members is a world of its own), so it comes first and does not count.
    """

    num_nodes: int
    processes_per_node: int
    node_rank: int = 0
    local_rank: int = 0
    axes: tuple[Axis, ...] = ()

    def __post_init__(self) -> None:
        inside = [axis.size for axis in self.axes if not axis.fault_tolerant]
        if inside and prod(inside) != self.world_size:
            listing = " x ".join(f"{a.name}={a.size}" for a in self.axes if not a.fault_tolerant)
            raise ValueError(
                f"The axes {listing} make {prod(inside)} processes, but the job has {self.world_size}"
                f" ({self.num_nodes} node(s) x {self.processes_per_node}). Choose axis sizes whose product is the world"
                " size."
            )
        names = [axis.name for axis in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"Axis names must differ, got {names}.")

    # ------------------------------------------------------------------------------------------ placement
    @property
    def world_size(self) -> int:
        """Processes in this ``torch.distributed`` world (a fault-tolerant replica group is a world of its own)."""
        return self.num_nodes * self.processes_per_node

    @property
    def global_rank(self) -> int:
        return self.node_rank * self.processes_per_node + self.local_rank

    def with_local_rank(self, local_rank: int) -> Topology:
        return replace(self, local_rank=local_rank)

    def with_axes(self, *axes: Axis) -> Topology:
        """The same placement split along ``axes`` (``ValueError`` when their sizes do not make the world)."""
        return replace(self, axes=tuple(axes))

    # ------------------------------------------------------------------------------------------ axes
    def axis(self, name: str) -> Axis | None:
        """The axis called ``name``, or ``None``."""
        for axis in self.axes:
            if axis.name == name:
                return axis
        return None

    def size(self, name: str) -> int:
        """How many processes (or groups) lie along the axis ``name`` (1 where there is no such axis)."""
        axis = self.axis(name)
        return axis.size if axis is not None else 1

    def coordinate(self, name: str) -> int:
        """This process's index along the axis ``name`` (0 where there is no such axis)."""
        axis = self.axis(name)
        return axis.coordinate if axis is not None else 0

    def axes_with_role(self, role: str) -> tuple[Axis, ...]:
        return tuple(axis for axis in self.axes if axis.role == role)

    @property
    def data_axes(self) -> tuple[Axis, ...]:
        """The axes along which processes train on different samples, outermost first."""
        return tuple(axis for axis in self.axes if axis.splits_data)

    @property
    def data_parallel_size(self) -> int:
        """Into how many shares the data is split: the product of the sizes of every data axis (1 with none)."""
        return prod(axis.size for axis in self.data_axes)

    @property
    def data_parallel_rank(self) -> int:
        """Which share this process trains on: its coordinates over the data axes read as one number, outermost
        first. Processes that differ only along model axes (tensor, pipeline, sequence peers) share it."""
        rank = 0
        for axis in self.data_axes:
            rank = rank * axis.size + axis.coordinate
        return rank

    @property
    def is_global_zero(self) -> bool:
        """Whether this process writes what one process writes for the whole job (single-file checkpoints, logs):
        global rank 0, in the first live member of every fault-tolerant axis (so it moves on when that member is
        down, and no member writes while it heals)."""
        return self.global_rank == 0 and all(axis.live_coordinate == 0 for axis in self.axes if axis.fault_tolerant)

    def groups_along(self, name: str) -> list[list[int]]:
        """Every group of global ranks that differ only along the axis ``name``, in order: the groups a process group
        per axis is made of (``torch.distributed.new_group`` must be called for each, by every rank)."""
        inside = [axis for axis in self.axes if not axis.fault_tolerant]
        index = next((i for i, axis in enumerate(inside) if axis.name == name), None)
        if index is None:
            raise ValueError(f"No axis {name!r} inside this world; its axes are {[a.name for a in inside]}.")
        strides = [prod(a.size for a in inside[i + 1 :]) for i in range(len(inside))]
        groups: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            key = rank - (rank // strides[index] % inside[index].size) * strides[index]
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def ranks_along(self, name: str) -> list[int]:
        """The global ranks of the processes that differ from this one only along the axis ``name``."""
        return next(group for group in self.groups_along(name) if self.global_rank in group)

    def describe(self) -> str:
        """One line for logs and ``fabric env``: ``2 node(s) x 2 process(es); data_shard=4 (this process: 3)``."""
        text = f"{self.num_nodes} node(s) x {self.processes_per_node} process(es)"
        if self.axes:
            sizes = " x ".join(f"{a.name}={a.size}" + (" (fault-tolerant)" if a.fault_tolerant else "") for a in self.axes)
            coordinates = ", ".join(str(a.coordinate) for a in self.axes)
            text += f"; {sizes} (this process: {coordinates})"
        return text

    def as_dict(self) -> dict[str, object]:
        """Plain values for loggers, JSON reports and ``fabric env --json``."""
        return {
            "num_nodes": self.num_nodes,
            "processes_per_node": self.processes_per_node,
            "node_rank": self.node_rank,
            "local_rank": self.local_rank,
            "global_rank": self.global_rank,
            "world_size": self.world_size,
            "data_parallel_rank": self.data_parallel_rank,
            "data_parallel_size": self.data_parallel_size,
            "axes": [
                {"name": a.name, "role": a.role, "size": a.size, "coordinate": a.coordinate,
                 "fault_tolerant": a.fault_tolerant, "live_size": a.live_size, "live_coordinate": a.live_coordinate}
                for a in self.axes
            ],
        }

    # ------------------------------------------------------------------------------------------ rendezvous
    def export(self, main_address: str, main_port: int, keys: Iterable[str] | None = None) -> dict[str, str | None]:
        """Export :meth:`environment` (only ``keys``, when given) into ``os.environ``; returns the previous values."""
        values = self.environment(main_address, main_port)
        return export_variables({key: values[key] for key in (values if keys is None else keys)})

    def environment(self, main_address: str, main_port: int, *, torchrun: bool = False) -> dict[str, str]:
        """The variables a process of this job is started with (what torchrun exports, plus ``NODE_RANK``). With
        ``torchrun``, also what torchrun's agent exports beside them (``GROUP_RANK``, ``ROLE_*``), for a launcher that
        stands in for it: the started process then finds what it would find under torchrun."""
        values = {
            "LOCAL_RANK": str(self.local_rank),
            "NODE_RANK": str(self.node_rank),
            "RANK": str(self.global_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.processes_per_node),
            "MASTER_ADDR": main_address,
            "MASTER_PORT": str(main_port),
        }
        if torchrun:
            values.update(
                GROUP_RANK=str(self.node_rank),
                GROUP_WORLD_SIZE=str(self.num_nodes),
                ROLE_RANK=str(self.global_rank),
                ROLE_WORLD_SIZE=str(self.world_size),
                ROLE_NAME="default",
            )
        return values
