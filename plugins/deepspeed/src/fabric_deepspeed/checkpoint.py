"""DeepSpeed checkpoints as a format of the core's checkpoint interface (:mod:`fabric_core.io.format`).

:class:`DeepSpeedFormat` writes DeepSpeed's own checkpoint folder (its engine writes it, every rank its files) and
commits it with the core's :func:`~fabric_core.io.commit.commit_directory`, on a local disk or at a URL; it loads
it through the engine when as many ranks load as saved (the ZeRO partitions included), through DeepSpeed's universal
checkpoint when another number of ranks loads the optimizer state too (:mod:`fabric_deepspeed.universal`), and as
full weights when another number of ranks loads the model alone. The layout is described in
:mod:`fabric_deepspeed.layout`.

DeepSpeed's engine reads and writes local folders only. At a URL every rank writes into a local scratch folder
(the system's temporary directory) and uploads its files into the version the core stages; loading downloads the
committed version into a scratch folder first (every file: make room for the whole checkpoint).

Loading a single file or another plugin's folder into engines goes through the core's formats, with the adapters
of this module that ``DeepSpeedStrategy.checkpoint_context()`` hands over: full weights are loaded into the engine
(gathered under ZeRO-3) and DeepSpeed's float32 master weights refreshed (:func:`load_full_weights`); a plain
optimizer state dict cannot go into a ZeRO optimizer (:func:`check_restorable` refuses before anything is loaded).

:func:`load_deepspeed_checkpoint` turns a DeepSpeed folder into the single-file layout in one process, with no
process group (DeepSpeed's ``zero_to_fp32`` merges the partitions into float32 weights): the registered format's
``read``, which other strategies (a single device, DDP, FSDP) and ``fabric consolidate`` use.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.io import (
    CheckpointFormat,
    CheckpointLocation,
    Filter,
    FormatContext,
    check_missing,
    check_replaceable,
    commit_directory,
    restore_state,
    state_to_save,
)
from fabric_deepspeed import runtime, universal
from fabric_deepspeed.layout import (
    FORMAT_KEY,
    FORMAT_VERSION,
    LATEST,
    TAG,
    is_deepspeed_checkpoint,
    model_states_files,
    read_tag,
)

__all__ = [
    "DeepSpeedCheckpointError",
    "DeepSpeedFormat",
    "check_restorable",
    "check_safe_to_load",
    "find_engine",
    "load_deepspeed_checkpoint",
    "load_full_weights",
    "load_module_state",
    "load_optimizer_state",
]


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
        except ImportError:  # a version without the module has nothing of it to allow
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


# ---------------------------------------------------------------------------------------------------- state
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


def _record_from(client_state: dict[str, Any] | None) -> dict[str, Any] | None:
    record = (client_state or {}).get(FORMAT_KEY)
    return record if isinstance(record, dict) and "state" in record else None


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



# ---------------------------------------------------------------------------------------------------- adapters
def _engine_holding(engines: list[Any], module: Module) -> Any | None:
    return next((e for e in engines if module is e or module is e.module), None)


def load_full_weights(engine: Any, state_dict: dict[str, Any], strict: bool) -> None:
    """Load a full state dict into the user's module inside ``engine``, and into the optimizer's master weights.

    Stage 3: the parameters are gathered and loaded (rank 0's values are partitioned again). Then the ZeRO
    optimizer's float32 master partitions are rebuilt from the loaded weights (``refresh_fp32_params``); otherwise
    its next step would bring the old weights back.
    """
    module = engine.module
    with _gathered(module):
        module.load_state_dict(state_dict, strict=strict)
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if callable(refresh):
        refresh()


def load_module_state(engines: list[Any], module: Module, state_dict: dict[str, Any], strict: bool) -> None:
    """The module adapter: full weights into an engine (or the module inside one), a plain load otherwise."""
    engine = _engine_holding(engines, module)
    if engine is None:
        module.load_state_dict(state_dict, strict=strict)
    else:
        load_full_weights(engine, state_dict, strict)


ZERO_OPTIMIZER_STATE_ERROR = (
    "Loading a plain PyTorch optimizer state dict into DeepSpeed's ZeRO optimizer is not supported: its state is"
    " partitioned across ranks (and held as flat float32 groups). Load a DeepSpeed checkpoint with"
    " `fabric.load(path, {'model': model, 'optimizer': optimizer})`, or start the optimizer fresh."
)


def load_optimizer_state(engines: list[Any], optimizer: Optimizer, state: dict[str, Any]) -> None:
    """The optimizer adapter: a torch optimizer that no engine partitions (none owns it, or ZeRO is off) loads its
    state dict; a ZeRO optimizer cannot (``NotImplementedError``)."""
    owner = next((e for e in engines if e.optimizer is optimizer), None)
    if isinstance(optimizer, Optimizer) and (owner is None or owner.zero_optimization_stage() == 0):
        optimizer.load_state_dict(state)
        return
    raise NotImplementedError(ZERO_OPTIMIZER_STATE_ERROR)


def check_restorable(state: Any, checkpoint: dict[str, Any]) -> None:
    """Refuse, before anything is loaded, a checkpoint whose plain optimizer state would go into an engine's ZeRO
    optimizer."""
    if not isinstance(state, dict):
        return
    for key, engine in [(k, v) for k, v in state.items() if runtime.is_engine(v)]:
        optimizer_key = _optimizer_key(state, engine)
        if optimizer_key is not None and optimizer_key in checkpoint:
            raise NotImplementedError(
                "The checkpoint holds the optimizer state as a plain PyTorch state dict, which cannot be loaded into"
                " DeepSpeed's ZeRO optimizer (its state is partitioned across ranks). Leave the optimizer out"
                f" of the state to load the rest: `fabric.load(path, {{{key!r}: model, ...}})`."
            )


def is_deepspeed_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is one of DeepSpeed's optimizers (ZeRO's are not ``torch.optim.Optimizer`` subclasses)."""
    base = sys.modules.get("deepspeed.runtime.base_optimizer")
    return base is not None and isinstance(obj, base.DeepSpeedOptimizer)


def _read_model_states(path: Path, tag: str) -> dict[str, Any]:
    """The first model-states file of ``tag`` (stage 3: rank 0's), memory-mapped: our record and DeepSpeed's sizes."""
    files = model_states_files(path, tag)
    if not files:
        return {}
    return torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)


