"""The parts of a save the training loop does not wait for, run by one background thread per process.

Two uses:

* **Durability** of a synchronous ``fabric.save``: when the call returns the checkpoint is already at its path
  (renamed over the previous one); forcing it to disk (``fsync`` of the file and of its folder) happens here.
* **Asynchronous saves** (``fabric.save(..., async_save=True)``): the caller waits only for a snapshot of the
  state; serialisation, the commit to the path and durability happen here.

Work runs in submission order. ``wait(path)`` waits for the saves of one target (a new save of that target, and
``fabric.load`` of it, call it first); :func:`wait_all` waits for everything and runs at interpreter exit, so a
normal exit never drops a checkpoint. An error in the background is kept and raised by the next save, load or
wait of this process (and printed at exit if nothing asked), never lost.

The thread exists only while there is work: it is started by :func:`submit` and ends when the queue is empty, so
once :meth:`CheckpointHandle.wait` or :func:`wait_all` has returned and nothing else was submitted, no thread of
ours is left (a test harness that checks for stray threads sees none).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fabric_core.io.location import CheckpointLocation

__all__ = ["BackgroundSaveError", "CheckpointHandle", "NotDurableError", "submit", "wait_all", "wait_for_save"]

THREAD_NAME = "fabric-checkpoint"


class BackgroundSaveError(RuntimeError):
    """A save that finished in the background failed (the message says what is at its path now)."""


class NotDurableError(OSError):
    """The checkpoint is in place, but forcing it to disk failed: it may not survive a power cut."""


class CheckpointHandle:
    """A save in progress. ``wait()`` blocks until the save's background part is done and raises its error.

    For a synchronous ``fabric.save`` the checkpoint is at its path already; ``wait()`` adds durability (it is on
    disk, a power cut keeps it). For ``async_save=True``, ``wait()`` returns once the checkpoint is at its path and
    durable.
    """

    def __init__(self, path: str, future: Future, before_wait: Callable[[], Any] | None = None) -> None:
        self.path = path
        self._future = future
        #: Called by :meth:`wait` first, in the waiting thread: what the caller's side must finish for the background
        #: part to complete (a memory snapshot's last copies, which otherwise wait for the next optimizer step).
        self.before_wait = before_wait

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is complete (see the class); raise :class:`BackgroundSaveError` if it failed."""
        if self.before_wait is not None:
            self.before_wait()
        _raise_from(self._future, self.path, timeout)
        _forget(self._future)
        _join_if_idle()

    def __repr__(self) -> str:
        return f"CheckpointHandle(path={self.path!r}, done={self.done()})"


_lock = threading.Lock()
_queue: deque[tuple[Future, Callable[[], Any]]] = deque()
_thread: threading.Thread | None = None
_running: Future | None = None  # the work the thread is doing now
_pending: dict[str, list[Future]] = {}
_failed: list[tuple[str, Future]] = []  # failed in the background and not yet reported to the caller
_worker = threading.local()


def _key(path: Any) -> str:
    location = CheckpointLocation.of(path)
    return str(location) if location.is_url else str(location.path.absolute())


def in_worker() -> bool:
    """Whether the caller runs in the background thread (its saves must not queue more background work)."""
    return getattr(_worker, "active", False)


def _work_loop() -> None:
    global _thread, _running
    _worker.active = True
    while True:
        with _lock:
            _running = None
            if not _queue:
                _thread = None  # decided under the lock: a later submit starts a new thread
                return
            future, work = _queue.popleft()
            _running = future
        if not future.set_running_or_notify_cancel():
            continue
        try:
            result = work()
        except BaseException as err:  # noqa: BLE001 - kept and raised to the caller by wait()
            future.set_exception(err)
        else:
            future.set_result(result)


def submit(path: Any, work: Callable[[], Any]) -> CheckpointHandle:
    """Run ``work`` (the rest of the save of ``path``) in the background, after what was submitted before."""
    global _thread
    key = _key(path)
    future: Future = Future()
    future.add_done_callback(lambda f: _finished(key, f))
    with _lock:
        _queue.append((future, work))
        _pending.setdefault(key, []).append(future)
        if _thread is None:
            _thread = threading.Thread(target=_work_loop, name=THREAD_NAME, daemon=True)
            _thread.start()
    return CheckpointHandle(key, future)


def handle(path: Any) -> CheckpointHandle:
    """A handle that completes when every save of ``path`` submitted so far has (completed at once if none)."""
    key = _key(path)
    with _lock:
        futures = list(_pending.get(key, []))
    if not futures:
        return completed(path)
    return CheckpointHandle(key, futures[-1])  # work runs in order: the last one finishing means all did


def completed(path: Any) -> CheckpointHandle:
    """A handle for a save this rank has nothing (more) to do for."""
    future: Future = Future()
    future.set_result(None)
    return CheckpointHandle(_key(path), future)


def _finished(key: str, future: Future) -> None:
    with _lock:
        futures = _pending.get(key, [])
        if future in futures:
            futures.remove(future)
        if not futures:
            _pending.pop(key, None)
        if future.exception() is not None:
            _failed.append((key, future))


def _forget(future: Future) -> None:
    with _lock:
        _failed[:] = [(k, f) for k, f in _failed if f is not future]


def _join_if_idle() -> None:
    """Wait for the thread to end when nothing is queued (it is on its way out), so none outlives a wait."""
    if in_worker():
        return
    with _lock:
        idle = not _queue and (_running is None or _running.done())
        thread = _thread if idle else None
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _raise_from(future: Future, key: str, timeout: float | None = None) -> None:
    error = future.exception(timeout=timeout)
    if error is not None:
        _forget(future)
        if isinstance(error, NotDurableError):
            raise BackgroundSaveError(f"Saving the checkpoint {key!r}: {error}") from error
        raise BackgroundSaveError(
            f"Saving the checkpoint {key!r} failed in the background: {type(error).__name__}: {error}. The"
            " previous checkpoint at that path, if any, is intact."
        ) from error


def raise_failures() -> None:
    """Raise the first background failure no caller has seen yet."""
    with _lock:
        failed = list(_failed)
    for key, future in failed:
        _raise_from(future, key)


def wait_for_save(path: Any) -> None:
    """Wait for every in-flight save of ``path``; then raise any unreported background failure.

    In the background thread itself this returns at once: its work runs in order, so what came before is done.
    """
    if in_worker():
        return
    key = _key(path)
    with _lock:
        futures = list(_pending.get(key, []))
    for future in futures:
        future.exception()  # wait; the error is raised below, once
    raise_failures()


def wait_all() -> None:
    """Wait for every in-flight save of this process (and for the thread to end); then raise any unreported
    background failure."""
    if in_worker():
        return
    with _lock:
        futures = [f for fs in _pending.values() for f in fs]
    for future in futures:
        future.exception()
    _join_if_idle()
    raise_failures()


def pending() -> int:
    """How many saves are in flight."""
    with _lock:
        return sum(len(fs) for fs in _pending.values())


def _at_exit() -> None:
    try:
        wait_all()
    except BackgroundSaveError as err:
        sys.stderr.write(f"[fabric] {err}\n")


def _after_fork_in_child() -> None:
    """A forked child has no background thread (only the forking thread survives a fork): start empty."""
    global _thread, _lock, _running
    _lock = threading.Lock()
    _thread = _running = None
    _queue.clear()
    _pending.clear()
    _failed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# Registered at import, so it runs after any atexit handler registered later (LIFO): the background work finishes
# while the process group and the interpreter are still fully alive.
atexit.register(_at_exit)
