"""Registers the ``npz`` checkpoint format. Cheap: recognising a file looks at its name, imports nothing else."""

from __future__ import annotations

from fabric_core.plugins import hookimpl


def is_npz(location) -> bool:
    return location.name.endswith(".npz") and location.is_file()


@hookimpl
def fabric_register_checkpoint_formats(registrar) -> None:
    registrar.add(
        "npz",
        "fabric_npz_format.format:NpzFormat",
        description="one numpy .npz file: every tensor an array, the rest as JSON",
        recognised_by="fabric_npz_format.register:is_npz",
    )
