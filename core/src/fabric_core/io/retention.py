"""Keeping the last K checkpoints of a numbered series (``step-100.ckpt``, ``step-200.ckpt``, ...).

The series is the newest checkpoint's :class:`~fabric_core.io.series.CheckpointSeries` (its name with every run of
digits replaced by ``*``: ``step-*.ckpt``, ordered by those numbers), the same that ``fabric.latest_checkpoint``
reads. Pruning runs only after the new checkpoint is committed and
durable, on global rank 0, and removes the oldest first; each entry is renamed aside to a hidden name (atomic) before
it is deleted, so a kill never leaves a half-deleted checkpoint under a real name, only a hidden leftover that the
next prune removes. The newest entries are never touched, so at every moment at least the last K complete
checkpoints exist.
"""

from __future__ import annotations

import os
from typing import Any

from fabric_core.io.commit import OLD_MARK, leftovers, new_temp_path, remove_path
from fabric_core.io.location import CheckpointLocation
from fabric_core.io.series import CheckpointSeries


def prune(newest: Any, keep_last: int) -> list[str]:
    """Remove all but the ``keep_last`` newest checkpoints of ``newest``'s series; returns what was removed."""
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"`keep_last` must be a positive integer, got {keep_last!r}.")
    location = CheckpointLocation.of(newest)
    series = CheckpointSeries.of_member(location)
    if location.is_url:
        return _prune_remote(location, series, keep_last)
    folder = location.path.parent
    members = series.members()
    removed = []
    for name in members[: max(0, len(members) - keep_last)]:
        if name == location.name:
            continue
        entry = folder / name
        aside = new_temp_path(entry, OLD_MARK)
        os.rename(entry, aside)  # gone from its name at once; deleting a big tree below may take a while
        remove_path(aside)
        removed.append(entry.name)
    # Entries set aside by prunes that were killed before deleting them (their checkpoint's name is gone already).
    names = {p.name[1:].split(OLD_MARK, 1)[0] for p in folder.iterdir() if p.name.startswith(".") and OLD_MARK in p.name}
    for name in names:
        if series.number(name) is not None:
            for leftover in leftovers(folder / name):
                if OLD_MARK in leftover.name:
                    remove_path(leftover)
    return removed


def _prune_remote(newest: CheckpointLocation, series: CheckpointSeries, keep_last: int) -> list[str]:
    members = series.members()
    removed = []
    for member in members[: max(0, len(members) - keep_last)]:
        if member != newest.name:
            series.folder.child(member).remove()
            removed.append(member)
    return removed


def series_pattern(name: str) -> str:
    """``step-000100.ckpt`` -> ``step-*.ckpt``; a name without digits has no series (:meth:`CheckpointSeries.of_member`)."""
    return CheckpointSeries.of_member(name).pattern
