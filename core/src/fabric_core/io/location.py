"""Where a checkpoint is: a local path or a URL, decided once, at the door.

``fabric.save``, ``fabric.load`` and ``fabric.load_raw`` turn the ``path`` they receive into a
:class:`CheckpointLocation` (:meth:`CheckpointLocation.of`); strategies and checkpoint formats receive that object
and never decide again. It offers the few file operations a format needs (``child`` or ``/``, ``exists``,
``is_dir``, ``is_file``, ``open``, ``read_bytes``, ``listdir``, ``remove``, ...), with ``pathlib``'s names, for both
kinds, so a format is written once for local disks and object stores.

A URL is never turned into a local path: ``os.fspath(location)`` (and so ``Path(location)``, ``open(location)``)
works for a local location and raises :class:`NotALocalPathError` for a URL, instead of silently creating a folder
named ``s3:`` in the working directory. ``str(location)`` is the path or the URL as text.

What formats would otherwise branch on is done here, once for both kinds: finding a folder checkpoint's committed
files (:meth:`CheckpointLocation.committed`), and a local view of a folder for libraries that only read or write
local files (:meth:`CheckpointLocation.local_view`, :meth:`CheckpointLocation.local_staging`). Writing one file
whole or not at all is :func:`fabric_core.io.commit.save_file` (commits import locations, not the reverse).

``file://`` URLs are local paths. Every other scheme (``s3://``, ``gs://``, ``az://``, ``memory://``, ...) is
reached through fsspec (:mod:`fabric_core.io.remote`), imported only when a URL is used.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["CheckpointLocation", "NotALocalPathError"]

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


class NotALocalPathError(TypeError):
    """A URL location was used where a local path is needed (``Path(location)``, ``open(location)``)."""


def _parse(text: str) -> tuple[str, bool]:
    """``(text, is_url)``: ``file://`` URLs become local paths, other schemes stay URLs."""
    match = _SCHEME.match(text)
    if match is None:
        return text, False
    if match.group(1).lower() == "file":
        return text[len("file://") :], False
    return text, True


