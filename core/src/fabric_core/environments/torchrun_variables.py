"""torchrun's arguments in their environment form: ``PET_<ARGUMENT>`` (``PET_NNODES=2`` stands for ``--nnodes=2``).

torchrun reads such a variable wherever its argument is not on its command line. Kubeflow Trainer v2 configures every
pod of a TrainJob this way (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT``), and the older Kubeflow training operator does so for its elastic jobs (``PET_NNODES=MIN:MAX``,
``PET_RDZV_BACKEND``, ``PET_RDZV_ENDPOINT``, ``PET_MAX_RESTARTS``, ...) and, from v1.8, ``PET_NNODES``,
``PET_NPROC_PER_NODE`` and ``PET_NODE_RANK`` beside its ``MASTER_ADDR``/``MASTER_PORT``.

``fabric run`` reads them as torchrun does (its explicit options win), and ``Fabric(...)`` in a process that no
launcher started takes the node count, processes per node, node rank and rendezvous from them
(:func:`job_shape`), so each node joins the one world torchrun would form there instead of a world of its own.
Only the standard library is imported here, except for torchrun's device words (``auto``, ``gpu``, ...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "PET_"
NNODES = "PET_NNODES"
NPROC_PER_NODE = "PET_NPROC_PER_NODE"
NODE_RANK = "PET_NODE_RANK"
MASTER_ADDR = "PET_MASTER_ADDR"
MASTER_PORT = "PET_MASTER_PORT"
RDZV_BACKEND = "PET_RDZV_BACKEND"


def variable_for(flag: str) -> str:
    """The variable torchrun reads for its option ``flag``: ``--rdzv-backend`` -> ``PET_RDZV_BACKEND``."""
    return PREFIX + flag.lstrip("-").upper().replace("-", "_")


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, ``None`` where it is unset or blank.

    Node 0's address and port fall back to the older Kubeflow operator's ``MASTER_ADDR``/``MASTER_PORT`` where the
    ``PET_*`` form names the nodes (``PET_NNODES`` or ``PET_NODE_RANK``) but not node 0: that operator sets both
    forms in the same pods (torchrun itself would meet at 127.0.0.1 there, which no other node reaches).
    """
    environ = os.environ if environ is None else environ
    value = _value(name, environ)
    if value is None and name in (MASTER_ADDR, MASTER_PORT) and _value(MASTER_ADDR, environ) is None:
        if _value(NNODES, environ) or _value(NODE_RANK, environ):
            value = _value(name[len(PREFIX) :], environ)
    return value


def _value(name: str, environ: Mapping[str, str]) -> str | None:
    value = environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def parse_nodes(text: str, name: str = NNODES) -> tuple[int, int]:
    """torchrun's node count: ``N`` or ``MIN:MAX`` -> ``(min, max)``; a ``ValueError`` naming ``name`` otherwise."""
    parts = text.strip().split(":")
    try:
        low, high = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        low = high = 0
    if len(parts) > 2 or not 0 < low <= high:
        raise ValueError(f"{name}={text!r} must be a number of nodes N or a range MIN:MAX with 0 < MIN <= MAX.")
    return low, high


def node_count(text: str, name: str = "--num-nodes") -> int | tuple[int, int]:
    """A node count as ``fabric run --num-nodes`` and ``FABRIC_NUM_NODES`` give it: ``N``, or ``MIN:MAX`` for an elastic
    job (returned as the pair ``(MIN, MAX)``; ``N:N`` is ``N``)."""
    low, high = parse_nodes(text, name)
    return low if low == high else (low, high)


def parse_processes_per_node(text: str, name: str = NPROC_PER_NODE) -> int:
    """torchrun's processes per node: a number, or one of its words (``auto``, ``cpu``, ``gpu``, ``xpu``) counted
    by torchrun's own rule (``torch.distributed.run.determine_local_world_size``)."""
    text = text.strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text.isdigit() or text.lstrip("-").isdigit():
        raise ValueError(f"{name}={text!r} must be a positive number of processes (or auto, cpu, gpu).")
    from torch.distributed.run import determine_local_world_size

    try:
        return int(determine_local_world_size(text))
    except ValueError as err:
        raise ValueError(f"{name}={text!r}: {err} Use a number of processes, auto, cpu or gpu.") from None


def static_rendezvous(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun would meet at a fixed address (its default ``static`` backend) rather than elastically."""
    return (get(RDZV_BACKEND, environ) or "static") == "static"


@dataclass(frozen=True)
class JobShape:
    """What the ``PET_*`` variables say about the job, for a process that no launcher started (``None``: unset)."""

    num_nodes: int | None
    processes_per_node: int | None
    node_rank: int | None
    main_address: str | None
    main_port: int | None

    @property
    def is_set(self) -> bool:
        return any(value is not None for value in (self.num_nodes, self.processes_per_node, self.node_rank))


def job_shape(environ: Mapping[str, str] | None = None) -> JobShape:
    """Read the job's shape as torchrun's static rendezvous would form it: ``MIN:MAX`` nodes are ``MAX`` nodes
    (torchrun's static rendezvous waits for ``max_nodes``). Where the ``PET_*`` form names the nodes but not node
    0's address, the older Kubeflow operator's ``MASTER_ADDR``/``MASTER_PORT`` name it (:func:`get`)."""
    nodes, processes = get(NNODES, environ), get(NPROC_PER_NODE, environ)
    rank, address, port = get(NODE_RANK, environ), get(MASTER_ADDR, environ), get(MASTER_PORT, environ)
    return JobShape(
        num_nodes=parse_nodes(nodes)[1] if nodes else None,
        processes_per_node=parse_processes_per_node(processes) if processes else None,
        node_rank=_integer(rank, NODE_RANK),
        main_address=address,
        main_port=_integer(port, MASTER_PORT),
    )


def _integer(text: str | None, name: str) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={text!r} must be a non-negative integer.")
    return value
