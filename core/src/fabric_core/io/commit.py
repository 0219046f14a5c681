"""Crash-safe commits: write a checkpoint beside its target, then swap it in, whole.

Every format commits through here, so the crash safety exists once:

* :func:`atomic_save` writes one file (``torch.save`` into a hidden temporary file beside the target, then
  ``os.replace`` over it);
* :func:`commit_directory` / :func:`commit_directory_async` commit a directory written by several ranks (a local
  hidden directory swapped in, or a new version folder on an object store marked committed, see
  :mod:`fabric_core.io.remote`), after the two votes of :func:`~fabric_core.io.coordination.publish_together`.

At every moment the target path holds either the previous or the new complete checkpoint, and when these functions
return, the new one is at the target. Only durability against a power cut (``fsync``) may be left to the
background (``atomic_save(..., durable_in_background=True)``).

**Leftovers.** A save that is killed (SIGKILL, preemption) cannot clean up after itself. Every temporary entry is
named ``.<target>.tmp-<host>-<pid>-<random>`` (``.old-`` for a previous directory set aside), and its writer holds
an exclusive ``flock`` on it while it works. The next save of the same target removes the entries of that target
whose writer is gone: the lock is free (the kernel released it when the writer died) and the name does not belong
to another live process on this host. A live writer's entry is never touched, and other targets' never looked at.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from fabric_core.io import background, remote
from fabric_core.io.background import CheckpointHandle, NotDurableError
from fabric_core.io.coordination import ALONE, Coordinator, publish_together
from fabric_core.io.errors import unpicklable_value_error
from fabric_core.io.location import CheckpointLocation
from fabric_core.utilities.exceptions import guarded, on_failure

try:
    import fcntl
except ImportError:  # Windows: no flock; leftovers are then judged by process id only
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "Coordinator",
    "atomic_save",
    "check_replaceable",
    "commit_directory",
    "commit_file",
    "committed_folder",
    "commit_directory_async",
    "fsync_directory",
    "fsync_tree",
    "is_temporary",
    "leftovers",
    "remove_leftovers",
    "save_file",
]

TEMP_MARK = ".tmp-"
OLD_MARK = ".old-"
_OWNER = re.compile(r"^(?P<host>.*)-(?P<pid>\d+)-(?P<rand>[^-]+)$")


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
def _fsync_fd(path: str | os.PathLike, directory: bool) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make a rename durable by syncing the directory entry; best effort (impossible on Windows)."""
    _fsync_fd(directory, directory=True)


def fsync_tree(folder: str | os.PathLike) -> None:
    """Make every file under ``folder`` durable, then every folder (for writers that do not ``fsync``)."""
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync_fd(os.path.join(root, name), directory=False)
        fsync_directory(root)


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


def check_replaceable(
    target: CheckpointLocation | Path, is_checkpoint: Callable[[Path], bool], description: str = "a checkpoint"
) -> None:
    """Refuse to replace a non-empty local directory that is not ``description`` (it may hold the user's files).
    At a URL a folder checkpoint is a new version beside the old ones (:mod:`fabric_core.io.remote`): nothing to
    refuse."""
    if isinstance(target, CheckpointLocation):
        if target.is_url:
            return
        target = target.path
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




# ---------------------------------------------------------------------------------------------------------- one file
def _default_file_mode() -> int:
    """The permission bits a plain ``open(path, "w")`` would give, so atomic saves do not end up 0600."""
    umask: int | None = None
    try:
        # Linux exposes the umask read-only; this avoids the process-wide set-and-restore below.
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
                    break
    except (OSError, ValueError):
        umask = None
    if umask is None:
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range, do not wait


def _load_sync_file_range() -> Any:
    """``sync_file_range(2)`` from libc on Linux (Python has no binding), else ``None``."""
    if not hasattr(os, "sched_getaffinity"):  # cheap "is this Linux" check
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


#: The next checkpoint file written fails with this error after its first write (fabric chaos's "disk_full",
#: set in the rank that should fail: runtime/chaos.py). Taken by that write, so it fails once.
fail_next_write: OSError | None = None


def _take_injected_failure() -> OSError | None:
    global fail_next_write
    failure, fail_next_write = fail_next_write, None
    return failure


