"""DeepSpeed checkpoints: saving and loading them from the strategy, and reading them without DeepSpeed's engine.

The layout is described in :mod:`fabric_deepspeed.layout`. What is not DeepSpeed-specific comes from the core:
the walk over the user's state (:mod:`fabric_core.io.state`), reading files and other plugins' directories
(:mod:`fabric_core.io.formats`) and the crash-safe multi-rank directory commit
(:func:`fabric_core.io.commit.commit_directory`). What stays here is how an engine becomes DeepSpeed's directory
and back, and how full weights go into (or come out of) a partitioned model.

:func:`load_deepspeed_checkpoint` turns a DeepSpeed directory into the single-file layout in one process, with no
process group (DeepSpeed's ``zero_to_fp32`` merges the partitions into float32 weights); the core uses it through
the ``fabric_select_checkpoint_reader`` hook (a single device, DDP, FSDP) and for ``fabric consolidate``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.io.commit import check_replaceable, commit_directory
from fabric_core.io.errors import CheckpointPathError
from fabric_core.io.state import Filter, check_missing, restore_state, state_to_save
from fabric_deepspeed import runtime
from fabric_deepspeed.layout import (
    FORMAT_KEY,
    FORMAT_VERSION,
    LATEST,
    TAG,
    is_deepspeed_checkpoint,
    model_states_files,
    read_tag,
    tag_folder_parent,
)

if TYPE_CHECKING:
    from fabric_deepspeed.strategy import DeepSpeedStrategy

__all__ = ["DeepSpeedCheckpointError", "check_safe_to_load", "find_engine", "load", "load_deepspeed_checkpoint", "save"]


class DeepSpeedCheckpointError(RuntimeError):
    """A DeepSpeed checkpoint directory could not be read (incomplete, foreign objects, not DeepSpeed's)."""


# ---------------------------------------------------------------------------------------------------- safety
def _deepspeed_safe_globals() -> list[Any]:
    """DeepSpeed's own (data-only) classes that its checkpoint files hold: allowed by the safe check below."""
    found: list[Any] = []
    for module_name, names in (
        ("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
        ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
        ("deepspeed.utils.tensor_fragment", ("fragment_address",)),
        ("deepspeed.runtime.zero.offload_config", ("OffloadDeviceEnum",)),
    ):
        try:
            module = __import__(module_name, fromlist=list(names))
        except Exception:  # noqa: S112 - a version without the module has nothing of it to allow
            continue
        found.extend(getattr(module, n) for n in names if hasattr(module, n))
    return found


def check_safe_to_load(path: Path, tag: str, weights_only: bool | None) -> None:
    """Refuse a checkpoint whose files hold objects torch's safe loader does not allow, unless ``weights_only=False``.

    DeepSpeed reads its files with ``torch.load(weights_only=False)``; Fabric loads safely by default, so every
    ``.pt`` file of the tag folder is opened with the safe loader first (memory-mapped: only the pickled
    structure is read, not the tensor data), allowing DeepSpeed's own data-only classes.
    """
    if weights_only is False:
        return
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        for file in sorted((path / tag).glob("*.pt")):
            try:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError as err:
                raise DeepSpeedCheckpointError(
                    f"The DeepSpeed checkpoint {str(path)!r} holds objects that the safe loader refuses ({file.name}:"
                    f" {str(err).splitlines()[0]}). If you trust the checkpoint, load it with `weights_only=False`,"
                    " or allowlist the classes with `torch.serialization.add_safe_globals([...])`."
                ) from err
            except RuntimeError as err:
                raise DeepSpeedCheckpointError(
                    f"The DeepSpeed checkpoint {str(path)!r} is not readable: {file.name} is corrupt or truncated"
                    f" ({type(err).__name__}: {str(err).splitlines()[0]})."
                ) from err


class _NullWriter(io.RawIOBase):
    """A file that forgets what is written to it: serialising into it finds unpicklable objects for free."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(memoryview(data))


def _check_picklable(obj: Any) -> None:
    """``torch.save`` ``obj`` into nothing, on every rank, before DeepSpeed's save starts its collectives.

    DeepSpeed's save runs barriers between the files it writes; if one rank fails there, the others wait for the
    collective timeout. A client state that cannot be pickled fails here instead, on every rank, before any of them.
    """
    torch.save(obj, _NullWriter())


# ---------------------------------------------------------------------------------------------------- strategy side
def find_engine(state: dict[str, Any], action: str) -> tuple[str, Any]:
    """The one DeepSpeed engine in ``state`` (key and engine); none or several are a ``ValueError``."""
    found = [(k, v) for k, v in state.items() if runtime.is_engine(v)]
    if not found:
        raise ValueError(
            f"Could not find a DeepSpeed model in the provided checkpoint state. Please provide the model as part of"
            f" the state like so: `{action}_checkpoint(..., state={{'model': model, ...}})`. Make sure you set up the"
            " model (and optimizers if any) through the strategy before saving the checkpoint."
        )
    if len(found) > 1:
        verb = "Saving" if action == "save" else "Saving and loading"
        raise ValueError(
            f"Found multiple DeepSpeed engine modules in the given state ({', '.join(repr(k) for k, _ in found)})."
            f" {verb} checkpoints with DeepSpeed is currently limited to a single model per checkpoint. To"
            f" {action} multiple models, call the {action} method for each model separately with a different path."
        )
    return found[0]


def _optimizer_key(state: dict[str, Any], engine: Any) -> str | None:
    own = engine.optimizer
    if own is None:
        return None
    inner = getattr(own, "optimizer", None)
    return next((k for k, v in state.items() if v is own or (inner is not None and v is inner)), None)


def save(
    strategy: DeepSpeedStrategy, path: Path, state: dict[str, Any], storage_options: Any, filter: Filter | None
) -> None:
    if storage_options is not None:
        raise TypeError(
            "`DeepSpeedStrategy.save_checkpoint(..., storage_options=...)` is not supported because"
            " `DeepSpeedStrategy` does not use the `CheckpointIO`: DeepSpeed's engine writes the directory."
            " Leave `storage_options` out."
        )
    if filter is not None:
        raise TypeError(
            "`DeepSpeedStrategy.save_checkpoint(..., filter=...)` is not supported because `DeepSpeedStrategy`"
            " manages the state serialization internally. Save without a filter; to keep only some weights, run"
            " `fabric consolidate` on the checkpoint and filter the resulting state dict."
        )
    key, engine = find_engine(state, "save")
    optimizer_key = _optimizer_key(state, engine)
    rest = {k: v for k, v in state.items() if k != key and k != optimizer_key}
    record = {
        "version": FORMAT_VERSION,
        "model": key,
        "optimizer": optimizer_key,
        "world_size": strategy.world_size,
        "zero_stage": strategy.zero_stage,
        "state": state_to_save(
            rest,
            module_state=lambda m: m.state_dict(),
            optimizer_state=lambda o: o.state_dict(),
            precision_state=strategy.precision.state_dict(),
        ),
    }
    _check_picklable(record)
    check_replaceable(path, is_deepspeed_checkpoint, "a DeepSpeed checkpoint")

    def write(tmp: Path) -> None:
        engine.save_checkpoint(
            str(tmp), tag=TAG, client_state={FORMAT_KEY: record}, exclude_frozen_parameters=strategy.exclude_frozen_parameters
        )

    commit_directory(path, write, strategy)


def _record_from(client_state: dict[str, Any] | None) -> dict[str, Any] | None:
    record = (client_state or {}).get(FORMAT_KEY)
    return record if isinstance(record, dict) and "state" in record else None


def _check_directory(path: Path) -> str:
    """The tag of the DeepSpeed checkpoint at ``path``, or an error that says what ``path`` is instead."""
    if not path.exists():
        raise CheckpointPathError(
            f"The path {str(path)!r} does not point to a valid checkpoint: nothing exists there. Make sure the path"
            " points to a DeepSpeed checkpoint directory (written by `fabric.save`) or a single checkpoint file."
        )
    parent = tag_folder_parent(path)
    if parent is not None:
        raise FileNotFoundError(
            f"The provided path is not a valid DeepSpeed checkpoint: {str(path)!r}. It is the {path.name!r} folder"
            f" inside one; load the directory that holds it instead: {str(parent)!r}."
        )
    tag = read_tag(path)
    if tag is None or not model_states_files(path, tag):
        raise FileNotFoundError(
            f"The provided path is not a valid DeepSpeed checkpoint: {str(path)!r} has no {LATEST!r} file naming a"
            " folder of DeepSpeed model states. Pass the directory `fabric.save` wrote."
        )
    return tag


def load(
    strategy: DeepSpeedStrategy,
    path: Path,
    state: Module | Optimizer | dict[str, Any] | None,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Restore ``state`` in place; returns what the checkpoint holds beyond it.

    * a DeepSpeed directory, saved on as many ranks: the engine reads its partitions (model, and the optimizer if
      the state asks for it); the rest comes from the client state;
    * a single file, another plugin's directory, or a DeepSpeed directory saved on another number of ranks: the
      full weights are read in every process and loaded into the engine (``GatheredParameters`` under stage 3),
      then DeepSpeed's float32 master weights are refreshed from them; ZeRO optimizer state cannot come from a
      plain optimizer state dict (``NotImplementedError``);
    * a bare module or optimizer (``fabric.load_raw``): the file *is* its state dict.
    """
    if isinstance(state, (Module, Optimizer)) or _is_deepspeed_optimizer(state):
        return _load_raw(strategy, path, state, strict, weights_only)
    if not state:
        raise ValueError(
            f"Got DeepSpeedStrategy.load_checkpoint(..., state={state!r}) but a state with at least  a model instance"
            " to reload is required. Pass it in like so: DeepSpeedStrategy.load_checkpoint(..., state={'model':"
            " model, ...})"
        )
    if not path.exists():
        _check_directory(path)
    if path.is_file() or not is_deepspeed_checkpoint(path):
        if path.is_dir():
            find_reader = strategy.checkpoint_context().find_reader
            if tag_folder_parent(path) is not None or find_reader is None or find_reader(path) is None:
                _check_directory(path)  # raises, saying what the directory is
        return _load_full(strategy, path, state, strict, weights_only)

    tag = _check_directory(path)
    key, engine = find_engine(state, "load")
    optimizer_key = _optimizer_key(state, engine)
    check_safe_to_load(path, tag, weights_only)
    saved = _read_record(path, tag)
    if saved is not None and saved.get("world_size") not in (None, strategy.world_size):
        if optimizer_key is not None:
            raise ValueError(
                f"The DeepSpeed checkpoint {str(path)!r} was saved on {saved['world_size']} ranks and is loaded on"
                f" {strategy.world_size}: DeepSpeed's ZeRO optimizer state can only be loaded on as many ranks as"
                " saved it. Load only the model (leave the optimizer out of the state), or use the same number of"
                " processes."
            )
        return _load_full(strategy, path, state, strict, weights_only)
    rest = {k: v for k, v in state.items() if k not in (key, optimizer_key)}
    if saved is not None:
        available = {*saved["state"], *(k for k in (saved.get("model"), saved.get("optimizer")) if k)}
        asked = [k for k in rest] + ([optimizer_key] if optimizer_key is not None and saved.get("optimizer") is None else [])
        check_missing(asked, available, strict)
    loaded_path, client_state = engine.load_checkpoint(
        str(path),
        tag=tag,
        load_module_strict=strict,
        load_optimizer_states=optimizer_key is not None,
        load_lr_scheduler_states=False,
    )
    if loaded_path is None:
        raise RuntimeError(
            "DeepSpeed was unable to load the checkpoint. Ensure you passed in a DeepSpeed compatible checkpoint or"
            f" a single checkpoint file: {str(path)!r}."
        )
    record = _record_from(client_state)
    checkpoint: dict[str, Any] = dict(record["state"]) if record is not None else _plain_client_state(client_state)
    remainder = restore_state(
        rest,
        checkpoint,
        strict=strict,
        load_module=lambda m, sd, s: m.load_state_dict(sd, strict=s),
        load_optimizer=lambda o, sd: o.load_state_dict(sd),
        load_precision=strategy.precision.load_state_dict,
    )
    state.update(rest)  # plain values (step, epoch) were replaced in `rest`
    return remainder


def _is_deepspeed_optimizer(obj: Any) -> bool:
    base = sys.modules.get("deepspeed.runtime.base_optimizer")
    return base is not None and isinstance(obj, base.DeepSpeedOptimizer)


def _read_record(path: Path, tag: str) -> dict[str, Any] | None:
    files = model_states_files(path, tag)
    if not files:
        return None
    states = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    return _record_from(states)


_DEEPSPEED_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "autotp_layers",
    "autotp_checkpoint_version",
    "autoep_layers",
    "autoep_checkpoint_version",
}


def _plain_client_state(client_state: dict[str, Any] | None) -> dict[str, Any]:
    """The user's entries of a checkpoint written by a plain DeepSpeed script (no record of ours)."""
    return {k: v for k, v in (client_state or {}).items() if k not in _DEEPSPEED_KEYS and not k.startswith("ds_")}


def _load_raw(strategy: DeepSpeedStrategy, path: Path, obj: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """``fabric.load_raw``: the file holds a plain state dict of ``obj``."""
    if path.is_dir():
        raise ValueError(
            f"`fabric.load_raw` expects a file with a plain PyTorch state dict, but {str(path)!r} is a directory. Load a"
            " checkpoint directory with `fabric.load(path, {'model': model, ...})`."
        )
    if isinstance(obj, Module):
        load_full_weights(strategy, obj, strategy.read_checkpoint(path, weights_only=weights_only), strict)
        return {}
    owner = next((e for e in strategy.engines if e.optimizer is obj), None)
    if isinstance(obj, Optimizer) and (owner is None or owner.zero_optimization_stage() == 0):
        # Not an engine's, or the engine steps this torch optimizer itself (ZeRO off, float32): a plain load.
        obj.load_state_dict(strategy.read_checkpoint(path, weights_only=weights_only))
        return {}
    raise NotImplementedError(
        "Loading a plain PyTorch optimizer state dict into DeepSpeed's ZeRO optimizer is not supported: its state is"
        " partitioned across ranks (and held as flat float32 groups). Load a DeepSpeed checkpoint with"
        " `fabric.load(path, {'model': model, 'optimizer': optimizer})`, or start the optimizer fresh."
    )


def _load_full(
    strategy: DeepSpeedStrategy, path: Path, state: dict[str, Any], strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Full weights from a file or any checkpoint directory a reader understands, into the engine."""
    key, engine = find_engine(state, "load")
    optimizer_key = _optimizer_key(state, engine)
    checkpoint = strategy.read_checkpoint(path, weights_only=weights_only)
    if optimizer_key is not None and optimizer_key in checkpoint:
        raise NotImplementedError(
            f"The checkpoint {str(path)!r} holds the optimizer state as a plain PyTorch state dict, which cannot be"
            " loaded into DeepSpeed's ZeRO optimizer (its state is partitioned across ranks). Leave the optimizer out"
            f" of the state to load the rest: `fabric.load(path, {{{key!r}: model, ...}})`."
        )

    def load_module(module: Module, state_dict: dict[str, Any], strict: bool) -> None:
        if runtime.is_engine(module):
            load_full_weights(strategy, module.module, state_dict, strict)
        else:
            module.load_state_dict(state_dict, strict=strict)

    return restore_state(
        state,
        checkpoint,
        strict=strict,
        load_module=load_module,
        load_optimizer=lambda o, sd: o.load_state_dict(sd),
        load_precision=strategy.precision.load_state_dict,
    )


@contextlib.contextmanager
def _gathered(module: Module) -> Iterator[None]:
    """Under stage 3, the full parameters for the duration; rank 0's changes are partitioned again at the end."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        yield


def load_full_weights(strategy: DeepSpeedStrategy, module: Module, state_dict: dict[str, Any], strict: bool) -> None:
    """Load a full state dict into the user's module inside an engine, and into the optimizer's master weights.

    Stage 3: the parameters are gathered and loaded (rank 0's values are partitioned again). Then the ZeRO
    optimizer's float32 master partitions are rebuilt from the loaded weights (``refresh_fp32_params``); otherwise
    its next step would bring the old weights back.
    """
    engine = strategy.engine_of(module)
    module = engine.module
    with _gathered(module):
        module.load_state_dict(state_dict, strict=strict)
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if callable(refresh):
        refresh()


# ---------------------------------------------------------------------------------------------------- reader
def load_deepspeed_checkpoint(
    path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool | None = None
) -> dict[str, Any]:
    """Read a DeepSpeed checkpoint directory into one plain dict in this process (no process group needed).

    The model's key holds a float32 state dict (DeepSpeed's ``zero_to_fp32`` merges every rank's float32 master
    partitions for ZeRO 1-3; stage 0 stores the module whole, upcast here), the other entries are the saved
    non-model state. The ZeRO optimizer state is not converted (it stays with DeepSpeed), so the result has no
    optimizer entry. A checkpoint written by a plain DeepSpeed script (without our record) gives its model under
    ``"model"``. Needs memory for the full float32 model.
    """
    path = Path(path)
    if not is_deepspeed_checkpoint(path):
        raise ValueError(
            f"{str(path)!r} is not a DeepSpeed checkpoint: expected a directory with a {LATEST!r} file naming a folder"
            " of DeepSpeed model states."
        )
    tag = read_tag(path)
    assert tag is not None
    runtime.import_for_reading()
    check_safe_to_load(path, tag, weights_only)
    files = model_states_files(path, tag)
    first = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    record = _record_from(first)
    model_key = record["model"] if record is not None else "model"
    optim_files = list((path / tag).glob("*optim_states.pt"))
    if optim_files:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # It prints its progress and draws tqdm bars: a reader that returns a dict stays quiet.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            weights = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
    else:  # ZeRO disabled: the module is stored whole (in the compute dtype)
        weights = {k: (v.float() if torch.is_floating_point(v) else v) for k, v in first["module"].items()}
    weights = {k: v.contiguous().clone() if not v.is_contiguous() else v for k, v in weights.items()}
    if map_location is not None and str(map_location) != "cpu":
        from fabric_core.utilities.apply import move_data_to_device

        weights = move_data_to_device(weights, torch.device(map_location))
    out: dict[str, Any] = {model_key: weights}
    rest = dict(record["state"]) if record is not None else _plain_client_state(first)
    out.update(rest)
    return out
