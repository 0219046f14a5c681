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

Part of the plugin SDK: the names in ``__all__`` are the stable contract plugins (ours and third parties') import,
listed in docs/plugins.md; every other module of the core is internal and may change. The names are imported on
first access, so importing this package costs nothing.
"""

from __future__ import annotations

from fabric_core.utilities.lazy import lazy_exports

__all__ = [
    "CheckpointFormat",
    "CheckpointHandle",
    "CheckpointIO",
    "CheckpointLocation",
    "CheckpointPathError",
    "CheckpointReadError",
    "CheckpointSaveError",
    "Filter",
    "FormatContext",
    "RegisteredFormat",
    "TorchCheckpointIO",
    "atomic_save",
    "check_missing",
    "check_replaceable",
    "commit_directory",
    "commit_directory_async",
    "commit_file",
    "lazy_load",
    "restore_state",
    "save_file",
    "state_to_save",
    "storage_reader",
    "storage_writer",
    "wait_for_save",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "CheckpointHandle": "fabric_core.io.background",
        "wait_for_save": "fabric_core.io.background",
        "CheckpointIO": "fabric_core.io.checkpoint_io",
        "TorchCheckpointIO": "fabric_core.io.checkpoint_io",
        "atomic_save": "fabric_core.io.commit",
        "check_replaceable": "fabric_core.io.commit",
        "commit_directory": "fabric_core.io.commit",
        "commit_directory_async": "fabric_core.io.commit",
        "commit_file": "fabric_core.io.commit",
        "save_file": "fabric_core.io.commit",
        "storage_reader": "fabric_core.io.dcp",
        "storage_writer": "fabric_core.io.dcp",
        "CheckpointPathError": "fabric_core.io.errors",
        "CheckpointReadError": "fabric_core.io.errors",
        "CheckpointSaveError": "fabric_core.io.errors",
        "CheckpointFormat": "fabric_core.io.format",
        "FormatContext": "fabric_core.io.format",
        "RegisteredFormat": "fabric_core.io.registered",
        "lazy_load": "fabric_core.io.lazy",
        "CheckpointLocation": "fabric_core.io.location",
        "Filter": "fabric_core.io.state",
        "check_missing": "fabric_core.io.state",
        "restore_state": "fabric_core.io.state",
        "state_to_save": "fabric_core.io.state",
    },
    submodules=('background', 'retention', 'series', 'state'),
)
