"""Memory snapshots on one node: where they live, how one is committed, checked, found and pruned.

The memory tier (:mod:`fabric_core.io.tiers`) keeps each rank's newest checkpoints in RAM that outlives the training
process: files in a shared-memory folder (``/dev/shm`` by default, a tmpfs), one folder per node and run::

    <root>/                          FABRIC_MEMORY_DIR, else /dev/shm/fabric-<uid>/<run id>
      keeper.json                    the node's keeper (address, port, token, pid): fabric_core.io.keeper
      own/<key>/step-000000012/      this node's ranks' snapshots, <key> = the rank's topology coordinates
      peer/<key>/step-000000012/     copies of other nodes' ranks' snapshots (peer copies)
      own/<key>/.step-000000013.tmp-<host>-<pid>-<random>/   a snapshot being written (never loaded)
      own/<key>/.free-<random>       the data file of a pruned snapshot, reused by the next one

A snapshot folder holds ``data`` (every tensor's bytes, 64-byte aligned), ``skeleton.pkl`` (the state with each
tensor replaced by its index) and ``manifest.json`` (step, the tensors' dtypes/shapes/offsets, the topology that wrote
it, and a checksum of ``data`` and ``skeleton.pkl``: :mod:`fabric_core.io.snapshot_checksum`). **The commit rule is
the disk's**: a snapshot is written under a hidden temporary name and renamed into place only once complete and
checksummed, so a visible name is a complete snapshot and a write or a copy killed midway leaves only a hidden entry
(removed by the next writer). Loading checks the checksum again; a mismatch skips the snapshot for an older one.

Only the standard library is imported: the keeper process uses this module before it needs torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; pruning then never waits for readers
    fcntl = None  # type: ignore[assignment]

MEMORY_DIR_VARIABLE = "FABRIC_MEMORY_DIR"
DATA = "data"
SKELETON = "skeleton.pkl"
MANIFEST = "manifest.json"
FORMAT = "fabric-memory-snapshot/2"  # 2: the block checksum of fabric_core.io.snapshot_checksum (1: CRC-32)
OWN = "own"
PEER = "peer"
#: Every tensor starts at a multiple of this many bytes in ``data`` (cache lines; any dtype's alignment).
ALIGN = 64
_STEP = re.compile(r"^step-(\d+)$")


class SnapshotChecksumError(RuntimeError):
    """A memory snapshot's bytes do not match the checksum written when it was committed."""


def default_root(run_id: str) -> Path:
    """Where this node keeps the run's memory snapshots: ``FABRIC_MEMORY_DIR``, else ``/dev/shm/fabric-<uid>/<run>``
    (a tmpfs: RAM that outlives the process), else the temporary folder where there is no ``/dev/shm``."""
    chosen = os.environ.get(MEMORY_DIR_VARIABLE, "").strip()
    if chosen:
        return Path(chosen)
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    return base / f"fabric-{user}" / _safe(run_id)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", text) or "run"


def snapshot_name(step: int) -> str:
    return f"step-{step:09d}"


def parse_step(name: str) -> int | None:
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


def aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def temp_name(step: int) -> str:
    """A hidden name for a snapshot being written (never listed, never loaded)."""
    return f".{snapshot_name(step)}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:10]}"


# ------------------------------------------------------------------------------------------------------ manifests
def read_manifest(folder: Path) -> dict[str, Any]:
    with open(folder / MANIFEST, encoding="utf-8") as f:
        return check_format(json.load(f), folder)


def check_format(manifest: dict[str, Any], where: Any) -> dict[str, Any]:
    """``manifest``, if it is one of a snapshot of this version; else a ``ValueError`` naming ``where``."""
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{where} is not a memory snapshot of this version (format {manifest.get('format')!r}).")
    return manifest


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    with open(folder / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, separators=(",", ":"))


def commit(tmp: Path, target: Path) -> None:
    """Make the finished snapshot ``tmp`` visible as ``target`` (a rename: atomic). A snapshot already there (the
    same step saved again) is replaced whole."""
    if target.exists():
        aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:10]}"
        os.rename(target, aside)
        os.rename(tmp, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, target)


# ------------------------------------------------------------------------------------------------------ the folder
@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot on this node: ``kind`` is ``"own"`` (written here) or ``"peer"`` (a copy received)."""

    kind: str
    key: str
    step: int
    path: Path


def rank_folder(root: Path, kind: str, key: str) -> Path:
    return root / kind / key


def committed(folder: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the committed snapshots in one rank's folder, oldest first."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = [(step, folder / name) for name in names if (step := parse_step(name)) is not None]
    return sorted(found)


def inventory(root: Path) -> list[Snapshot]:
    """Every committed snapshot on this node (own and peer copies), oldest first per rank."""
    found: list[Snapshot] = []
    for kind in (OWN, PEER):
        try:
            keys = sorted(os.listdir(root / kind))
        except OSError:
            continue
        for key in keys:
            found.extend(Snapshot(kind, key, step, path) for step, path in committed(root / kind / key))
    return found


def bytes_held(root: Path) -> int:
    """Bytes of every file under ``root`` (snapshots, peer copies, free data files kept for reuse)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, name)).st_blocks * 512
    return total


