"""TorchCheckpointIO: round trips, crash safety of saves, and safe-by-default loads, on real files."""

from __future__ import annotations

import os
import pickle
import stat
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from fabric_core.io import CheckpointIO, TorchCheckpointIO, atomic_save
from fabric_core.io import checkpoint_io as checkpoint_io_module


class Exploding:
    """Pickling it fails, like an object holding a lock or a socket in the middle of a checkpoint."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self):
        raise self.exc


class CustomState:
    """An arbitrary class: the safe unpickler must refuse to rebuild it."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CustomState) and other.value == self.value


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


def _state() -> dict:
    return {
        "model": {"weight": torch.randn(4, 3), "bias": torch.arange(3, dtype=torch.float64)},
        "step": 7,
        "lr": [0.1, 0.01],
        "name": "run",
    }


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_checkpoint_io_is_abstract():
    with pytest.raises(TypeError):
        CheckpointIO()  # type: ignore[abstract]
    assert TorchCheckpointIO().teardown() is None


def test_round_trip_creates_parent_dirs(tmp_path):
    io = TorchCheckpointIO()
    path = tmp_path / "a" / "b" / "ckpt.pt"
    state = _state()
    io.save_checkpoint(state, path)
    assert path.is_file()
    _assert_same(io.load_checkpoint(path), state)
    _assert_same(io.load_checkpoint(str(path)), state)  # str paths too
    assert _leftovers(path.parent) == []


def test_overwrite_replaces_content(tmp_path):
    io = TorchCheckpointIO()
    path = tmp_path / "ckpt.pt"
    io.save_checkpoint({"v": torch.tensor(1)}, path)
    io.save_checkpoint({"v": torch.tensor(2)}, path)
    assert io.load_checkpoint(path)["v"].item() == 2
    assert _leftovers(tmp_path) == []


def test_saved_file_is_a_plain_torch_file(tmp_path):
    """Other tools must be able to read our checkpoints with torch.load alone."""
    path = tmp_path / "ckpt.pt"
    state = _state()
    TorchCheckpointIO().save_checkpoint(state, path)
    _assert_same(torch.load(path, weights_only=True), state)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")
def test_saved_file_has_umask_permissions_not_tempfile_0600(tmp_path):
    path = tmp_path / "ckpt.pt"
    TorchCheckpointIO().save_checkpoint({"x": 1}, path)
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("cannot pickle this"), KeyboardInterrupt()],
    ids=["error", "keyboard-interrupt"],
)
def test_interrupted_save_keeps_previous_checkpoint(tmp_path, exc):
    io = TorchCheckpointIO()
    path = tmp_path / "ckpt.pt"
    io.save_checkpoint({"weights": torch.randn(1000), "step": 1}, path)
    before = path.read_bytes()

    # The big tensor comes first, so the failure happens after part of the state was already serialised.
    doomed = {"weights": torch.randn(100_000), "bad": Exploding(exc), "step": 2}
    with pytest.raises(type(exc)):
        io.save_checkpoint(doomed, path)

    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []
    assert io.load_checkpoint(path)["step"] == 1


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_failure_after_full_write_keeps_previous_checkpoint(tmp_path, monkeypatch, failing):
    """Errors after the payload is written (EIO on fsync, rename failure) must not leak the temp file."""
    io = TorchCheckpointIO()
    path = tmp_path / "ckpt.pt"
    io.save_checkpoint({"step": 1}, path)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint_io_module.os, failing, boom)
    with pytest.raises(OSError, match="Input/output"):
        io.save_checkpoint({"step": 2, "w": torch.randn(10_000)}, path)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_temp_file_is_fsynced_in_target_folder_then_renamed(tmp_path, monkeypatch):
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}") if sys.platform == "linux" else None))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_io_module.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint_io_module.os, "replace", replace)
    path = tmp_path / "sub" / "ckpt.pt"
    TorchCheckpointIO().save_checkpoint({"x": torch.ones(2)}, path)

    kinds = [e[0] for e in events]
    assert kinds[:2] == ["fsync", "replace"], "data must be on disk before the rename"
    _, src, dst = events[1]
    assert src.parent == path.parent and src.name.startswith(".ckpt.pt.tmp-")
    assert dst == path
    if sys.platform == "linux":
        assert events[0][1] is False  # the file itself ...
        assert events[2:] == [("fsync", True)]  # ... then the directory holding the new entry


