"""torch.distributed.checkpoint (DCP) storage for a :class:`~fabric_core.io.location.CheckpointLocation`.

A format that writes DCP shards asks here for the storage reader or writer of a location and never decides "local
path or URL" itself: the file-system storage on a local disk, fsspec's at a URL. torch is imported when asked.
"""

from __future__ import annotations

from typing import Any

from fabric_core.io.location import CheckpointLocation

__all__ = ["storage_reader", "storage_writer"]


def storage_reader(location: CheckpointLocation) -> Any:
    """DCP's ``StorageReader`` for the folder at ``location``."""
    if location.is_url:
        from torch.distributed.checkpoint._fsspec_filesystem import (
            FsspecReader,  # not re-exported by torch 2.13
        )

        return FsspecReader(location.url)
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(location.path)


def storage_writer(location: CheckpointLocation) -> Any:
    """DCP's ``StorageWriter`` for the folder at ``location``."""
    if location.is_url:
        from torch.distributed.checkpoint._fsspec_filesystem import (
            FsspecWriter,  # not re-exported by torch 2.13
        )

        return FsspecWriter(location.url)
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(location.path)
