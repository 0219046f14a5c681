"""Crash-safe commits: write a checkpoint beside its target, make it durable, then swap it in.

Used by every format: :func:`~fabric_core.io.checkpoint_io.atomic_save` for single files and
:func:`commit_directory` for directories written by several ranks (sharded FSDP, DeepSpeed). At every moment the
target path holds either the previous or the new complete checkpoint.

**Leftovers.** A save that is killed (SIGKILL, preemption) cannot clean up after itself. Every temporary entry is
named ``.<target>.tmp-<host>-<pid>-<random>`` (``.old-`` for a previous directory set aside), and its writer holds
an exclusive ``flock`` on it while it works. The next save of the same target removes the entries of that target
whose writer is gone: the lock is free (the kernel released it when the writer died) and the name does not belong
to another live process on this host. A live writer's entry is never touched, and other targets' never looked at.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from fabric_core.io import remote

try:
    import fcntl
except ImportError:  # Windows: no flock; leftovers are then judged by process id only
    fcntl = None  # type: ignore[assignment]

TEMP_MARK = ".tmp-"
OLD_MARK = ".old-"
_OWNER = re.compile(r"^(?P<host>.*)-(?P<pid>\d+)-(?P<rand>[^-]+)$")


class Coordinator(Protocol):
    """What a multi-rank commit needs from the strategy: which rank leads, and two collectives."""

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def temp_prefix(target: Path, mark: str = TEMP_MARK) -> str:
    """The name prefix of this process's temporary entries for ``target`` (``mkstemp`` adds the random part)."""
    return f".{target.name}{mark}{_host()}-{os.getpid()}-"


