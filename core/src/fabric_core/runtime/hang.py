"""Hang detection: a rank that makes no progress for ``FABRIC_HANG_TIMEOUT`` seconds ends the job, named, with its stack.

Without it, a rank stuck in user code holds every other rank in their next collective until the collective timeout
(30 minutes by default), and the error then names neither the rank nor the line.

**Progress** is a call of Fabric's training loop: ``fabric.backward``, ``optimizer.step()`` of a set-up optimizer
(both report inline, and only while :data:`watching`: they are the per-step hot paths), the facade's methods marked
:func:`counts_as_progress` (the collectives ``barrier``, ``broadcast``, ``all_gather``, ``all_reduce``,
``fabric.save``/``load``, ``fabric.setup*``), and :func:`report_progress` for code that legitimately runs long
without them (an evaluation loop, a download). A forward pass or a batch alone does not count (they are the hottest
calls; a training step always has a backward).

Once the processes are launched, a daemon thread in every rank checks the time since the last progress:

* past the limit, if the main thread is in the user's code (``time.sleep``, a Python loop, I/O): this rank is what
  the others wait for. It prints its rank, the line it is at and the stack of every thread (``faulthandler``),
  records the same as its error (so the launcher's last lines quote it) and ends with exit code 124 (as
  ``timeout(1)``); the launcher then ends the job;
* a rank whose main thread is inside library code (torch, Fabric and its plugins, the frameworks they drive, the
  standard library: a collective, a backward, an import) is usually waiting for another rank: it gets one more
  limit, so the stuck rank is reported first. Which packages are library code beyond torch, the core and the
  standard library, each installed plugin says for its own (the ``fabric_library_packages`` hook, asked by
  ``Fabric`` when the watchdog starts);
* if the thread itself cannot run (native code holding the GIL), ``faulthandler.dump_traceback_later`` fires at three
  limits: it prints every thread's stack and exits with code 1.

``FABRIC_HANG_TIMEOUT`` unset, empty or ``0``: off (the default). It should be below the collective timeout
(``FABRIC_TIMEOUT``), which otherwise fires first without naming the stuck rank.
"""

from __future__ import annotations

import atexit
import faulthandler
import linecache
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from functools import wraps
from types import FrameType
from typing import Any, TypeVar

from fabric_core.runtime import failures

HANG_TIMEOUT_VARIABLE = "FABRIC_HANG_TIMEOUT"
#: The exit code of a rank ended for making no progress (``timeout(1)``'s).
HANG_EXIT_CODE = 124
#: What a plugin may say about a package's frames (``fabric_library_packages``): library code, or library code
#: where a rank whose innermost frame is there waits for the other ranks (a collective).
LIBRARY, COLLECTIVE = "library", "collective"
#: Folders whose frames mean "waiting for the other ranks" when they are innermost (torch's; plugins add theirs).
_WAITING_IN: set[str] = {"torch/distributed/", "torch/autograd/", "torch/nn/parallel/"}
#: Top-level packages whose frames are library code, skipped when naming the user's line (plugins add theirs).
_LIBRARIES: set[str] = {"fabric_core", "torch"}

# The standard library's folder, as ``sysconfig.get_paths()["stdlib"]`` says, without importing ``sysconfig`` (about
# 2 ms at every `import fabric_core`): the folder ``os`` was loaded from.
_STDLIB = os.path.dirname(os.__file__)

_clock = time.monotonic
_last = _clock()
_watchdog: _Watchdog | None = None
#: Whether a watchdog watches this process now. The per-step calls (``fabric.backward``, ``optimizer.step()``) read it
#: and report progress only then: without hang detection a step costs no call here (public, read-only elsewhere).
watching = False
_on_hang: list[Callable[[failures.RecordedError], None]] = []


class HangError(RuntimeError):
    """The name under which a rank's lack of progress is recorded and reported."""


def report_progress() -> None:
    """Tell the hang detector that this rank is making progress (Fabric's training calls do it themselves)."""
    global _last
    _last = _clock()


