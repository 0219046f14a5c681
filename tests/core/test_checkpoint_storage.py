"""Where the loop does not wait: durability in the background, asynchronous saves, remote storage, retention."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric_core import Fabric
from fabric_core.io import background
from fabric_core.io.background import BackgroundSaveError


@pytest.fixture
def fabric():
    return Fabric(accelerator="cpu", devices=1)


def _model(fabric, seed=0):
    torch.manual_seed(seed)
    module = nn.Linear(8, 4)
    return fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))


# ------------------------------------------------------------------------------------------------ sync saves
def test_a_save_is_durable_and_in_place_when_its_handle_is_done(fabric, tmp_path):
    model, optimizer = _model(fabric)
    handle = fabric.save(tmp_path / "a.ckpt", {"model": model, "step": 1})
    handle.wait()
    assert handle.done() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["step"] == 1


def test_the_checkpoint_is_in_place_when_save_returns(fabric, tmp_path):
    """At return the file is at `path`: other tools can read, copy or delete it, and its folder can be removed
    (a TemporaryDirectory cleaned up right after a save); the fsync that follows never touches the path."""
    model, _ = _model(fabric)
    with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
        target = Path(folder) / "a.ckpt"
        fabric.save(target, {"model": model, "step": 1})
        assert target.is_file() and torch.load(target, weights_only=True)["step"] == 1
        assert [p.name for p in Path(folder).iterdir()] == ["a.ckpt"]
    background.wait_all()  # the background fsync of the removed file raised nothing
    assert not Path(folder).exists()


def test_no_thread_of_ours_outlives_wait(fabric, tmp_path):
    def ours():
        return [t for t in threading.enumerate() if t.name == background.THREAD_NAME]

    model, _ = _model(fabric)
    fabric.save(tmp_path / "a.ckpt", {"model": model}).wait()
    assert ours() == []
    fabric.save(tmp_path / "b.ckpt", {"model": model}, async_save=True).wait()
    assert ours() == []
    fabric.save(tmp_path / "c.ckpt", {"model": model}, keep_last=None)
    fabric.strategy.teardown()  # waits for what is still in the background
    assert ours() == []


def test_load_and_a_new_save_of_the_path_wait_for_the_commit(fabric, tmp_path):
    model, _ = _model(fabric)
    for step in range(5):
        fabric.save(tmp_path / "a.ckpt", {"model": model, "step": step})
        assert fabric.load(tmp_path / "a.ckpt")["step"] == step  # never the previous one


def test_interpreter_exit_waits_for_the_commit(tmp_path):
    code = textwrap.dedent(
        f"""
        import torch
        from fabric_core import Fabric
        Fabric(accelerator="cpu", devices=1).save({str(tmp_path / "x.ckpt")!r}, {{"w": torch.ones(4 * 1024 * 1024), "step": 9}})
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert torch.load(tmp_path / "x.ckpt", weights_only=True)["step"] == 9
    assert [p.name for p in tmp_path.iterdir()] == ["x.ckpt"]


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot be saved")

    def __deepcopy__(self, memo):
        return self


def test_an_error_in_the_background_is_raised_by_the_next_call_never_lost(fabric, tmp_path):
    model, _ = _model(fabric)
    fabric.save(tmp_path / "ok.ckpt", {"model": model, "step": 1}).wait()
    handle = fabric.save(tmp_path / "bad.ckpt", {"model": model, "thing": Unpicklable()}, async_save=True)
    with pytest.raises(BackgroundSaveError, match="bad.ckpt.*failed in the background.*cannot be saved"):
        handle.wait()
    handle = fabric.save(tmp_path / "bad.ckpt", {"model": model, "thing": Unpicklable()}, async_save=True)
    handle._future.exception()  # let it fail without asking the handle
    with pytest.raises(BackgroundSaveError, match="previous checkpoint at that path, if any, is intact"):
        fabric.save(tmp_path / "other.ckpt", {"step": 2})  # the next call reports it
    assert not (tmp_path / "bad.ckpt").exists() and fabric.load(tmp_path / "ok.ckpt")["step"] == 1


# ------------------------------------------------------------------------------------------------ async saves
def test_async_save_writes_the_state_as_it_was_at_the_call(fabric, tmp_path):
    model, optimizer = _model(fabric)
    fabric.backward(model(torch.randn(3, 8)).sum())
    optimizer.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    lr = optimizer.param_groups[0]["lr"]
    handle = fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": optimizer, "meta": {"tags": ["x"]}}, async_save=True)
    with torch.no_grad():
        model.weight.mul_(0).add_(7)  # training changes everything right away
    optimizer.param_groups[0]["lr"] = 123.0
    handle.wait()
    raw = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert all(torch.equal(raw["model"][k], v) for k, v in expected.items())
    assert raw["optimizer"]["param_groups"][0]["lr"] == lr and raw["meta"] == {"tags": ["x"]}


