"""Reading and writing one checkpoint file, kept behind a small interface so storage backends can be swapped.

``CheckpointIO`` is the reference's plugin type (``Fabric(plugins=[MyCheckpointIO()])``); the single-file format
(:mod:`fabric_core.io.single_file`) writes and reads through it. The default, :class:`TorchCheckpointIO`, writes
local files with :func:`torch.save` and is built around two promises that matter when a run is killed at the
worst moment:

* **Crash-safe saves.** A checkpoint is streamed into a hidden temporary file next to the target and renamed over
  it (:func:`fabric_core.io.commit.atomic_save`). A crash, a full disk or Ctrl-C during the save leaves the
  previous checkpoint exactly as it was, and the temporary file is removed.
* **Safe loads by default.** Loading uses torch's restricted ``weights_only`` unpickler unless the caller opts out,
  so opening a checkpoint from an untrusted source cannot run arbitrary code.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from abc import ABC, abstractmethod
from typing import Any

import torch

from fabric_core.io import background, remote
from fabric_core.io.commit import atomic_save
from fabric_core.io.errors import CheckpointReadError
from fabric_core.io.location import CheckpointLocation

__all__ = ["CheckpointIO", "CheckpointReadError", "TorchCheckpointIO", "atomic_save"]

#: What ``CheckpointIO`` methods accept as ``path``: a :class:`CheckpointLocation` from ``fabric.save``/``load``, or
#: a plain path or URL string when called directly.
_PathLike = str | os.PathLike | CheckpointLocation


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


_UNSAFE_LOAD_HINT = (
    "Could not load the checkpoint {path!r} with the safe loader (weights_only=True): it contains arbitrary "
    "Python objects, and unpickling those can execute code. If you trust the source of this file, load it with "
    "`weights_only=False` (for example `fabric.load(path, weights_only=False)`), or keep the safe loader and "
    "allowlist the classes it needs with `torch.serialization.add_safe_globals([...])`.\n\n"
    "Details from torch.load: {detail}"
)


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
        durable_in_background: return from :meth:`save_checkpoint` once the file is at its path, and finish making
            it durable (``fsync``) in the background (see :func:`~fabric_core.io.commit.atomic_save`). The
            strategies' default checkpoint I/O does (so ``fabric.save`` costs what ``torch.save`` costs);
            constructed by hand, it saves durably before returning unless asked.
    """

    def __init__(self, durable_in_background: bool = False) -> None:
        self.durable_in_background = durable_in_background

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PathLike, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` crash-safely (:func:`~fabric_core.io.commit.atomic_save`), or to a URL
        in one upload; on return the complete file is at ``path``, replacing the previous one atomically.

        With ``durable_in_background`` the ``fsync`` of a local file finishes in the background (a later save or
        load of the path waits for it, and so does interpreter exit).
        ``storage_options`` are fsspec's options for a URL (credentials, endpoint); a local path takes none.
        """
        location = CheckpointLocation.of(path)
        if location.is_url:
            background.wait_for_save(location)
            remote.save(checkpoint, location.url, storage_options)
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
        atomic_save(checkpoint, location.path, durable_in_background=durable_later)

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
        location = CheckpointLocation.of(path)
        background.wait_for_save(location)  # a save of this path still finishing in the background lands first
        if location.is_url:
            return remote.load(location.url, map_location, True if weights_only is None else bool(weights_only))
        fspath = str(location.path)
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
        location = CheckpointLocation.of(path)
        background.wait_for_save(location)
        location.remove()
