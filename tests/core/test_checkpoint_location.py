"""``CheckpointLocation``: a local path or a URL, decided once; a URL never becomes a local path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fabric_core import Fabric
from fabric_core.io.location import CheckpointLocation, NotALocalPathError


def test_paths_and_urls_are_told_apart_once():
    local = CheckpointLocation.of(Path("ckpts") / "a.ckpt")
    assert not local.is_url and local.path == Path("ckpts/a.ckpt") and os.fspath(local) == "ckpts/a.ckpt"
    assert CheckpointLocation.of("file:///tmp/x.ckpt").path == Path("/tmp/x.ckpt")  # file:// is a local path
    url = CheckpointLocation.of("s3://bucket/run/step-3")
    assert url.is_url and url.scheme == "s3" and url.url == "s3://bucket/run/step-3" and str(url) == url.url
    assert CheckpointLocation.of(url) is url  # a location passes through unchanged


def test_a_url_cannot_be_used_as_a_local_path():
    url = CheckpointLocation.of("s3://bucket/ckpt")
    with pytest.raises(NotALocalPathError, match="is a URL, not a local path"):
        Path(url)
    with pytest.raises(NotALocalPathError, match="'s3://bucket/ckpt' is a URL, not a local path"):
        _ = url.path  # the property raises: no local path to hand out
    with pytest.raises(TypeError):  # NotALocalPathError is a TypeError: os functions refuse it as they should
        os.path.exists(url)


def test_names_parents_and_children_for_both_kinds():
    for text, parent in (("/data/run/step-3", "/data/run"), ("memory://bucket/run/step-3", "memory://bucket/run")):
        location = CheckpointLocation.of(text)
        assert location.name == "step-3" and str(location.parent) == parent
        assert str(location / "meta.pt") == f"{text}/meta.pt" == str(location.child("meta.pt"))
        assert location.sibling("step-4") == CheckpointLocation.of(f"{parent}/step-4")


def test_file_operations_work_the_same_locally_and_at_a_url(tmp_path):
    pytest.importorskip("fsspec")
    for base in (CheckpointLocation.of(tmp_path / "run"), CheckpointLocation.of("memory://location-test/run")):
        target = base / "folder" / "part.bin"
        with target.open("wb") as file:  # parents are created
            file.write(b"abc")
        assert target.is_file() and target.read_bytes() == b"abc" and (base / "folder").is_dir()
        assert base.child("folder").listdir() == ["part.bin"] and base.child("missing").listdir() == []
        (base / "folder").remove()
        assert not target.exists()


def test_bad_paths_are_typed_errors():
    with pytest.raises(TypeError, match="must be a str, an os.PathLike"):
        CheckpointLocation.of(3)
    with pytest.raises(ValueError, match="empty"):
        CheckpointLocation.of("")


def test_memory_urls_are_refused_when_several_processes_save():
    CheckpointLocation.of("memory://x/ckpt").check_reachable_by(1)
    CheckpointLocation.of("s3://x/ckpt").check_reachable_by(4)
    with pytest.raises(ValueError, match="in-process `memory://` store"):
        CheckpointLocation.of("memory://x/ckpt").check_reachable_by(2)


def test_fabric_hands_the_strategy_a_location(tmp_path):
    seen = []
    fabric = Fabric(accelerator="cpu", devices=1)
    original = fabric.strategy.save_checkpoint
    fabric.strategy.save_checkpoint = lambda path, **kw: (seen.append(path), original(path, **kw))[1]
    fabric.save(str(tmp_path / "a.ckpt"), {"step": 1})
    assert seen == [CheckpointLocation.of(str(tmp_path / "a.ckpt"))] and isinstance(seen[0], CheckpointLocation)
