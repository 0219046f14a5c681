"""Checkpoint reading and writing, kept behind a small interface so storage backends can be swapped.

The default, :class:`TorchCheckpointIO`, writes local files with :func:`torch.save` and is built around two
promises that matter when a run is killed at the worst moment:

* **Crash-safe saves.** A checkpoint is streamed into a hidden temporary file next to the target, forced to disk,
  and only then renamed over the target. A crash, a full disk or Ctrl-C during the save leaves the previous
  checkpoint exactly as it was, and the temporary file is removed.
* **Safe loads by default.** Loading uses torch's restricted ``weights_only`` unpickler unless the caller opts out,
  so opening a checkpoint from an untrusted source cannot run arbitrary code.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import tempfile
import zipfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from fabric_core.io import background, remote
from fabric_core.io.background import CheckpointHandle
from fabric_core.io.commit import fsync_directory, remove_leftovers, temp_prefix

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["CheckpointIO", "CheckpointReadError", "TorchCheckpointIO", "atomic_save"]

_PathLike = str | os.PathLike


class CheckpointIO(ABC):
    """Interface for saving, loading and removing checkpoints.

    Strategies call these methods instead of touching files directly, so a plugin can redirect checkpoints to
    another format or storage system without changing the training loop.
    """

    @abstractmethod
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PathLike, storage_options: Any | None = None
    ) -> None:
        """Persist ``checkpoint`` at ``path``; ``storage_options`` are backend-specific extras."""

    @abstractmethod
    def load_checkpoint(
        self,
        path: _PathLike,
        map_location: Any = "cpu",
        weights_only: bool | None = None,
        mmap: bool = False,
    ) -> dict[str, Any]:
        """Read a checkpoint written by :meth:`save_checkpoint` and return its contents."""

    @abstractmethod
    def remove_checkpoint(self, path: _PathLike) -> None:
        """Delete the checkpoint at ``path`` if it exists."""

    def teardown(self) -> None:  # noqa: B027 - optional hook, most backends hold no resources
        """Release any resources (open handles, background threads) held by the backend."""


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


class _WritebackFile:
    """Write-through file wrapper that starts disk writeback every few MiB while ``torch.save`` serialises
    (without ``sync_file_range``: plain writes), and keeps the ``OSError`` of a failed write.

    Without it the whole checkpoint sits in the page cache until the final ``fsync``, which then waits for all of
    it: measured +55% over a plain ``torch.save`` for 256 MiB. Starting writeback early overlaps disk I/O with
    serialisation, and the final ``fsync`` only waits for the tail. Durability is unchanged: the ``fsync`` before
    the rename still happens.
    """

    CHUNK = 8 << 20

    def __init__(self, raw: Any, sync_file_range: Any) -> None:
        self._raw = raw
        self._fd = raw.fileno()
        self._sync_file_range = sync_file_range
        self._written = 0
        self._started = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
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
    """A checkpoint serialised into its temporary file (locked, not yet durable): commit it or discard it."""

    def __init__(self, file: Any, name: str, target: Path) -> None:
        self.file = file
        self.name = name
        self.target = target

    def commit(self) -> None:
        """fsync the file, rename it over the target, sync the folder; on any failure remove it (target untouched)."""
        try:
            os.fsync(self.file.fileno())
            os.chmod(self.name, _default_file_mode())
            os.replace(self.name, self.target)  # the old checkpoint is dropped only now, after the new one is durable
            self.file.close()  # releases the writer lock
        except BaseException as err:
            self.discard()
            if _no_space(err):
                raise _no_space_error(self.target, err) from err  # type: ignore[arg-type]
            raise
        fsync_directory(self.target.parent)

    def discard(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass
        try:
            os.unlink(self.name)
        except FileNotFoundError:
            pass


def _write_temp(obj: Any, target: Path, start_writeback: bool) -> _WrittenTemp:
    """``torch.save`` into a fresh locked temporary file beside ``target``: what the caller must wait for.

    ``start_writeback`` overlaps disk writes with serialising (:class:`_WritebackFile`), for a caller that waits
    for the ``fsync`` right after. When the ``fsync`` runs in the background it only costs the caller: measured
    with 512 MiB, 12 interleaved forked runs, the call blocked 0.80 s (median) with it and 0.21 s without, and the
    file was durable after 0.85 s with it and 0.44 s without (plain ``torch.save`` over an existing file: 0.40 s).
    """
    if target.is_dir():
        raise IsADirectoryError(f"Cannot save a checkpoint to {str(target)!r}: it is an existing directory.")
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target)
    fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(target), dir=parent)
    tmp_file = os.fdopen(fd, "wb")
    written = _WrittenTemp(tmp_file, tmp_name, target)
    writer: _WritebackFile | None = None
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # marks the file as being written (see commit.py)
        writer = _WritebackFile(tmp_file, _load_sync_file_range() if start_writeback else None)
        torch.save(obj, writer)
        tmp_file.flush()
    except BaseException as err:
        # BaseException on purpose: Ctrl-C mid-save must not leave a multi-GB temporary file behind.
        written.discard()
        cause = writer.error if writer is not None and writer.error is not None else err
        if _no_space(cause):
            raise _no_space_error(target, cause) from err  # type: ignore[arg-type]
        raise
    return written


def atomic_save(obj: Any, path: _PathLike, *, durable_in_background: bool = False) -> CheckpointHandle | None:
    """``torch.save(obj, path)``, but a reader sees either the old file or the complete new one, never a torso.

    The data is streamed straight into ``.<name>.tmp-<host>-<pid>-XXXX`` in the target's folder (the same
    filesystem, so the final rename is atomic) while this process holds a ``flock`` on it, flushed and fsynced,
    then moved over ``path`` with :func:`os.replace`. Nothing is buffered in memory first, so saving needs no
    second copy of the state. On any failure, including ``KeyboardInterrupt``, the temporary file is deleted and
    the exception propagates; ``path`` is untouched. What a killed save left is removed by the next save of the
    same path (see :mod:`fabric_core.io.commit`).

    With ``durable_in_background=True`` this returns once the file is written (what ``torch.save`` costs); the
    fsync, the rename and the folder sync finish in the background (:mod:`fabric_core.io.background`), and the
    returned handle's ``wait()`` waits for them. A save or load of the same path waits for them first.

    Processes that memory-mapped the old file keep a valid view of it: the rename swaps the directory entry, it
    does not modify the old file's contents.
    """
    target = Path(os.fspath(path))
    background.wait(target)  # an earlier save of this path must land first (and its error surfaces here)
    written = _write_temp(obj, target, start_writeback=not durable_in_background)
    if durable_in_background:
        return background.submit(target, written.commit)
    written.commit()
    return None


_UNSAFE_LOAD_HINT = (
    "Could not load the checkpoint {path!r} with the safe loader (weights_only=True): it contains arbitrary "
    "Python objects, and unpickling those can execute code. If you trust the source of this file, load it with "
    "`weights_only=False` (for example `fabric.load(path, weights_only=False)`), or keep the safe loader and "
    "allowlist the classes it needs with `torch.serialization.add_safe_globals([...])`.\n\n"
    "Details from torch.load: {detail}"
)


class CheckpointReadError(RuntimeError):
    """The file is not a readable checkpoint: empty, truncated, corrupt, or not written by ``torch.save``."""


#: What torch says when a file is not (or no longer) a valid checkpoint archive.
_CORRUPT_MARKS = ("PytorchStreamReader failed", "failed finding central directory", "invalid header", "not a zip")


def _refused_by_safe_loader(err: pickle.UnpicklingError) -> bool:
    """Whether torch's safe loader refused an object it does not allow (not a corrupt file)."""
    text = str(err)
    return "Weights only load failed" in text and any(
        mark in text for mark in ("Unsupported global", "GLOBAL", "not an allowed global", "add_safe_globals")
    )


