"""A folder with ``keys.json`` and one ``<key>.pt`` per top-level entry of the state, written by global rank 0.

Written against the core's building blocks only: the location's methods (never "local path or URL"), the
context's state walk, and the core's folder commit, so it is crash-safe and works for any strategy.
"""

from __future__ import annotations

import json
from typing import Any

from fabric_core.io import CheckpointFormat, check_replaceable, commit_directory, save_file
from fabric_keyed_format.register import MARKER, is_keyed_folder


class KeyedFolderFormat(CheckpointFormat):
    description = "a keyed checkpoint folder (fabric-keyed-format)"

    def recognises(self, location) -> bool:
        return is_keyed_folder(location)

    def write(self, location, state, context, *, filter=None, storage_options=None) -> None:
        check_replaceable(location, lambda path: (path / MARKER).is_file(), self.description)
        converted = context.state_to_save(state, filter)  # every rank: the strategy's adapters may gather

        def write_files(folder) -> None:
            if context.coordinator.is_global_zero:
                for key, value in converted.items():
                    save_file(value, folder.child(f"{key}.pt"))
                with folder.child(MARKER).open("wb") as file:
                    file.write(json.dumps(sorted(converted)).encode())

        commit_directory(location, write_files, context.coordinator)

    def read(self, location, map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]:
        import torch

        folder = location.committed()
        out = {}
        for key in json.loads(folder.child(MARKER).read_text()):
            with folder.child(f"{key}.pt").open("rb") as file:
                out[key] = torch.load(file, map_location=map_location, weights_only=weights_only is not False)
        return out
