"""The parts of a save the training loop does not wait for, run in one background thread per process.

Two uses:

* **Durability** of a synchronous ``fabric.save``: the caller waits while the state is serialised into a hidden
  temporary file (what ``torch.save`` costs); forcing it to disk (``fsync``), renaming it over the target and
  syncing the folder happen here. Until that rename the target still names the previous, complete checkpoint.
* **Asynchronous saves** (``fabric.save(..., async_save=True)``): the caller waits only for a snapshot of the
  state; serialisation, durability and the commit happen here.

Work runs in submission order. ``wait(path)`` waits for the saves of one target (a new save of that target, and
``fabric.load`` of it, call it first); :func:`wait_all` waits for everything and runs at interpreter exit, so a
normal exit never drops a checkpoint. An error in the background is kept and raised by the next save, load or
wait of this process (and printed at exit if nothing asked), never lost.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["BackgroundSaveError", "CheckpointHandle", "submit", "wait", "wait_all"]


class BackgroundSaveError(RuntimeError):
    """A save that finished in the background failed; the previous checkpoint at its path is intact."""


class CheckpointHandle:
    """A save in progress: ``wait()`` blocks until the checkpoint is durable at its path (and raises its error)."""

    def __init__(self, path: str, future: Future) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed; raise :class:`BackgroundSaveError` if the save failed."""
        _raise_from(self._future, self.path, timeout)
        _forget(self._future)

    def __repr__(self) -> str:
        return f"CheckpointHandle(path={self.path!r}, done={self.done()})"


_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_pending: dict[str, list[Future]] = {}
_failed: list[tuple[str, Future]] = []  # failed in the background and not yet reported to the caller


def _key(path: Any) -> str:
    text = os.fspath(path) if not isinstance(path, str) else path
    return text if "://" in text else str(Path(text).absolute())


_worker = threading.local()


def in_worker() -> bool:
    """Whether the caller runs in the background thread (its saves must not queue more background work)."""
    return getattr(_worker, "active", False)


def _run(work: Callable[[], Any]) -> Any:
    _worker.active = True
    try:
        return work()
    finally:
        _worker.active = False


def submit(path: Any, work: Callable[[], Any]) -> CheckpointHandle:
    """Run ``work`` (the rest of the save of ``path``) in the background; return its handle."""
    global _executor
    key = _key(path)
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fabric-checkpoint")
        future = _executor.submit(_run, work)
        _pending.setdefault(key, []).append(future)
    future.add_done_callback(lambda f: _finished(key, f))
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


def _raise_from(future: Future, key: str, timeout: float | None = None) -> None:
    error = future.exception(timeout=timeout)
    if error is not None:
        _forget(future)
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


def wait(path: Any) -> None:
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
    """Wait for every in-flight save of this process; then raise any unreported background failure."""
    if in_worker():
        return
    with _lock:
        futures = [f for fs in _pending.values() for f in fs]
    for future in futures:
        future.exception()
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


# Registered at import, so it runs after any atexit handler registered later (LIFO): the background work finishes
# while the process group and the interpreter are still fully alive.
atexit.register(_at_exit)