class _WritebackFile:
    """Write-through file wrapper that keeps the ``OSError`` of a failed write and, for a save that waits for its
    ``fsync``, starts disk writeback every few MiB while ``torch.save`` serialises (``sync_file_range``).

    Without the early writeback the whole checkpoint sits in the page cache until the final ``fsync``, which then
    waits for all of it; starting it early overlaps disk I/O with serialisation (docs/benchmarks.md). A save whose
    ``fsync`` runs in the background does not start it: that would only cost the caller.
    """

    CHUNK = 8 << 20

    def __init__(self, raw: Any, sync_file_range: Any) -> None:
        self._fail = _take_injected_failure()
        self._writes = 0
        self._raw = raw
        self._fd = raw.fileno()
        self._sync_file_range = sync_file_range
        self._written = 0
        self._started = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        if self._fail is not None:  # an injected failure (fabric chaos): after the first write, half way through
            self._writes += 1
            if self._writes > 1:
                self.error = self._fail
                raise self._fail
        if self._sync_file_range is None:  # only keep the error (torch would report a generic failure)
            try:
                return self._raw.write(data)
            except OSError as err:
                self.error = err
                raise
        view = memoryview(data).cast("B")  # one tensor arrives as one write: slice it so writeback starts early
        for start in range(0, len(view), self.CHUNK):
            try:
                self._written += self._raw.write(view[start : start + self.CHUNK])
            except OSError as err:
                self.error = err  # torch reports it as a generic "file write failed"; atomic_save names it
                raise
            if self._written - self._started >= self.CHUNK:
                self._raw.flush()
                self._sync_file_range(self._fd, self._started, self._written - self._started, _SYNC_FILE_RANGE_WRITE)
                self._started = self._written
        return len(view)

    def flush(self) -> None:
        self._raw.flush()


def _no_space(cause: BaseException | None) -> bool:
    return isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _no_space_error(target: Path, cause: OSError) -> OSError:
    return OSError(
        cause.errno,
        f"No space left to save the checkpoint {str(target)!r} ({os.strerror(cause.errno or errno.ENOSPC)}). Nothing"
        " was changed: the previous checkpoint at that path, if any, is intact and the partial file was removed."
        " Free some space or save elsewhere.",
    )


class _WrittenTemp:
    """A checkpoint serialised into its locked temporary file: moved into place (and made durable) or discarded."""

    def __init__(self, file: Any, name: str, target: Path) -> None:
        self.file = file
        self.name = name
        self.target = target

    def replace_target(self, sync_first: bool) -> None:
        """Rename the file over the target (after an ``fsync`` with ``sync_first``); on failure remove it, the
        target untouched. The previous checkpoint is dropped only by this rename."""
        with on_failure(self.discard):
            try:
                if sync_first:
                    os.fsync(self.file.fileno())
                os.chmod(self.name, _default_file_mode())
                os.replace(self.name, self.target)
            except OSError as err:
                if _no_space(err):
                    raise _no_space_error(self.target, err) from err
                raise

    def make_durable(self, folder_fd: int | None, synced: bool) -> None:
        """``fsync`` the file (unless already done) and the folder's entry; close both (releasing the lock).

        Works on descriptors only, so it never touches the path again: the user may move or delete the checkpoint
        (or its folder) while this runs."""
        try:
            if not synced:
                os.fsync(self.file.fileno())
            if folder_fd is not None:
                with contextlib.suppress(OSError):  # not supported for folders everywhere: best effort
                    os.fsync(folder_fd)
        except OSError as err:
            raise NotDurableError(
                err.errno,
                f"The checkpoint {str(self.target)!r} is in place but could not be forced to disk ({err}); it may not"
                " survive a power cut.",
            ) from err
        finally:
            with contextlib.suppress(OSError):
                self.file.close()
            if folder_fd is not None:
                os.close(folder_fd)

    def discard(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass
        try:
            os.unlink(self.name)
        except FileNotFoundError:
            pass


#: What a write into a temporary file may fail with that :func:`_write_temp`'s ``explain`` can say more about: a
#: full disk (``OSError``, which ``torch.save`` reports as a ``RuntimeError``), a value that does not pickle.
EXPLAINED = (OSError, RuntimeError, pickle.PicklingError, TypeError, AttributeError)


def _write_temp(
    target: Path, write: Callable[[Any], None], explain: Callable[[BaseException], BaseException | None]
) -> _WrittenTemp:
    """``write(file)`` into a fresh locked temporary file beside ``target`` (removing what killed saves left). On a
    failure the file is removed and the error raised, or the clearer one ``explain(error)`` gives."""
    if target.is_dir():
        raise IsADirectoryError(f"Cannot save a checkpoint to {str(target)!r}: it is an existing directory.")
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target)
    fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(target), dir=parent)
    tmp_file = os.fdopen(fd, "wb")
    written = _WrittenTemp(tmp_file, tmp_name, target)
    with on_failure(written.discard):  # Ctrl-C mid-save too: no multi-GB temporary file may stay behind
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # marks the file as being written (see leftovers)
            write(tmp_file)
            tmp_file.flush()
        except EXPLAINED as err:
            clearer = explain(err)
            if clearer is not None:
                raise clearer from err
            raise
    return written


