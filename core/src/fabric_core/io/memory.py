"""Writing a rank's state into a memory snapshot, and reading one back (the torch side of
:mod:`fabric_core.io.snapshot_store`).

**Writing overlaps the next step.** :meth:`SnapshotWriter.begin` is called right after an optimizer step: it converts
the state (``state_dict()`` of every object, which copies nothing), pickles the small remainder, and copies at once
every tensor that the forward pass may change (buffers such as batch-norm statistics, anything not owned by an
optimizer). The big part, the parameters and optimizer states that only the next ``optimizer.step()`` changes, is
copied by a background thread while the next forward and backward run (``copy_`` releases the GIL), which digests
each block of the data for the checksum as soon as the copy completes it (:mod:`fabric_core.io.snapshot_checksum`).
That optimizer's ``step()`` first waits for the copy (a step pre-hook: :meth:`SnapshotWriter.gate`) and checks with the
tensors' version counters that nothing changed them in place meanwhile; only then is the snapshot committed (renamed
into place). A snapshot whose tensors did change is dropped, with a warning naming one of them (pass ``overlap=False`` to
copy everything in the call). So a snapshot costs the caller the conversion and the small copies, not a copy of the
state.

**Reading** maps the data file copy-on-write and gives every tensor its own storage over its bytes
(``torch.frombuffer``): nothing is read before ``load_state_dict`` copies it, and a disk file written from it
(:func:`write_file`) holds one storage per tensor, as ``torch.save`` of the live state would.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import pickle
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fabric_core.io import snapshot_checksum
from fabric_core.io import snapshot_store as store
from fabric_core.utilities.exceptions import on_failure

__all__ = [
    "MemoryTierError",
    "SnapshotWriter",
    "TensorRef",
    "private_buffer",
    "read_snapshot",
    "release_unused",
    "state_bytes",
    "state_from_parts",
    "write_file",
]


class MemoryTierError(RuntimeError):
    """The memory tier cannot keep snapshots here (too little shared memory, a folder it cannot write); the message
    names the size and the setting to change. Training continues with the other tiers."""


class TensorRef:
    """Stands for tensor ``index`` of a snapshot in its pickled skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return TensorRef, (self.index,)

    def __repr__(self) -> str:
        return f"TensorRef({self.index})"


# ------------------------------------------------------------------------------------------------------ the walk
def _flatten(obj: Any, tensors: list[Tensor], seen: dict[int, int]) -> Any:
    """``obj`` with every tensor replaced by a :class:`TensorRef` (a tensor met twice is stored once)."""
    if isinstance(obj, Tensor):
        index = seen.get(id(obj))
        if index is None:
            _check_storable(obj)
            index = seen[id(obj)] = len(tensors)
            tensors.append(obj)
        return TensorRef(index)
    if isinstance(obj, dict):
        out = obj.copy() if type(obj) in (dict, collections.OrderedDict) else dict(obj)
        for key, value in obj.items():
            out[key] = _flatten(value, tensors, seen)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_flatten(v, tensors, seen) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_flatten(v, tensors, seen) for v in obj)
    return obj


def _check_storable(tensor: Tensor) -> None:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        raise TypeError(
            f"A memory snapshot holds dense tensors, but the state has a {tensor.layout} tensor of dtype {tensor.dtype}"
            f" on {tensor.device}. Keep it out of the state given to the memory tier (it still reaches disk checkpoints)."
        )
    if type(tensor) not in (Tensor, torch.nn.Parameter) and hasattr(tensor, "to_local"):
        raise TypeError(
            "A memory snapshot holds plain tensors, but the state has a DTensor: the strategy's checkpoint context"
            " should gather it (the full-state adapters do). Use a disk tier for this strategy's sharded checkpoints."
        )


def _rebuild(obj: Any, tensors: list[Tensor]) -> Any:
    if isinstance(obj, TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            obj[key] = _rebuild(value, tensors)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_rebuild(v, tensors) for v in obj))
    if isinstance(obj, list):
        return [_rebuild(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, tensors) for v in obj)
    return obj


