"""A failed rank's own error, carried to the end of the job's output.

When one rank dies, the others usually fail right after it with errors that only say a peer went away (gloo's
"Connection closed by peer"), and those are what a reader sees last. So every process we start writes its uncaught
exception to an error file the launcher chose, and the launcher ends the job by naming the rank that failed first
and quoting its error, whatever the order in which the processes' output arrived.

* In a started process, :func:`record_uncaught_errors` (called by ``Fabric()``) wraps ``sys.excepthook``: an
  uncaught exception is written to ``FABRIC_ERROR_FILE`` (our subprocess launcher sets it for each child) or
  ``TORCHELASTIC_ERROR_FILE`` (torchrun sets it for each worker; ``fabric run`` uses torchrun), then printed as
  usual. The format is torch elastic's (what its ``@record`` writes), with a nanosecond timestamp added.
* A launcher collects :class:`RankFailure` objects (exit code, and the recorded error when there is one) and
  prints :func:`report`: the root cause first with its traceback, then the ranks that failed after it.

Which failure came first: a rank that died without a Python error (a signal, ``os._exit``) is listed first, since
a peer's death is what makes the others raise; recorded errors follow in the order they were raised; a rank ended
by SIGTERM without an error comes last (that is how launchers stop the others). Only the standard library is
imported here.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterable
from typing import Any, NamedTuple

#: Set by the subprocess launcher for each child: where the child writes its uncaught exception.
ERROR_FILE_VARIABLE = "FABRIC_ERROR_FILE"
#: torch elastic's variable (torchrun sets it for every worker).
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
#: Lines of a traceback quoted in a report (its end: where it was raised, and the message).
TRACEBACK_LINES = 30

_installed = False


def error_file_path() -> str | None:
    return os.environ.get(ERROR_FILE_VARIABLE) or os.environ.get(TORCHELASTIC_ERROR_FILE) or None


def record_uncaught_errors() -> None:
    """In a process a launcher started: write an uncaught exception to the launcher's error file, then print it as
    usual. Installed once per process; nothing happens when no launcher asked for an error file."""
    global _installed
    if _installed or error_file_path() is None:
        return
    _installed = True
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            write_error_file(exc_type, exc, tb)
        finally:
            previous(exc_type, exc, tb)

    sys.excepthook = excepthook


def write_error_file(exc_type: type[BaseException], exc: BaseException, tb: Any, path: str | None = None) -> None:
    """Write ``exc`` in torch elastic's error-file format (plus ``fabric_time_ns``); never raises."""
    callstack = "".join(traceback.format_exception(exc_type, exc, tb))
    write_record(f"{exc_type.__name__}: {exc}", callstack, path)


def write_record(message: str, callstack: str, path: str | None = None) -> None:
    """Write a failure of this process (``message``, and the stack or traceback that explains it) where the launcher
    looks for it; never raises (a process that is failing must still end)."""
    path = path or error_file_path()
    if not path:
        return
    now = time.time_ns()
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(now // 1_000_000_000),
                "fabric_time_ns": str(now),
            },
        }
    }
    try:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:  # the record is a courtesy: a full or read-only disk must not mask the error being recorded
        pass


class RecordedError(NamedTuple):
    message: str
    traceback: str
    time_ns: int


def read_error_file(path: str | None) -> RecordedError | None:
    """The error a process recorded at ``path`` (our format or torch elastic's), or ``None``."""
    if not path:
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        mtime = os.stat(path).st_mtime_ns
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if isinstance(message, str):  # torch's other format: {"message": "...", "timestamp": ...}
        return RecordedError(message, "", int(data.get("timestamp", 0)) * 1_000_000_000 or mtime)
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo", {}) or {}
    stamp = extra.get("fabric_time_ns")
    time_ns = int(stamp) if stamp else mtime
    return RecordedError(str(message.get("message", "")), str(extra.get("py_callstack", "")), time_ns)


def exit_description(code: int) -> str:
    """`` (killed by SIGKILL)`` for an exit code that means death by a signal (128 + N), else ``""``."""
    if code > 128:
        try:
            return f" (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return ""


class RankFailure(NamedTuple):
    """One process of the job that ended non-zero."""

    label: str  # "local rank 1" / "rank 3 (local rank 1)"
    pid: int | None
    exit_code: int  # shell style: 128 + N for signal N
    error: RecordedError | None = None

    def headline(self) -> str:
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        died = exit_description(self.exit_code)
        if self.error is not None:
            what = f": {self.error.message}"
        elif self.exit_code == 1:  # what an uncaught exception gives, raised before `Fabric()` could record it
            what = ", with no error recorded (a Python error before `Fabric()` was created? its traceback is above)"
        else:
            what = ", without a Python error"
        return f"{self.label}{pid} exited with code {self.exit_code}{died}{what}"


def first_failures(failures: Iterable[RankFailure]) -> list[RankFailure]:
    """Root cause first: deaths without a recorded error (a signal, a hard exit), then errors in the order they were
    raised, then processes ended by SIGTERM without an error (what launchers send to stop the others)."""

    def order(failure: RankFailure) -> tuple[int, int]:
        if failure.error is not None:
            return 1, failure.error.time_ns
        return (2 if failure.exit_code == 128 + signal.SIGTERM else 0), 0

    return sorted(failures, key=order)


def job_exit_code(failures: Iterable[RankFailure]) -> int:
    """The exit status of a job that failed: its first failure's code (1 when none), except that a process which
    raised and was then stopped by its launcher while exiting (SIGTERM) counts as the 1 of an uncaught exception."""
    ordered = first_failures(failures)
    if not ordered:
        return 1
    root = ordered[0]
    if root.error is not None and root.exit_code == 128 + signal.SIGTERM:
        return 1
    return root.exit_code if 0 < root.exit_code < 256 else 1


def _tail(text: str, lines: int = TRACEBACK_LINES) -> str:
    kept = text.rstrip().splitlines()
    shown = (["..."] if len(kept) > lines else []) + kept[-lines:]
    return "\n".join(f"    {line}" for line in shown)


def report_failures(failures: Iterable[RankFailure]) -> str:
    """The job's last words: the process that failed first, its own error (traceback end), and who failed after."""
    ordered = first_failures(failures)
    if not ordered:
        return ""
    root, others = ordered[0], ordered[1:]
    lines = [f"[fabric] First failure: {root.headline()}"]
    if root.error is not None and root.error.traceback:
        lines.append(f"[fabric] {root.label}'s error:")
        lines.append(_tail(root.error.traceback))
    elif root.error is None and root.exit_code == 1:
        lines.append(
            f"[fabric] {root.label} recorded no error: exit code 1 is what an uncaught Python exception gives, so it"
            " likely raised before creating `Fabric()` (which records errors); its traceback is in its output above."
        )
    elif root.error is None:
        lines.append(
            f"[fabric] {root.label} ended without raising a Python exception (a signal, a crash in native code, or"
            " os._exit): its own output above, or the system log (out of memory?), says why."
        )
    for other in others:
        lines.append(f"[fabric] Failed after it (likely a consequence): {other.headline()}")
    return "\n".join(lines) + "\n"
