"""A run's identity: its id, this attempt's number, and the one folder where the run's own records live.

A *run* is one training, from its first start to its end, across every restart; a *job* is one start of it by a
launcher or a scheduler (``fabric run``, ``fabric.launch()``, a Slurm job); an *attempt* is one start of the
processes (a job restarted by ``fabric run --max-restarts`` has several). Everything that must survive a restart and
be read afterwards writes into the **run folder**: the goodput ledger (``goodput/``), the elastic sample ledger, the
checkpoint tiers' records. Rank 0 keeps ``run.json`` there: the run id and one entry per attempt.

* **run id**: the same on every rank and in every attempt. ``FABRIC_RUN_ID`` when set; else the id recorded in an
  existing run folder (a job resubmitted into the folder of an earlier one continues that run); else the job id.
* **job id**: ``FABRIC_JOB_ID``, which our launchers set for the processes they start (``fabric run`` once per job,
  so torchrun's restarts keep it; the subprocess and spawn launchers from the starting process); else a scheduler's
  job id (Slurm, LSF, PBS, Flux, torchelastic's ``--rdzv-id``); else one made up in this process.
* **attempt**: 0 for the first start; the launcher's restart count (``FABRIC_RUN_ATTEMPT``,
  ``TORCHELASTIC_RESTART_COUNT`` as torchrun and fabric-ray's launcher set it, ``SLURM_RESTART_COUNT``) plus the
  attempts of earlier jobs recorded in the run folder, so a resubmitted job counts on.
* **run folder**: ``Fabric(run_dir=...)``, else ``FABRIC_RUN_DIR``, else ``<loggers' root>/runs/<run id>`` (the first
  logger's ``root_dir``, else ``fabric_logs``, the built-in loggers' default): beside the loggers' output. It is
  created only when something writes there.

Everything is decided from the environment and the run folder, without a collective, so every rank (and a launcher
before it starts them) computes the same values on its own. Only the standard library is imported here.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RUN_ID_VARIABLE = "FABRIC_RUN_ID"
RUN_DIR_VARIABLE = "FABRIC_RUN_DIR"
JOB_ID_VARIABLE = "FABRIC_JOB_ID"
ATTEMPT_VARIABLE = "FABRIC_RUN_ATTEMPT"
#: rank 0's record of the run in its folder: ``{"run_id": ..., "attempts": [{...}, ...]}``
RECORD_FILE = "run.json"
#: the built-in loggers' default root folder (``Fabric(loggers="csv")`` logs below it)
DEFAULT_ROOT = "fabric_logs"
RUNS_FOLDER = "runs"

#: Schedulers' job ids, in the order they are trusted: the same in every process of one job, and kept by a requeue.
SCHEDULER_JOB_IDS = ("SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID", "FLUX_JOB_ID", "TORCHELASTIC_RUN_ID")
#: Restart counters of the launchers that restart a job themselves, first found wins.
RESTART_COUNTS = (ATTEMPT_VARIABLE, "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")

_made_up_job_id: str | None = None
#: (folder, job, restart) of the attempts this process has recorded in ``run.json``
_recorded: set[tuple[str, str, int]] = set()


def _read_start_ns() -> int:
    """When this process started (wall clock, ns): from ``/proc`` where there is one, else when this module loaded."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat(5), counted after the command's closing parenthesis
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return (boot * 1_000_000_000) + ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time_ns()


#: When this process started (wall clock, ns; the ledger's start-up begins there).
PROCESS_START_NS = _read_start_ns()


def _scheduler_job_id() -> str | None:
    for name in SCHEDULER_JOB_IDS:
        value = os.environ.get(name, "").strip()
        if value and value.lower() != "none":  # torchrun's --rdzv-id defaults to "none"
            return value
    return None


