"""How the ranks of a multi-rank save agree to publish it: two votes around one publishing step, written once.

Every commit of a checkpoint that several ranks write (a local directory swapped into place, a version folder on
an object store marked committed) ends the same way, implemented by :func:`publish_together`:

1. all ranks vote whether their part was written;
2. only if every rank succeeded, global rank 0 publishes (swaps the directory in, writes the marker);
3. all ranks vote again, so every rank learns whether the publishing step worked.

Every rank then returns (published) or raises: its own error, or a ``RuntimeError`` saying that another rank
failed. A rank that dies makes the collectives fail on the others, which raise that failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Coordinator", "publish_together"]


class Coordinator(Protocol):
    """What a multi-rank commit needs from the strategy: which rank leads, and two collectives.

    A strategy is one; ``Strategy.checkpoint_coordinator()`` gives one whose collectives do not share a process
    group with the training loop's (for saves finished in the background).
    """

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...


def publish_together(error: Exception | None, coordinator: Coordinator, publish: Callable[[], None], target: str) -> None:
    """Vote on ``error``; if no rank failed, run ``publish`` on global rank 0; vote again. Raise unless published.

    ``error`` is this rank's failure while writing its part (``None``: written). Returns on every rank once the
    checkpoint is published; otherwise raises this rank's error, or a ``RuntimeError`` naming ``target`` when only
    another rank failed. The caller removes what it staged when this raises.
    """
    if coordinator.reduce_boolean_decision(error is None, all=True):
        try:
            if coordinator.is_global_zero:
                publish()
        except Exception as err:
            error = err
        if coordinator.reduce_boolean_decision(error is None, all=True):
            return
    if error is not None:
        raise error
    raise RuntimeError(
        f"Saving the checkpoint {target!r} failed on another rank (see its error); the previous checkpoint, if any,"
        " was left untouched."
    )
