"""The checkpoint format interface: how a checkpoint is laid out at a location, as a component of its own.

A **format** writes a user's state at a :class:`~fabric_core.io.location.CheckpointLocation`, loads it back into
live objects, reads it whole in one process, and recognises its own checkpoints. It never reaches into a
strategy: everything it needs from one arrives in a :class:`FormatContext`, built by
``Strategy.checkpoint_context()``:

* ``coordinator``: which rank leads, ``broadcast`` and ``reduce_boolean_decision`` (for multi-rank commits);
* state adapters: how a module and an optimizer become state and back (gathered, sharded, inside an engine);
* the precision's state (saved beside the model, restored on load);
* ``find_reader``: the reader of a checkpoint folder written by another plugin's format.

The core's building blocks do the rest once for every format: the walk over the user's state
(:meth:`FormatContext.state_to_save`, :meth:`FormatContext.restore`), crash-safe single files
(:func:`~fabric_core.io.commit.atomic_save`), multi-rank folder commits on disks and object stores
(:func:`~fabric_core.io.commit.commit_directory`), and the path errors (:mod:`fabric_core.io.errors`).

The single-file format (:class:`~fabric_core.io.single_file.SingleFileFormat`) is the default of every strategy;
fabric-fsdp and fabric-deepspeed implement their folder formats on the same interface. Formats are a plugin kind
(``fabric_register_checkpoint_formats``): a registered format is read by any strategy that does not know it and
written by any strategy asked to (``Strategy.save_checkpoint(..., checkpoint_format=...)``). ``docs/plugins.md``
shows how to write a new one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fabric_core.io.coordination import Coordinator
from fabric_core.io.errors import checkpoint_path_error
from fabric_core.io.location import CheckpointLocation
from fabric_core.io.state import Filter, restore_state, state_to_save

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.optim import Optimizer

    from fabric_core.io.background import CheckpointHandle
    from fabric_core.utilities.topology import Topology

__all__ = ["CheckpointFormat", "CheckpointReader", "FindReader", "FormatContext", "ReaderFormat", "format_for_loading"]


class CheckpointReader(Protocol):
    """Reads a whole checkpoint (any layout its plugin owns) into one dict, in this process."""

    def __call__(
        self, path: CheckpointLocation, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]: ...


#: Given a location, the reader of its format, or ``None`` when no installed plugin recognises it (the
#: ``fabric_select_checkpoint_reader`` hook, bound to the registry by the resolver).
FindReader = Callable[[CheckpointLocation], CheckpointReader | None]


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
    #: The reader of a checkpoint folder written by another plugin's format, or ``None`` when none is installed.
    find_reader: FindReader | None
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

    def reader_for(self, location: CheckpointLocation) -> CheckpointReader | None:
        """The installed reader of the checkpoint folder at ``location``, or ``None``."""
        return self.find_reader(location) if self.find_reader is not None else None


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
        """Take what must be taken now (a snapshot) and finish the write in the background; return its handle.

        Override to support ``fabric.save(..., async_save=True)``; the default refuses, saying so."""
        raise NotImplementedError(
            f"`fabric.save(..., async_save=True)` is not supported for {self.description}: its format"
            f" ({type(self).__name__}) writes synchronously. Save without `async_save`."
        )

    @abstractmethod
    def read(
        self, location: CheckpointLocation, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The whole checkpoint in this one process, in the single-file layout (a module's key holds a plain state
        dict, an optimizer's a torch optimizer state dict). Used by other strategies and ``fabric consolidate``
        through the ``fabric_select_checkpoint_reader`` hook. No process group needed."""

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

        The default reads the checkpoint whole (:meth:`read`) and restores through the context's adapters;
        override it to load shards in place (resharding) or through an engine."""
        return context.restore(state, self.read(location, weights_only=weights_only), strict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReaderFormat(CheckpointFormat):
    """A folder of another plugin's format, loaded through its reader (whole, in every process): what lets a
    single-device or DDP run load an FSDP or DeepSpeed checkpoint. It only reads."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.description = f"a checkpoint read by {getattr(reader, '__qualname__', type(reader).__name__)}"

    def recognises(self, location: CheckpointLocation) -> bool:
        return True

    def write(
        self,
        location: CheckpointLocation,
        state: dict[str, Any],
        context: FormatContext,
        *,
        filter: Filter | None = None,
        storage_options: Any | None = None,
    ) -> None:
        raise NotImplementedError("A checkpoint reader of another plugin's format only reads.")

    def read(
        self, location: CheckpointLocation, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        return self.reader(location, map_location=map_location, weights_only=weights_only)


def expected_checkpoints(formats: Sequence[CheckpointFormat]) -> str:
    """``"either A, or B"``: what a path should point to, from the formats' descriptions (for error messages)."""
    names = [f.description for f in formats]
    return names[0] if len(names) == 1 else "either " + ", or ".join([", ".join(names[:-1]), names[-1]])


def format_for_loading(
    location: CheckpointLocation, formats: Sequence[CheckpointFormat], find_reader: FindReader | None
) -> CheckpointFormat:
    """The format to load ``location`` with.

    The first of ``formats`` (a strategy's own, in its order) that recognises it; else, for a folder, the reader of
    the installed plugin that recognises it (:class:`ReaderFormat`), or a format that may read it
    (:meth:`CheckpointFormat.may_read_folder`: a user's ``CheckpointIO``), or a ``ValueError`` saying none does;
    else the last of ``formats`` (the single-file format), whose read says what is wrong with the file. A path
    where nothing exists is a :class:`~fabric_core.io.errors.CheckpointPathError` when the strategy has a format of
    its own besides the single file (the single file's own error otherwise: ``FileNotFoundError``).
    """
    for candidate in formats:
        if candidate.recognises(location):
            return candidate
    if location.is_dir():
        reader = find_reader(location) if find_reader is not None else None
        if reader is not None:
            return ReaderFormat(reader)
        for candidate in formats:  # a user's CheckpointIO that writes folders reads them too
            if candidate.may_read_folder(location):
                return candidate
        raise ValueError(
            f"The path {str(location)!r} does not point to a valid checkpoint. Make sure the path points to"
            f" {expected_checkpoints(formats)}. It is a directory, but no installed plugin recognises it as a"
            " checkpoint (a sharded checkpoint of another strategy is read by its plugin when that is installed;"
            " `fabric plugins` lists them)."
        )
    if len(formats) > 1 and not location.exists():
        raise checkpoint_path_error(location, expected_checkpoints(formats))
    return formats[-1]
