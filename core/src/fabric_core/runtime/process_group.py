"""Ending a process that used ``torch.distributed`` cleanly, so a successful run exits 0 every time.

Why a successful 2-process gloo run sometimes exited with 134 ("terminate called without an active
exception"), found with a core dump: a collective launched during ``backward`` captures the thread-local state,
which in torch 2.13 holds a Python object (the ``contextvars`` context that autograd stashes for the duration of
backward). The gloo worker thread that ran the collective drops that object after marking the work complete; if
it is descheduled at that moment (a busy machine) and the main thread meanwhile reaches interpreter shutdown,
the worker needs the GIL of a finalizing interpreter, Python 3.11 ends the thread with ``pthread_exit``, and the
forced unwind through a ``noexcept`` destructor calls ``std::terminate``.

So at exit (:func:`release_at_exit`, registered once by the strategy that creates a process group) this module
destroys the group and then gives native threads a moment, with the GIL released, until none of them is
runnable: a worker waiting for the GIL to drop its last Python reference gets it while Python is still alive.
``fabric.teardown()`` destroys the group early. Nothing here imports torch.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

_registered = False


def release_process_group() -> None:
    """Destroy this process's default process group (and its subgroups), if there is one; never raises."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):  # what destroy_process_group and a backend's shutdown raise
        pass


def _runnable_native_threads() -> bool:
    """Whether a thread of this process other than the caller is runnable (Linux; ``False`` elsewhere)."""
    me = str(threading.get_native_id())
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields and fields[0] == "R":
            return True
    return False


def settle_native_threads(minimum_s: float = 0.02, maximum_s: float = 1.0) -> None:
    """Sleep (GIL released) until no other thread is runnable twice in a row, at least ``minimum_s``."""
    start = time.monotonic()
    quiet = 0
    while time.monotonic() - start < maximum_s:
        time.sleep(0.005)
        quiet = 0 if _runnable_native_threads() else quiet + 1
        if quiet >= 2 and time.monotonic() - start >= minimum_s:
            return


_abandoned = False


def abandon_at_exit() -> None:
    """This process is failing: leave its process group to die with it (peers keep waiting until the launcher
    stops them), so the launcher reports this process's error, not the peers' errors that its exit would cause."""
    global _abandoned
    _abandoned = True


def _at_exit() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or _abandoned:
        return
    background = sys.modules.get("fabric_core.io.background")
    if background is not None:  # asynchronous saves may still agree over a process group: let them land first
        try:
            background.wait_all()
        except Exception as err:  # an asynchronous save's own error (whatever its writer raised) is reported, the exit goes on
            sys.stderr.write(f"[fabric] {err}\n")
    release_process_group()
    settle_native_threads()


def release_at_exit() -> None:
    """Make sure the process group is released, and its workers settled, at normal interpreter exit (once)."""
    global _registered
    if not _registered:
        atexit.register(_at_exit)
        _registered = True