def test_save_streams_to_disk_without_in_memory_copy(tmp_path):
    """A buffer-first save (BytesIO, pickle.dumps, ...) would allocate the whole 64 MiB payload in Python memory."""
    size = 64 * 2**20
    tensor = torch.ones(size // 4, dtype=torch.float32)  # torch's allocator is invisible to tracemalloc
    path = tmp_path / "big.pt"
    tracemalloc.start()
    try:
        TorchCheckpointIO().save_checkpoint({"t": tensor}, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert path.stat().st_size >= size
    assert peak < size // 8, f"peak Python allocation during save was {peak / 2**20:.1f} MiB"
    assert torch.equal(TorchCheckpointIO().load_checkpoint(path, mmap=True)["t"], tensor)


def test_mmap_load_matches_saved_tensors(tmp_path):
    io = TorchCheckpointIO()
    path = tmp_path / "ckpt.pt"
    state = _state()
    io.save_checkpoint(state, path)
    loaded = io.load_checkpoint(path, mmap=True)
    _assert_same(loaded, state)


def test_mmapped_tensors_survive_overwrite(tmp_path):
    """Atomic replace swaps the directory entry, so a mapping of the old file keeps seeing the old data."""
    io = TorchCheckpointIO()
    path = tmp_path / "ckpt.pt"
    old = torch.arange(1000, dtype=torch.float32)
    io.save_checkpoint({"t": old}, path)
    mapped = io.load_checkpoint(path, mmap=True)["t"]
    io.save_checkpoint({"t": torch.zeros(1000)}, path)
    assert torch.equal(mapped, old)
    assert torch.count_nonzero(io.load_checkpoint(path)["t"]) == 0


def test_mmap_of_a_legacy_format_file_reads_it_normally(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"t": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(TorchCheckpointIO().load_checkpoint(path, mmap=True)["t"], torch.ones(2))


def test_load_is_safe_by_default(tmp_path):
    io = TorchCheckpointIO()
    path = tmp_path / "ckpt.pt"
    io.save_checkpoint({"obj": CustomState(3), "t": torch.ones(1)}, path)

    with pytest.raises(pickle.UnpicklingError) as info:
        io.load_checkpoint(path)
    message = str(info.value)
    assert "arbitrary Python objects" in message
    assert "weights_only=False" in message
    assert "fabric.load(path, weights_only=False)" in message
    assert "torch.serialization.add_safe_globals" in message
    assert "CustomState" in message  # torch's own detail names the offending class

    with pytest.raises(pickle.UnpicklingError):
        io.load_checkpoint(path, weights_only=True)

    loaded = io.load_checkpoint(path, weights_only=False)
    assert loaded["obj"] == CustomState(3)


def test_safe_load_honours_allowlist(tmp_path):
    io = TorchCheckpointIO()
    path = tmp_path / "ckpt.pt"
    io.save_checkpoint({"obj": CustomState(5)}, path)
    with torch.serialization.safe_globals([CustomState]):
        assert io.load_checkpoint(path)["obj"] == CustomState(5)


def test_load_map_location_forwarded(tmp_path):
    io = TorchCheckpointIO()
    path = tmp_path / "ckpt.pt"
    io.save_checkpoint({"t": torch.ones(2)}, path)
    assert io.load_checkpoint(path, map_location=torch.device("cpu"))["t"].device.type == "cpu"
    assert io.load_checkpoint(path, map_location=None)["t"].device.type == "cpu"


def test_missing_file(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: ") as info:
        TorchCheckpointIO().load_checkpoint(path)
    assert str(path) in str(info.value)


def test_directory_load_explains_sharded_checkpoint(tmp_path):
    folder = tmp_path / "sharded.ckpt"
    folder.mkdir()
    (folder / "meta.pt").write_bytes(b"")
    with pytest.raises(IsADirectoryError, match="directory.*sharded"):
        TorchCheckpointIO().load_checkpoint(folder)


def test_save_onto_directory_fails_early(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with pytest.raises(IsADirectoryError):
        TorchCheckpointIO().save_checkpoint({"x": 1}, folder)
    assert list(folder.iterdir()) == [] and _leftovers(tmp_path) == []


def test_storage_options_rejected(tmp_path):
    path = tmp_path / "ckpt.pt"
    with pytest.raises(TypeError, match="with `storage_options` arg is not supported for `TorchCheckpointIO`"):
        TorchCheckpointIO().save_checkpoint({"x": 1}, path, storage_options={"anon": True})
    assert not path.exists()


def test_remove_checkpoint(tmp_path):
    io = TorchCheckpointIO()
    file_path = tmp_path / "ckpt.pt"
    io.save_checkpoint({"x": 1}, file_path)
    io.remove_checkpoint(file_path)
    assert not file_path.exists()

    folder = tmp_path / "sharded"
    (folder / "nested").mkdir(parents=True)
    (folder / "nested" / "shard0.distcp").write_bytes(b"x")
    (folder / "meta.pt").write_bytes(b"y")
    io.remove_checkpoint(str(folder))
    assert not folder.exists()

    io.remove_checkpoint(tmp_path / "never-existed")  # no error


def test_atomic_save_helper(tmp_path):
    path = tmp_path / "x" / "obj.pt"
    atomic_save({"a": torch.ones(3), "b": (1, 2)}, path)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["a"], torch.ones(3)) and loaded["b"] == (1, 2)
    assert _leftovers(path.parent) == []


def test_large_saves_start_writeback_while_serialising(tmp_path, monkeypatch):
    """Disk writeback is started every few MiB (sync_file_range), so the final fsync only waits for the tail."""
    from fabric_core.io import commit

    real = commit._load_sync_file_range()
    if real is None:
        pytest.skip("sync_file_range is Linux-only; elsewhere the save relies on the final fsync alone")
    calls: list[tuple[int, int]] = []

    def recording(fd, offset, nbytes, flags):
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(commit, "_load_sync_file_range", lambda: recording)
    state = {"w": torch.arange((40 << 20) // 4, dtype=torch.float32)}  # 40 MiB
    target = tmp_path / "big.pt"
    commit.atomic_save(state, target)

    assert len(calls) >= 4  # 40 MiB in 8 MiB chunks
    offsets = [offset for offset, _ in calls]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(offset + nbytes == nxt for (offset, nbytes), nxt in zip(calls, offsets[1:]))  # contiguous ranges
    assert torch.equal(torch.load(target)["w"], state["w"])

    # Durable in the background (what `fabric.save` does): the caller serialises and renames; the fsync comes later.
    calls.clear()
    handle = commit.atomic_save(state, tmp_path / "bg.pt", durable_in_background=True)
    assert (tmp_path / "bg.pt").is_file()  # in place at return, before the fsync
    handle.wait()
    assert calls == []
    assert torch.equal(torch.load(tmp_path / "bg.pt")["w"], state["w"]) and _leftovers(tmp_path) == []


class FolderCheckpointIO(CheckpointIO):
    """A user's CheckpointIO that writes a folder: one file per top-level key (as some storage layouts do)."""

    def __init__(self) -> None:
        self.loads = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        os.makedirs(path, exist_ok=True)
        for key, value in checkpoint.items():
            torch.save(value, os.path.join(path, f"{key}.pt"))

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        self.loads += 1
        return {name[:-3]: torch.load(os.path.join(path, name), weights_only=False) for name in os.listdir(path)}

    def remove_checkpoint(self, path):
        pass


def test_a_checkpoint_io_that_writes_a_folder_round_trips_through_fabric(tmp_path):
    """``fabric.load`` asks the user's CheckpointIO before refusing a directory (as the reference does)."""
    from fabric_core import Fabric

    io = FolderCheckpointIO()
    fabric = Fabric(accelerator="cpu", plugins=[io])
    model = fabric.setup(torch.nn.Linear(3, 2))
    fabric.save(tmp_path / "ckpt", {"model": model, "step": 7})
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model.pt", "step.pt"]
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = fabric.setup(torch.nn.Linear(3, 2))
    state = {"model": fresh, "step": 0}
    assert fabric.load(tmp_path / "ckpt", state) == {}
    assert io.loads == 1 and state["step"] == 7
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


def test_our_own_checkpoint_io_still_refuses_a_folder_it_did_not_write(tmp_path):
    from fabric_core import Fabric

    (tmp_path / "folder").mkdir()
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(ValueError, match="It is a directory, but no installed plugin recognises it"):
        fabric.load(tmp_path / "folder", {"model": fabric.setup(torch.nn.Linear(3, 2))})


@pytest.mark.parametrize(
    ("value", "kind"), [(lambda x: x, "function"), ((i for i in range(3)), "generator")], ids=["lambda", "generator"]
)
def test_saving_a_value_that_cannot_be_pickled_names_its_key(tmp_path, value, kind):
    """Not torch's pickler message eight frames deep: the key, and what to do."""
    from fabric_core import Fabric

    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(torch.nn.Linear(2, 2))
    fabric.save(tmp_path / "ckpt", {"model": model, "step": 1})
    before = (tmp_path / "ckpt").read_bytes()
    with pytest.raises(TypeError, match=rf"cannot save state\['config'\]\['fn'\]: it is a {kind} .*cannot be pickled"):
        fabric.save(tmp_path / "ckpt", {"model": model, "config": {"lr": 0.1, "fn": value}})
    assert (tmp_path / "ckpt").read_bytes() == before  # the previous checkpoint is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # and no temporary file is left
