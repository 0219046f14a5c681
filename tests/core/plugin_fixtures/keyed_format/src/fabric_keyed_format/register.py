"""Registers the ``keyed_folder`` checkpoint format; recognising a folder imports nothing beyond this module."""

from __future__ import annotations

from fabric_core.plugins import hookimpl

MARKER = "keys.json"


def is_keyed_folder(location) -> bool:
    """Cheap: a file name in the folder's committed version."""
    return location.committed().child(MARKER).is_file()


@hookimpl
def fabric_register_checkpoint_formats(registrar) -> None:
    registrar.add(
        "keyed_folder",
        "fabric_keyed_format.format:KeyedFolderFormat",
        description="a folder with one torch.save file per top-level key",
        recognised_by="fabric_keyed_format.register:is_keyed_folder",
    )
