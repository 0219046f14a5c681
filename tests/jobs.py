"""Running real multi-process jobs from tests, for every plugin: hard timeouts, nothing left behind.

Two ways to start a job:

* :func:`start_job` / :func:`run_job`: one command (``python script.py``, ``fabric run ...``) that leads its own
  session; every process it creates (launcher children, DataLoader workers) stays in that session, so "no
  orphans" is checked by looking for live processes of the session after the job ended, and a job that overruns
  its timeout is killed as a whole instead of hanging the test run.
* :func:`run_ranks`: ``world_size`` processes started externally with the variables a launcher exports, as
  torchrun would; if one rank fails, the others are killed at once and the test fails with every rank's output.

Every job starts from :func:`job_env`: this process's environment without launcher, cluster or Fabric
variables, so a job never inherits the test runner's, and with a rendezvous port of its own (:func:`free_port`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fabric_core.launchers.processes import live_processes, session_processes

# Variables a launcher or cluster would set; a job must start without any of them.
_LAUNCH_VARS = (
    "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "OMP_NUM_THREADS", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "SLURM_NTASKS", "SLURM_JOB_NAME",
    "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
)  # fmt: skip
#: Handles to services a test process started in itself, which a job must not share. ``WANDB_SERVICE`` is the socket of
#: the wandb service that an in-process wandb test left running in this pytest worker: a job that inherits it sends its
#: run there instead of starting its own service, and its exit no longer waits for the run's file to be complete (the
#: job ends while the worker's service still writes it: a ``wandb leet inspect`` right after reads a run still
#: "running", without records it was sent; seen as a missing config key under load).
_SERVICE_VARS = ("WANDB_SERVICE",)


#: Where handed-out ports are recorded, shared by every test process on this machine (xdist workers, stress runs).
PORT_REGISTRY = Path(tempfile.gettempdir()) / "fabric-test-ports"
#: A port handed out is not handed out again for this long (longer than any job of the suite).
PORT_HOLD_S = 30 * 60
#: Ports are taken from here: below the kernel's ephemeral range (32768-60999 by default), so the outgoing
#: connections of other jobs (gloo, stores, S3 clients) cannot take one between the check and the job's bind.
PORT_RANGE = (20000, 32000)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))  # all interfaces, as torch's TCPStore binds
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for a job's rendezvous that no other test process was given (collision-free across xdist workers).

    ``bind(port 0)`` gives a port from the ephemeral range that is free *now*: two workers can be handed the same
    one, and any outgoing connection can take it before the job binds it ("address already in use", or a rank that
    joins another job's store). Here ports come from :data:`PORT_RANGE` (outside the ephemeral range) and each one is
    claimed by creating ``PORT_REGISTRY/<port>`` exclusively, so a port goes to one caller only; claims expire after
    :data:`PORT_HOLD_S`.
    """
    low, high = PORT_RANGE
    ephemeral = _ephemeral_range()
    if not (high < ephemeral[0] or low > ephemeral[1]):
        low, high = 10000, max(10001, ephemeral[0] - 1)
    PORT_REGISTRY.mkdir(exist_ok=True)
    span = high - low
    start = (os.getpid() * 7919 + time.monotonic_ns()) % span
    for step in range(span):
        port = low + (start + step) % span
        claim = PORT_REGISTRY / str(port)
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                if time.time() - claim.stat().st_mtime < PORT_HOLD_S:
                    continue
                claim.unlink()  # an expired claim; whoever unlinks it first may claim it next
            except FileNotFoundError:
                pass
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port left in {low}-{high} (claims in {PORT_REGISTRY})")


