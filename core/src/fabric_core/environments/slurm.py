"""Processes started by SLURM's ``srun`` (one task per device)."""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import signal
import sys
from collections.abc import Iterator
from typing import ClassVar

from fabric_core.environments.base import ClusterEnvironment, env_int
from fabric_core.utilities.rank_zero import PossibleUserWarning, rank_zero_warn

log = logging.getLogger(__name__)

_INTERACTIVE_JOB_NAMES = frozenset({"bash", "interactive"})
_HINT = "SLURM exports it for tasks started with `srun`; run the script through `srun` inside the job."
_FALLBACK_PORT = 12910
_IS_WINDOWS = sys.platform == "win32"
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


def _is_interactive() -> bool:
    """Job name ``bash``/``interactive``: the user runs the script by hand inside an allocation."""
    return os.environ.get("SLURM_JOB_NAME") in _INTERACTIVE_JOB_NAMES


def _srun_available() -> bool:
    return shutil.which("srun") is not None


def _srun_used() -> bool:
    return "SLURM_NTASKS" in os.environ and not _is_interactive()


class SLURMEnvironment(ClusterEnvironment):
    """Reads the per-task variables ``srun`` exports. SLURM owns every rank, so setters are ignored.

    Interactive allocations (job name ``bash``/``interactive``) are not detected: there the user starts the script
    by hand in one shell, so the library must launch the processes itself.

    Args:
        auto_requeue: whether the job should be resubmitted when SLURM signals that its time is nearly up.
            Fabric itself never requeues: the value is stored for requeue-aware code (a training loop or a
            signal handler of yours, as the reference's Trainer does) to read.
        requeue_signal: the signal SLURM sends for that (``#SBATCH --signal=USR1@90``); ``None`` picks
            ``signal.SIGUSR1`` (``None`` on Windows, which has no such signal). Also only stored.

    Constructing it checks the task counts: ``--ntasks`` without ``--ntasks-per-node`` raises ``RuntimeError``,
    since Fabric places one task per device and needs to know how many tasks each node runs. An ``srun`` binary
    on ``PATH`` that did not start this process gives a ``PossibleUserWarning`` (here and in :meth:`detect`).
    """

    name: ClassVar[str] = "slurm"
    detect_priority: ClassVar[int | None] = 20

    def __init__(self, auto_requeue: bool = True, requeue_signal: signal.Signals | int | None = None) -> None:
        if not isinstance(auto_requeue, bool):
            raise TypeError(f"`SLURMEnvironment(auto_requeue=...)` must be True or False, got {auto_requeue!r}.")
        if requeue_signal is None and not _IS_WINDOWS:
            requeue_signal = signal.SIGUSR1
        if requeue_signal is not None:
            try:
                requeue_signal = signal.Signals(requeue_signal)
            except (TypeError, ValueError):
                raise ValueError(
                    f"`SLURMEnvironment(requeue_signal={requeue_signal!r})` is not a signal of this platform: pass"
                    " one such as `signal.SIGUSR1`, the signal named in `#SBATCH --signal=...`."
                ) from None
        self.auto_requeue = auto_requeue
        self.requeue_signal: signal.Signals | None = requeue_signal
        self._warn_if_srun_unused()
        self._check_task_counts()

    def __repr__(self) -> str:
        return f"SLURMEnvironment(auto_requeue={self.auto_requeue}, requeue_signal={self.requeue_signal!r})"

    @staticmethod
    def _warn_if_srun_unused() -> None:
        """Warn when ``srun`` exists here but did not start this process: the usual cause of a multi-GPU SLURM job
        that hangs (the batch script ran ``python train.py`` once instead of once per task)."""
        if _IS_WINDOWS or not _srun_available() or _srun_used():
            return
        command = " ".join(["srun", os.path.basename(sys.executable), *sys.argv])[:64]
        rank_zero_warn(
            "The `srun` command is available on your system but is not used. HINT: If your intention is to run"
            f" Fabric on SLURM, prepend your python command with `srun` like so: {command} ..."
            " (without SLURM, or inside an interactive allocation, this warning does not apply).",
            category=PossibleUserWarning,
        )

    @staticmethod
    def _check_task_counts() -> None:
        ntasks = env_int("SLURM_NTASKS", default=1)
        if ntasks > 1 and "SLURM_NTASKS_PER_NODE" not in os.environ:
            raise RuntimeError(
                f"You set `--ntasks={ntasks}` in your SLURM bash script, but this variable is not supported."
                f" HINT: Use `--ntasks-per-node={ntasks}` instead. Fabric runs one task per device, so it needs the"
                " tasks of each node: `#SBATCH --nodes=<num_nodes>` with `#SBATCH --ntasks-per-node=<devices>`."
            )

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        """``MASTER_ADDR``, else the first host of ``SLURM_NODELIST`` (``127.0.0.1`` without one), which is then
        exported as ``MASTER_ADDR`` (as the reference does) so that later readers agree."""
        address = os.environ.get("MASTER_ADDR")
        if address:
            return address
        nodelist = os.environ.get("SLURM_NODELIST") or "127.0.0.1"
        address = next(iter_slurm_nodelist(nodelist), None)
        if address is None:
            raise ValueError(f"SLURM_NODELIST={nodelist!r} names no host; set MASTER_ADDR to the host of rank 0.")
        os.environ["MASTER_ADDR"] = address
        log.debug("MASTER_ADDR: %s", address)
        return address

    @property
    def main_port(self) -> int:
        """``MASTER_PORT``, else ``15000`` + the last four digits of ``SLURM_JOB_ID`` (``12910`` without a numeric
        job id), which is then exported as ``MASTER_PORT`` (as the reference does)."""
        if os.environ.get("MASTER_PORT"):
            return env_int("MASTER_PORT")
        # Every task computes the same port from the job id, so no communication is needed, and concurrent jobs
        # on shared nodes usually get different ports.
        job_id = os.environ.get("SLURM_JOB_ID", "").strip()
        port = 15000 + int(job_id[-4:]) if job_id.isdigit() else _FALLBACK_PORT
        os.environ["MASTER_PORT"] = str(port)
        log.debug("MASTER_PORT: %s", port)
        return port

    @classmethod
    def detect(cls) -> bool:
        cls._warn_if_srun_unused()
        return _srun_used()

    @staticmethod
    def job_name() -> str | None:
        return os.environ.get("SLURM_JOB_NAME")

    @staticmethod
    def job_id() -> int | None:
        """The numeric ``SLURM_JOB_ID``; ``None`` outside a job, when it is not a number, or in an interactive
        allocation (there the script is not the job's own, so requeueing the job is not its business)."""
        if _is_interactive():
            return None
        value = os.environ.get("SLURM_JOB_ID", "").strip()
        return int(value) if value.isdigit() else None

    def world_size(self) -> int:
        return env_int("SLURM_NTASKS", hint=_HINT)

    def set_world_size(self, size: int) -> None:
        log.debug("SLURMEnvironment.set_world_size(%s) ignored: setting world size is not allowed.", size)

    def global_rank(self) -> int:
        return env_int("SLURM_PROCID", hint=_HINT)

    def set_global_rank(self, rank: int) -> None:
        log.debug("SLURMEnvironment.set_global_rank(%s) ignored: setting global rank is not allowed.", rank)

    def local_rank(self) -> int:
        return env_int("SLURM_LOCALID", hint=_HINT)

    def node_rank(self) -> int:
        return env_int("SLURM_NODEID", hint=_HINT)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if _is_interactive():
            return  # the library launches the processes itself; SLURM's task counts do not apply
        if os.environ.get("SLURM_NTASKS_PER_NODE"):
            per_node = env_int("SLURM_NTASKS_PER_NODE")
            if per_node != num_devices:
                raise ValueError(
                    f"You set `devices={num_devices}` in Fabric, but the number of tasks per node configured in SLURM"
                    f" `--ntasks-per-node={per_node}` does not match. HINT: Set `devices={per_node}`. Each device"
                    f" needs one task, so `#SBATCH --ntasks-per-node={num_devices}` works too."
                )
        if os.environ.get("SLURM_NNODES"):
            nnodes = env_int("SLURM_NNODES")
            if nnodes != num_nodes:
                raise ValueError(
                    f"You set `num_nodes={num_nodes}` in Fabric, but the number of nodes configured in SLURM"
                    f" `--nodes={nnodes}` does not match. HINT: Set `num_nodes={nnodes}`, or request"
                    f" `#SBATCH --nodes={num_nodes}`."
                )