def _torch_save(obj: Any, target: Path, start_writeback: bool) -> _WrittenTemp:
    """``torch.save(obj)`` into a temporary file beside ``target``, starting disk writeback early when asked; a full
    disk and an unpicklable value get errors that say so."""
    import torch

    writers: list[_WritebackFile] = []

    def write(file: Any) -> None:
        writers.append(_WritebackFile(file, _load_sync_file_range() if start_writeback else None))
        torch.save(obj, writers[0])

    def explain(err: BaseException) -> BaseException | None:
        cause = writers[0].error if writers and writers[0].error is not None else err
        if _no_space(cause):
            return _no_space_error(target, cause)  # type: ignore[arg-type]
        if isinstance(err, (pickle.PicklingError, TypeError, AttributeError)):
            return unpicklable_value_error(obj)  # which key holds a lambda, a generator, ...
        return None

    return _write_temp(target, write, explain)


def _open_folder(folder: Path) -> int | None:
    try:
        return os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None


def atomic_save(obj: Any, path: str | os.PathLike, *, durable_in_background: bool = False) -> CheckpointHandle | None:
    """``torch.save(obj, path)``, but a reader sees either the old file or the complete new one, never a torso.

    The data is streamed straight into ``.<name>.tmp-<host>-<pid>-XXXX`` in the target's folder (the same
    filesystem, so the rename is atomic) while this process holds a ``flock`` on it, then moved over ``path`` with
    :func:`os.replace`. Nothing is buffered in memory first, so saving needs no second copy of the state. On any
    failure, including ``KeyboardInterrupt``, the temporary file is deleted and the exception propagates; ``path``
    is untouched. What a killed save left is removed by the next save of the same path.

    **When this returns, the complete new file is at** ``path``. By default it is also durable: the file is
    ``fsync``'d before the rename and the folder after it, so even a power cut leaves the previous or the new file.
    With ``durable_in_background=True`` this returns right after the rename (what ``torch.save`` costs); the two
    ``fsync`` calls run in the background (:mod:`fabric_core.io.background`) on open descriptors, and the returned
    handle's ``wait()`` waits for them. A kill (not a power cut) at any moment still leaves the previous or the new
    file. Processes that memory-mapped the old file keep a valid view of it: the rename swaps the directory entry.
    """
    target = Path(os.fspath(path))
    background.wait_for_save(target)  # an earlier save of this path lands first (and its error surfaces here)
    written = _torch_save(obj, target, start_writeback=not durable_in_background)
    written.replace_target(sync_first=not durable_in_background)
    folder_fd = _open_folder(target.parent)
    if durable_in_background:
        return background.submit(target, lambda: written.make_durable(folder_fd, synced=False))
    written.make_durable(folder_fd, synced=True)
    return None


def save_file(obj: Any, location: CheckpointLocation, storage_options: dict[str, Any] | None = None) -> None:
    """``torch.save(obj)`` at ``location``, whole or not at all: :func:`atomic_save` on a local disk, one upload at
    a URL (:func:`fabric_core.io.remote.save`; ``storage_options`` are fsspec's). A format writes its files through
    this and never decides "local path or URL" itself."""
    if location.is_url:
        remote.save(obj, location.url, storage_options)
    else:
        atomic_save(obj, location.path)


