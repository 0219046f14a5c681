"""The on-disk layout of a sharded FSDP checkpoint, recognisable without importing torch.

A **sharded** checkpoint is a directory::

    ckpt/
      .metadata          torch.distributed.checkpoint (DCP) index of every tensor shard
      __0_0.distcp ...   one data file per rank that wrote
      meta.pt            torch.save of everything that is not the model or an optimizer (written by rank 0)

Inside DCP, the model's state dict lives under the key the user gave it in ``fabric.save(path, {"model": ...})``
and every optimizer under its own key, with the optimizer state keyed by *parameter name* (DCP's format), which is
what makes a checkpoint loadable on a different number of ranks. ``meta.pt`` also holds a small record
(:data:`FORMAT_KEY`) naming those keys.

A **full** checkpoint is one ``torch.save`` file with ordinary state dicts (optimizer state keyed by parameter
position, as ``Optimizer.state_dict()`` writes it), so any strategy can read it.
"""

from __future__ import annotations

import os
from pathlib import Path

#: DCP's index file, present in every DCP checkpoint directory.
DCP_METADATA = ".metadata"
#: Our file with the non-tensor part of the state; its presence is what marks a checkpoint as ours.
META_FILE = "meta.pt"
#: Key in ``meta.pt`` describing which DCP entries are the model and the optimizers.
FORMAT_KEY = "__fabric_fsdp__"
FORMAT_VERSION = 1


def sharded_location(path: str | os.PathLike) -> str | Path | None:
    """Where the files of the sharded checkpoint at ``path`` are, or ``None`` when it is not one.

    Locally that is ``path`` itself: a directory holding a DCP index and our ``meta.pt``. At a URL (an object
    store) it is the committed version the core's marker names (:func:`fabric_core.io.commit.committed_version`).
    """
    from fabric_core.io import remote

    if remote.is_url(path):
        from fabric_core.io.commit import committed_version

        location = committed_version(str(path))
        fs, inner = remote.filesystem(location)
        base = inner.rstrip("/")
        return location if fs.exists(f"{base}/{DCP_METADATA}") and fs.exists(f"{base}/{META_FILE}") else None
    path = Path(remote.local_path(path))
    return path if path.is_dir() and (path / DCP_METADATA).is_file() and (path / META_FILE).is_file() else None


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True for a sharded FSDP checkpoint (a local directory, or a committed folder at a URL)."""
    return sharded_location(path) is not None