def test_async_snapshots_reuse_their_buffers_and_keep_shared_tensors_shared(fabric, tmp_path):
    shared = torch.randn(1000)
    first = fabric.save(tmp_path / "a.ckpt", {"a": shared, "b": shared}, async_save=True)
    first.wait()
    buffers = list(fabric.strategy._snapshot_buffers._buffers)
    assert len(buffers) == 1  # one copy for the tensor that appears twice
    fabric.save(tmp_path / "a.ckpt", {"a": shared, "b": shared}, async_save=True).wait()
    assert fabric.strategy._snapshot_buffers._buffers[0] is buffers[0]  # reused, not reallocated
    raw = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert raw["a"].untyped_storage().data_ptr() == raw["b"].untyped_storage().data_ptr()


# ------------------------------------------------------------------------------------------------ retention
def test_keep_last_keeps_the_newest_of_the_series(fabric, tmp_path):
    for step in (5, 10, 50, 100, 1000):
        fabric.save(tmp_path / f"step-{step}.ckpt", {"step": step}, keep_last=2)
    fabric.save(tmp_path / "other.ckpt", {"step": 0}).wait()
    background.wait_all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.ckpt", "step-100.ckpt", "step-1000.ckpt"]


def test_keep_last_removes_what_a_killed_prune_set_aside(fabric, tmp_path):
    for step in (1, 2):
        fabric.save(tmp_path / f"epoch-{step}.ckpt", {"step": step}).wait()
    aside = tmp_path / ".epoch-0.ckpt.old-host-999999999-dead"  # a prune killed between rename and delete
    aside.write_bytes(b"x")
    fabric.save(tmp_path / "epoch-3.ckpt", {"step": 3}, keep_last=2).wait()
    background.wait_all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-2.ckpt", "epoch-3.ckpt"]


# ------------------------------------------------------------------------------------------------ remote
@pytest.fixture
def s3(monkeypatch):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import s3_server

    server, endpoint = s3_server.start()
    s3_server.create_bucket(endpoint, "bucket")
    for key, value in s3_server.client_env(endpoint).items():
        monkeypatch.setenv(key, value)
    s3_server.configure_this_process(endpoint)
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.mark.parametrize("base", ["s3://bucket/run", "memory://bucket/run"], ids=["s3", "memory"])
def test_save_load_and_load_raw_at_a_url(fabric, base, request):
    if base.startswith("s3"):
        request.getfixturevalue("s3")
    model, optimizer = _model(fabric)
    fabric.save(f"{base}/last.ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    other, other_optimizer = _model(fabric, seed=1)
    remainder = fabric.load(f"{base}/last.ckpt", {"model": other, "optimizer": other_optimizer})
    assert remainder == {"step": 3} and torch.equal(other.weight, model.weight)
    from fabric_core.io import remote

    remote.save(model.state_dict(), f"{base}/raw.pt")
    raw_target = nn.Linear(8, 4)
    fabric.load_raw(f"{base}/raw.pt", raw_target)
    assert torch.equal(raw_target.weight, model.weight)
    handle = fabric.save(f"{base}/async.ckpt", {"model": model, "step": 4}, async_save=True)
    handle.wait()
    assert fabric.load(f"{base}/async.ckpt")["step"] == 4
    for step in (1, 2, 3):
        fabric.save(f"{base}/s-{step}.ckpt", {"step": step}, keep_last=1)
    background.wait_all()
    fs, inner = remote.filesystem(f"{base}/s-3.ckpt")
    assert sorted(p.rpartition("/")[2] for p in fs.ls(inner.rpartition("/")[0], detail=False) if "/s-" in p) == ["s-3.ckpt"]


def test_a_missing_checkpoint_at_a_url_is_file_not_found(fabric, s3):
    with pytest.raises(FileNotFoundError, match="s3://bucket/nothing.ckpt"):
        fabric.load("s3://bucket/nothing.ckpt")


def test_a_url_without_its_package_says_what_to_install(fabric):
    pytest.importorskip("fsspec")
    with pytest.raises(ImportError, match="pip install gcsfs"):
        fabric.save("gs://bucket/x.ckpt", {"step": 1})
    assert "fsspec" in sys.modules
