"""Say which rank left and where this one waited, when a collective fails because a peer's process ended.

gloo reports a peer that ended (returned from its script, or died) as "Connection closed by peer" or a read error
ten frames deep; what a user needs is "rank 1 left the job while rank 0 waited in barrier() at train.py:42": a rank
that skipped a ``fabric.barrier()`` its peers reached, or returned early.
"""

from __future__ import annotations

import os
import sys

__all__ = ["caller_outside_fabric", "peer_left_error"]

#: What gloo and the TCP store say when the other end of a connection went away.
_GONE_MARKS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def caller_outside_fabric() -> str:
    """``file:line`` of the innermost frame that is not fabric-core's or torch's (the user's call)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_PACKAGE_DIR) and f"{os.sep}torch{os.sep}" not in filename:
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "an unknown place"


def peer_left_error(err: BaseException, rank: int, world_size: int, what: str) -> RuntimeError | None:
    """A ``RuntimeError`` naming the rank that left (the other one, with two processes) and where ``rank`` waited
    in ``what``; ``None`` when ``err`` is not a peer going away."""
    if not any(mark in str(err) for mark in _GONE_MARKS):
        return None
    who = f"rank {1 - rank}" if world_size == 2 else "another rank"
    return RuntimeError(
        f"{who} left the job while rank {rank} waited in {what} at {caller_outside_fabric()}: every rank must reach"
        " the same collectives in the same order (a rank that returns early, or skips a `fabric.barrier()` behind an"
        f" `if`, leaves the others waiting). Its own output says why it ended. ({type(err).__name__}: {err})"
    )