def job_id() -> str:
    """This job's id: ``FABRIC_JOB_ID``, else a scheduler's, else one made up once in this process."""
    global _made_up_job_id
    value = os.environ.get(JOB_ID_VARIABLE, "").strip() or _scheduler_job_id()
    if value:
        return value
    if _made_up_job_id is None:
        _made_up_job_id = new_job_id()
    return _made_up_job_id


def new_job_id(rendezvous: str | None = None) -> str:
    """The id a launcher gives a job it starts: a scheduler's when there is one, else a fresh one.

    ``rendezvous`` (``"HOST:PORT"``, for a job whose nodes are started separately, e.g. ``fabric run --num-nodes 2``
    on each node) makes it the same on every node, derived from where they meet.
    """
    scheduled = _scheduler_job_id()
    if scheduled:
        return scheduled
    if rendezvous:
        return "rdzv-" + hashlib.sha1(rendezvous.encode()).hexdigest()[:12]
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def job_environment(*, new: bool = False, rendezvous: str | None = None) -> dict[str, str]:
    """What a launcher sets in the processes it starts (``FABRIC_JOB_ID``), so that they agree on the run.

    ``new``: the launcher starts a job of its own (``fabric run``): a scheduler's id or a fresh one (``rendezvous``:
    see :func:`new_job_id`), never one inherited from a shell. Otherwise (``fabric.launch()``): this process's job.
    """
    return {JOB_ID_VARIABLE: new_job_id(rendezvous) if new else job_id()}


def restart_count() -> int:
    """How many times the launcher has restarted this job (0 on its first start)."""
    for name in RESTART_COUNTS:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                count = int(value)
            except ValueError:
                raise ValueError(f"`{name}={value}` must be a whole number (a restart count).") from None
            if count < 0:
                raise ValueError(f"`{name}={value}` must not be negative (a restart count).")
            return count
    return 0


@dataclass(frozen=True)
class RunInfo:
    """Who this run is, which attempt this process belongs to, and where the run's records go (``fabric.run_info``).

    The same values on every rank of an attempt; ``id`` and ``dir`` are also the same in every attempt."""

    id: str
    attempt: int
    dir: Path
    #: the job this process belongs to (``FABRIC_JOB_ID``, a scheduler's id, or made up)
    job: str
    #: the launcher's restart count inside this job (``attempt`` counts earlier jobs' attempts too)
    restart: int = 0
    #: whether the folder or the id was chosen (``run_dir=``, ``FABRIC_RUN_DIR``, ``FABRIC_RUN_ID``), not defaulted
    chosen: bool = False
    #: whether this process keeps ``run.json`` (global rank 0; ``Fabric`` sets it): it records the attempt there the
    #: first time it asks for a :meth:`path`
    keeps_record: bool = False
    #: what the attempt's entry in ``run.json`` holds besides the ids (``world_size``, ...)
    details: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: when this process started (wall clock, ns)
    process_start_ns: int = field(default=PROCESS_START_NS, compare=False)

    def path(self, *parts: str) -> Path:
        """``dir/parts...``, with its parent folders created: the run folder exists from its first write on (then
        the record keeper adds this attempt to ``run.json``)."""
        target = self.dir.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        if self.keeps_record and (str(self.dir), self.job, self.restart) not in _recorded:
            _recorded.add((str(self.dir), self.job, self.restart))
            record_attempt(self, **self.details)
        return target

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["dir"] = str(self.dir)
        values["details"] = dict(self.details)
        return values