# ---------------------------------------------------------------------------------------------------- the format
class DeepSpeedFormat(CheckpointFormat):
    """DeepSpeed's checkpoint folder, written by the engine on every rank, committed by the core.

    Args:
        zero_stage: recorded with the checkpoint (``None``: unknown, as when built from the registry to read).
        exclude_frozen_parameters: leave parameters with ``requires_grad=False`` out (DeepSpeed's option).
    """

    description = "a DeepSpeed checkpoint directory (written by `fabric.save`)"

    def __init__(self, *, zero_stage: int | None = None, exclude_frozen_parameters: bool = False) -> None:
        self.zero_stage = zero_stage
        self.exclude_frozen_parameters = exclude_frozen_parameters

    def recognises(self, location: CheckpointLocation) -> bool:
        return is_deepspeed_checkpoint(location)

    def write(
        self,
        location: CheckpointLocation,
        state: dict[str, Any],
        context: FormatContext,
        *,
        filter: Filter | None = None,
        storage_options: Any | None = None,
    ) -> None:
        """The engine writes its folder on every rank (the partitions of its ZeRO optimizer included); the rest of
        the state goes into DeepSpeed's client state under our record. Nothing is written when the state cannot
        be saved (no engine, an object that does not pickle, a folder of the user's at ``location``)."""
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
            "world_size": context.world_size,
            "zero_stage": self.zero_stage,
            "state": state_to_save(
                rest,
                module_state=lambda m: m.state_dict(),
                optimizer_state=lambda o: o.state_dict(),
                precision_state=context.precision_state(),
            ),
        }
        _check_picklable(record)
        check_replaceable(location, is_deepspeed_checkpoint, "a DeepSpeed checkpoint")

        def write(folder: CheckpointLocation) -> None:
            with folder.local_staging() as local:  # the engine writes local folders only
                engine.save_checkpoint(
                    str(local),
                    tag=TAG,
                    client_state={FORMAT_KEY: record},
                    exclude_frozen_parameters=self.exclude_frozen_parameters,
                )

        commit_directory(location, write, context.coordinator)

    def write_async(
        self,
        location: CheckpointLocation,
        state: dict[str, Any],
        context: FormatContext,
        *,
        filter: Filter | None = None,
        storage_options: Any | None = None,
    ) -> Any:
        """Refused: the engine writes its partitions from the live engine, so there is no snapshot to write later."""
        raise NotImplementedError(
            "`fabric.save(..., async_save=True)` is not supported with DeepSpeed: its engine writes the checkpoint"
            " directory on every rank itself (the ZeRO partitions live inside its optimizer), so there is no snapshot"
            " to hand to a background writer. Call `fabric.save(path, state)`: it returns when every rank has written"
            " its files and the directory is committed."
        )

    def read(
        self, location: CheckpointLocation, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_deepspeed_checkpoint(location, map_location=map_location, weights_only=weights_only)

    def load(
        self,
        location: CheckpointLocation,
        state: Any,
        context: FormatContext,
        *,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Saved on as many ranks: the engine reads its partitions (the model, and the optimizer if the state asks
        for it); the rest comes from the client state. Saved on another number of data-parallel ranks: with the
        optimizer in ``state``, the partitions are resharded through DeepSpeed's universal checkpoint
        (:func:`fabric_deepspeed.universal.load_resharded`; ZeRO off: the engine reads the whole state as usual);
        without it, full weights (float32, merged by ``zero_to_fp32``) into the engine."""
        if isinstance(state, (Module, Optimizer)):
            raise ValueError(
                f"`fabric.load_raw` expects a file with a plain PyTorch state dict, but {str(location)!r} is a"
                " directory. Load a checkpoint directory with `fabric.load(path, {'model': model, ...})`."
            )
        key, engine = find_engine(state, "load")
        optimizer_key = _optimizer_key(state, engine)
        with location.local_view() as path:
            tag = read_tag(path)
            assert tag is not None  # recognised before
            check_safe_to_load(path, tag, weights_only)
            first = _read_model_states(path, tag)
            saved = _record_from(first)
            saved_size = universal.saved_data_parallel_size(first, saved)
            resized = saved_size is not None and saved_size != context.world_size
            if resized and optimizer_key is None and saved is not None:  # the weights alone, merged: any stage
                return context.restore(state, self.read(location, weights_only=weights_only), strict)
            rest = {k: v for k, v in state.items() if k not in (key, optimizer_key)}
            if saved is not None:
                available = {*saved["state"], *(k for k in (saved.get("model"), saved.get("optimizer")) if k)}
                asked = list(rest) + ([optimizer_key] if optimizer_key is not None and saved.get("optimizer") is None else [])
                check_missing(asked, available, strict)
            if resized and engine.zero_optimization_stage() > 0:
                # ZeRO partitions for another number of ranks: DeepSpeed's universal checkpoint reshards them.
                loaded_path = str(path)
                client_state = universal.load_resharded(
                    engine, path, tag, context, model_states=first, saved_size=saved_size, strict=strict
                )
            else:  # as many ranks as saved it (or ZeRO off: the optimizer state is whole on every rank)
                loaded_path, client_state = engine.load_checkpoint(
                    str(path),
                    tag=tag,
                    load_module_strict=strict,
                    load_optimizer_states=optimizer_key is not None,
                    load_lr_scheduler_states=False,
                )
        if loaded_path is None:
            raise RuntimeError(
                "DeepSpeed was unable to load the checkpoint. Ensure you passed in a DeepSpeed compatible checkpoint"
                f" or a single checkpoint file: {str(location)!r}."
            )
        record = _record_from(client_state)
        checkpoint: dict[str, Any] = dict(record["state"]) if record is not None else _plain_client_state(client_state)
        remainder = restore_state(
            rest,
            checkpoint,
            strict=strict,
            load_module=lambda m, sd, s: m.load_state_dict(sd, strict=s),
            load_optimizer=lambda o, sd: o.load_state_dict(sd),
            load_precision=context.load_precision_state,
        )
        state.update(rest)  # plain values (step, epoch) were replaced in `rest`
        return remainder


# ---------------------------------------------------------------------------------------------------- reader
def load_deepspeed_checkpoint(
    path: CheckpointLocation | str | os.PathLike, map_location: Any = "cpu", weights_only: bool | None = None
) -> dict[str, Any]:
    """Read a DeepSpeed checkpoint directory into one plain dict in this process (no process group needed).

    The model's key holds a float32 state dict (DeepSpeed's ``zero_to_fp32`` merges every rank's float32 master
    partitions for ZeRO 1-3; stage 0 stores the module whole, upcast here), the other entries are the saved
    non-model state. The ZeRO optimizer state is not converted (it stays with DeepSpeed), so the result has no
    optimizer entry. A checkpoint written by a plain DeepSpeed script (without our record) gives its model under
    ``"model"``. Needs memory for the full float32 model. A checkpoint at a URL is downloaded to a scratch folder.
    """
    location = CheckpointLocation.of(path)
    if not is_deepspeed_checkpoint(location):
        raise ValueError(
            f"{str(location)!r} is not a DeepSpeed checkpoint: expected a directory with a {LATEST!r} file naming a"
            " folder of DeepSpeed model states."
        )
    with location.local_view() as local:
        return _read_local(local, map_location, weights_only)


def _read_local(path: Path, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    tag = read_tag(path)
    assert tag is not None
    runtime.import_for_reading()
    check_safe_to_load(path, tag, weights_only)
    files = model_states_files(path, tag)
    first = torch.load(os.fspath(files[0]), map_location="cpu", weights_only=False, mmap=True)
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
        from fabric_core.utilities import move_data_to_device

        weights = move_data_to_device(weights, torch.device(map_location))
    out: dict[str, Any] = {model_key: weights}
    rest = dict(record["state"]) if record is not None else _plain_client_state(first)
    out.update(rest)
    return out
