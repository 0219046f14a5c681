"""How the ranks of a multi-rank save agree to publish it: two votes around one publishing step, written once.

Every commit of a checkpoint that several ranks write (a local directory swapped into place, a version folder on
an object store marked committed) ends the same way, implemented by :func:`publish_together`:

1. all ranks vote whether their part was written;
2. only if every rank succeeded, global rank 0 publishes (swaps the directory in, writes the marker);
3. all ranks vote again, so every rank learns whether the publishing step worked.

Every rank then returns (published) or raises. After a failed vote the ranks exchange their errors' text (one
object all-gather, only on this path): a rank whose own write or publish failed raises that very error (its
traceback intact, a note naming any other rank that failed too); the others raise :class:`CheckpointSaveError`
naming which rank failed and why. A rank that dies makes the collectives fail on the others, which raise that
failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fabric_core.io.errors import CheckpointSaveError
from fabric_core.utilities.exceptions import guarded

__all__ = ["ALONE", "CheckpointSaveError", "Coordinator", "publish_together"]

#: How much of an error's text travels to the other ranks (a long message is cut there).
_MAX_ERROR_TEXT = 2000


class Coordinator(Protocol):
    """What a multi-rank commit needs from the strategy: which rank leads, and two collectives.

    A strategy is one; ``Strategy.checkpoint_coordinator()`` gives one whose collectives do not share a process
    group with the training loop's (for saves finished in the background).
    """

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class _Alone:
    """The coordinator of a save that one process makes by itself: it leads, and every vote is its own."""

    is_global_zero = True

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


#: :class:`Coordinator` of a process that saves alone (``commit_directory(location, write)``).
ALONE: Coordinator = _Alone()


def publish_together(error: Exception | None, coordinator: Coordinator, publish: Callable[[], None], target: str) -> None:
    """Vote on ``error``; if no rank failed, run ``publish`` on global rank 0; vote again. Raise unless published.

    ``error`` is this rank's failure while writing its part (``None``: written). Returns on every rank once the
    checkpoint is published; otherwise raises this rank's own error, or a :class:`CheckpointSaveError` naming the
    rank that failed, its error and ``target`` when only other ranks failed. The caller removes what it staged when
    this raises.
    """
    if coordinator.reduce_boolean_decision(error is None, all=True):
        if coordinator.is_global_zero:
            _, error = guarded(publish)  # any failure must reach the second vote, or the other ranks wait at it
        if coordinator.reduce_boolean_decision(error is None, all=True):
            return
    failed = _gather_failures(coordinator, error)
    if error is not None:
        if len(failed) > 1:
            error.add_note(f"Saving {target!r} failed on more than this rank: " + "; ".join(f"rank {r}: {t}" for r, t in failed))
        raise error
    reasons = "; ".join(f"rank {rank}: {text}" for rank, text in failed) or "a rank that did not say why"
    raise CheckpointSaveError(
        f"Saving the checkpoint {target!r} failed on {reasons}. Nothing was published; the previous checkpoint at"
        " that path, if any, was left untouched."
    )


def _gather_failures(coordinator: Coordinator, error: Exception | None) -> list[tuple[int, str]]:
    """``(rank, error text)`` of every rank that failed. Every rank calls it together (the votes agreed), after a
    failed vote only. If the exchange itself fails (a rank died meanwhile) or the coordinator cannot gather objects
    (one written for an older version of this protocol), the ranks still raise what they know."""
    gather = getattr(coordinator, "all_gather_object", None)
    if gather is None:
        return []
    texts, failed = guarded(gather, None if error is None else _describe(error))  # a coordinator's collective
    if failed is not None:
        return []
    return [(rank, text) for rank, text in enumerate(texts) if text is not None]


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_ERROR_TEXT else text[: _MAX_ERROR_TEXT - 3] + "..."
