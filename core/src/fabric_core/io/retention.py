"""Keeping the last K checkpoints of a numbered series (``step-100.ckpt``, ``step-200.ckpt``, ...).

A series is the entries beside the newest checkpoint whose names match its name with every run of digits replaced
by ``*`` (``step-*.ckpt``), ordered by those numbers. Pruning runs only after the new checkpoint is committed and
durable, on global rank 0, and removes the oldest first; each entry is renamed aside to a hidden name (atomic) before
it is deleted, so a kill never leaves a half-deleted checkpoint under a real name, only a hidden leftover that the
next prune removes. The newest entries are never touched, so at every moment at least the last K complete
checkpoints exist.
"""

from __future__ import annotations

import fnmatch
import os
import re
from typing import Any

from fabric_core.io.commit import OLD_MARK, is_temporary, leftovers, new_temp_path, remove_path
from fabric_core.io.location import CheckpointLocation

_DIGITS = re.compile(r"\d+")


def series_pattern(name: str) -> str:
    """``step-000100.ckpt`` -> ``step-*.ckpt``; a name without digits has no series."""
    if not _DIGITS.search(name):
        raise ValueError(
            f"`keep_last` keeps the newest checkpoints of a numbered series, but {name!r} has no number in it. Name"
            " each checkpoint after its step or epoch, e.g. `fabric.save(f'ckpts/step-{step}.ckpt', ...)`."
        )
    return _DIGITS.sub("*", name)


def _order(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in _DIGITS.findall(name))


def prune(newest: Any, keep_last: int) -> list[str]:
    """Remove all but the ``keep_last`` newest checkpoints of ``newest``'s series; returns what was removed."""
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"`keep_last` must be a positive integer, got {keep_last!r}.")
    location = CheckpointLocation.of(newest)
    if location.is_url:
        return _prune_remote(location, keep_last)
    newest = location.path
    pattern = series_pattern(newest.name)
    folder = newest.parent
    members = sorted(
        (p for p in folder.iterdir() if fnmatch.fnmatchcase(p.name, pattern) and not is_temporary(p)),
        key=lambda p: _order(p.name),
    )
    removed = []
    for entry in members[: max(0, len(members) - keep_last)]:
        if entry == newest:
            continue
        aside = new_temp_path(entry, OLD_MARK)
        os.rename(entry, aside)  # gone from its name at once; deleting a big tree below may take a while
        remove_path(aside)
        removed.append(entry.name)
    # Entries set aside by prunes that were killed before deleting them (their checkpoint's name is gone already).
    names = {p.name[1:].split(OLD_MARK, 1)[0] for p in folder.iterdir() if p.name.startswith(".") and OLD_MARK in p.name}
    for name in names:
        if fnmatch.fnmatchcase(name, pattern):
            for leftover in leftovers(folder / name):
                if OLD_MARK in leftover.name:
                    remove_path(leftover)
    return removed


def _prune_remote(newest: CheckpointLocation, keep_last: int) -> list[str]:
    pattern = series_pattern(newest.name)
    folder = newest.parent
    members = sorted((m for m in folder.listdir() if fnmatch.fnmatchcase(m, pattern) and not m.startswith(".")), key=_order)
    removed = []
    for member in members[: max(0, len(members) - keep_last)]:
        if member != newest.name:
            folder.child(member).remove()
            removed.append(member)
    return removed