def read_record(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run folder's ``run.json`` (``None`` when there is none or it cannot be read)."""
    try:
        with open(Path(folder) / RECORD_FILE) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _earlier_attempts(record: Mapping[str, Any] | None, job: str) -> int:
    """Attempts that jobs other than ``job`` recorded in the run folder (each job's restarts 0..n count n + 1)."""
    if not record:
        return 0
    last: dict[str, int] = {}
    for entry in record.get("attempts", []):
        if isinstance(entry, dict) and entry.get("job") != job:
            last[str(entry.get("job"))] = max(last.get(str(entry.get("job")), -1), int(entry.get("restart", 0)))
    return sum(count + 1 for count in last.values())


def resolve_run(run_dir: str | os.PathLike[str] | None = None, *, logs_root: str | os.PathLike[str] | None = None) -> RunInfo:
    """This process's :class:`RunInfo`, from ``run_dir`` (or ``FABRIC_RUN_DIR``), the environment and the folder.

    ``logs_root``: the loggers' root folder, under which the run folder goes when none is chosen (``runs/<id>``).
    """
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"`run_dir` must be a path (str or os.PathLike), got {type(run_dir).__name__}: {run_dir!r}.")
    chosen_dir = os.fspath(run_dir) if run_dir is not None else os.environ.get(RUN_DIR_VARIABLE, "").strip() or None
    if chosen_dir == "":
        raise ValueError("`run_dir` must not be empty: give a folder, or leave it out for the default.")
    given_id = os.environ.get(RUN_ID_VARIABLE, "").strip() or None
    if given_id is not None and ("/" in given_id or given_id in (".", "..")):
        raise ValueError(f"`{RUN_ID_VARIABLE}={given_id}` must be usable as a folder name (no '/').")
    job = job_id()
    if chosen_dir is not None:
        folder = Path(chosen_dir)
        record = read_record(folder)
        recorded = str(record["run_id"]) if record and record.get("run_id") else None
        if given_id is not None and recorded is not None and recorded != given_id:
            raise ValueError(
                f"The run folder {str(folder)!r} belongs to run {recorded!r} (its {RECORD_FILE}), but"
                f" `{RUN_ID_VARIABLE}={given_id}`: unset {RUN_ID_VARIABLE} to continue that run, or choose another folder."
            )
        run_id = given_id or recorded or job
    else:
        run_id = given_id or job
        root = os.fspath(logs_root) if logs_root is not None else DEFAULT_ROOT
        folder = Path(root) / RUNS_FOLDER / run_id
        record = read_record(folder) if given_id is not None else None
    restart = restart_count()
    return RunInfo(
        id=run_id,
        attempt=restart + _earlier_attempts(record, job),
        dir=folder,
        job=job,
        restart=restart,
        chosen=chosen_dir is not None or given_id is not None,
    )


def logs_root(loggers: Any) -> str | None:
    """The first logger's ``root_dir`` (where the run folder goes by default), or ``None``."""
    for logger in loggers:
        root = getattr(logger, "root_dir", None)
        if isinstance(root, (str, os.PathLike)) and os.fspath(root):
            return os.fspath(root)
    return None


def record_attempt(info: RunInfo, **details: Any) -> None:
    """Add this attempt to the run folder's ``run.json`` (global rank 0 calls it once per attempt; atomic replace).

    ``details``: what else is worth knowing about the attempt (``world_size``, ...)."""
    record = read_record(info.dir) or {}
    attempts = [a for a in record.get("attempts", []) if isinstance(a, dict)]
    if any(a.get("job") == info.job and a.get("restart") == info.restart for a in attempts):
        return
    entry = {
        "attempt": info.attempt,
        "job": info.job,
        "restart": info.restart,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start_ns": info.process_start_ns,
        "recorded_ns": time.time_ns(),
        **details,
    }
    record = {"run_id": info.id, **{k: v for k, v in record.items() if k not in ("run_id", "attempts")}}
    record["attempts"] = [*attempts, entry]
    info.dir.mkdir(parents=True, exist_ok=True)
    path = info.dir / RECORD_FILE
    tmp = path.with_name(f".{RECORD_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


__all__ = [
    "ATTEMPT_VARIABLE",
    "JOB_ID_VARIABLE",
    "PROCESS_START_NS",
    "RECORD_FILE",
    "RUN_DIR_VARIABLE",
    "RUN_ID_VARIABLE",
    "RunInfo",
    "job_environment",
    "job_id",
    "logs_root",
    "new_job_id",
    "read_record",
    "record_attempt",
    "resolve_run",
    "restart_count",
]
