"""Processes started by SLURM's ``srun`` (one task per device)."""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Iterator
from typing import ClassVar

from fabric_core.environments.base import ClusterEnvironment, env_int, env_str

log = logging.getLogger(__name__)

_INTERACTIVE_JOB_NAMES = frozenset({"bash", "interactive"})
_HINT = "SLURM exports it for tasks started with `srun`; run the script through `srun` inside the job."
_FALLBACK_PORT = 12910
_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas/whitespace that are outside brackets (those inside separate ranges, not hosts)."""
    tokens: list[str] = []
    depth = 0
    current: list[str] = []
    for char in nodelist:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"Unbalanced ']' in SLURM node list {nodelist!r}.")
        if depth == 0 and (char == "," or char.isspace()):
            if current:
                tokens.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth != 0:
        raise ValueError(f"Unbalanced '[' in SLURM node list {nodelist!r}.")
    if current:
        tokens.append("".join(current))
    return tokens


def _expand_ranges(spec: str, nodelist: str) -> list[str]:
    """Expand ``"001-003,7"`` into ``["001", "002", "003", "7"]``, keeping zero padding."""
    values: list[str] = []
    for piece in spec.split(","):
        piece = piece.strip()
        if not piece:
            continue
        start, sep, end = piece.partition("-")
        if not sep:
            values.append(start)
            continue
        if not (start.isdigit() and end.isdigit()) or int(end) < int(start):
            raise ValueError(f"Invalid range {piece!r} in SLURM node list {nodelist!r}.")
        width = len(start)
        values.extend(str(n).zfill(width) for n in range(int(start), int(end) + 1))
    if not values:
        raise ValueError(f"Empty range '[{spec}]' in SLURM node list {nodelist!r}.")
    return values


def iter_slurm_nodelist(nodelist: str) -> Iterator[str]:
    """Yield host names from SLURM's compressed notation, lazily (a range may name thousands of hosts).

    Handles ``host[5-9]``, ``a,b``, ``a b``, ``node[001-003,7]``, ``1.2.3.[089, 100-110]`` and several bracket
    groups in one name (``rack[1-2]-n[1-4]``).
    """
    for token in _split_top_level(nodelist):
        literals = _BRACKET.split(token)  # even indices: literal text, odd indices: range specs
        choices = [
            [part] if i % 2 == 0 else _expand_ranges(part, nodelist) for i, part in enumerate(literals)
        ]
        for combo in itertools.product(*choices):
            yield "".join(combo)


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """All host names in ``nodelist``, in order (see :func:`iter_slurm_nodelist`)."""
    return list(iter_slurm_nodelist(nodelist))


class SLURMEnvironment(ClusterEnvironment):
    """Reads the per-task variables ``srun`` exports. SLURM owns every rank, so setters are ignored.

    Interactive allocations (job name ``bash``/``interactive``) are not detected: there the user starts the script
    by hand in one shell, so the library must launch the processes itself.
    """

    name: ClassVar[str] = "slurm"
    detect_priority: ClassVar[int | None] = 20

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        address = os.environ.get("MASTER_ADDR")
        if address:
            return address
        nodelist = env_str("SLURM_NODELIST", hint=_HINT)
        first = next(iter_slurm_nodelist(nodelist), None)
        if first is None:
            raise ValueError(f"SLURM_NODELIST={nodelist!r} names no host.")
        return first

    @property
    def main_port(self) -> int:
        if os.environ.get("MASTER_PORT"):
            return env_int("MASTER_PORT")
        # Every task computes the same port from the job id, so no communication is needed, and concurrent jobs
        # on shared nodes usually get different ports.
        job_id = self.job_id()
        if job_id is None:
            return _FALLBACK_PORT
        return 15000 + int(str(job_id)[-4:])

    @classmethod
    def detect(cls) -> bool:
        return "SLURM_NTASKS" in os.environ and cls.job_name() not in _INTERACTIVE_JOB_NAMES

    @staticmethod
    def job_name() -> str | None:
        return os.environ.get("SLURM_JOB_NAME")

    @staticmethod
    def job_id() -> int | None:
        """The numeric ``SLURM_JOB_ID``, or ``None`` outside a job or when it is not a number."""
        value = os.environ.get("SLURM_JOB_ID", "").strip()
        return int(value) if value.isdigit() else None

    def world_size(self) -> int:
        return env_int("SLURM_NTASKS", hint=_HINT)

    def set_world_size(self, size: int) -> None:
        log.debug("SLURMEnvironment.set_world_size(%s) ignored: SLURM sets the world size.", size)

    def global_rank(self) -> int:
        return env_int("SLURM_PROCID", hint=_HINT)

    def set_global_rank(self, rank: int) -> None:
        log.debug("SLURMEnvironment.set_global_rank(%s) ignored: SLURM sets the global rank.", rank)

    def local_rank(self) -> int:
        return env_int("SLURM_LOCALID", hint=_HINT)

    def node_rank(self) -> int:
        return env_int("SLURM_NODEID", hint=_HINT)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if self.job_name() in _INTERACTIVE_JOB_NAMES:
            return  # the library launches the processes itself; SLURM's task counts do not apply
        if os.environ.get("SLURM_NTASKS_PER_NODE"):
            per_node = env_int("SLURM_NTASKS_PER_NODE")
            if per_node != num_devices:
                raise ValueError(
                    f"SLURM runs {per_node} tasks per node (SLURM_NTASKS_PER_NODE={per_node}) but devices="
                    f"{num_devices}. Each device needs one task: set `#SBATCH --ntasks-per-node={num_devices}` "
                    f"or pass devices={per_node}."
                )
        else:
            ntasks = env_int("SLURM_NTASKS", default=1)
            if ntasks > 1:
                raise ValueError(
                    f"Your SLURM job sets `--ntasks={ntasks}` without `--ntasks-per-node`, so the tasks per node "
                    f"are unknown. Use `#SBATCH --ntasks-per-node={num_devices}` (one task per device) instead."
                )
        if os.environ.get("SLURM_NNODES"):
            nnodes = env_int("SLURM_NNODES")
            if nnodes != num_nodes:
                raise ValueError(
                    f"SLURM allocated {nnodes} nodes (SLURM_NNODES={nnodes}) but num_nodes={num_nodes}. "
                    f"Set `#SBATCH --nodes={num_nodes}` or pass num_nodes={nnodes}."
                )
