"""The on-disk layout of a sharded FSDP checkpoint, recognisable without importing torch (or fabric-core's io).

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fabric_core.io import CheckpointLocation

#: DCP's index file, present in every DCP checkpoint directory.
DCP_METADATA = ".metadata"
#: Our file with the non-tensor part of the state; its presence is what marks a checkpoint as ours.
META_FILE = "meta.pt"
#: Key in ``meta.pt`` describing which DCP entries are the model and the optimizers.
FORMAT_KEY = "__fabric_fsdp__"
FORMAT_VERSION = 1


def sharded_location(path: CheckpointLocation | str | os.PathLike) -> CheckpointLocation | None:
    """Where the files of the sharded checkpoint at ``path`` are, or ``None`` when it is not one.

    Locally that is ``path`` itself: a directory holding a DCP index and our ``meta.pt``. At a URL (an object
    store) it is the committed version the core's marker names (:meth:`CheckpointLocation.committed`).
    """
    from fabric_core.io import CheckpointLocation

    location = CheckpointLocation.of(path).committed()
    return location if location.child(DCP_METADATA).is_file() and location.child(META_FILE).is_file() else None


def is_sharded_checkpoint(path: CheckpointLocation | str | os.PathLike) -> bool:
    """True for a sharded FSDP checkpoint (a local directory, or a committed folder at a URL)."""
    return sharded_location(path) is not None
