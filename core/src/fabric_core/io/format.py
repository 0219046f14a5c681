"""The checkpoint format interface: how a checkpoint is laid out at a location, as a component of its own.

A **format** writes a user's state at a :class:`~fabric_core.io.location.CheckpointLocation`, loads it back into
live objects, reads it whole in one process, and recognises its own checkpoints. It never reaches into a
strategy: everything it needs from one arrives in a :class:`FormatContext`, built by
``Strategy.checkpoint_context()``:

* ``coordinator``: which rank leads, ``broadcast`` and ``reduce_boolean_decision`` (for multi-rank commits);
* state adapters: how a module and an optimizer become state and back (gathered, sharded, inside an engine);
* the precision's state (saved beside the model, restored on load);
* ``topology``: where this rank sits, for formats that write per-rank or per-shard files.

The core's building blocks do the rest once for every format: the walk over the user's state
(:meth:`FormatContext.state_to_save`, :meth:`FormatContext.restore`), crash-safe single files
(:func:`~fabric_core.io.commit.atomic_save`), multi-rank folder commits on disks and object stores
(:func:`~fabric_core.io.commit.commit_directory`), and the path errors (:mod:`fabric_core.io.errors`).

The single-file format (:class:`~fabric_core.io.single_file.SingleFileFormat`) is the default of every strategy;
fabric-fsdp and fabric-deepspeed implement their folder formats on the same interface. Formats are a plugin kind
(``fabric_register_checkpoint_formats``): a registered format (:class:`RegisteredFormat`, handed to every strategy
when it is bound) is read by any strategy that does not know it, by asking it directly whether it recognises a
checkpoint (:func:`format_for_loading`), and written by any strategy asked to (``fabric.save(...,
checkpoint_format=NAME)``). ``docs/plugins.md`` shows how to write a new one.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fabric_core.io.coordination import Coordinator
from fabric_core.io.errors import checkpoint_path_error
from fabric_core.io.location import CheckpointLocation
from fabric_core.io.state import Filter, restore_state, state_to_save

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.optim import Optimizer

    from fabric_core.io.background import CheckpointHandle
    from fabric_core.utilities.topology import Topology

__all__ = ["CheckpointFormat", "FormatContext", "format_for_loading"]


@dataclass(frozen=True)
class FormatContext:
    """What a checkpoint format needs from the strategy that saves or loads, passed explicitly.

    Built on every rank by ``Strategy.checkpoint_context()``; a strategy changes what it hands over by overriding
    that method (or the methods it reads), never by letting a format read its members.
    """

    #: Which rank leads and the two collectives of a multi-rank commit (the strategy itself, usually).
    coordinator: Coordinator
    #: How many processes save or load together.
    world_size: int
    #: ``module -> state`` for a checkpoint (full or this rank's shard, as the strategy sees fit).
    module_state: Callable[[Module], Any]
    #: ``(module, state, strict)``: load a module's state from a checkpoint.
    load_module_state: Callable[[Module, Any, bool], None]
    #: ``optimizer -> state`` for a checkpoint.
    optimizer_state: Callable[[Optimizer], Any]
    #: ``(optimizer, state)``: load an optimizer's state from a checkpoint.
    load_optimizer_state: Callable[[Optimizer, Any], None]
    #: The precision's state to store beside the model (a GradScaler's, say; empty for most).
    precision_state: Callable[[], Mapping[str, Any]]
    #: Restore the precision's state saved by :attr:`precision_state`.
    load_precision_state: Callable[[dict[str, Any]], None]
    #: Coordinator for the background thread that finishes an asynchronous multi-rank save; its collectives do
    #: not share a process group with the training loop's. Call it on every rank at the same point.
    background_coordinator: Callable[[], Coordinator]
    #: What happens to the converted state before this rank writes it (fabric-xla: one copy to CPU memory).
    prepare_for_writing: Callable[[dict[str, Any]], dict[str, Any]] = lambda converted: converted
    #: ``(state, checkpoint)``: raise, before anything is loaded, when ``checkpoint`` cannot be restored into
    #: ``state`` by these adapters (fabric-deepspeed: a plain optimizer state for a ZeRO optimizer). So a load that
    #: fails leaves the user's objects as they were.
    check_restore: Callable[[Any, dict[str, Any]], None] = lambda state, checkpoint: None
    #: Where this rank sits (its data-parallel coordinate, every axis): what a format that writes per-rank or
    #: per-shard files keys them on. ``None`` from a context built without one.
    topology: Topology | None = None

    def state_to_save(self, state: Mapping[str, Any], filter: Filter | None = None) -> dict[str, Any]:
        """What a checkpoint of ``state`` holds, through this context's adapters (and the precision's state), as
        this rank writes it (:attr:`prepare_for_writing`)."""
        converted = state_to_save(
            state,
            module_state=self.module_state,
            optimizer_state=self.optimizer_state,
            filter=filter,
            precision_state=self.precision_state(),
        )
        return self.prepare_for_writing(converted)

    def restore(self, state: Any, checkpoint: dict[str, Any], strict: bool) -> dict[str, Any]:
        """Load ``checkpoint`` into ``state`` in place through this context's adapters; return the remainder."""
        self.check_restore(state, checkpoint)
        return restore_state(
            state,
            checkpoint,
            strict=strict,
            load_module=self.load_module_state,
            load_optimizer=self.load_optimizer_state,
            load_precision=self.load_precision_state,
        )