def state_bytes(converted: Any) -> int:
    """Bytes a snapshot of ``converted`` (a state as a checkpoint holds it) takes in shared memory."""
    tensors: list[Tensor] = []
    _flatten(converted, tensors, {})
    return _layout(tensors)[1]


def _layout(tensors: list[Tensor]) -> tuple[list[dict[str, Any]], int]:
    table, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        table.append({"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), "offset": offset, "nbytes": nbytes})
        offset = store.aligned(offset + nbytes)
    return table, offset


# ------------------------------------------------------------------------------------------------------ mappings
class _Mappings:
    """Writable shared mappings of data files, kept while the files are reused (so a reused file costs no page
    faults); the least recently used beyond ``limit`` are closed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._maps: collections.OrderedDict[tuple[int, int, int], tuple[mmap.mmap, Tensor]] = collections.OrderedDict()

    def bytes_of(self, path: Path, size: int) -> Tensor:
        fd = os.open(path, os.O_RDWR)
        try:
            stat = _reserve(fd, size, path)
            key = (stat.st_dev, stat.st_ino, size)
            if key in self._maps:
                self._maps.move_to_end(key)
                return self._maps[key][1]
            if size == 0:
                return torch.empty(0, dtype=torch.uint8)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            view = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tensor = torch.frombuffer(view, dtype=torch.uint8)
        self._maps[key] = (view, tensor)
        while len(self._maps) > self.limit:
            _, (old, _old_tensor) = self._maps.popitem(last=False)
            del _old_tensor
            with contextlib.suppress(BufferError):
                old.close()
        return tensor

    def close(self) -> None:
        while self._maps:
            _, (view, tensor) = self._maps.popitem()
            del tensor
            with contextlib.suppress(BufferError):
                view.close()


def _reserve(fd: int, size: int, path: Path) -> os.stat_result:
    """:func:`~fabric_core.io.snapshot_store.size_data_file`, a full shared memory said in the tier's words."""
    try:
        return store.size_data_file(fd, size)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise MemoryTierError(
                f"No room for a {_size(size)} memory snapshot in {path.parent} ({_size(store.free_bytes(path))} free"
                f" of {_size(store.filesystem_size(path))}). Give the shared memory more room ({_SETTINGS}) or keep"
                " fewer snapshots (memory_keep_last)."
            ) from err
        raise


_SETTINGS = (
    "docker run --shm-size=...; Kubernetes: an emptyDir with medium: Memory and a sizeLimit; or"
    f" {store.MEMORY_DIR_VARIABLE}=<a larger tmpfs folder>"
)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ------------------------------------------------------------------------------------------------------ writing
@dataclass
class PendingSnapshot:
    """A snapshot between :meth:`SnapshotWriter.begin` and its commit."""

    step: int
    tmp: Path
    target: Path
    manifest: dict[str, Any]
    deferred: list[tuple[Tensor, Tensor, int, str, int]]  # (source, destination view, version at begin, name, end)
    digest: snapshot_checksum.BlockDigest
    skeleton: bytes
    copied: threading.Event = field(default_factory=threading.Event)
    checked: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    valid: bool = True
    error: BaseException | None = None
    #: keep the committed snapshot from being pruned until :meth:`release` (a disk write from it is pending)
    hold: bool = False
    read_lock: store.ReadLock | None = None
    began: float = field(default_factory=time.perf_counter)
    committed_s: float | None = None

    def release(self) -> None:
        if self.read_lock is not None:
            self.read_lock.release()
            self.read_lock = None


class SnapshotWriter:
    """Writes one rank's snapshots into its folder (``<root>/own/<key>``), one at a time, keeping the newest
    ``keep_last`` committed. ``on_commit(step, path)`` runs in the writer's thread after each commit."""

    def __init__(self, folder: Path, keep_last: int, on_commit: Callable[[int, Path], None] | None = None) -> None:
        self.folder = folder
        self.keep_last = keep_last
        self.on_commit = on_commit
        self._mappings = _Mappings(limit=keep_last + 2)
        self._pending: PendingSnapshot | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_error: BaseException | None = None
        self.last_committed: int | None = None
        self.dropped: list[tuple[int, str]] = []

    # -------------------------------------------------------------------------------------- the caller's part
    def begin(
        self,
        step: int,
        converted: Any,
        manifest: dict[str, Any],
        deferred_storages: Iterable[int] = (),
        names: dict[int, str] | None = None,
    ) -> PendingSnapshot:
        """Start the snapshot of ``converted`` for ``step``. Tensors whose storage pointer is in ``deferred_storages``
        are copied in the background (see the module); the rest now. Waits for the previous snapshot first."""
        self.finish_previous()
        tensors: list[Tensor] = []
        skeleton = _flatten(converted, tensors, {})
        table, size = _layout(tensors)
        skeleton_bytes = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / store.temp_name(step)
        tmp.mkdir()
        with on_failure(lambda: _remove_tree(tmp)):
            data = tmp / store.DATA
            reused = store.claim_free(self.folder)
            if reused is not None:
                os.rename(reused, data)
            else:
                data.touch()
            buffer = self._mappings.bytes_of(data, size)
            (tmp / store.SKELETON).write_bytes(skeleton_bytes)
            deferred_set = set(deferred_storages)
            deferred = []
            with torch.no_grad():
                for index, (tensor, entry) in enumerate(zip(tensors, table)):
                    view = buffer[entry["offset"] : entry["offset"] + entry["nbytes"]].view(tensor.dtype).view(tensor.shape)
                    if tensor.numel() and tensor.untyped_storage().data_ptr() in deferred_set:
                        name = (names or {}).get(tensor.untyped_storage().data_ptr(), f"tensor {index}")
                        deferred.append((tensor, view, tensor._version, name, entry["offset"] + entry["nbytes"]))
                    else:
                        view.copy_(tensor.detach())
        manifest = {**manifest, "format": store.FORMAT, "step": step, "tensors": table, "data_bytes": size}
        digest = snapshot_checksum.BlockDigest(buffer, size)
        pending = PendingSnapshot(step, tmp, self.folder / store.snapshot_name(step), manifest, deferred, digest, skeleton_bytes)
        with self._lock:
            self._pending = pending
            self._thread = threading.Thread(target=self._work, args=(pending,), name="fabric-memory-snapshot", daemon=True)
            self._thread.start()
        return pending

    def gate(self) -> None:
        """Called before anything changes the deferred tensors (an optimizer step, a load): wait for their copy, check
        nothing changed them meanwhile, and let the snapshot commit."""
        pending = self._pending
        if pending is None or pending.checked.is_set():
            return
        pending.copied.wait()
        for source, _, version, name, _ in pending.deferred:
            if source._version != version:
                pending.valid = False
                reason = f"{name} changed in place before the next optimizer step"
                self.dropped.append((pending.step, reason))
                warnings.warn(
                    f"The memory snapshot of step {pending.step} was dropped: {reason}, while the snapshot was copied"
                    " in the background. Change parameters and optimizer states only in `optimizer.step()` (or pass"
                    " `overlap=False` to the checkpoint tiers).",
                    RuntimeWarning,
                    stacklevel=3,
                )
                break
        pending.checked.set()

    def finish_previous(self, timeout: float | None = None) -> None:
        """Wait until the snapshot in progress is committed (or dropped); raise what failed in its thread."""
        pending = self._pending
        if pending is not None:
            self.gate()
            pending.done.wait(timeout)
            thread = self._thread
            if thread is not None and pending.done.is_set():
                thread.join()
        error, self._last_error = self._last_error, None
        if error is not None:
            raise error

    @property
    def in_progress(self) -> PendingSnapshot | None:
        pending = self._pending
        return pending if pending is not None and not pending.done.is_set() else None

    @property
    def pending(self) -> PendingSnapshot | None:
        """The snapshot begun last (committed, dropped or still in progress)."""
        return self._pending

    # -------------------------------------------------------------------------------------- the thread's part
    def _work(self, pending: PendingSnapshot) -> None:
        try:
            with torch.no_grad():
                for source, view, _, _, end in pending.deferred:
                    view.copy_(source.detach())
                    pending.digest.advance(end)  # the blocks this copy completed, while they are in the cache
            pending.copied.set()
            pending.digest.advance(pending.manifest["data_bytes"])  # while the optimizer step runs
            pending.checked.wait()
            if not pending.valid:
                import shutil

                shutil.rmtree(pending.tmp, ignore_errors=True)
                return
            pending.manifest["checksum"] = pending.digest.result(pending.skeleton)
            pending.manifest["committed_unix"] = time.time()
            store.write_manifest(pending.tmp, pending.manifest)
            store.commit(pending.tmp, pending.target)
            if pending.hold:
                pending.read_lock = store.ReadLock(pending.target / store.DATA)
            pending.committed_s = time.perf_counter() - pending.began
            self.last_committed = pending.step
            store.prune(self.folder, self.keep_last)
            if self.on_commit is not None:
                self.on_commit(pending.step, pending.target)
        except BaseException as err:  # noqa: BLE001 - raised to the caller by finish_previous()
            pending.error = err
            self._last_error = err
            pending.copied.set()
            import shutil

            shutil.rmtree(pending.tmp, ignore_errors=True)
        finally:
            pending.done.set()

    def close(self) -> None:
        with contextlib.suppress(BaseException):
            self.finish_previous()
        self._mappings.close()


# ------------------------------------------------------------------------------------------------------ reading
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("builtins", "range"),
    ("fabric_core.io.memory", "TensorRef"),
    ("torch", "Size"),
}


class _SafeUnpickler(pickle.Unpickler):
    """Containers, numbers, strings and tensor references only, as ``torch.load(weights_only=True)`` allows."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"The memory snapshot holds a {module}.{name} object, which the safe loader refuses. Load it with"
            " `weights_only=False` if you trust it."
        )


_DTYPE_NAMES = {
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
}


def private_buffer(size: int) -> Any:
    """Writable memory of this process for a snapshot's ``size`` bytes, its pages allocated at once (``MAP_POPULATE``):
    a fresh ``bytearray`` faults each 4 KiB page in as it is written, 0.30-0.33 s to read 512 MiB from shared memory
    here against 0.22 s. Not transparent huge pages: 0.10 s when the kernel has them free, but its direct compaction
    stalled the first one for 1.2 s."""
    if size == 0:
        return bytearray(0)
    try:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0))
    except (AttributeError, OSError, TypeError):  # no anonymous private mappings with flags (Windows)
        return bytearray(size)


def _data_bytes(data: Path, size: int, copy: bool) -> Any:
    """The first ``size`` bytes of ``data``: a private copy-on-write mapping, or (``copy``) a copy in this process."""
    with open(data, "rb") as f:
        store.check_data_size(f.fileno(), size, data)
        if not copy:
            return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        view = private_buffer(size)
        with memoryview(view) as target:
            got = f.readinto(target)
        if got != size:
            raise store.SnapshotChecksumError(f"{data} ended after {got} of {size} bytes")
        return view


def _tensor_views(buffer: Any, table: list[dict[str, Any]]) -> list[Tensor]:
    """A tensor per entry of ``table``, each with its own storage over its bytes of ``buffer`` (so that a disk file
    written from them holds one storage per tensor, as ``torch.save`` of the live state would)."""
    tensors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for entry in table:
            dtype = getattr(torch, entry["dtype"])
            count = entry["nbytes"] // dtype.itemsize
            if count == 0:
                tensors.append(torch.empty(entry["shape"], dtype=dtype))
                continue
            flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=entry["offset"])
            tensors.append(flat.view(entry["shape"]))
    return tensors


def read_snapshot(
    folder: Path, weights_only: bool = True, check: bool = True, copy: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, manifest)`` of the snapshot in ``folder``; the checksum is verified first (``check``), so a torn or
    corrupted snapshot raises :class:`~fabric_core.io.snapshot_store.SnapshotChecksumError` before anything is
    used. Tensors are read lazily from a private mapping of the data file, or (``copy``) from a copy in this
    process's memory: what a training process restores must, since an optimizer keeps the tensors it is given and a
    pruned snapshot's file is written again by a later snapshot."""
    manifest = store.read_manifest(folder)
    skeleton = (folder / store.SKELETON).read_bytes()
    size = manifest["data_bytes"]
    data = _data_bytes(folder / store.DATA, size, copy) if size else bytearray(0)
    return state_from_parts(manifest, skeleton, data, weights_only, check, where=folder), manifest


def state_from_parts(
    manifest: dict[str, Any], skeleton: bytes, data: Any, weights_only: bool = True, check: bool = True, where: Any = ""
) -> Any:
    """The state a snapshot holds, from its manifest, its pickled skeleton and its data (a buffer of at least
    ``manifest["data_bytes"]`` bytes, which the tensors keep using); the checksum is verified first (``check``),
    over these very bytes."""
    store.check_format(manifest, where)
    size = manifest["data_bytes"]
    if len(data) < size:
        raise store.SnapshotChecksumError(f"{where}: {len(data)} data bytes, the manifest says {size}.")
    if check:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = torch.frombuffer(data, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        snapshot_checksum.check(snapshot_checksum.checksum(raw, size, skeleton), manifest, where)
        del raw
    unpickler = _SafeUnpickler(_BytesReader(skeleton)) if weights_only else None
    tree = unpickler.load() if unpickler is not None else pickle.loads(skeleton)
    tensors = _tensor_views(data, manifest["tensors"])
    _watch(data, manifest["tensors"], tensors)
    return _rebuild(tree, tensors)


# ------------------------------------------------------------------------------------------------------ giving back
try:
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover - every torch this package supports has it
    StorageWeakRef = None  # type: ignore[assignment,misc]

#: Restored buffers (weakly) and, per tensor, its byte range and a weak reference to its storage.
_WATCHED: list[tuple[weakref.ReferenceType, list[tuple[int, int, Any]]]] = []


def _watch(buffer: Any, table: list[dict[str, Any]], tensors: list[Tensor]) -> None:
    _WATCHED[:] = [(ref, ranges) for ref, ranges in _WATCHED if ref() is not None]  # buffers gone since
    if isinstance(buffer, mmap.mmap) and StorageWeakRef is not None:
        ranges = [(e["offset"], e["nbytes"], StorageWeakRef(t.untyped_storage())) for e, t in zip(table, tensors) if e["nbytes"]]
        _WATCHED.append((weakref.ref(buffer), ranges))


def release_unused() -> int:
    """Give back the memory of restored tensors that nobody holds any more; returns the bytes given back. Call it once
    a restored state has been loaded into the live objects.

    A restored snapshot is one private buffer (one read, one checksum pass) that every tensor of the state views. A
    module's values are copied into its parameters, so their views die at once, but an optimizer keeps the views of its
    states, and the buffer lived on whole while any view did: a third of an AdamW state per rank, for the whole run. The
    pages wholly inside the bytes of a tensor whose storage is gone are given back (``MADV_DONTNEED``); a storage still
    held anywhere, even by a view of a view, keeps its bytes."""
    given = 0
    still: list[tuple[weakref.ReferenceType, list[tuple[int, int, Any]]]] = []
    for ref, ranges in _WATCHED:
        buffer = ref()
        if buffer is None or buffer.closed:
            continue
        held = []
        for offset, nbytes, storage in ranges:
            if not storage.expired():
                held.append((offset, nbytes, storage))
                continue
            start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
            end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                buffer.madvise(mmap.MADV_DONTNEED, start, end - start)
                given += end - start
        if held:
            still.append((ref, held))
    _WATCHED[:] = still
    return given


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        import io

        self._io = io.BytesIO(data)
        self.read = self._io.read
        self.readline = self._io.readline
        self.readinto = self._io.readinto


def write_file(folder: Path, target: Any, storage_options: Any = None) -> None:
    """Write the snapshot in ``folder`` as a single-file checkpoint at ``target`` (a local path or URL), whole or not
    at all, durable when this returns (the keeper's disk tier; :func:`fabric_core.io.commit.save_file`)."""
    from fabric_core.io.commit import atomic_save
    from fabric_core.io.location import CheckpointLocation
    from fabric_core.io.remote import save as remote_save

    state, _ = read_snapshot(folder, weights_only=False)
    location = CheckpointLocation.of(target)
    if location.is_url:
        remote_save(state, location.url, storage_options)
    else:
        atomic_save(state, location.path)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