def job_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and k not in _SERVICE_VARS and not k.startswith(("FABRIC_", "TORCHELASTIC_", "PET_", "PYTEST_", "SLURM_", "OMPI_", "PMI_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    # Our launchers' rendezvous port when nothing else fixes it (instead of a port from the ephemeral range).
    env["STANDALONE_PORT"] = str(free_port())
    env.update(extra)
    return env


def fabric_command() -> list[str]:
    """``fabric run`` as users type it: the console script installed beside this interpreter."""
    script = Path(sys.executable).parent / "fabric"
    if script.exists() and importlib.util.find_spec("fabric_core.cli") is not None:
        return [str(script), "run"]
    return [sys.executable, "-m", "fabric_core.cli_run"]


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def read_jsonl(path: Path) -> list[dict]:
    """The records a job appends to ``path`` one JSON object a line, so far (none before the file exists; a last
    line still being written is left out)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            break
    return records


def wait_until(condition, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def descendants(pid: int) -> list[int]:
    """Live processes below ``pid`` (children, theirs, ...), wherever their session: torchrun's agent starts each
    worker in a session of its own."""
    parents: dict[int, list[int]] = {}
    for child, (parent, _) in live_processes().items():
        parents.setdefault(parent, []).append(child)
    found, stack = [], [pid]
    while stack:
        for child in parents.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it at once (a machine that fails takes all of them)."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_session(sid: int) -> None:
    for pid in session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Job:
    """A running job: a process that leads its own session."""

    process: subprocess.Popen
    log: Path
    started: float

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """Wait for the job's main process; on timeout kill the whole session and fail the test."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(self.pid)
            self.process.wait(timeout=10)
            pytest.fail(f"job did not end within {timeout} s; output:\n{self.output()[-4000:]}")

    def wait_for(self, condition, timeout: float, what: str) -> None:
        """Wait until ``condition()`` holds while the job runs; on timeout kill the job and fail naming ``what``."""
        if not wait_until(condition, timeout, interval=0.1):
            kill_session(self.pid)
            pytest.fail(f"timed out after {timeout} s waiting for {what}\n{self.output()[-6000:]}")

    def leftovers(self, timeout: float = 10.0) -> list[int]:
        """Processes of the job still alive ``timeout`` seconds after its main process ended (then killed)."""
        wait_until(lambda: not session_processes(self.pid), timeout)
        left = session_processes(self.pid)
        kill_session(self.pid)
        return left


def start_job(
    command: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
    ends_with_test: bool = False,
) -> Job:
    """Start ``command`` in a session of its own, its output to ``log``. ``ends_with_test``: the job gets SIGTERM
    when the test process dies (``PR_SET_PDEATHSIG``), for daemons a killed test run must not leave behind (a Ray
    node); only from the thread that lives as long as the test process (the main thread)."""
    handle = open(log, "w")
    try:
        process = subprocess.Popen(
            [str(c) for c in command],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env if env is not None else job_env(),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_interruptible_ending_with_test if ends_with_test else _interruptible,
        )
    finally:
        handle.close()
    job = Job(process, log, time.monotonic())
    _STARTED.append(job)
    return job


#: Jobs started by the current test; what a failed test left running is ended after it (``end_leftover_jobs``).
_STARTED: list[Job] = []


def end_leftover_jobs() -> None:
    """Kill the whole session of every job the test started that is still running (a test that failed half way
    would otherwise leave a stuck job, its ranks and their ports behind for the rest of the run)."""
    while _STARTED:
        job = _STARTED.pop()
        if job.process.poll() is None or session_processes(job.pid):
            kill_session(job.pid)
            try:
                job.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _interruptible() -> None:
    """Give the job SIGINT's default disposition, as a terminal's foreground job has. A test run started in the
    background of a non-interactive shell (``make test &``, ``nohup``) inherits SIGINT ignored; the job would
    inherit that too, and our launchers rightly keep a signal the user ignores ignored, so a test that interrupts
    the job would wait for nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interruptible_ending_with_test() -> None:
    _interruptible()
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_job(
    command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None
) -> tuple[Job, int]:
    """Run a job to completion (bounded by ``timeout``), check it left nothing behind; return it and its code."""
    job = start_job(command, log, env)
    code = job.wait(timeout)
    assert not job.leftovers(), f"processes left behind by {command}:\n{job.output()[-3000:]}"
    return job, code


def _kill(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in processes:
        p.wait()


def _finish(processes: list[subprocess.Popen], logs: list[Path], timeout: float, what: str) -> list[str]:
    deadline = time.monotonic() + timeout
    failed = None
    while True:
        codes = [p.poll() for p in processes]
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None or all(c == 0 for c in codes) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    timed_out = failed is None and not all(p.poll() == 0 for p in processes)
    _kill(processes)
    outputs = [log.read_text(errors="replace") for log in logs]
    if failed is not None or timed_out:
        reason = f"rank {failed} exited with {processes[failed].returncode}" if failed is not None else f"timeout {timeout}s"
        dump = "\n".join(f"----- rank {i} -----\n{out[-6000:]}" for i, out in enumerate(outputs))
        pytest.fail(f"{what} failed ({reason}):\n{dump}")
    return outputs


def run_ranks(script: Path, *args: str, world_size: int = 2, timeout: float = 120, tmp_path: Path) -> list[str]:
    """Run ``script`` as ``world_size`` ranks started externally (as torchrun would: ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, rendezvous on a free port); if one fails the others are killed. Returns each rank's output."""
    port = str(free_port())
    processes, logs = [], []
    for rank in range(world_size):
        env = job_env(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
        )  # fmt: skip
        log = tmp_path / f"{script.name}.{world_size}.rank{rank}.log"
        with open(log, "w") as out:
            processes.append(
                subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            )
        logs.append(log)
    return _finish(processes, logs, timeout, f"{script.name} on {world_size} ranks")


def run_script(
    script: Path, *args: str, timeout: float = 120, tmp_path: Path, env: dict[str, str] | None = None
) -> str:
    """Run ``script`` as one plain process (it may launch more itself); fails the test if it fails or overruns
    ``timeout``. ``env`` adds variables to the job's clean environment."""
    log = tmp_path / f"{script.name}.single.log"
    env = job_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, str(script), *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return _finish([process], [log], timeout, script.name)[0]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