def hang_timeout() -> float | None:
    """``FABRIC_HANG_TIMEOUT`` in seconds, or ``None`` when hang detection is off."""
    value = os.environ.get(HANG_TIMEOUT_VARIABLE, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(
            f"`{HANG_TIMEOUT_VARIABLE}={value}` must be a number of seconds (0 or unset: no hang detection)."
        ) from None
    if seconds < 0:
        raise ValueError(f"`{HANG_TIMEOUT_VARIABLE}={value}` must not be negative (0 or unset: no hang detection).")
    return seconds or None


def on_hang(callback: Callable[[failures.RecordedError], None]) -> None:
    """Let ``callback`` end the job when this rank hangs (a launcher whose children must be stopped first); it is
    given this rank's record and should not return. Without one, the process exits with :data:`HANG_EXIT_CODE`."""
    _on_hang.append(callback)


F = TypeVar("F", bound=Callable[..., Any])


def counts_as_progress(method: F) -> F:
    """Mark a call of the training loop as progress, before and after it runs (a collective, a save, a setup).

    For calls that take long next to the extra frame; the per-step ones (``backward``, ``optimizer.step()``)
    report inline, and only while :data:`watching`."""

    @wraps(method)
    def reporting(*args: Any, **kwargs: Any) -> Any:
        report_progress()
        result = method(*args, **kwargs)
        report_progress()
        return result

    return reporting  # type: ignore[return-value]


def add_library_packages(packages: Mapping[str, str]) -> None:
    """Read the frames of ``packages`` (``{"deepspeed": "library", "deepspeed.comm": "collective"}``) as library code
    in the hang report; a ``"collective"`` (sub)package is also where a rank waits for the others."""
    for package, role in packages.items():
        if role not in (LIBRARY, COLLECTIVE) or not isinstance(package, str) or not package:
            raise ValueError(
                f"`fabric_library_packages` answered {package!r}: {role!r}; map an import package's name to"
                f" {LIBRARY!r} or {COLLECTIVE!r}."
            )
        _LIBRARIES.add(package.split(".", 1)[0])
        if role == COLLECTIVE:
            _WAITING_IN.add(package.replace(".", "/") + "/")


def start_watchdog(rank: int, library_packages: Callable[[], Mapping[str, str]] | None = None) -> None:
    """Start this process's hang detector for ``rank`` if ``FABRIC_HANG_TIMEOUT`` asks for one (once per process).

    ``library_packages`` is asked then (only then) for the installed plugins' packages (:func:`add_library_packages`).
    """
    global _watchdog, watching
    limit = hang_timeout()
    if limit is None:
        return
    if library_packages is not None:
        add_library_packages(library_packages())
    report_progress()
    watching = True
    if _watchdog is not None and _watchdog.is_alive():
        _watchdog.rank = rank
        return
    _watchdog = _Watchdog(rank, limit, threading.main_thread().ident)
    _watchdog.start()
    atexit.register(stop_watchdog)  # the script is done: waiting for the other ranks at exit is not a hang


def stop_watchdog() -> None:
    """The job is ending (a launcher is stopping the ranks): this process must not report a hang any more."""
    global watching
    watching = False
    if _watchdog is not None:
        _watchdog.stopped = True
        faulthandler.cancel_dump_traceback_later()


def _importing(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _is_library(filename: str) -> bool:
    parts = filename.replace(os.sep, "/").split("/")
    if filename.startswith(("<", _STDLIB)) or "site-packages" in parts:
        return True
    return any(part in _LIBRARIES for part in parts[:-1])


def describe_stack(frame: FrameType | None, rank: int, idle: float, limit: float) -> tuple[str, str, bool]:
    """``(message, stack, in_library)`` for the main thread at ``frame``: where it is, and whether its innermost frame
    is library code (a collective, a backward, an import: often waiting for another rank, so it gets more time)."""
    stack = traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()
    text = "".join(stack.format())
    head = f"Rank {rank} made no progress for {idle:.1f} s ({HANG_TIMEOUT_VARIABLE}={limit:g})"
    if not stack:
        return f"{head}; its main thread has no Python frame.", text, False
    innermost = stack[-1]
    in_library = _is_library(innermost.filename)
    peers = any(marker in innermost.filename.replace(os.sep, "/") for marker in _WAITING_IN)
    user = next((f for f in reversed(stack) if not _is_library(f.filename)), None)
    at = ""
    if user is not None:
        line = (user.line or linecache.getline(user.filename, user.lineno or 0)).strip()
        at = f"{user.filename}:{user.lineno} in {user.name}(): {line}"
    called = f", called at {at}" if at else ""
    where = f"{innermost.name}() ({innermost.filename}:{innermost.lineno}){called}"
    if peers:
        message = f"{head}: it is waiting in {where}. Another rank has probably stopped before this call."
    elif in_library:
        message = f"{head}: it is inside {where}"
    else:
        message = f"{head}: it is running {at or where}"
    return message, text, in_library


class _Watchdog(threading.Thread):
    def __init__(self, rank: int, limit: float, main_ident: int | None) -> None:
        super().__init__(name="fabric-hang-watchdog", daemon=True)
        self.rank = rank
        self.limit = limit
        self.main_ident = main_ident
        self.interval = min(0.5, limit / 10)
        self.stopped = False

    def run(self) -> None:
        while not self.stopped:
            # Backstop for a main thread that holds the GIL in native code: then this thread cannot run to re-arm it.
            faulthandler.dump_traceback_later(3 * self.limit, exit=True)
            time.sleep(self.interval)
            idle = _clock() - _last
            if idle < self.limit or self.stopped:
                continue
            frame = sys._current_frames().get(self.main_ident) if self.main_ident is not None else None
            if _importing(frame):
                report_progress()  # a slow first import (torch._dynamo in the first setup) is work, not a hang
                continue
            message, stack, in_library = describe_stack(frame, self.rank, idle, self.limit)
            if in_library and idle < 2 * self.limit:
                continue  # give the rank that does not arrive the chance to be reported first
            self.fire(message, stack)
        faulthandler.cancel_dump_traceback_later()

    def fire(self, message: str, stack: str) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self.stopped:
            return
        headline = f"{HangError.__name__}: {message}"
        stack = f"Stack of the main thread (most recent call last):\n{stack}{headline}\n"
        record = failures.RecordedError(headline, stack, time.time_ns())
        try:
            sys.stderr.write(f"[fabric] {message}\n[fabric] Stacks of rank {self.rank}'s threads:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except Exception:
            pass
        failures.write_record(headline, stack)
        for callback in _on_hang:
            callback(record)
        os._exit(HANG_EXIT_CODE)
