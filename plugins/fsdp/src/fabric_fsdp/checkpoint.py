"""The on-disk formats of FSDP checkpoints, and reading them without FSDP.

A **sharded** checkpoint is a directory::

    ckpt/
      .metadata          torch.distributed.checkpoint (DCP) index of every tensor shard
      __0_0.distcp ...   one data file per rank that wrote
      meta.pt            torch.save of everything that is not the model or an optimizer (written by rank 0)

Inside DCP, the model's state dict lives under the key the user gave it in ``fabric.save(path, {"model": ...})``
and every optimizer under its own key, with the optimizer state keyed by *parameter name* (DCP's format),
which is what makes a checkpoint loadable on a different number of ranks. ``meta.pt`` also holds a small
record (:data:`FORMAT_KEY`) naming those keys.

A **full** checkpoint is one ``torch.save`` file with ordinary state dicts (optimizer state keyed by parameter
position, as ``Optimizer.state_dict()`` writes it), so any strategy can read it.

:func:`load_sharded_checkpoint` turns a sharded directory into the full layout in one process, with no
process group; the core uses it through the ``fabric_checkpoint_loader`` hook (single device, DDP) and for
``fabric consolidate``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

#: DCP's index file, present in every DCP checkpoint directory.
DCP_METADATA = ".metadata"
#: Our file with the non-tensor part of the state; its presence is what marks a checkpoint as ours.
META_FILE = "meta.pt"
#: Key in ``meta.pt`` describing which DCP entries are the model and the optimizers.
FORMAT_KEY = "__fabric_fsdp__"
FORMAT_VERSION = 1


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory holding a DCP index and our ``meta.pt``."""
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA).is_file() and (path / META_FILE).is_file()


def read_meta(path: str | os.PathLike, weights_only: bool | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return ``(meta, format_record)`` of a sharded checkpoint; the record is removed from ``meta``."""
    from fabric_core.io.checkpoint_io import TorchCheckpointIO

    meta = TorchCheckpointIO().load_checkpoint(Path(path) / META_FILE, weights_only=weights_only)
    record = meta.pop(FORMAT_KEY, None)
    if not isinstance(record, dict) or "module" not in record:
        raise ValueError(
            f"{str(path)!r} has a {META_FILE} but it was not written by fabric-fsdp (no {FORMAT_KEY!r} record)."
            " Only sharded checkpoints saved with `Fabric(strategy='fsdp').save(...)` can be read here."
        )
    return meta, record


def optimizer_state_by_position(state: dict[str, Any]) -> dict[str, Any]:
    """Convert an optimizer state dict keyed by parameter name (DCP) to one keyed by position (torch).

    Positions follow the order of the names in ``param_groups``, which is the optimizer's own parameter
    order, so the result loads into a plain optimizer built over the same parameters in the same order.
    """
    groups = state.get("param_groups", [])
    if not groups or all(isinstance(p, int) for g in groups for p in g.get("params", [])):
        return state
    index: dict[str, int] = {}
    new_groups = []
    for group in groups:
        ids = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        new_groups.append({**group, "params": ids})
    new_state = {index[name]: value for name, value in state.get("state", {}).items() if name in index}
    return {"state": new_state, "param_groups": new_groups}


def optimizer_state_by_name(state: dict[str, Any], optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_position` for ``optimizer``.

    ``names`` maps ``id(parameter)`` to the parameter's name in the model. Saved position ``i`` is the
    ``i``-th parameter of ``optimizer`` (torch's own rule for loading optimizer state).
    """
    groups = state.get("param_groups", [])
    if not groups or not all(isinstance(p, int) for g in groups for p in g.get("params", [])):
        return state
    current = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [p for group in groups for p in group["params"]]
    if len(groups) != len(optimizer.param_groups) or len(saved) != len(current):
        raise ValueError(
            f"The optimizer state in the checkpoint has {len(groups)} parameter group(s) with {len(saved)}"
            f" parameters, but the optimizer has {len(optimizer.param_groups)} group(s) with {len(current)}."
            " Build the optimizer over the same parameters, in the same order, as the one that was saved."
        )
    position_to_name: dict[int, str] = {}
    for position, param in zip(saved, current):
        name = names.get(id(param))
        if name is None:
            raise ValueError(
                "The optimizer holds a parameter that is not part of the FSDP model it is loaded with; FSDP can"
                " only restore optimizer state for the parameters of that model."
            )
        position_to_name[position] = name
    new_groups = [{**g, "params": [position_to_name[p] for p in g["params"]]} for g in groups]
    new_state = {position_to_name[k]: v for k, v in state.get("state", {}).items() if k in position_to_name}
    return {"state": new_state, "param_groups": new_groups}


def load_sharded_checkpoint(
    path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool | None = None
) -> dict[str, Any]:
    """Read a sharded FSDP checkpoint into one plain dict in this process (no process group needed).

    The result has the layout of a full checkpoint: the model's key holds a state dict of plain tensors,
    each optimizer's key a ``torch`` optimizer state dict, and the entries of ``meta.pt`` sit at the top
    level. Needs memory for the whole model and optimizer state.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{str(path)!r} is not a sharded FSDP checkpoint: expected a directory with {DCP_METADATA!r} and"
            f" {META_FILE!r}."
        )
    meta, record = read_meta(path, weights_only=weights_only)
    tensors: dict[str, Any] = {}
    # What torch's own dcp_to_torch_save does, minus the file: the public `dcp.load` only fills keys that
    # already exist in the dict it is given, so the empty-dict planner needs the lower-level entry point.
    _load_state_dict(tensors, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    for key in record.get("optimizers", []):
        if key in tensors:
            tensors[key] = optimizer_state_by_position(tensors[key])
    if map_location is not None and str(map_location) != "cpu":
        from fabric_core.utilities.apply import move_data_to_device

        tensors = move_data_to_device(tensors, torch.device(map_location))
    tensors.update(meta)
    return tensors
