"""The errors of checkpoint I/O, defined once for every strategy and format."""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointPathError", "CheckpointReadError", "CheckpointSaveError", "checkpoint_path_error"]


class CheckpointPathError(FileNotFoundError, ValueError):
    """Nothing (or nothing loadable) at the path given to ``fabric.load``: a ``FileNotFoundError``, and the
    reference's ``ValueError``, so code written for either catches it."""


class CheckpointSaveError(RuntimeError):
    """A save that several ranks write failed on another rank: the message names the rank(s) and their errors (the
    failing rank raises its own error). Nothing was published; the previous checkpoint at the path is untouched."""


class CheckpointReadError(RuntimeError):
    """The file is not a readable checkpoint: empty, truncated, corrupt, or not written by ``torch.save``."""


def checkpoint_path_error(location: Any, expected: str) -> CheckpointPathError:
    """The error for a load from ``location`` where nothing exists; ``expected`` says what the path should be."""
    return CheckpointPathError(
        f"The path {str(location)!r} does not point to a valid checkpoint: nothing exists there. Make sure the path"
        f" points to {expected}."
    )
