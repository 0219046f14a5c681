"""Finding the ``fabric.plugins`` entry points of the installed distributions, in the documented load order.

:func:`group_entry_points` answers what ``importlib.metadata.entry_points(group=...)`` answers, reading only the
metadata files that name the group (the standard call parses every distribution's entry points, a few ms at every
``Fabric()``); :func:`ordered_entry_points` puts them in the load order (first-party distributions, then the others,
each alphabetically). :mod:`fabric_core.plugins.discovery` loads and checks what is found here.
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

from fabric_core.plugins.registry import ENTRY_POINT_GROUP, normalise_distribution
from fabric_core.utilities.lazy import name_and_version


def dist_of(ep: Any) -> tuple[str, str | None]:
    dist = getattr(ep, "dist", None)
    return name_and_version(dist) if dist is not None else (ep.name, None)


def _read_entry_points_text(dist: Any) -> str | None:
    """``dist.read_text("entry_points.txt")``; for a metadata folder on disk read with ``open`` directly, which is
    about twice as fast as the pathlib call (most of the hundred distributions have no such file)."""
    path = getattr(dist, "_path", None)
    if not isinstance(path, pathlib.Path):  # e.g. a distribution inside a zip file
        return dist.read_text("entry_points.txt")
    try:
        with open(os.path.join(path, "entry_points.txt"), encoding="utf-8") as file:
            return file.read()
    except OSError:  # no such file, or not readable: what `read_text` answers with None
        return None


def group_entry_points() -> list[Any]:
    """``importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)``, without parsing every distribution's entry points.

    The standard call parses the ``entry_points.txt`` of every installed distribution (console scripts included)
    into entry point objects, to keep those of one group: a few ms at every ``Fabric()`` in an environment of a
    hundred packages. Here a file is parsed only when its text names the group's section; the rest of the rules are
    the standard call's: the first distribution of each (normalised) name on ``sys.path`` wins.
    """
    header = f"[{ENTRY_POINT_GROUP}]"
    if _only_path_finders_find_distributions():
        return _scan_path_entries(header)
    from importlib.metadata import distributions

    seen: set[str] = set()
    found: list[Any] = []
    for dist in distributions():
        name = getattr(dist, "_normalized_name", None)
        if name is None:  # a Distribution subclass without the attribute: what the standard call would key by
            name = normalise_distribution(name_and_version(dist)[0])
        if name in seen:
            continue
        seen.add(name)
        text = _read_entry_points_text(dist)
        if text and header in text:
            found.extend(dist.entry_points.select(group=ENTRY_POINT_GROUP))
    return found


def _only_path_finders_find_distributions() -> bool:
    """Whether every finder that can report distributions is the standard one, which reads metadata folders on
    ``sys.path`` (a finder of another kind, e.g. of a bundled application, is then asked the standard way)."""
    from importlib.machinery import PathFinder

    # The `importlib_metadata` backport, once imported, removes the standard finder's method and adds a finder of
    # its own: then the standard way it is.
    standard = getattr(PathFinder, "find_distributions", None)
    for finder in sys.meta_path:
        find = getattr(finder, "find_distributions", None)
        if find is not None and getattr(find, "__func__", find) is not standard:
            return False
    return standard is not None


def _scan_path_entries(header: str) -> list[Any]:
    """What ``distributions()`` finds on ``sys.path``, read with one ``os.scandir`` per folder: only a metadata
    folder whose ``entry_points.txt`` names ``header`` becomes a distribution object. A ``sys.path`` entry that is
    not a folder (a zip file) is asked the standard way."""
    from importlib.metadata import PathDistribution, distributions

    seen: set[str] = set()
    found: list[Any] = []
    for entry in sys.path:
        folder = entry or "."
        try:
            children = os.scandir(folder)
        except OSError:  # missing, not a folder (zip files: below), or unreadable
            if os.path.isfile(folder):
                for dist in distributions(path=[entry]):
                    name = getattr(dist, "_normalized_name", None) or _normalised_stem(name_and_version(dist)[0])
                    if name not in seen:
                        seen.add(name)
                        text = _read_entry_points_text(dist)
                        if text and header in text:
                            found.extend(dist.entry_points.select(group=ENTRY_POINT_GROUP))
            continue
        with children:
            names = [child.name for child in children]
        for child in names:
            stem, dot, suffix = child.rpartition(".")
            if not dot or suffix.lower() not in ("dist-info", "egg-info"):
                continue
            # importlib.metadata's rule: the name is the part before the first "-", normalised
            name = _normalised_stem(stem.partition("-")[0])
            if name in seen:
                continue
            seen.add(name)
            path = os.path.join(folder, child)
            try:
                with open(os.path.join(path, "entry_points.txt"), encoding="utf-8") as file:
                    text = file.read()
            except OSError:
                continue
            if header in text:
                found.extend(PathDistribution(pathlib.Path(path)).entry_points.select(group=ENTRY_POINT_GROUP))
    return found


def _normalised_stem(name: str) -> str:
    """importlib.metadata's normalisation of a metadata folder's name (``Prepared.normalize``): PEP 503's, with ``_``."""
    return normalise_distribution(name).replace("-", "_")


def ordered_entry_points(first_party: set[str]) -> Iterator[Any]:
    """Entry points in the load order: first-party distributions, then the others, alphabetically."""

    def order(ep: Any) -> tuple[bool, str, str]:
        dist = normalise_distribution(dist_of(ep)[0])
        return dist not in first_party, dist, ep.name

    seen: set[tuple[str, str]] = set()
    for ep in sorted(group_entry_points(), key=order):
        key = (ep.name, ep.value)
        if key in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(key)
        yield ep