def new_temp_path(target: Path, mark: str = TEMP_MARK) -> Path:
    return target.parent / f"{temp_prefix(target, mark)}{uuid.uuid4().hex[:12]}"


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is a temporary or set-aside entry of some save (never a checkpoint to load)."""
    name = path.name
    return name.startswith(".") and (TEMP_MARK in name or OLD_MARK in name)


# ---------------------------------------------------------------------------------------------------------- locks
class WriterLock:
    """An exclusive ``flock`` on a file or directory, held while a save writes there; released on close or death."""

    def __init__(self, path: Path) -> None:
        self.fd: int | None = None
        if fcntl is None:
            return
        flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
        self.fd = os.open(path, flags)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            self.fd = None
            raise

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def _writer_alive(entry: Path) -> bool:
    """Whether a live process may still be writing ``entry``."""
    if fcntl is not None:
        try:
            fd = os.open(entry, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if entry.is_dir() else 0))
        except OSError:
            return False  # vanished meanwhile, or unreadable: nothing to protect
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True  # somebody holds it: a live writer
        finally:
            os.close(fd)
    # The lock was free. Between creating an entry and locking it a writer holds no lock yet, so an entry named
    # after another live process of this host is spared (it is removed by a later save once that process is gone).
    for mark in (TEMP_MARK, OLD_MARK):
        if mark in entry.name:
            owner = _OWNER.match(entry.name.split(mark, 1)[1])
            break
    else:
        return False
    if owner is None or owner["host"] != _host():
        return False
    pid = int(owner["pid"])
    return pid != os.getpid() and _process_exists(pid)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def leftovers(target: Path) -> Iterator[Path]:
    """Temporary and set-aside entries of ``target`` left by saves whose writer is gone."""
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    prefixes = (f".{target.name}{TEMP_MARK}", f".{target.name}{OLD_MARK}")
    for name in names:
        if name.startswith(prefixes):
            entry = target.parent / name
            if not _writer_alive(entry):
                yield entry


def remove_leftovers(target: Path) -> list[Path]:
    """Remove what interrupted saves of ``target`` left beside it; returns what was removed."""
    removed = list(leftovers(target))
    for entry in removed:
        remove_path(entry)
    return removed


# ---------------------------------------------------------------------------------------------------------- moves
def fsync_directory(directory: Path) -> None:
    """Make a rename durable by syncing the directory entry; best effort (impossible on Windows)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree; missing is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; ``False`` where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def swap_into_place(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` to ``target``; an old entry there is replaced as a whole, never mixed.

    A file replaces a file with ``os.replace``. A directory is exchanged atomically with the old one on Linux;
    elsewhere the old one is first renamed aside (``.old-``), so at every moment one complete checkpoint exists.
    """
    if not os.path.lexists(target) or not tmp.is_dir():
        os.replace(tmp, target)
    elif exchange_paths(tmp, target):
        remove_path(tmp)  # now holds the old checkpoint
    else:
        old = new_temp_path(target, OLD_MARK)
        os.rename(target, old)
        os.rename(tmp, target)
        remove_path(old)
    fsync_directory(target.parent)


def check_replaceable(target: Path, is_checkpoint: Callable[[Path], bool], description: str = "a checkpoint") -> None:
    """Refuse to replace a non-empty directory that is not ``description`` (it may hold the user's files)."""
    if target.is_dir() and any(target.iterdir()) and not is_checkpoint(target):
        raise FileExistsError(
            f"Cannot save a checkpoint to {str(target)!r}: it is a non-empty directory that is not {description},"
            " and saving would replace it. Choose a new path, for example inside that directory."
        )
    if target.exists() and not target.is_dir():
        raise FileExistsError(
            f"Cannot save a checkpoint directory to {str(target)!r}: a file with that name exists. Remove it or"
            " choose another path."
        )


# ---------------------------------------------------------------------------------------------------------- commits
def commit_directory(target: str | os.PathLike, write: Callable[[Any], None], coordinator: Coordinator) -> None:
    """Write a checkpoint directory on every rank, crash-safely, and swap it in when every rank succeeded.

    1. Rank 0 removes what interrupted saves of ``target`` left, creates one hidden temporary directory beside
       it (holding its writer lock) and tells every rank its name (so all ranks agree on the path even if they
       were given different ones).
    2. Every rank calls ``write(tmp)``; then all ranks vote. Only if every rank succeeded does rank 0 swap the
       directory into place; then all vote again.
    3. On every rank, whatever happened (an error here or on another rank, a failed collective because a rank
       died, ``KeyboardInterrupt``), the temporary directory is removed in ``finally`` unless it was committed.

    The error of this rank is raised; if only another rank failed, a ``RuntimeError`` says so. The previous
    checkpoint at ``target`` is untouched by a failed save. A URL ``target`` is committed as described in
    :func:`commit_remote_directory`.
    """
    if remote.is_url(target):
        commit_remote_directory(str(target), write, coordinator)
        return
    staged = _stage_directory(Path(remote.local_path(target)), coordinator)
    error: Exception | None = None
    try:
        write(staged.tmp)
    except BaseException as err:  # noqa: B036 (agree on failure below, then clean up in finally)
        if not isinstance(err, Exception):
            staged.abandon()
            raise
        error = err
    staged.finish(error, coordinator)


def commit_directory_async(
    target: str | os.PathLike,
    start_write: Callable[[Path], Callable[[], None]],
    coordinator: Coordinator,
    background_coordinator: Coordinator,
) -> Any:
    """Like :func:`commit_directory`, but only the start of the write happens in the caller.

    ``start_write(tmp)`` begins this rank's write (e.g. torch.distributed.checkpoint's ``async_save``, which
    copies the state first) and returns a function that waits for it; for a URL ``target``, ``tmp`` is the URL of
    the new version (:func:`commit_remote_directory`). Waiting, the votes, the swap and the cleanup
    run in the background thread (:mod:`fabric_core.io.background`) and agree over ``background_coordinator``,
    whose collectives must not share a process group with the training loop's. Returns the save's handle.
    """
    from fabric_core.io import background

    staged: _StagedDirectory | _StagedVersion
    if remote.is_url(target):
        staged = _stage_version(str(target), coordinator)
        location: Any = staged.location
    else:
        staged = _stage_directory(Path(remote.local_path(target)), coordinator)
        location = staged.tmp
    try:
        wait = start_write(location)
    except BaseException:
        staged.abandon()
        raise

    def complete() -> None:
        error: Exception | None = None
        try:
            wait()
        except Exception as err:
            error = err
        staged.finish(error, background_coordinator)

    return background.submit(staged.target, complete)


class _StagedDirectory:
    """A temporary directory all ranks write into, committed (or removed) by :meth:`finish` on every rank."""

    def __init__(self, target: Path, tmp: Path, lock: WriterLock | None) -> None:
        self.target = target
        self.tmp = tmp
        self.lock = lock

    def abandon(self) -> None:
        if self.lock is not None:
            self.lock.release()
        remove_path(self.tmp)

    def finish(self, error: Exception | None, coordinator: Coordinator) -> None:
        committed = False
        try:
            if coordinator.reduce_boolean_decision(error is None, all=True):
                try:
                    if coordinator.is_global_zero:
                        swap_into_place(self.tmp, self.target)
                except Exception as err:
                    error = err
                if coordinator.reduce_boolean_decision(error is None, all=True):
                    committed = True
                    return
            if error is not None:
                raise error
            raise RuntimeError(
                f"Saving the checkpoint {str(self.target)!r} failed on another rank (see its error); the previous"
                " checkpoint, if any, was left untouched."
            )
        finally:
            if self.lock is not None:
                self.lock.release()
            if not committed:
                remove_path(self.tmp)


def _stage_directory(target: Path, coordinator: Coordinator) -> _StagedDirectory:
    lock: WriterLock | None = None
    tmp: Path | None = None
    try:
        if coordinator.is_global_zero:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_leftovers(target)
            tmp = new_temp_path(target)
            tmp.mkdir()
            lock = WriterLock(tmp)
        # Rank 0's paths for everyone: ranks given different paths (a timestamp in the name) still write together.
        agreed = coordinator.broadcast((str(target), str(tmp)) if tmp is not None else None, src=0)
        target, tmp = Path(agreed[0]), Path(agreed[1])
        tmp.mkdir(parents=True, exist_ok=True)
    except BaseException:
        if lock is not None:
            lock.release()
        if tmp is not None:
            remove_path(tmp)
        raise
    return _StagedDirectory(target, tmp, lock)


# ---------------------------------------------------------------------------------------------------------- remote
#: In a checkpoint folder on an object store: the name of the complete version (written last, in one PUT).
COMMIT_MARKER = ".fabric-committed"
VERSION_PREFIX = "v-"


def committed_version(url: str) -> str:
    """The folder that holds the checkpoint at ``url``: its committed version, or ``url`` itself (no versions)."""
    fs, path = remote.filesystem(url)
    marker = f"{path.rstrip('/')}/{COMMIT_MARKER}"
    if fs.exists(marker):
        with fs.open(marker, "rb") as file:
            version = file.read().decode().strip()
        return remote.join(url, version)
    return url


def commit_remote_directory(target: str, write: Callable[[str], None], coordinator: Coordinator) -> None:
    """Commit a directory checkpoint on an object store, where nothing can be renamed atomically.

    Every save writes a new version under ``target/v-<token>/``; only when every rank has written its part does
    rank 0 write ``target/.fabric-committed`` (one small object, replaced at once) naming that version, then
    delete the older versions. Readers follow the marker (:func:`committed_version`). So at every moment the
    marker names a complete version: a kill before it leaves the previous version committed, a kill after it at
    worst leaves an old version to delete. A failed save removes its version.
    """
    staged = _stage_version(target, coordinator)
    error: Exception | None = None
    try:
        write(staged.location)
    except Exception as err:
        error = err
    staged.finish(error, coordinator)


class _StagedVersion:
    """A new version folder at an object-store URL, committed (marker written) or removed by :meth:`finish`."""

    def __init__(self, target: str, version: str) -> None:
        self.target = target
        self.version = version
        self.location = remote.join(target, version)

    def abandon(self) -> None:
        self._remove()

    def _remove(self) -> None:
        try:
            remote.remove(self.location)
        except Exception:
            pass

    def finish(self, error: Exception | None, coordinator: Coordinator) -> None:
        committed = marked = False
        try:
            if coordinator.reduce_boolean_decision(error is None, all=True):
                try:
                    if coordinator.is_global_zero:
                        fs, path = remote.filesystem(self.target)
                        with fs.open(f"{path.rstrip('/')}/{COMMIT_MARKER}", "wb") as file:
                            file.write(self.version.encode())
                        marked = True
                        for entry in fs.ls(path, detail=False):  # best effort: an old version left behind harms nothing
                            name = entry.rstrip("/").rpartition("/")[2]
                            if name.startswith(VERSION_PREFIX) and name != self.version:
                                try:
                                    fs.rm(entry, recursive=True)
                                except Exception:
                                    pass
                except Exception as err:
                    error = err
                if coordinator.reduce_boolean_decision(error is None, all=True):
                    committed = True
                    return
            if error is not None:
                raise error
            raise RuntimeError(f"Saving the checkpoint {self.target!r} failed on another rank (see its error).")
        finally:
            if not committed and not marked and coordinator.is_global_zero:
                self._remove()


def _stage_version(target: str, coordinator: Coordinator) -> _StagedVersion:
    """Rank 0 names the new version; every rank writes into it."""
    version = coordinator.broadcast(f"{VERSION_PREFIX}{uuid.uuid4().hex[:12]}" if coordinator.is_global_zero else None)
    return _StagedVersion(target, version)
