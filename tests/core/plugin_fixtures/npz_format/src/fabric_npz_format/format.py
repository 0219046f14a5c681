"""One ``.npz`` file, written by global rank 0: every tensor of the state an array named ``t<N>``, the structure
around them (dicts, lists, numbers, strings) as JSON in the array ``__tree__``. Readable without torch by numpy.

Crash safety comes from the core: ``commit_file`` writes the file beside its target and renames it into place.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from fabric_core.io import CheckpointFormat, commit_file


def _encode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, torch.Tensor):
        name = f"t{len(arrays)}"
        arrays[name] = value.detach().cpu().numpy()
        return {"tensor": name}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"list": [_encode(v, arrays) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"The npz format stores tensors, dicts, lists, numbers and strings, not {type(value).__name__}.")


def _decode(node: dict[str, Any], arrays: Any) -> Any:
    if "tensor" in node:
        return torch.from_numpy(arrays[node["tensor"]].copy())
    if "dict" in node:
        return {_decode(k, arrays): _decode(v, arrays) for k, v in node["dict"]}
    if "list" in node:
        return [_decode(v, arrays) for v in node["list"]]
    return node["value"]


class NpzFormat(CheckpointFormat):
    description = "a numpy .npz checkpoint (fabric-npz-format)"

    def recognises(self, location) -> bool:
        return location.name.endswith(".npz") and location.is_file()

    def write(self, location, state, context, *, filter=None, storage_options=None) -> None:
        converted = context.state_to_save(state, filter)  # on every rank: the strategy's adapters may gather
        if not context.coordinator.is_global_zero:
            return
        arrays: dict[str, np.ndarray] = {}
        tree = json.dumps(_encode(converted, arrays))

        def write_file(file) -> None:
            np.savez(file, __tree__=np.frombuffer(tree.encode(), dtype=np.uint8), **arrays)

        commit_file(location, write_file, storage_options)

    def read(self, location, map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]:
        with location.open("rb") as file:
            with np.load(file) as arrays:
                tree = json.loads(arrays["__tree__"].tobytes().decode())
                return _decode(tree, arrays)
