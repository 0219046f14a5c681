"""FSDP checkpoints: saving and loading them from a strategy, and reading them without FSDP.

The layouts are described in :mod:`fabric_fsdp.formats`. Everything that is not FSDP-specific comes from the
core: the walk over the user's state (:mod:`fabric_core.io.state`), the single-file reader with its mmap
fallback and the reader of other plugins' directories (:mod:`fabric_core.io.formats`), and the crash-safe
multi-rank directory commit (:func:`fabric_core.io.commit.commit_directory`). What stays here is how an FSDP
model and its optimizers become DCP shards or full state dicts and back.

:func:`load_sharded_checkpoint` turns a sharded directory into the full layout in one process, with no
process group; the core uses it through the ``fabric_select_checkpoint_reader`` hook (single device, DDP) and
for ``fabric consolidate``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.io import remote
from fabric_core.io.commit import check_replaceable, commit_directory, commit_directory_async
from fabric_core.io.state import Filter, check_missing, restore_state, state_to_save
from fabric_fsdp.formats import (
    DCP_METADATA,
    FORMAT_KEY,
    FORMAT_VERSION,
    META_FILE,
    is_sharded_checkpoint,
    sharded_location,
)
from fabric_fsdp.sharding import grads_hidden, is_fsdp

if TYPE_CHECKING:
    from fabric_fsdp.strategy import FSDPStrategy

__all__ = [
    "CheckpointPathError",
    "find_model",
    "load",
    "load_sharded_checkpoint",
    "optimizer_state_by_name",
    "optimizer_state_by_position",
    "read_meta",
    "save_full",
    "save_sharded",
]


def _child(folder: str | os.PathLike, name: str) -> str | Path:
    return remote.join(str(folder), name) if remote.is_url(folder) else Path(folder) / name


def _reader(location: str | Path) -> Any:
    """DCP's reader for a local folder or a URL (fsspec)."""
    if remote.is_url(location):
        from torch.distributed.checkpoint._fsspec_filesystem import (
            FsspecReader,  # not re-exported by torch 2.13
        )

        return FsspecReader(str(location))
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(location)


def _writer(location: str | Path) -> Any:
    if remote.is_url(location):
        from torch.distributed.checkpoint._fsspec_filesystem import (
            FsspecWriter,  # not re-exported by torch 2.13
        )

        return FsspecWriter(str(location))
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(location)


