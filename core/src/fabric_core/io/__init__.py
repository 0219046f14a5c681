"""Checkpoints as a component: where they are, how they are laid out, how they are committed.

* :mod:`~fabric_core.io.location`: :class:`CheckpointLocation`, a local path or a URL, decided once;
* :mod:`~fabric_core.io.format`: the :class:`CheckpointFormat` interface and the :class:`FormatContext` a format
  receives from its strategy; :mod:`~fabric_core.io.single_file`: the default format;
* :mod:`~fabric_core.io.commit`: crash-safe single files and multi-rank folders (:mod:`~fabric_core.io.remote` for
  object stores, :mod:`~fabric_core.io.coordination` for the ranks' votes); :mod:`~fabric_core.io.dcp`:
  torch.distributed.checkpoint's storage for a location;
* :func:`lazy_load` (:mod:`~fabric_core.io.lazy`): open a big checkpoint file with tensors read on access;
* :mod:`~fabric_core.io.state`: the walk over a user's state; :mod:`~fabric_core.io.checkpoint_io`: the
  reference's ``CheckpointIO`` plugin type; :mod:`~fabric_core.io.background`: what finishes after the call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric_core.io.checkpoint_io import CheckpointIO, TorchCheckpointIO
    from fabric_core.io.commit import atomic_save
    from fabric_core.io.errors import CheckpointPathError, CheckpointReadError, CheckpointSaveError
    from fabric_core.io.format import CheckpointFormat, FormatContext
    from fabric_core.io.lazy import lazy_load
    from fabric_core.io.location import CheckpointLocation

__all__ = [
    "CheckpointFormat",
    "CheckpointIO",
    "CheckpointLocation",
    "CheckpointPathError",
    "CheckpointReadError",
    "CheckpointSaveError",
    "FormatContext",
    "TorchCheckpointIO",
    "atomic_save",
    "lazy_load",
]

# Imported on first use: recognising a checkpoint by its location must not import torch, and a script that never
# saves does not import the checkpoint modules (``Fabric`` reads ``io.background`` etc. inside its calls).
__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "CheckpointFormat": "fabric_core.io.format",
        "CheckpointIO": "fabric_core.io.checkpoint_io",
        "CheckpointLocation": "fabric_core.io.location",
        "CheckpointPathError": "fabric_core.io.errors",
        "CheckpointReadError": "fabric_core.io.errors",
        "CheckpointSaveError": "fabric_core.io.errors",
        "FormatContext": "fabric_core.io.format",
        "TorchCheckpointIO": "fabric_core.io.checkpoint_io",
        "atomic_save": "fabric_core.io.commit",
        "lazy_load": "fabric_core.io.lazy",
    },
    submodules=("background", "retention", "series", "state"),
)
