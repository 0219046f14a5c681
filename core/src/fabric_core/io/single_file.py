"""The single-file format: one ``torch.save`` file written by global rank 0, every strategy's default.

What the file holds is the user's state through the strategy's adapters (:meth:`FormatContext.state_to_save`):
modules and optimizers as state dicts (gathered to full ones by a sharding strategy), stateful objects through
``state_dict()``, plain values as they are, the precision's state under ``__fabric_precision__``. It is written
and read through the strategy's ``CheckpointIO`` (``TorchCheckpointIO`` unless the user passed another), so it is
a plain ``torch.load``-able file any strategy (and plain PyTorch) reads.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from fabric_core.io import background
from fabric_core.io.format import CheckpointFormat, FormatContext
from fabric_core.io.location import CheckpointLocation
from fabric_core.io.snapshot import SnapshotBuffers
from fabric_core.io.state import Filter

if TYPE_CHECKING:
    from fabric_core.io.background import CheckpointHandle
    from fabric_core.io.checkpoint_io import CheckpointIO

__all__ = ["SingleFileFormat", "is_single_file", "read_file"]


def is_single_file(location: CheckpointLocation) -> bool:
    """Whether a single-file checkpoint may be at ``location``: a file (what is inside is checked when read)."""
    return location.is_file()


def _is_mmap_refusal(err: RuntimeError) -> bool:
    # torch refuses to memory-map files in its legacy (pre-zipfile) format with a message naming mmap.
    return "mmap" in str(err)


def _takes_mmap(checkpoint_io: CheckpointIO) -> bool:
    """Whether this ``CheckpointIO`` accepts ``mmap=`` (ours does; the reference's interface has no such argument)."""
    try:
        parameters = inspect.signature(checkpoint_io.load_checkpoint).parameters
    except (TypeError, ValueError):
        return False
    return "mmap" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def read_file(
    checkpoint_io: CheckpointIO, location: CheckpointLocation, map_location: Any = "cpu", weights_only: bool | None = None
) -> Any:
    """Read a single checkpoint file, memory-mapped when the file and the ``CheckpointIO`` allow it.

    Mapping means tensors are paged in only as ``load_state_dict`` copies them, so loading needs no second full
    copy in RAM. Files in torch's legacy format cannot be mapped and are read normally, and so are URLs.
    """
    if location.is_url or not _takes_mmap(checkpoint_io):
        return checkpoint_io.load_checkpoint(location, map_location=map_location, weights_only=weights_only)
    try:
        return checkpoint_io.load_checkpoint(location, map_location=map_location, weights_only=weights_only, mmap=True)
    except RuntimeError as err:
        if not _is_mmap_refusal(err):
            raise
    return checkpoint_io.load_checkpoint(location, map_location=map_location, weights_only=weights_only)


class SingleFileFormat(CheckpointFormat):
    """One file, written by global rank 0 through ``checkpoint_io``; every rank reads it whole (memory-mapped).

    Args:
        checkpoint_io: writes and reads the file (``TorchCheckpointIO`` when ``None``).
        snapshot_buffers: the CPU buffers an asynchronous save copies the state into, kept by the strategy so the
            next asynchronous save reuses them.
    """

    description = "a single file with a full checkpoint"

    def __init__(self, checkpoint_io: CheckpointIO | None = None, snapshot_buffers: SnapshotBuffers | None = None) -> None:
        if checkpoint_io is None:
            from fabric_core.io.checkpoint_io import TorchCheckpointIO

            checkpoint_io = TorchCheckpointIO()
        self.checkpoint_io = checkpoint_io
        self.snapshot_buffers = snapshot_buffers if snapshot_buffers is not None else SnapshotBuffers()

    def recognises(self, location: CheckpointLocation) -> bool:
        """Any file (what is inside is checked when it is read)."""
        return is_single_file(location)

    def may_read_folder(self, location: CheckpointLocation) -> bool:
        """A ``CheckpointIO`` that reads its own way (not our :class:`TorchCheckpointIO`'s ``load_checkpoint``) may
        have written a folder: it is asked before a folder is refused, as the reference asks it. Judged on the
        object, not its class: a ``load_checkpoint`` replaced on one instance (a per-object override, a ``Mock``)
        reads its own way too."""
        from fabric_core.io.checkpoint_io import TorchCheckpointIO

        method = getattr(self.checkpoint_io, "load_checkpoint", None)
        return getattr(method, "__func__", method) is not TorchCheckpointIO.load_checkpoint

    def write(
        self,
        location: CheckpointLocation,
        state: dict[str, Any],
        context: FormatContext,
        *,
        filter: Filter | None = None,
        storage_options: Any | None = None,
    ) -> None:
        """Convert on every rank (a strategy that gathers shards needs all of them), write from global rank 0."""
        converted = context.state_to_save(state, filter)
        if context.coordinator.is_global_zero:
            self.checkpoint_io.save_checkpoint(converted, location, storage_options=storage_options)

    def write_async(
        self,
        location: CheckpointLocation,
        state: dict[str, Any],
        context: FormatContext,
        *,
        filter: Filter | None = None,
        storage_options: Any | None = None,
    ) -> CheckpointHandle:
        """Convert on every rank; rank 0 copies the result into reusable CPU buffers (:mod:`fabric_core.io.snapshot`)
        and writes that snapshot in the background (:mod:`fabric_core.io.background`)."""
        converted = context.state_to_save(state, filter)
        if not context.coordinator.is_global_zero:
            return background.completed(location)
        snapshot, release = self.snapshot_buffers.take(converted)
        del converted

        def write() -> None:
            try:
                self.checkpoint_io.save_checkpoint(snapshot, location, storage_options=storage_options)
            finally:
                release()

        return background.submit(location, write)

    def read(
        self, location: CheckpointLocation, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        return read_file(self.checkpoint_io, location, map_location=map_location, weights_only=weights_only)
