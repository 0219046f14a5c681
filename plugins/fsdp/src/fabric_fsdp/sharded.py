"""``ShardedStrategy``: what fabric-fsdp's strategies share, whatever shards their parameters into DTensors.

``fsdp`` shards with FSDP2 itself; ``model_parallel`` lets the user's ``parallelize_fn`` apply tensor parallelism and
FSDP2 over a 2-D mesh. Both keep the models they set up (an optimizer's model is found for its state), skip FSDP2's
gradient reduction in ``no_backward_sync``, free gathered parameters before a step, build models on the meta device
under ``init_module(empty_init=True)``, and save the same two checkpoint layouts (:mod:`fabric_fsdp.checkpoint`):
a sharded folder written by every rank (DCP) or one full file, so each loads what the other saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Generator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.io import CheckpointFormat, CheckpointLocation, Filter, FormatContext
from fabric_core.strategies import BackwardSyncControl, ParallelStrategy
from fabric_core.utilities import clip_grad_norm
from fabric_fsdp import checkpoint as fsdp_checkpoint
from fabric_fsdp.sharding import is_fsdp, is_sharded

if TYPE_CHECKING:
    from typing import Unpack

    from fabric_core.io import CheckpointHandle, CheckpointIO
    from fabric_core.strategies import ParallelOptions

STATE_DICT_TYPES = ("sharded", "full")


def _is_default_io(io: Any) -> bool:
    from fabric_core.io import TorchCheckpointIO

    return io is None or type(io) is TorchCheckpointIO


class _ShardedBackwardSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync``: skip FSDP2's gradient reduce-scatter while accumulating (every FSDP unit of the
    model). FSDP then keeps unsharded gradients until the next synchronised backward: less communication, more
    memory. Tensor parallelism reduces no gradients in backward, so a model without FSDP units has nothing to skip."""

    def __init__(self, strategy_name: str) -> None:
        self.strategy_name = strategy_name

    @contextlib.contextmanager
    def no_backward_sync(self, module: Module, enabled: bool) -> Generator[None, None, None]:
        if not enabled:
            yield
            return
        units = [m for m in module.modules() if is_fsdp(m)]
        if not units and not is_sharded(module):
            raise TypeError(
                "Blocking backward sync is only possible if the module passed to"
                f" `{self.strategy_name}.no_backward_sync` is wrapped in `FullyShardedDataParallel` (with FSDP2:"
                f" sharded by `fully_shard`, as `fabric.setup` does). Got: {type(module).__name__}. Pass the model"
                " returned by `fabric.setup`."
            )
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]


