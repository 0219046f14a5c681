"""Checkpoints at URLs (``s3://``, ``gs://``, ``memory://``, ...) through fsspec, imported only when a URL is used.

What each kind of storage guarantees, and so what a save there guarantees:

* **Object stores** (S3 and S3-compatible servers, GCS, Azure): an object is written by one upload that becomes
  visible only when it completes, whole, replacing the previous object at once. So a single-file checkpoint is
  streamed straight to its key: a kill mid-upload leaves the previous object intact and no partial one (an
  unfinished multipart upload is aborted by the client when it can; after a SIGKILL its parts wait for the bucket's
  lifecycle rule to expire them).
* **Folders** (a sharded checkpoint, many objects) cannot be renamed atomically on a store. They are committed by
  :func:`stage_version`: every save writes a new version folder ``<url>/v-<token>/``, and only when every rank has
  written its part does rank 0 write the small object ``<url>/.fabric-committed`` naming it (one upload, replaced at
  once), then delete the older versions. Readers follow the marker (:func:`committed_version`), so it always names a
  complete version: a kill before the marker leaves the previous version committed, a kill after it at worst an
  old version to delete. A failed save removes its version.
* **``memory://``** (fsspec's in-process store, for tests): a file is replaced when it is closed.

``file://`` URLs are local paths (:class:`~fabric_core.io.location.CheckpointLocation` decides that once).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric_core.io.coordination import Coordinator, publish_together
from fabric_core.utilities.exceptions import guarded

if TYPE_CHECKING:
    from fabric_core.io.location import CheckpointLocation

__all__ = [
    "COMMIT_MARKER",
    "StagedVersion",
    "committed_version",
    "download_folder",
    "filesystem",
    "load",
    "save",
    "stage_version",
    "upload_folder",
    "write",
]

_CHUNK = 8 << 20

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_INSTALL = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}

#: In a checkpoint folder on an object store: the name of the complete version (written last, in one upload).
COMMIT_MARKER = ".fabric-committed"
VERSION_PREFIX = "v-"


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for ``url``, with an install hint when a package is missing."""
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else "file"
    try:
        import fsspec
    except ImportError as err:
        extra = f" and {_INSTALL[scheme]}" if scheme in _INSTALL else ""
        raise ImportError(
            f"Checkpoints at {scheme}:// URLs need fsspec{extra}: `pip install fsspec{extra.replace(' and', '')}`."
        ) from err
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as err:
        package = _INSTALL.get(scheme, f"the fsspec implementation of {scheme}://")
        raise ImportError(f"Checkpoints at {scheme}:// URLs need {package}: `pip install {package}`. ({err})") from err
    except ValueError as err:
        raise ValueError(f"fsspec knows no storage for {url!r}: {err}") from err
    return fs, path


def write(url: str, writer: Callable[[Any], None], storage_options: dict[str, Any] | None = None) -> None:
    """``writer(file)`` to ``url`` in one upload (see the module docstring for what the store guarantees)."""
    fs, path = filesystem(url, storage_options)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as file:
        writer(file)


def save(obj: Any, url: str, storage_options: dict[str, Any] | None = None) -> None:
    """``torch.save`` to ``url`` in one upload."""
    import torch

    write(url, lambda file: torch.save(obj, file), storage_options)


def load(url: str, map_location: Any, weights_only: bool, storage_options: dict[str, Any] | None = None) -> Any:
    """``torch.load`` from ``url``; ``FileNotFoundError`` naming it when nothing is there."""
    import torch

    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {url}")
    with fs.open(path, "rb") as file:
        return torch.load(file, map_location=map_location, weights_only=weights_only)


# ---------------------------------------------------------------------------------------------------- folders
def download_folder(folder: CheckpointLocation, local: Path) -> None:
    """Every file under ``folder`` (a URL) into the local folder ``local``, keeping relative paths."""
    fs, inner = folder.filesystem()
    base = inner.rstrip("/")
    for remote_file in fs.find(base):
        target = local / remote_file[len(base) :].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        with fs.open(remote_file, "rb") as source, open(target, "wb") as sink:
            shutil.copyfileobj(source, sink, _CHUNK)


def upload_folder(local: Path, folder: CheckpointLocation) -> None:
    """Every file under the local folder ``local`` into ``folder`` (a URL), keeping relative paths."""
    for root, _, files in os.walk(local):
        for name in files:
            source = Path(root, name)
            with open(source, "rb") as src, folder.child(*source.relative_to(local).parts).open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)


def committed_version(location: CheckpointLocation) -> CheckpointLocation:
    """The folder that holds the checkpoint at ``location``: its committed version, or ``location`` itself."""
    marker = location.child(COMMIT_MARKER)
    if marker.exists():
        with marker.open("rb") as file:
            version = file.read().decode().strip()
        return location.child(version)
    return location


class StagedVersion:
    """A new version folder at an object-store URL that every rank writes into; published or removed by
    :meth:`finish` on every rank."""

    def __init__(self, target: CheckpointLocation, version: str) -> None:
        self.target = target
        self.version = version
        #: Where every rank writes its part.
        self.location = target.child(version)
        self._published = False

    def abandon(self) -> None:
        """Remove the version (a failure before every rank could vote)."""
        self._remove()

    def make_durable(self) -> None:
        """Nothing to do: an object store keeps what an upload completed."""

    def finish(self, error: Exception | None, coordinator: Coordinator) -> None:
        """Vote, publish the marker from rank 0, vote again (:func:`~fabric_core.io.coordination.publish_together`);
        remove the version unless it was published."""
        try:
            publish_together(error, coordinator, self._publish, str(self.target))
        finally:
            if not self._published and coordinator.is_global_zero:
                self._remove()

    def _publish(self) -> None:
        with self.target.child(COMMIT_MARKER).open("wb") as file:
            file.write(self.version.encode())
        self._published = True
        for name in self.target.listdir():  # best effort: an old version left behind harms nothing
            if name.startswith(VERSION_PREFIX) and name != self.version:
                guarded(self.target.child(name).remove)  # a failure is ignored: the next save tries again
        # A single-file checkpoint saved at this key before is replaced by the folder: drop that object (only it).
        fs, inner = self.target.filesystem()
        if fs.isfile(inner):
            fs.rm_file(inner)

    def _remove(self) -> None:
        guarded(self.location.remove)  # a failure is ignored: a version never named by the marker harms nothing


def stage_version(target: CheckpointLocation, coordinator: Coordinator) -> StagedVersion:
    """Rank 0 names the new version of the folder checkpoint at ``target``; every rank writes into it."""
    version = coordinator.broadcast(f"{VERSION_PREFIX}{uuid.uuid4().hex[:12]}" if coordinator.is_global_zero else None)
    return StagedVersion(target, version)