class CheckpointLocation:
    """A checkpoint's place: a local path (``is_url`` false, :attr:`path`) or a URL (``is_url`` true, :attr:`url`).

    Build it with :meth:`of`, which accepts ``str``, ``os.PathLike`` and a location (returned unchanged). Equal
    locations compare equal and hash alike; ``str()`` gives the text (a local path as given, not resolved).
    """

    __slots__ = ("_text", "_is_url")

    def __init__(self, text: str, is_url: bool) -> None:
        self._text = text
        self._is_url = is_url

    # ------------------------------------------------------------------------------------------------ the door
    @classmethod
    def of(cls, path: Any) -> CheckpointLocation:
        """The location of ``path``: a ``CheckpointLocation`` (as is), a URL string, or a local ``str``/``PathLike``."""
        if isinstance(path, CheckpointLocation):
            return path
        if isinstance(path, str):
            if not path:
                raise ValueError("The checkpoint path is empty: pass a file or folder path, or a URL such as 's3://bucket/ckpt'.")
            text, is_url = _parse(path)
            return cls(text, is_url)
        if isinstance(path, os.PathLike):
            text = os.fspath(path)
            if isinstance(text, bytes):
                text = os.fsdecode(text)
            return cls(text, False)
        raise TypeError(
            f"A checkpoint path must be a str, an os.PathLike (e.g. pathlib.Path) or a URL string such as"
            f" 's3://bucket/ckpt', got {type(path).__name__}: {path!r}."
        )

    # ------------------------------------------------------------------------------------------------ what it is
    @property
    def is_url(self) -> bool:
        """Whether this is a URL reached through fsspec (``s3://``, ``memory://``, ...), not a local path."""
        return self._is_url

    @property
    def path(self) -> Path:
        """The local path; :class:`NotALocalPathError` for a URL."""
        if self._is_url:
            raise NotALocalPathError(self._not_local_message())
        return Path(self._text)

    @property
    def url(self) -> str:
        """The URL; ``ValueError`` for a local path."""
        if not self._is_url:
            raise ValueError(f"{self._text!r} is a local path, not a URL.")
        return self._text

    @property
    def scheme(self) -> str:
        """``"s3"``, ``"memory"``, ... for a URL; ``"file"`` for a local path."""
        match = _SCHEME.match(self._text) if self._is_url else None
        return match.group(1).lower() if match else "file"

    def check_reachable_by(self, world_size: int) -> None:
        """Refuse (``ValueError``) a location the processes of one job cannot all reach: ``memory://`` is fsspec's
        store of one process, so a checkpoint one rank writes there is invisible to the others."""
        if world_size > 1 and self.scheme == "memory":
            raise ValueError(
                f"{self._text!r} is in fsspec's in-process `memory://` store, which every process has its own of: with"
                f" {world_size} processes, what one writes there the others cannot read. Save to a folder all processes"
                " share, or an object store (`s3://...`)."
            )

    @property
    def name(self) -> str:
        """The last component (``step-10.ckpt``)."""
        if self._is_url:
            return self._text.rstrip("/").rpartition("/")[2]
        return Path(self._text).name

    @property
    def parent(self) -> CheckpointLocation:
        """The folder holding this location (a URL's parent stays on the same store)."""
        if self._is_url:
            head = self._text.rstrip("/").rpartition("/")[0]
            return CheckpointLocation(head, True)
        return CheckpointLocation(str(Path(self._text).parent), False)

    def child(self, *parts: str) -> CheckpointLocation:
        """A location inside this one (``location.child("meta.pt")``)."""
        if self._is_url:
            return CheckpointLocation("/".join([self._text.rstrip("/"), *parts]), True)
        return CheckpointLocation(str(Path(self._text, *parts)), False)

    def __truediv__(self, name: str) -> CheckpointLocation:
        """``location / "meta.pt"``: the same as :meth:`child`, as with ``pathlib``."""
        return self.child(name)

    def sibling(self, name: str) -> CheckpointLocation:
        """The location named ``name`` in the same folder."""
        return self.parent.child(name)

    def filesystem(self) -> tuple[Any, str]:
        """``(fsspec filesystem, path inside it)`` of a URL, with an install hint when its package is missing."""
        from fabric_core.io import remote

        return remote.filesystem(self.url)

    # ------------------------------------------------------------------------------------------------ file operations
    def exists(self) -> bool:
        if self._is_url:
            fs, inner = self.filesystem()
            return bool(fs.exists(inner))
        return os.path.lexists(self._text)

    def is_dir(self) -> bool:
        if self._is_url:
            fs, inner = self.filesystem()
            return bool(fs.isdir(inner))
        return os.path.isdir(self._text)

    def is_file(self) -> bool:
        if self._is_url:
            fs, inner = self.filesystem()
            return bool(fs.isfile(inner))
        return os.path.isfile(self._text)

    def listdir(self) -> list[str]:
        """The names inside this folder (empty when it does not exist)."""
        if self._is_url:
            fs, inner = self.filesystem()
            try:
                entries = fs.ls(inner, detail=False)
            except FileNotFoundError:
                return []
            base = inner.rstrip("/")
            return sorted(e.rstrip("/").rpartition("/")[2] for e in entries if e.rstrip("/") != base)
        try:
            return sorted(os.listdir(self._text))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def open(self, mode: str = "rb") -> IO[Any]:
        """Open the file here (binary modes); writing creates the parent folders. A URL's file is replaced when
        it is closed (an object store publishes an upload only when it completes)."""
        if "b" not in mode:
            raise ValueError(f"Checkpoint files are opened in binary mode, got mode={mode!r}.")
        writing = any(c in mode for c in "wax+")
        if self._is_url:
            fs, inner = self.filesystem()
            if writing:
                parent = inner.rstrip("/").rpartition("/")[0]
                if parent:
                    fs.makedirs(parent, exist_ok=True)
            return fs.open(inner, mode)
        if writing:
            Path(self._text).parent.mkdir(parents=True, exist_ok=True)
        return open(self._text, mode)  # noqa: SIM115 - the caller closes it

    def read_bytes(self) -> bytes:
        with self.open("rb") as file:
            return file.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def makedirs(self) -> None:
        """Create this folder (and its parents); nothing to do on object stores, where folders are implicit."""
        if self._is_url:
            fs, inner = self.filesystem()
            fs.makedirs(inner, exist_ok=True)
            return
        Path(self._text).mkdir(parents=True, exist_ok=True)

    def remove(self) -> None:
        """Delete the file or the folder tree here; missing is fine."""
        if self._is_url:
            fs, inner = self.filesystem()
            if fs.exists(inner):
                fs.rm(inner, recursive=True)
            return
        if os.path.islink(self._text) or os.path.isfile(self._text):
            try:
                os.unlink(self._text)
            except FileNotFoundError:
                pass
        elif os.path.isdir(self._text):
            shutil.rmtree(self._text, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ what formats need
    def committed(self) -> CheckpointLocation:
        """Where the files of the folder checkpoint published here are: this folder on a local disk, the version its
        commit marker names on an object store (:func:`~fabric_core.io.remote.committed_version`). A format reads
        and recognises its folders through this."""
        if not self._is_url:
            return self
        from fabric_core.io import remote

        return remote.committed_version(self)

    @contextlib.contextmanager
    def local_view(self) -> Iterator[Path]:
        """The folder checkpoint here as a local folder, for a library that reads only local files: the folder
        itself, or a scratch copy of a URL's committed version (every file: make room), removed afterwards."""
        if not self._is_url:
            yield self.path
            return
        from fabric_core.io import remote

        scratch = Path(tempfile.mkdtemp(prefix="fabric-checkpoint-"))
        try:
            remote.download_folder(self.committed(), scratch)
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    @contextlib.contextmanager
    def local_staging(self) -> Iterator[Path]:
        """A local folder to write this folder's files into, for a library that writes only local files: the
        folder itself, or a scratch folder that is uploaded here when the block succeeds, removed afterwards."""
        if not self._is_url:
            yield self.path
            return
        from fabric_core.io import remote

        scratch = Path(tempfile.mkdtemp(prefix="fabric-checkpoint-"))
        try:
            yield scratch
            remote.upload_folder(scratch, self)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ protocol
    def __fspath__(self) -> str:
        if self._is_url:
            raise NotALocalPathError(self._not_local_message())
        return self._text

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"CheckpointLocation({self._text!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CheckpointLocation):
            return NotImplemented
        return (self._text, self._is_url) == (other._text, other._is_url)

    def __hash__(self) -> int:
        return hash((self._text, self._is_url))

    def __reduce__(self) -> tuple[Any, tuple]:
        return CheckpointLocation, (self._text, self._is_url)

    def _not_local_message(self) -> str:
        return (
            f"The checkpoint location {self._text!r} is a URL, not a local path: it cannot be opened with `Path`,"
            " `open` or `os` functions. Code that writes checkpoints reaches it through the location's methods"
            " (`open`, `child`, `exists`, ...) or `location.filesystem()` (fsspec). A strategy or format that only"
            " handles local paths should say so with a clear error before writing anything."
        )