class ShardedStrategy(ParallelStrategy):
    """One process per device whose model parameters are DTensors; the base of ``fsdp`` and ``model_parallel``.

    Args:
        state_dict_type: ``"sharded"`` (a folder every rank writes its shards into, loadable on any number of ranks)
            or ``"full"`` (one file written by rank 0, readable by every strategy).
        **options: the keywords of :class:`~fabric_core.strategies.ParallelStrategy` (:class:`ParallelOptions`).
    """

    #: How the user asks for full checkpoints, for messages.
    full_checkpoint_hint = "state_dict_type='full'"

    def __init__(self, *, state_dict_type: str = "sharded", **options: Unpack[ParallelOptions]) -> None:
        super().__init__(**options)
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"`state_dict_type` must be one of {STATE_DICT_TYPES}, got {state_dict_type!r}.")
        self._state_dict_type = state_dict_type
        self.check_checkpoint_io(self.configured_checkpoint_io)
        self._models: weakref.WeakSet[Module] = weakref.WeakSet()
        self._dcp_stager: Any = None
        # model -> its FSDP units that can keep gathered parameters after a forward (see `optimizer_step`)
        self._may_stay_gathered: weakref.WeakKeyDictionary[Module, list[weakref.ref[Module]]] = weakref.WeakKeyDictionary()
        self._backward_sync_control = _ShardedBackwardSyncControl(type(self).__name__)

    # ---------------------------------------------------------------------------------------- checkpoint kind
    @property
    def state_dict_type(self) -> str:
        """``"sharded"`` or ``"full"``; may be changed between saves."""
        return self._state_dict_type

    @state_dict_type.setter
    def state_dict_type(self, value: str) -> None:
        if value not in STATE_DICT_TYPES:
            raise ValueError(f"`state_dict_type` must be one of {STATE_DICT_TYPES}, got {value!r}.")
        self.check_checkpoint_io(self.configured_checkpoint_io, value)
        self._state_dict_type = value

    def check_checkpoint_io(self, io: CheckpointIO | None, state_dict_type: str | None = None) -> None:
        """A custom ``CheckpointIO`` writes full checkpoints; sharded ones are DCP's, so it would be bypassed."""
        if (state_dict_type or self._state_dict_type) == "sharded" and not _is_default_io(io):
            name = type(self).__name__
            raise NotImplementedError(
                f"The `{name}` does not support setting a `CheckpointIO` plugin for sharded checkpoints"
                f" (`state_dict_type='sharded'`), got {type(io).__name__}: they are written by"
                " torch.distributed.checkpoint, every rank its own shards, so it would not be used. Pass"
                f" `{name}({self.full_checkpoint_hint})` to save through it (rank 0 writes one file with it), or"
                " leave it out."
            )

    # ---------------------------------------------------------------------------------------- models
    @property
    def backward_sync_control(self) -> BackwardSyncControl:
        """Skips FSDP2's gradient reduction in every FSDP unit of the model (``fabric.no_backward_sync``)."""
        return self._backward_sync_control

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True`` builds the model on the meta device: no memory until ``setup_module`` shards it."""
        if not empty_init:
            return super().module_init_context(empty_init=empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: Module) -> None:
        """Nothing: sharding places each shard on the device, so the full model never lands there."""

    def track(self, module: Module, may_stay_gathered: list[Module]) -> None:
        """Remember a model this strategy set up, and its FSDP units that may keep gathered parameters after a
        forward (freed before each optimizer step)."""
        self._models.add(module)
        self._may_stay_gathered[module] = [weakref.ref(m) for m in may_stay_gathered]

    def owner(self, optimizer: Optimizer) -> Module:
        """The set-up model whose parameters ``optimizer`` updates (its state is keyed by that model's names)."""
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for model in self._models:
            if any(id(p) in params for p in model.parameters()):
                return model
        raise ValueError(
            f"This optimizer does not belong to a model set up with the `{type(self).__name__}`, so its sharded state"
            " cannot be saved or restored. Set up the model and the optimizer through this Fabric first."
        )

    # ---------------------------------------------------------------------------------------- training step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step, after freeing parameters that a forward left gathered, so the next forward gathers new ones.

        A unit that does not reshard after forward keeps its gathered copy until its backward. After a forward
        without backward (evaluation under ``torch.no_grad()``), that copy would survive the step, and the next
        forward would compute with the weights from before the step. ``reshard()`` is a no-op when the backward
        has already freed them, which is the usual case.
        """
        for units in self._may_stay_gathered.values():
            for ref in units:
                unit = ref()
                if unit is not None:
                    unit.reshard()  # type: ignore[operator]
        return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int | str = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm over *all* shards on all ranks; returns that norm as a plain tensor."""
        if not is_sharded(self.unwrap_module(module)):
            raise TypeError(
                "Gradient clipping with FSDP is only possible if the module passed to"
                f" `{type(self).__name__}.clip_gradients_norm` is wrapped in `FullyShardedDataParallel` (with FSDP2:"
                f" sharded by `fully_shard`, as `fabric.setup` does). Got: {type(module).__name__}. Pass the model"
                " returned by `fabric.setup`."
            )
        self.precision.unscale_gradients(optimizer)
        params = [p for p in self.precision.main_params(optimizer) if p.grad is not None]
        return clip_grad_norm(params, float(max_norm), float(norm_type), error_if_nonfinite)

    # ---------------------------------------------------------------------------------------- checkpoints
    def checkpoint_context(self) -> FormatContext:
        """The core's context with full-state adapters: a full (single-file) checkpoint gathers the model and its
        optimizers, and loading one gives every rank its shard (:mod:`fabric_fsdp.checkpoint`)."""
        return dataclasses.replace(
            super().checkpoint_context(),
            module_state=fsdp_checkpoint.full_module_state,
            load_module_state=fsdp_checkpoint.load_full_module_state,
            optimizer_state=lambda optimizer: fsdp_checkpoint.full_optimizer_state(self.owner(optimizer), optimizer),
            load_optimizer_state=lambda optimizer, state: fsdp_checkpoint.load_full_optimizer_state(
                self.owner(optimizer), optimizer, state
            ),
        )

    def sharded_checkpoint_format(self) -> fsdp_checkpoint.ShardedFormat:
        """The sharded folder format (DCP shards plus ``meta.pt``) over this strategy's models."""
        return fsdp_checkpoint.ShardedFormat(owner=self.owner, stager=self.dcp_stager)

    def checkpoint_format(self) -> CheckpointFormat:
        """``state_dict_type="sharded"``: the sharded folder; ``"full"``: the core's single file, gathered."""
        if self.state_dict_type == "full":
            return super().checkpoint_format()
        return self.sharded_checkpoint_format()

    def checkpoint_formats(self) -> list[CheckpointFormat]:
        """Sharded folders (resharded on load), then single files (each rank keeps its shard)."""
        return [self.sharded_checkpoint_format(), *super().checkpoint_formats()]

    def _require_model(self, state: dict[str, Any]) -> None:
        _, model = fsdp_checkpoint.find_model(state, "save")
        if model is None:
            raise ValueError(
                "Could not find a FSDP model in the provided checkpoint state. Pass the model set up with"
                " `fabric.setup` as part of the state, like `fabric.save(path, {'model': model, 'optimizer':"
                " optimizer, ...})`."
            )
        if self.state_dict_type == "sharded":
            self.check_checkpoint_io(self.configured_checkpoint_io)

    def save_checkpoint(
        self,
        path: CheckpointLocation | str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: Filter | None = None,
        *,
        checkpoint_format: CheckpointFormat | None = None,
    ) -> None:
        """Write ``state`` as a sharded directory (all ranks) or as one full file (rank 0, through the
        ``CheckpointIO``, which gets ``storage_options``).

        Exactly one sharded model may be in ``state``; optimizers of that model are saved with it.
        """
        self._require_model(state)
        super().save_checkpoint(path, state, storage_options, filter, checkpoint_format=checkpoint_format)

    def save_checkpoint_async(
        self,
        path: CheckpointLocation | str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: Filter | None = None,
        *,
        checkpoint_format: CheckpointFormat | None = None,
    ) -> CheckpointHandle:
        """Sharded: torch.distributed.checkpoint's asynchronous save, committed by the core in the background.
        Full: the core's snapshot-and-write (the full state dict is gathered now, on every rank)."""
        self._require_model(state)
        return super().save_checkpoint_async(path, state, storage_options, filter, checkpoint_format=checkpoint_format)

    def dcp_stager(self) -> Any:
        """The stager asynchronous sharded saves copy into; kept so its CPU buffers are reused by the next save."""
        if self._dcp_stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._dcp_stager = DefaultStager(StagingOptions(False, False, False, False))
        return self._dcp_stager

    def teardown(self) -> None:
        """Close the DCP stager, then what every parallel strategy releases."""
        if self._dcp_stager is not None:
            self._dcp_stager.close()
            self._dcp_stager = None
        super().teardown()
