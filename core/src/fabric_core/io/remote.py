"""Checkpoints at URLs (``s3://``, ``gs://``, ``memory://``, ...) through fsspec, imported only when a URL is used.

What each kind of storage guarantees, and so what a save there guarantees:

* **Object stores** (S3 and S3-compatible servers, GCS, Azure): an object is written by one upload that becomes
  visible only when it completes, whole, replacing the previous object at once. So a single-file checkpoint is
  streamed straight to its key: a kill mid-upload leaves the previous object intact and no partial one (an
  unfinished multipart upload is aborted by the client when it can; after a SIGKILL its parts wait for the bucket's
  lifecycle rule to expire them). There is no atomic rename of a "folder", so a sharded checkpoint (many objects)
  is committed by writing every object first and the small object that marks the folder a checkpoint last; a kill
  before that leaves a folder no reader takes for a checkpoint.
* **``file://``** URLs are local paths and get the local crash-safe commit (temporary file, fsync, rename).
* **``memory://``** (fsspec's in-process store, for tests): a file is replaced when it is closed.
"""

from __future__ import annotations

import os
import re
from typing import Any

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_INSTALL = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL with a scheme other than ``file://`` (which is a local path)."""
    if not isinstance(path, str):
        return False
    match = _SCHEME.match(path)
    return match is not None and match.group(1).lower() != "file"


def local_path(path: Any) -> Any:
    """``file:///a/b`` -> ``/a/b``; anything else unchanged."""
    if isinstance(path, str) and path.lower().startswith("file://"):
        return path[len("file://") :]
    return path


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for ``url``, with an install hint when a package is missing."""
    scheme = _SCHEME.match(url).group(1).lower()  # type: ignore[union-attr]
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


def save(obj: Any, url: str, storage_options: dict[str, Any] | None = None) -> None:
    """``torch.save`` to ``url`` in one upload (see the module docstring for what the store guarantees)."""
    import torch

    fs, path = filesystem(url, storage_options)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as file:
        torch.save(obj, file)


def load(url: str, map_location: Any, weights_only: bool, storage_options: dict[str, Any] | None = None) -> Any:
    import torch

    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {url}")
    with fs.open(path, "rb") as file:
        return torch.load(file, map_location=map_location, weights_only=weights_only)


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return bool(fs.exists(path))


def isdir(url: str) -> bool:
    fs, path = filesystem(url)
    return bool(fs.isdir(path))


def remove(url: str) -> None:
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def name(path: Any) -> str:
    return os.path.basename(str(path).rstrip("/"))
