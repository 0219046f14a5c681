"""A numbered series of checkpoints (``step-100.ckpt``, ``step-200.ckpt``, ...), read by one rule.

Retention (``fabric.save(..., keep_last=K)``), ``fabric.latest_checkpoint`` and resuming all ask the same questions
(which entries belong to the series, in which order, which is the newest complete one), so they share this type:

* a series is written as the members' name with ``*`` where the number goes (``ckpts/step-*.ckpt``,
  ``s3://bucket/run/epoch-*``), or given by one member (``ckpts/step-100.ckpt``: each run of digits becomes ``*``);
* a member is a visible entry of the folder whose name matches with a number at every ``*``; hidden entries (saves
  in progress, what a prune is setting aside) never are;
* members are ordered by their numbers, left to right, never by time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from fabric_core.io.location import CheckpointLocation
from fabric_core.io.remote import COMMIT_MARKER

_DIGITS = re.compile(r"\d+")


class CheckpointSeries:
    """The checkpoints in ``folder`` whose names match ``pattern`` (``*`` for a number)."""

    def __init__(self, folder: CheckpointLocation, pattern: str) -> None:
        self.folder = folder
        self.pattern = pattern
        self._regex = re.compile("^" + r"(\d+)".join(re.escape(part) for part in pattern.split("*")) + "$")

    @classmethod
    def of(cls, series: Any) -> CheckpointSeries:
        """The series ``series`` names: a pattern with ``*`` for the number, or the path of any member."""
        location = CheckpointLocation.of(series)
        name = location.name
        if "*" not in name and not _DIGITS.search(name):
            raise ValueError(
                f"{str(location)!r} names no series: give the checkpoints' name with `*` where the number goes (e.g."
                " 'ckpts/step-*.ckpt'), or the path of one of them (e.g. 'ckpts/step-100.ckpt')."
            )
        return cls(location.parent, name if "*" in name else _DIGITS.sub("*", name))

    @classmethod
    def of_member(cls, checkpoint: Any) -> CheckpointSeries:
        """The series the checkpoint at ``checkpoint`` belongs to (what ``keep_last`` prunes)."""
        location = CheckpointLocation.of(checkpoint)
        if not _DIGITS.search(location.name):
            raise ValueError(
                f"`keep_last` keeps the newest checkpoints of a numbered series, but {location.name!r} has no number in"
                " it. Name each checkpoint after its step or epoch, e.g. `fabric.save(f'ckpts/step-{step}.ckpt', ...)`."
            )
        return cls(location.parent, _DIGITS.sub("*", location.name))

    def number(self, name: str) -> tuple[int, ...] | None:
        """The numbers of member ``name`` (its sort key), or ``None`` when ``name`` is not a member."""
        match = self._regex.match(name)
        if match is None or name.startswith("."):
            return None
        return tuple(int(n) for n in match.groups())

    def members(self) -> list[str]:
        """The members' names, oldest (lowest numbers) first."""
        numbered = [(number, name) for name in self.folder.listdir() if (number := self.number(name)) is not None]
        return [name for _, name in sorted(numbered)]

    def latest(self) -> CheckpointLocation | None:
        """The newest member whose save finished, or ``None`` when there is none yet (reads only)."""
        return next(self.committed_members(), None)

    def committed_members(self) -> Iterator[CheckpointLocation]:
        """The members whose save finished, newest first (reads only, lazily: the first costs one listing)."""
        for name in reversed(self.members()):
            entry = self.folder.child(name)
            if _committed(entry):
                yield entry

    def __repr__(self) -> str:
        return f"CheckpointSeries({str(self.folder.child(self.pattern))!r})"


def _committed(entry: CheckpointLocation) -> bool:
    """Whether ``entry`` is a checkpoint whose save finished.

    Locally every save writes under a hidden temporary name and renames (a file) or swaps (a folder) it into place,
    so a visible name is complete. On an object store an uploaded file appears only when complete, but a folder is
    complete only once its commit marker exists (:mod:`fabric_core.io.remote`).
    """
    if not entry.is_url:
        return True
    return not entry.is_dir() or entry.child(COMMIT_MARKER).exists()