def _not_a_checkpoint(path: str, err: BaseException) -> str:
    return (
        f"Cannot load checkpoint {path!r}: it is not a readable checkpoint (corrupt, truncated, or not written by"
        f" `torch.save`/`fabric.save`). {type(err).__name__}: {err}"
    )


class TorchCheckpointIO(CheckpointIO):
    """Local-file checkpoints via :func:`torch.save` / :func:`torch.load`, crash-safe on save, safe on load.

    Args:
        durable_in_background: return from :meth:`save_checkpoint` once the file is written, and finish making it
            durable and moving it into place in the background (see :func:`atomic_save`). The strategies' default
            checkpoint I/O does (so ``fabric.save`` costs what ``torch.save`` costs); constructed by hand, it saves
            synchronously unless asked.
    """

    def __init__(self, durable_in_background: bool = False) -> None:
        self.durable_in_background = durable_in_background

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PathLike, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` crash-safely (see :func:`atomic_save`), or to a URL through fsspec.

        With ``durable_in_background`` a local save returns once the file is written; it becomes durable and
        replaces the previous checkpoint in the background (a later save or load of the path waits for that, and so
        does interpreter exit).
        ``storage_options`` are fsspec's options for a URL (credentials, endpoint); a local path takes none.
        """
        if remote.is_url(path):
            background.wait(path)
            remote.save(checkpoint, str(path), storage_options)
            return
        if storage_options is not None:
            name = type(self).__name__
            raise TypeError(
                f"`{name}.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not supported for"
                f" `{name}` when saving to a local path (got storage_options={storage_options!r}): they are fsspec"
                " options for URLs such as 's3://bucket/ckpt'. Please implement your custom `CheckpointIO` to define"
                " how you'd like to use `storage_options`, or pass storage_options=None."
            )
        durable_later = self.durable_in_background and not background.in_worker()
        atomic_save(checkpoint, remote.local_path(path), durable_in_background=durable_later)

    def load_checkpoint(
        self,
        path: _PathLike,
        map_location: Any = "cpu",
        weights_only: bool | None = None,
        mmap: bool = False,
    ) -> dict[str, Any]:
        """Load a checkpoint file.

        Args:
            path: the file written by :meth:`save_checkpoint` (or any ``torch.save`` file).
            map_location: forwarded to :func:`torch.load`; the default keeps everything on the CPU so loading
                never allocates on an accelerator behind the caller's back.
            weights_only: ``None`` (default) or ``True`` uses torch's safe unpickler, which only rebuilds
                tensors, primitive containers and allowlisted classes. Pass ``False`` only for trusted files.
            mmap: memory-map the file instead of reading it, so tensors are paged in lazily and a large checkpoint
                does not need to fit in RAM at once. Needs the zipfile format ``torch.save`` has written by default
                since torch 1.6; legacy files are read without mapping. The returned CPU tensors are backed by the
                file; atomic saves replace the file rather than rewriting it, so they stay valid.
        """
        if remote.is_url(path):
            background.wait(path)
            return remote.load(str(path), map_location, True if weights_only is None else bool(weights_only))
        fspath = os.fspath(remote.local_path(path))
        background.wait(fspath)  # a save of this path still finishing in the background lands first
        if os.path.isdir(fspath):
            raise IsADirectoryError(
                f"Cannot load checkpoint {fspath!r}: it is a directory, not a file. This is probably a sharded "
                "(distributed) checkpoint; load it through the strategy or CheckpointIO plugin that wrote it."
            )
        if not os.path.exists(fspath):
            raise FileNotFoundError(f"Checkpoint file not found: {fspath}")

        if os.path.getsize(fspath) == 0:
            raise CheckpointReadError(f"Cannot load checkpoint {fspath!r}: the file is empty (an interrupted copy?).")
        if mmap and not zipfile.is_zipfile(fspath):
            mmap = False  # torch's legacy (pre-zipfile) format cannot be mapped; a file that is no archive fails below
        safe = True if weights_only is None else bool(weights_only)
        try:
            return torch.load(fspath, map_location=map_location, weights_only=safe, mmap=mmap)
        except pickle.UnpicklingError as err:
            if safe and _refused_by_safe_loader(err):
                raise pickle.UnpicklingError(_UNSAFE_LOAD_HINT.format(path=fspath, detail=err)) from err
            raise CheckpointReadError(_not_a_checkpoint(fspath, err)) from err
        except (EOFError, zipfile.BadZipFile, UnicodeDecodeError) as err:
            raise CheckpointReadError(_not_a_checkpoint(fspath, err)) from err
        except (KeyError, ValueError, IndexError) as err:
            if zipfile.is_zipfile(fspath):
                raise
            # torch's legacy reader chokes on the first bytes of a file that is no checkpoint at all
            raise CheckpointReadError(_not_a_checkpoint(fspath, err)) from err
        except RuntimeError as err:
            if any(mark in str(err) for mark in _CORRUPT_MARKS):
                raise CheckpointReadError(_not_a_checkpoint(fspath, err)) from err
            raise

    def remove_checkpoint(self, path: _PathLike) -> None:
        """Delete a checkpoint file, or a whole checkpoint directory (sharded checkpoints); missing is fine."""
        if remote.is_url(path):
            remote.remove(str(path))
            return
        fspath = os.fspath(remote.local_path(path))
        background.wait(fspath)
        if os.path.islink(fspath) or os.path.isfile(fspath):
            os.unlink(fspath)
        elif os.path.isdir(fspath):
            shutil.rmtree(fspath)