def commit_file(
    target: CheckpointLocation | str | os.PathLike,
    write: Callable[[BinaryIO], None],
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Write one file at ``target`` with ``write(file)`` (any writer: ``numpy.savez``, ``json.dump`` of encoded text,
    ``safetensors``' bytes), whole or not at all: a format's crash-safe file, whatever it holds.

    On a local disk ``write`` fills a locked hidden temporary file beside ``target``, which is ``fsync``'d and renamed
    over it (as :func:`atomic_save` does for ``torch.save``); at a URL what ``write`` wrote is one upload. When this
    returns the complete new file is at ``target`` (and durable, locally); on any failure, ``KeyboardInterrupt``
    included, the previous file is intact and the temporary one removed; what a killed write left is removed by the
    next write of ``target``. ``file`` is a binary file object (``write``, ``flush``; locally also ``seek``/``tell``).
    """
    location = CheckpointLocation.of(target)
    if location.is_url:
        remote.write(location.url, write, storage_options)
        return
    path = location.path
    background.wait_for_save(path)  # an earlier save of this path lands first
    written = _write_temp(path, write, lambda err: _no_space_error(path, err) if _no_space(err) else None)  # type: ignore[arg-type]
    written.replace_target(sync_first=True)
    written.make_durable(_open_folder(path.parent), synced=True)


# ---------------------------------------------------------------------------------------------------------- folders
def commit_directory(
    target: CheckpointLocation | str | os.PathLike,
    write: Callable[[CheckpointLocation], None],
    coordinator: Coordinator | None = None,
) -> None:
    """Write a checkpoint folder on every rank, crash-safely, and publish it when every rank succeeded. Without a
    ``coordinator``, this process writes it alone.

    1. Rank 0 prepares where the ranks write and tells every rank (so all agree even if they were given different
       paths): locally, a hidden temporary directory beside ``target`` (after removing what killed saves left);
       at a URL, a new version folder (:func:`fabric_core.io.remote.stage_version`).
    2. Every rank calls ``write(folder)`` with that folder as a :class:`CheckpointLocation` and makes what it sees
       there durable (``fsync``, local folders); then all ranks vote.
       Only if every rank succeeded does rank 0 publish (swap the directory into place; write the URL's marker);
       then all vote again (:func:`~fabric_core.io.coordination.publish_together`).
    3. On every rank, whatever happened (an error here or on another rank, a failed collective because a rank
       died, ``KeyboardInterrupt``), the staged folder is removed unless it was published.

    When this returns on every rank, the checkpoint is at ``target``. The error of this rank is raised (its own
    traceback); if only other ranks failed, a ``CheckpointSaveError`` names them and their errors. The previous
    checkpoint at ``target`` is untouched by a failed save.
    """
    coordinator = coordinator if coordinator is not None else ALONE
    staged = _stage(CheckpointLocation.of(target), coordinator)
    with on_failure(staged.abandon):  # Ctrl-C: nothing to agree on, the staged folder goes
        # any other failure of this rank must reach the vote (raised, the other ranks would wait at it)
        _, error = guarded(_write_staged, write, staged)
    staged.finish(error, coordinator)


def _write_staged(write: Callable[[CheckpointLocation], None], staged: _StagedDirectory | remote.StagedVersion) -> None:
    write(staged.location)
    staged.make_durable()


def commit_directory_async(
    target: CheckpointLocation | str | os.PathLike,
    start_write: Callable[[CheckpointLocation], Callable[[], None]],
    coordinator: Coordinator,
    background_coordinator: Coordinator,
) -> CheckpointHandle:
    """Like :func:`commit_directory`, but only the start of the write happens in the caller.

    ``start_write(folder)`` begins this rank's write (e.g. torch.distributed.checkpoint's ``async_save``, which
    copies the state first) and returns a function that waits for it. Waiting, the votes, publishing and the
    cleanup run in the background thread (:mod:`fabric_core.io.background`) and agree over
    ``background_coordinator``, whose collectives must not share a process group with the training loop's.
    Returns the save's handle: at its ``wait()`` the checkpoint is at ``target``.
    """
    location = CheckpointLocation.of(target)
    staged = _stage(location, coordinator)
    with on_failure(staged.abandon):
        wait = start_write(staged.location)

    def complete() -> None:
        _, error = guarded(lambda: (wait(), staged.make_durable()))  # to the vote, as in commit_directory
        staged.finish(error, background_coordinator)

    return background.submit(location, complete)


class _StagedDirectory:
    """A hidden temporary directory all ranks write into, swapped in (or removed) by :meth:`finish` on every rank."""

    def __init__(self, target: Path, tmp: Path, lock: WriterLock | None) -> None:
        self.target = target
        self.tmp = tmp
        self.location = CheckpointLocation.of(tmp)
        self.lock = lock
        self._published = False

    def abandon(self) -> None:
        if self.lock is not None:
            self.lock.release()
        remove_path(self.tmp)

    def make_durable(self) -> None:
        """``fsync`` what this rank sees in the folder (files another rank synced already cost one cheap call)."""
        fsync_tree(self.tmp)

    def finish(self, error: Exception | None, coordinator: Coordinator) -> None:
        try:
            publish_together(error, coordinator, self._publish, str(self.target))
        finally:
            if self.lock is not None:
                self.lock.release()
            if not self._published:
                remove_path(self.tmp)

    def _publish(self) -> None:
        swap_into_place(self.tmp, self.target)
        self._published = True


def _stage(target: CheckpointLocation, coordinator: Coordinator) -> _StagedDirectory | remote.StagedVersion:
    if target.is_url:
        return remote.stage_version(target, coordinator)
    return _stage_directory(target.path, coordinator)


def _stage_directory(target: Path, coordinator: Coordinator) -> _StagedDirectory:
    lock: WriterLock | None = None
    tmp: Path | None = None

    def undo() -> None:
        if lock is not None:
            lock.release()
        if tmp is not None:
            remove_path(tmp)

    with on_failure(undo):
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
    return _StagedDirectory(target, tmp, lock)


def committed_folder(location: CheckpointLocation) -> CheckpointLocation:
    """Where the files of the folder checkpoint published at ``location`` are: the folder itself on a local disk,
    the committed version on an object store (:func:`fabric_core.io.remote.committed_version`). Formats read
    (and recognise) their folders through this."""
    return location.committed()