def read_meta(path: str | os.PathLike, weights_only: bool | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return ``(meta, format_record)`` of a sharded checkpoint; the record is removed from ``meta``."""
    from fabric_core.io.checkpoint_io import TorchCheckpointIO

    meta = TorchCheckpointIO().load_checkpoint(_child(path, META_FILE), weights_only=weights_only)
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
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    location = sharded_location(path)
    if location is None:
        raise ValueError(
            f"{str(path)!r} is not a sharded FSDP checkpoint: expected a directory with {DCP_METADATA!r} and"
            f" {META_FILE!r}."
        )
    meta, record = read_meta(location, weights_only=weights_only)
    tensors: dict[str, Any] = {}
    # What torch's own dcp_to_torch_save does, minus the file: the public `dcp.load` only fills keys that
    # already exist in the dict it is given, so the empty-dict planner needs the lower-level entry point.
    _load_state_dict(tensors, storage_reader=_reader(location), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    for key in record.get("optimizers", []):
        if key in tensors:
            tensors[key] = optimizer_state_by_position(tensors[key])
    if map_location is not None and str(map_location) != "cpu":
        from fabric_core.utilities.apply import move_data_to_device

        tensors = move_data_to_device(tensors, torch.device(map_location))
    tensors.update(meta)
    return tensors


# ---------------------------------------------------------------------------------------------------- strategy side
class CheckpointPathError(FileNotFoundError, ValueError):
    """Nothing at the path given to ``fabric.load``: a ``FileNotFoundError``, and the reference's ``ValueError``."""


def find_model(state: dict[str, Any], action: str) -> tuple[str | None, Module | None]:
    """The one FSDP model in ``state`` (key and module), or ``(None, None)``; several are an error."""
    found = [(k, v) for k, v in state.items() if isinstance(v, Module) and is_fsdp(v)]
    if len(found) > 1:
        verb = "Saving" if action == "save" else "Loading"
        raise ValueError(
            f"Found multiple FSDP models in the given state ({', '.join(repr(k) for k, _ in found)}). {verb}"
            " checkpoints with FSDP is limited to a single model per checkpoint: save each model in its own"
            " checkpoint (a separate path), and load each from its own."
        )
    return found[0] if found else (None, None)


def save_full(
    strategy: FSDPStrategy, path: Path, state: dict[str, Any], storage_options: Any, filter: Filter | None
) -> None:
    """One file written by rank 0: full (gathered) state dicts, optimizer state keyed by position."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    converted = strategy.convert_state(
        state,
        filter,
        module_state=lambda m: get_model_state_dict(m, options=options) if is_fsdp(m) else m.state_dict(),
        optimizer_state=lambda o: optimizer_state_by_position(get_optimizer_state_dict(strategy.owner(o), o, options=options)),
    )
    if strategy.is_global_zero:
        strategy.checkpoint_io.save_checkpoint(converted, path, storage_options=storage_options)


def _shards_and_meta(
    strategy: FSDPStrategy, model_key: str, model: Module, state: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What DCP writes (the model and its optimizers, sharded) and what ``meta.pt`` holds (everything else)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    shards: dict[str, Any] = {model_key: get_model_state_dict(model)}
    optimizer_keys = []
    rest: dict[str, Any] = {}
    for key, obj in state.items():
        if key == model_key:
            continue
        if isinstance(obj, Optimizer):
            shards[key] = get_optimizer_state_dict(strategy.owner(obj), obj)
            optimizer_keys.append(key)
        else:
            rest[key] = obj
    meta = state_to_save(
        rest,
        module_state=lambda m: m.state_dict(),
        optimizer_state=lambda o: o.state_dict(),
        precision_state=strategy.precision.state_dict(),
    )
    meta[FORMAT_KEY] = {
        "version": FORMAT_VERSION,
        "module": model_key,
        "optimizers": optimizer_keys,
        "world_size": strategy.world_size,
    }
    return shards, meta


def _write_meta(strategy: FSDPStrategy, meta: dict[str, Any], folder: str | Path) -> None:
    if not strategy.is_global_zero:
        return
    if remote.is_url(folder):
        remote.save(meta, str(_child(folder, META_FILE)))
    else:
        from fabric_core.io.checkpoint_io import atomic_save

        atomic_save(meta, Path(folder) / META_FILE)


def save_sharded(strategy: FSDPStrategy, path: str | Path, model_key: str, model: Module, state: dict[str, Any]) -> None:
    """A directory written by every rank in parallel (DCP shards plus ``meta.pt``), committed crash-safely.

    At a URL the folder is committed as the core does it on object stores (a new version, then its marker).
    """
    import torch.distributed.checkpoint as dcp

    if not remote.is_url(path):
        check_replaceable(Path(path), is_sharded_checkpoint, "an FSDP checkpoint")
    shards, meta = _shards_and_meta(strategy, model_key, model, state)

    def write(folder: str | Path) -> None:
        dcp.save(shards, storage_writer=_writer(folder))
        _write_meta(strategy, meta, folder)  # last: its presence marks the folder as a checkpoint

    commit_directory(path, write, strategy)


def save_sharded_async(
    strategy: FSDPStrategy, path: str | Path, model_key: str, model: Module, state: dict[str, Any]
) -> Any:
    """Like :func:`save_sharded`, but the caller waits only while DCP copies the shards to CPU memory.

    torch.distributed.checkpoint's ``async_save`` stages the shards (into buffers its stager keeps for the next
    save) and writes them in its own thread over the strategy's checkpoint process group; the core's
    :func:`~fabric_core.io.commit.commit_directory_async` then waits for that, writes ``meta.pt`` and commits in
    the background thread. ``meta.pt``'s content is taken now, so later changes to the state do not leak in.
    """
    import copy

    import torch.distributed.checkpoint as dcp

    if not remote.is_url(path):
        check_replaceable(Path(path), is_sharded_checkpoint, "an FSDP checkpoint")
    shards, meta = _shards_and_meta(strategy, model_key, model, state)
    meta = copy.deepcopy(meta)
    background_coordinator = strategy.checkpoint_coordinator()  # every rank, same point: may create its group

    def start(folder: str | Path) -> Any:
        future = dcp.async_save(
            shards,
            storage_writer=_writer(folder),
            process_group=background_coordinator.group,
            async_stager=strategy.dcp_stager(),
        )

        def wait() -> None:
            getattr(future, "upload_completion", future).result()
            _write_meta(strategy, meta, folder)

        return wait

    return commit_directory_async(path, start, strategy, background_coordinator)


def load(
    strategy: FSDPStrategy,
    path: str | Path,
    state: Module | Optimizer | dict[str, Any] | None,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Restore ``state`` in place: a sharded directory reshards on load (N ranks saved, M load); anything else
    (a full file from any strategy, another plugin's directory through its reader) is read whole by every rank,
    and each keeps its shard."""
    if remote.is_url(path):
        location = sharded_location(path)
        if location is not None:
            return _load_sharded(strategy, location, state, strict, weights_only)
        return restore_state(
            state,
            strategy.read_checkpoint(path, weights_only=weights_only),
            strict=strict,
            load_module=_load_model_full,
            load_optimizer=lambda optimizer, value: _load_optimizer_full(strategy.owner(optimizer), optimizer, value),
            load_precision=strategy.precision.load_state_dict,
        )
    path = Path(path)
    if not path.exists():
        raise CheckpointPathError(
            f"The path {str(path)!r} does not point to a valid checkpoint: nothing exists there. Make sure the path"
            " points to either a directory with FSDP checkpoint shards, or a single file with a full checkpoint."
        )
    if is_sharded_checkpoint(path):
        return _load_sharded(strategy, path, state, strict, weights_only)
    find_reader = strategy._find_checkpoint_reader
    if path.is_dir() and (find_reader is None or find_reader(path) is None):
        raise ValueError(
            f"The path {str(path)!r} does not point to a valid checkpoint. Make sure the path points to either a"
            " directory with FSDP checkpoint shards, or a single file with a full checkpoint. (A sharded"
            " checkpoint of another strategy is read by its plugin when that is installed; `fabric plugins`"
            " lists them.)"
        )
    return restore_state(
        state,
        strategy.read_checkpoint(path, weights_only=weights_only),
        strict=strict,
        load_module=_load_model_full,
        load_optimizer=lambda optimizer, value: _load_optimizer_full(strategy.owner(optimizer), optimizer, value),
        load_precision=strategy.precision.load_state_dict,
    )


