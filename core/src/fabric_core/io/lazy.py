"""Opening a big checkpoint without reading it: tensors are read when they are used, not when the file is opened.

:func:`lazy_load` is for single-device loads and weight surgery on checkpoints that are large next to the memory
at hand (merging adapter weights into a base model, converting a checkpoint, copying a few tensors out of it).
It memory-maps the file (``torch.load(mmap=True)``): opening it unpickles only the structure (names, shapes,
dtypes, plain values), every tensor is backed by the file, and its bytes are paged in by the operating system when
something reads them: ``model.load_state_dict(checkpoint["model"])`` copies tensor by tensor, so memory never holds
a second full copy; ``.clone()``, ``.to(device)`` or arithmetic read just that tensor. Pages that were read can be
dropped again by the kernel under memory pressure (they are the file's).

The tensors stay valid while the file is replaced by a later save (saves rename a new file over the old one; the
mapping keeps the old file's data), and they are read-only views of the file in effect: writing into one changes
only this process's copy of that page, never the file.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

from fabric_core.io.location import CheckpointLocation

__all__ = ["lazy_load"]


def lazy_load(path: str | os.PathLike | CheckpointLocation, *, weights_only: bool | None = None) -> Any:
    """Open the checkpoint file at ``path`` with every tensor backed by the file, read on access (see the module).

    Args:
        path: a local file written by ``fabric.save`` (single-file format) or ``torch.save``.
        weights_only: ``None`` (default) or ``True`` uses torch's safe unpickler; ``False`` only for trusted files.

    Returns what the file holds (for a ``fabric.save`` checkpoint: a dict whose module entries are state dicts of
    file-backed tensors). Raises ``FileNotFoundError`` for a missing file, ``IsADirectoryError`` for a checkpoint
    folder (run ``fabric consolidate`` on it first), ``ValueError`` for a URL or a file in torch's legacy format,
    which cannot be memory-mapped (save it again with ``torch.save`` of torch >= 1.6, or read it with ``fabric.load``).
    """
    from fabric_core.io import background
    from fabric_core.io.checkpoint_io import TorchCheckpointIO

    location = CheckpointLocation.of(path)
    if location.is_url:
        raise ValueError(
            f"`lazy_load` maps a local file into memory, and {str(location)!r} is a URL. Copy it to a local disk first"
            " (it is read once), or load it with `fabric.load`."
        )
    background.wait_for_save(location)  # a save of this path by this process lands first
    file = str(location.path)
    if os.path.isdir(file):
        raise IsADirectoryError(
            f"`lazy_load` reads single checkpoint files, and {file!r} is a folder (a sharded checkpoint). Convert it"
            f" with `fabric consolidate {file}` and open the file it writes."
        )
    if not os.path.exists(file):
        raise FileNotFoundError(f"Checkpoint file not found: {file}")
    if os.path.getsize(file) > 0 and not zipfile.is_zipfile(file):
        raise ValueError(
            f"{file!r} is in torch's legacy (pre-1.6) file format, which cannot be memory-mapped, so it cannot be"
            " opened lazily. Load it with `fabric.load` / `torch.load`, or save it again with `torch.save`."
        )
    return TorchCheckpointIO().load_checkpoint(location, map_location="cpu", weights_only=weights_only, mmap=True)
