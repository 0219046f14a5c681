"""Processes started by ``mpirun``/``mpiexec`` (Open MPI, or MPICH/Intel MPI via their PMI variables)."""

from __future__ import annotations

import importlib.util
import logging
import os
import zlib
from typing import ClassVar

from fabric_core.environments.base import ExternallyLaunched, MissingEnvironmentVariable, env_int

log = logging.getLogger(__name__)

_HINT = "mpirun exports it for every rank; run the script through `mpirun`/`mpiexec`."
_FALLBACK_PORT = 12910
# Job-wide identifiers that every rank of one mpirun sees identically (Open MPI 5/PMIx, Open MPI 4).
_JOB_ID_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")


def _first_int(*names: str, default: int | None = None) -> int | None:
    """The first of ``names`` that is set (Open MPI's name first, then the PMI one)."""
    for name in names:
        if os.environ.get(name):
            return env_int(name)
    return default


def _mpi4py_available() -> bool:
    """Whether mpi4py is installed, checked without importing it (importing initialises MPI)."""
    return importlib.util.find_spec("mpi4py") is not None


def _require_int(*names: str) -> int:
    value = _first_int(*names)
    if value is None:
        raise MissingEnvironmentVariable(names[0], f"Neither is {', '.join(names[1:])}. {_HINT}")
    return value


class MPIEnvironment(ExternallyLaunched):
    """Ranks read from the variables the MPI launcher exports, so no MPI call (and no mpi4py import) is needed.

    Detection still requires mpi4py to be installed, so that a stray ``PMI_SIZE`` alone does not switch the
    library into MPI mode. ``MASTER_ADDR`` must be set for jobs spanning several nodes: without an MPI broadcast
    the ranks cannot learn rank 0's host otherwise.
    """

    name: ClassVar[str] = "mpi"
    detect_priority: ClassVar[int | None] = 40

    @property
    def main_port(self) -> int:
        if os.environ.get("MASTER_PORT"):
            return env_int("MASTER_PORT")
        # Derive the port from the job id so all ranks agree without communicating.
        for name in _JOB_ID_VARS:
            job_id = os.environ.get(name)
            if job_id:
                return 15000 + zlib.crc32(job_id.encode()) % 10000
        return _FALLBACK_PORT

    @classmethod
    def detect(cls) -> bool:
        if not _mpi4py_available():
            return False
        try:
            size = _first_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=0)
        except ValueError:
            return False
        return size is not None and size > 1

    def world_size(self) -> int:
        return _require_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")

    def set_world_size(self, size: int) -> None:
        log.debug("MPIEnvironment.set_world_size(%s) ignored: mpirun sets the world size.", size)

    def global_rank(self) -> int:
        return _require_int("OMPI_COMM_WORLD_RANK", "PMI_RANK")

    def set_global_rank(self, rank: int) -> None:
        log.debug("MPIEnvironment.set_global_rank(%s) ignored: mpirun sets the global rank.", rank)

    def local_rank(self) -> int:
        return _require_int("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")

    def node_rank(self) -> int:
        # Assumes the default by-slot mapping (ranks fill one node before the next), as most launchers do.
        local_size = _first_int("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
        if not local_size:
            return 0
        return self.global_rank() // local_size

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        world_size = self.world_size()
        if num_devices * num_nodes != world_size:
            raise ValueError(
                f"You selected devices={num_devices} and num_nodes={num_nodes} ({num_devices * num_nodes} "
                f"processes), but mpirun started {world_size}. Start `mpirun -np {num_devices * num_nodes}` "
                f"or pass devices and num_nodes whose product is {world_size}."
            )
        if num_nodes > 1 and not os.environ.get("MASTER_ADDR"):
            raise ValueError(
                f"num_nodes={num_nodes} under MPI needs `MASTER_ADDR` (the host of rank 0) exported to every "
                "rank, e.g. `mpirun -x MASTER_ADDR=<host of rank 0> ...`."
            )