def _load_model_full(module: Module, state_dict: dict[str, Any], strict: bool) -> None:
    if not is_fsdp(module):
        module.load_state_dict(state_dict, strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))


def _load_optimizer_full(model: Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    by_name = optimizer_state_by_name(state, optimizer, names)
    with grads_hidden(optimizer):
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _load_sharded(
    strategy: FSDPStrategy, path: str | Path, state: Any, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    bare = isinstance(state, (Module, Optimizer))
    if not bare and not state:
        raise ValueError(
            "Could not find a FSDP model in the provided checkpoint state: loading a sharded FSDP checkpoint needs"
            " the model to load into. Pass it like `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
            f" To get a single file with everything instead, run `fabric consolidate {path}`."
        )
    meta, record = read_meta(path, weights_only=weights_only)
    model_key: str = record["module"]
    optimizer_keys: list[str] = list(record.get("optimizers", []))
    if bare:  # a bare model or optimizer: match it to the saved one by kind
        if isinstance(state, Optimizer) and len(optimizer_keys) != 1:
            raise ValueError(
                f"The checkpoint holds {len(optimizer_keys)} optimizers; pass a dict to say which one to load."
            )
        state = {model_key if isinstance(state, Module) else optimizer_keys[0]: state}

    key, model = find_model(state, "load")
    optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer) and k in optimizer_keys}
    if model is None and optimizers:
        model = strategy.owner(next(iter(optimizers.values())))
    check_missing(state, {model_key, *optimizer_keys, *meta}, strict)
    if key is not None and key != model_key:
        raise KeyError(
            f"The checkpoint stores its model under {model_key!r}, but the state passes the FSDP model under"
            f" {key!r}. Use the same key as when saving."
        )

    shards: dict[str, Any] = {}
    if key is not None:
        shards[model_key] = get_model_state_dict(model)
    for k, opt in optimizers.items():
        with grads_hidden(opt):
            shards[k] = get_optimizer_state_dict(model, opt)
    if shards:
        dcp.load(shards, storage_reader=_reader(path), planner=DefaultLoadPlanner(allow_partial_load=not strict))
    if key is not None:
        set_model_state_dict(model, shards[model_key], options=StateDictOptions(strict=strict))
    for k, opt in optimizers.items():
        set_optimizer_state_dict(model, opt, shards[k])
    if bare:
        return {}
    # Everything else was saved in meta.pt, as a single-file checkpoint would hold it.
    rest = {k: v for k, v in state.items() if k not in shards}
    remainder = restore_state(
        rest,
        meta,
        strict=False,
        load_module=lambda m, value, strict_: m.load_state_dict(value, strict=strict),
        load_optimizer=lambda o, value: o.load_state_dict(value),
        load_precision=strategy.precision.load_state_dict,
    )
    for k, v in rest.items():
        state[k] = v
    return remainder