def size_data_file(fd: int, size: int) -> os.stat_result:
    """Make the data file open as ``fd`` ``size`` bytes long with its pages allocated, so that a full tmpfs says
    ENOSPC here instead of killing the process that writes through a mapping (SIGBUS). A reused file of this size has
    its pages already: asking again took 17 ms per 528 MiB snapshot. A filesystem without fallocate is left to the
    writes. Returns the file's status before the change."""
    stat = os.fstat(fd)
    if stat.st_size != size:
        os.ftruncate(fd, size)
    if size and (stat.st_size != size or stat.st_blocks * 512 < size):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    return stat


def check_data_size(fd: int, size: int, path: Path) -> None:
    """Refuse a data file shorter than its manifest's ``size`` before it is mapped (touching a mapped page past the end
    of a file is a SIGBUS)."""
    found = os.fstat(fd).st_size
    if found < size:
        raise SnapshotChecksumError(f"{path} holds {found} bytes, the manifest says {size}.")


def free_bytes(path: Path) -> int:
    """Bytes that may still be written in the filesystem holding ``path`` (its nearest existing folder)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stats = os.statvfs(probe)
    return stats.f_bavail * stats.f_frsize


def filesystem_size(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stats = os.statvfs(probe)
    return stats.f_blocks * stats.f_frsize


# ------------------------------------------------------------------------------------------------------ locks
class ReadLock:
    """A shared ``flock`` on a snapshot's data file while it is read (copied to a peer, written to disk): pruning
    leaves a locked snapshot in place until a later prune."""

    def __init__(self, path: Path) -> None:
        self.fd: int | None = os.open(path, os.O_RDONLY)
        if fcntl is not None:
            fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> ReadLock:
        return self

    def __exit__(self, *_: Any) -> None:
        self.release()


def _being_read(path: Path) -> bool:
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


# ------------------------------------------------------------------------------------------------------ pruning
def prune(folder: Path, keep_last: int, reuse: bool = True) -> list[int]:
    """Keep the newest ``keep_last`` committed snapshots of one rank's folder; returns the steps removed.

    A removed snapshot is renamed to a hidden name first (gone from the listing at once), and its data file kept as
    ``.free-*`` for the next snapshot to write into (``reuse``): a tmpfs file whose pages exist already is written
    several times faster than a new one (page allocation). Snapshots being read (a peer copy or a disk write in
    flight) stay until a later prune. Leftovers of writers that died are removed too.
    """
    removed = []
    snapshots = committed(folder)
    for step, path in snapshots[: max(0, len(snapshots) - keep_last)]:
        data = path / DATA
        if data.exists() and _being_read(data):
            continue
        aside = folder / f".{path.name}.old-{uuid.uuid4().hex[:10]}"
        try:
            os.rename(path, aside)
        except OSError:
            continue
        if reuse and (aside / DATA).exists():
            with contextlib.suppress(OSError):
                os.rename(aside / DATA, folder / f".free-{uuid.uuid4().hex[:10]}")
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(step)
    remove_leftovers(folder)
    return removed


def remove_leftovers(folder: Path) -> None:
    """Remove hidden snapshot folders whose writer is gone (killed mid-write, mid-copy or mid-prune)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not name.startswith(".step-"):
            continue
        if ".tmp-" in name:
            owner = name.split(".tmp-", 1)[1].rsplit("-", 2)
            if len(owner) == 3 and owner[0] == _host() and owner[1].isdigit() and _alive(int(owner[1])):
                continue  # a live writer's snapshot in progress
        shutil.rmtree(folder / name, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def claim_free(folder: Path) -> Path | None:
    """Take a kept data file of a pruned snapshot for reuse (renamed to a hidden name of this process), or ``None``."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith(".free-"))
    except OSError:
        return None
    for name in names:
        mine = folder / f".claimed-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        try:
            os.rename(folder / name, mine)
        except OSError:
            continue
        return mine
    return None


def drop_free(folder: Path) -> None:
    """Remove kept data files (when the state's size changed, or the memory tier stops)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if name.startswith((".free-", ".claimed-")):
                with contextlib.suppress(OSError):
                    os.unlink(folder / name)


def iter_files(folder: Path) -> Iterator[tuple[str, Path]]:
    """The files a snapshot is made of, in the order a copy sends them (the manifest last: it commits)."""
    for name in (SKELETON, DATA, MANIFEST):
        yield name, folder / name
