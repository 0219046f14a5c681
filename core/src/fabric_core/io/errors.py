"""The errors of checkpoint I/O, defined once for every strategy and format."""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointPathError",
    "CheckpointReadError",
    "CheckpointSaveError",
    "checkpoint_path_error",
    "unpicklable_value_error",
]


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


def _pickles(value: Any) -> BaseException | None:
    """The error pickling ``value`` raises, or ``None``; tensors are not serialised (their data always pickles)."""
    import io
    import pickle

    import torch

    class Probe(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return 1 if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) else None

    from fabric_core.utilities.exceptions import guarded

    _, err = guarded(Probe(io.BytesIO(), protocol=2).dump, value)  # whatever pickling raises is the answer
    return err


def _first_unpicklable(value: Any, path: str) -> tuple[str, Any, BaseException] | None:
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_unpicklable(item, f"{path}[{key!r}]")
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _first_unpicklable(item, f"{path}[{index}]")
            if found is not None:
                return found
    error = _pickles(value)
    return None if error is None else (path, value, error)


def unpicklable_value_error(checkpoint: Any) -> TypeError | None:
    """After ``torch.save`` failed to pickle ``checkpoint``: a ``TypeError`` naming the first value that cannot be
    pickled (``state['config']['fn']``, a lambda), instead of the pickler's message eight frames deep; ``None`` when
    every value pickles on its own (the failure was something else). Only runs on that error path."""
    found = _first_unpicklable(checkpoint, "state")
    if found is None:
        return None
    path, value, error = found
    kind = type(value).__name__
    return TypeError(
        f"`fabric.save` cannot save {path}: it is a {kind} ({value!r:.80}), which cannot be pickled"
        f" ({type(error).__name__}: {error}). Save what it produces instead (a lambda or generator cannot be"
        " restored), leave it out of the state, or drop it with `filter=`."
    )
