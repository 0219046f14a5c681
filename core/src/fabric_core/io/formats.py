"""Reading a checkpoint whatever wrote it: single files here, directories through the plugin that owns the format.

A strategy does not ask the global registry who can read a directory: the resolver hands it a
:data:`FindReader` (the ``fabric_select_checkpoint_reader`` decision hook, bound to the registry), so a
strategy built by hand, in a test or another program, depends only on what it was given.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fabric_core.io import remote

if TYPE_CHECKING:
    from fabric_core.io.checkpoint_io import CheckpointIO


class CheckpointReader(Protocol):
    """Reads a whole checkpoint (any layout its plugin owns) into one dict, in this process."""

    def __call__(self, path: Path, map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]: ...


#: Given a directory, the reader of its format, or ``None`` when no installed plugin recognises it.
FindReader = Callable[[Path], CheckpointReader | None]


def _is_mmap_refusal(err: RuntimeError) -> bool:
    # torch refuses to memory-map files in its legacy (pre-zipfile) format with a message naming mmap.
    return "mmap" in str(err)


def read_file(checkpoint_io: CheckpointIO, path: str | os.PathLike, weights_only: bool | None = None) -> Any:
    """Read a single checkpoint file, memory-mapped when the file format allows it.

    Mapping means tensors are paged in only as ``load_state_dict`` copies them, so loading needs no second full
    copy in RAM. Files in torch's legacy format cannot be mapped and are read normally, and so are URLs.
    """
    if remote.is_url(path):
        return checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    try:
        return checkpoint_io.load_checkpoint(path, weights_only=weights_only, mmap=True)
    except RuntimeError as err:
        if not _is_mmap_refusal(err):
            raise
    return checkpoint_io.load_checkpoint(path, weights_only=weights_only)


def read_checkpoint(
    path: str | os.PathLike,
    checkpoint_io: CheckpointIO,
    find_reader: FindReader | None,
    weights_only: bool | None = None,
) -> Any:
    """Read the checkpoint at ``path``: a file with ``checkpoint_io``, a directory with its format's reader."""
    if remote.is_url(path):
        if not remote.isdir(str(path)):
            return read_file(checkpoint_io, path, weights_only=weights_only)
        reader = find_reader(path) if find_reader is not None else None  # type: ignore[arg-type]
        if reader is None:
            raise ValueError(f"{path!r} is a folder, but no installed plugin recognises it as a checkpoint.")
        return reader(path, map_location="cpu", weights_only=weights_only)  # type: ignore[arg-type]
    path = Path(remote.local_path(path))
    if path.is_dir():
        reader = find_reader(path) if find_reader is not None else None
        if reader is None:
            raise ValueError(
                f"{str(path)!r} is a directory, but no installed plugin recognises it as a checkpoint. Sharded"
                " checkpoints are read by the plugin of the strategy that wrote them; `fabric plugins` lists what is"
                " installed."
            )
        return reader(path, map_location="cpu", weights_only=weights_only)
    return read_file(checkpoint_io, path, weights_only=weights_only)