class CheckpointFormat(ABC):
    """One layout of checkpoints. Subclass it to add a format; every method a subclass may override says why.

    The contract of :meth:`write` (and of :meth:`write_async`'s handle at ``wait()``): when it returns on every
    rank, the checkpoint is complete and readable at ``location`` and has replaced the previous one atomically; a
    process killed at any instant leaves the previous or the new checkpoint, never a torn one; temporary entries a
    kill left are removed by the next save. Build on :func:`~fabric_core.io.commit.atomic_save` and
    :func:`~fabric_core.io.commit.commit_directory` and this holds by construction.
    """

    #: Shown in error messages ("an FSDP sharded checkpoint").
    description: str = "a checkpoint"

    @abstractmethod
    def recognises(self, location: CheckpointLocation) -> bool:
        """Whether a complete checkpoint of this format is at ``location``. Must be cheap (look at names, import
        nothing heavy): loading asks every candidate format."""

    @abstractmethod
    def write(
        self,
        location: CheckpointLocation,
        state: dict[str, Any],
        context: FormatContext,
        *,
        filter: Filter | None = None,
        storage_options: Any | None = None,
    ) -> None:
        """Write ``state`` (the user's objects: modules, optimizers, stateful objects, plain values) at
        ``location``, on every rank; see the class for what holds when it returns."""

    def may_read_folder(self, location: CheckpointLocation) -> bool:
        """Whether to try :meth:`read` on a folder that no format and no installed plugin recognises: a format whose
        reading is the user's code (a ``CheckpointIO`` of theirs may write folders) says yes. Asked last."""
        return False

    def write_async(
        self,
        location: CheckpointLocation,
        state: dict[str, Any],
        context: FormatContext,
        *,
        filter: Filter | None = None,
        storage_options: Any | None = None,
    ) -> CheckpointHandle:
        """Take what must be taken now and finish the write in the background; return its handle (at its ``wait()``
        the checkpoint is at ``location``, as :meth:`write` would leave it). Called on every rank.

        The default works for any format whose :meth:`write` needs only what ``context.state_to_save`` gives: it
        converts ``state`` now and copies its tensors to CPU memory (the snapshot), then runs :meth:`write` on that
        snapshot in the background thread, with a context whose collectives are the background coordinator's. A
        format whose ``write`` needs the live objects (an engine) overrides this (fabric-deepspeed refuses), and so
        may one that snapshots more cheaply (the single file, fabric-fsdp's shards)."""
        from fabric_core.io import background
        from fabric_core.io.snapshot import SnapshotBuffers

        snapshot, release = SnapshotBuffers().take(context.state_to_save(state, filter))
        taken = snapshot_context(context, context.background_coordinator())

        def write() -> None:
            try:
                self.write(location, snapshot, taken, storage_options=storage_options)
            finally:
                release()

        return background.submit(location, write)

    @abstractmethod
    def read(
        self, location: CheckpointLocation, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The whole checkpoint in this one process, in the single-file layout (a module's key holds a plain state
        dict, an optimizer's a torch optimizer state dict). Used by strategies that do not own this format (a
        registered one: :meth:`load_whole`) and by ``fabric consolidate``. No process group needed."""

    def load(
        self,
        location: CheckpointLocation,
        state: Any,
        context: FormatContext,
        *,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place (a dict of the user's objects, or a bare module or optimizer for
        ``fabric.load_raw``) and return what the checkpoint holds beyond it.

        The default reads the checkpoint whole (:meth:`load_whole`); override it to load shards in place (resharding)
        or through an engine."""
        return self.load_whole(location, state, context, strict=strict, weights_only=weights_only)

    def load_whole(
        self,
        location: CheckpointLocation,
        state: Any,
        context: FormatContext,
        *,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Read the checkpoint whole in this process (:meth:`read`) and restore ``state`` through the context's
        adapters: how a strategy loads a registered format it does not own (a DDP run, an FSDP folder)."""
        return context.restore(state, self.read(location, weights_only=weights_only), strict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def snapshot_context(context: FormatContext, coordinator: Any) -> FormatContext:
    """The context a format writes a snapshot with (``write_async``'s default): the snapshot is already what the
    adapters give, so they and the precision's state pass it through; ``coordinator`` is the background one."""
    return dataclasses.replace(
        context,
        coordinator=coordinator,
        module_state=lambda module: module.state_dict(),
        optimizer_state=lambda optimizer: optimizer.state_dict(),
        precision_state=dict,
        prepare_for_writing=lambda converted: converted,
    )


def expected_checkpoints(formats: Sequence[CheckpointFormat]) -> str:
    """``"either A, or B"``: what a path should point to, from the formats' descriptions (for error messages)."""
    names = [f.description for f in formats]
    return names[0] if len(names) == 1 else "either " + ", or ".join([", ".join(names[:-1]), names[-1]])


def format_for_loading(
    location: CheckpointLocation, formats: Sequence[CheckpointFormat], registered: Sequence[Any] = ()
) -> tuple[CheckpointFormat, bool]:
    """The format to load ``location`` with, and whether it is one the strategy does not own (then it is read whole
    and restored through the strategy's adapters: :meth:`CheckpointFormat.load_whole`).

    In this order: the first of ``formats`` (a strategy's own, in its order) but the last that recognises it; the
    first ``registered`` format (:class:`~fabric_core.io.registered.RegisteredFormat`) that does, other than a kind the strategy has its own instance of (its own is built
    with its ``CheckpointIO``, its owner lookups); the last of ``formats`` (the single file, which takes any file,
    and whose read says what is wrong with it). A folder none of them recognises is loaded by a format that may read
    it (:meth:`CheckpointFormat.may_read_folder`: a user's ``CheckpointIO``), else a ``ValueError`` says none does. A
    path where nothing exists is a :class:`~fabric_core.io.errors.CheckpointPathError` when the strategy has a format
    of its own besides the single file (the single file's own error otherwise: ``FileNotFoundError``).
    """
    *specific, fallback = formats
    for candidate in specific:
        if candidate.recognises(location):
            return candidate, False
    owned = {type(f) for f in formats}
    for entry in registered:
        candidate = entry.recognising(location)
        if candidate is not None and type(candidate) not in owned:
            return candidate, True
    if fallback.recognises(location):
        return fallback, False
    if location.is_dir():
        for candidate in formats:  # a user's CheckpointIO that writes folders reads them too
            if candidate.may_read_folder(location):
                return candidate, False
        raise ValueError(
            f"The path {str(location)!r} does not point to a valid checkpoint. Make sure the path points to"
            f" {expected_checkpoints(formats)}. It is a directory, but no installed plugin recognises it as a"
            " checkpoint (a sharded checkpoint of another strategy is read by its plugin when that is installed;"
            " `fabric plugins` lists them)."
        )
    if len(formats) > 1 and not location.exists():
        raise checkpoint_path_error(location, expected_checkpoints(formats))
    return fallback, False
