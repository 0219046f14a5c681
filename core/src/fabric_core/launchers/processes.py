"""The processes a launcher starts: tied to their parent, stopped with the processes they started, and their exit
reported the shell's way. Written once, for the core's launchers and for every plugin's (fabric-ray's actors).

* :func:`new_process_group` and :func:`parent_death_signal` are what ``subprocess.Popen`` needs so a child leads a
  process group of its own (stopping it also stops what it started, DataLoader workers say) and is killed by Linux
  when its parent dies without cleaning up (``SIGKILL``, a segfault); :func:`die_with_parent` does the latter from
  inside a child that was not started that way (a ``multiprocessing`` worker);
* :func:`signal_process_group` and :func:`stop_processes`: SIGTERM, a grace period, then SIGKILL, to each process's
  group;
* :func:`exit_status`: a process killed by signal N exits with 128 + N, as a shell reports it;
* :func:`start_rank_process` and :func:`rank_failure`: the two ends of a rank a launcher starts (own group, death
  signal, the file its uncaught exception goes to; then how it ended, with that exception, for ``report_failures``);
* :func:`live_processes` and :func:`session_processes`: what runs now, read from Linux's ``/proc`` (what a launcher
  or a test checks was left behind).

Only the standard library is imported here (and, by :func:`start_rank_process`/:func:`rank_failure` when called, the
core's failure records).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "DEFAULT_GRACE_S",
    "GRACE_VARIABLE",
    "die_with_parent",
    "exit_status",
    "grace_period",
    "live_processes",
    "new_process_group",
    "parent_death_signal",
    "rank_failure",
    "session_processes",
    "signal_process_group",
    "start_rank_process",
    "stop_processes",
]

#: Seconds between SIGTERM and SIGKILL when processes are stopped (override with :data:`GRACE_VARIABLE`).
DEFAULT_GRACE_S = 5.0
GRACE_VARIABLE = "FABRIC_TERMINATE_GRACE"
_PR_SET_PDEATHSIG = 1


def exit_status(returncode: int) -> int:
    """A shell-style exit status from ``Popen.returncode``/``Process.exitcode``: killed by signal N is 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def grace_period() -> float:
    """Seconds a stopped process gets between SIGTERM and SIGKILL: ``FABRIC_TERMINATE_GRACE``, else 5."""
    try:
        return float(os.environ.get(GRACE_VARIABLE, DEFAULT_GRACE_S))
    except ValueError:
        return DEFAULT_GRACE_S


def live_processes() -> dict[int, tuple[int, int]]:
    """Every live process (not a zombie) -> ``(parent pid, session id)``, read from ``/proc`` (empty without it)."""
    found: dict[int, tuple[int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, session
        if fields[0] not in ("Z", "X"):
            found[int(entry)] = (int(fields[1]), int(fields[3]))
    return found


def session_processes(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a job started with ``start_new_session=True`` has its pid as id)."""
    return [pid for pid, (_, session) in live_processes().items() if session == sid]


def new_process_group() -> dict[str, Any]:
    """``subprocess.Popen`` keywords that make the child lead a process group of its own (nothing on Windows)."""
    if os.name != "posix":
        return {}
    return {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGKILL the child when this process (its parent) dies, or ``None`` where
    that does not exist. libc is resolved here, in the parent, so the child makes one foreign call between fork and
    exec."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return set_death_signal


def die_with_parent(parent_pid: int | None = None) -> None:
    """From inside a child: be SIGKILLed by Linux when the parent dies (a no-op elsewhere). With ``parent_pid``,
    exit at once if the parent is already gone."""
    prctl = _prctl()
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _running(process: Any) -> bool:
    """For a ``subprocess.Popen`` or a ``multiprocessing.Process``: still running (not yet reaped)."""
    poll = getattr(process, "poll", None)
    return poll() is None if poll is not None else process.is_alive()


def _wait(process: Any, timeout: float) -> None:
    if hasattr(process, "poll"):
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    else:
        process.join(timeout=timeout)


def signal_process_group(process: Any, signum: int) -> None:
    """Send ``signum`` to the process group ``process`` leads (what it started, too); to the process alone when it
    leads none (a ``multiprocessing`` worker) and is still running. Gone is fine."""
    if hasattr(os, "killpg"):
        try:
            os.killpg(process.pid, signum)
            return
        except ProcessLookupError:
            pass  # it leads no group (any more): the process itself, below, if it still runs
        except PermissionError:
            return
    if not _running(process):
        return  # reaped: its pid may belong to another process by now
    try:
        if hasattr(process, "send_signal"):
            process.send_signal(signum)
        else:
            os.kill(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def start_rank_process(
    command: list[str], env: dict[str, str], error_file: str | None = None, **popen: Any
) -> subprocess.Popen:
    """Start one rank of a job: ``subprocess.Popen(command, env=...)`` leading a process group of its own (stopping
    it stops what it started) and killed when this process dies; with ``error_file`` the rank records its uncaught
    exception there (``ERROR_FILE_VARIABLE``), which :func:`rank_failure` reads back. ``popen``: more ``Popen``
    keywords (``cwd``, ``stdout``, ...)."""
    if error_file is not None:
        from fabric_core.runtime.failures import ERROR_FILE_VARIABLE

        env = {**env, ERROR_FILE_VARIABLE: error_file}
    return subprocess.Popen(command, env=env, preexec_fn=parent_death_signal(), **new_process_group(), **popen)  # noqa: S603 (the job's own command line)


def rank_failure(label: str, process: subprocess.Popen, error_file: str | None = None) -> Any:
    """How a rank started by :func:`start_rank_process` ended, as a ``RankFailure`` for ``report_failures`` (its
    shell-style exit status, the exception it recorded in ``error_file`` if any); call it once the process ended."""
    from fabric_core.runtime.failures import RankFailure, read_error_file

    code = process.returncode if process.returncode is not None else process.poll()
    error = read_error_file(error_file) if error_file is not None else None
    return RankFailure(label, process.pid, exit_status(code) if code is not None else 1, error)


def stop_processes(processes: Iterable[Any], grace: float | None = None) -> None:
    """Stop ``processes`` (``subprocess.Popen`` or ``multiprocessing.Process`` objects) with what they started:
    SIGTERM to each running one's group, SIGKILL to every group still there after ``grace`` seconds (default
    :func:`grace_period`), also of processes that ended meanwhile (their grandchildren may live on), then reap."""
    processes = list(processes)
    grace = grace_period() if grace is None else grace
    running = [p for p in processes if _running(p)]
    for process in running:
        signal_process_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in running:
        _wait(process, max(0.0, deadline - time.monotonic()))
    for process in processes:
        signal_process_group(process, signal.SIGKILL)
    for process in processes:
        _wait(process, max(grace, 1.0))
