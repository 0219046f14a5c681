"""Resuming: the newest complete checkpoint of a series (local, memory://, S3) and every rank's random generators.

The 2-process job that is SIGKILLed, restarted and resumed is in tests/plugins/test_resume_after_kill.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fabric_core import Fabric
from fabric_core.io.location import CheckpointLocation
from fabric_core.io.remote import COMMIT_MARKER
from fabric_core.runtime.resume import (
    RandomStates,
    checkpoint_key,
    find_latest_checkpoint,
    resized_seed,
    seed_generators,
)


def _fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")


def test_the_newest_member_by_number_and_only_complete_visible_members(tmp_path: Path):
    for name in ("step-2.ckpt", "step-10.ckpt", "step-9.ckpt", "other-99.ckpt", "step-x.ckpt", "step-11.ckpt.bak"):
        _touch(tmp_path / name)
    _touch(tmp_path / ".step-11.ckpt.tmp-host-123-abc")  # a save in progress
    _touch(tmp_path / ".step-12.ckpt.old-host-9-def")  # what a prune is deleting
    for series in (tmp_path / "step-*.ckpt", str(tmp_path / "step-2.ckpt"), f"file://{tmp_path}/step-*.ckpt"):
        assert find_latest_checkpoint(series) == CheckpointLocation.of(tmp_path / "step-10.ckpt")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "epoch-3").mkdir()  # a sharded checkpoint is a folder
    _touch(tmp_path / "folder" / "epoch-3" / "shard")
    _touch(tmp_path / "folder" / "epoch-12")
    assert find_latest_checkpoint(tmp_path / "folder" / "epoch-*").name == "epoch-12"
    assert find_latest_checkpoint(tmp_path / "nothing-yet" / "step-*.ckpt") is None


def test_several_numbers_order_lexicographically_by_value(tmp_path: Path):
    for name in ("e2-s100.pt", "e10-s5.pt", "e10-s40.pt", "e9-s900.pt"):
        _touch(tmp_path / name)
    assert find_latest_checkpoint(tmp_path / "e*-s*.pt").name == "e10-s40.pt"


def test_a_series_needs_a_number(tmp_path: Path):
    with pytest.raises(ValueError, match=r"names no series: give the checkpoints' name with `\*`"):
        find_latest_checkpoint(tmp_path / "last.ckpt")
    with pytest.raises(ValueError, match="names no series"):
        _fabric().latest_checkpoint(tmp_path / "last.ckpt")


def test_fabric_saves_with_keep_last_and_finds_the_newest(tmp_path: Path):
    fabric = _fabric()
    model = torch.nn.Linear(2, 2)
    assert fabric.latest_checkpoint(tmp_path / "step-*.ckpt") is None
    for step in (5, 10, 15):
        fabric.save(tmp_path / f"step-{step}.ckpt", {"model": model, "step": step}, keep_last=2)
    latest = fabric.latest_checkpoint(tmp_path / "step-*.ckpt")
    assert latest == str(tmp_path / "step-15.ckpt")
    assert fabric.load(latest)["step"] == 15


def _remote_series(fabric: Fabric, base: str) -> None:
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        fabric.save(f"{base}/step-{step}.ckpt", {"model": model, "step": step}, keep_last=2)
    assert fabric.latest_checkpoint(f"{base}/step-*.ckpt") == f"{base}/step-3.ckpt"
    # A sharded save to an object store that was killed before its commit marker: a folder without it.
    unfinished = CheckpointLocation.of(f"{base}/step-9.ckpt")
    with unfinished.child("v1", "shard-0").open("wb") as f:
        f.write(b"partial")
    assert fabric.latest_checkpoint(f"{base}/step-*.ckpt") == f"{base}/step-3.ckpt"
    with unfinished.child(COMMIT_MARKER).open("wb") as f:
        f.write(b"v1")
    assert fabric.latest_checkpoint(f"{base}/step-*.ckpt") == f"{base}/step-9.ckpt"


def test_a_series_at_a_memory_url():
    import uuid

    _remote_series(_fabric(), f"memory://resume-{uuid.uuid4().hex[:8]}")


def test_a_series_on_an_s3_server():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import s3_server

    server, endpoint = s3_server.start()
    try:
        s3_server.create_bucket(endpoint, "resume")
        s3_server.configure_this_process(endpoint)
        _remote_series(_fabric(), "s3://resume/run")
    finally:
        server.stop()


def _draws() -> tuple:
    import numpy

    return random.random(), random.gauss(0, 1), numpy.random.rand(), torch.rand(3).tolist()


def test_random_states_round_trip_through_a_checkpoint(tmp_path: Path):
    fabric = _fabric()
    fabric.seed_everything(7)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    fabric.save(tmp_path / "rng.ckpt", {"rng": RandomStates(fabric)})
    expected = _draws()
    fabric.seed_everything(99)  # anything else
    fabric.load(tmp_path / "rng.ckpt", {"rng": RandomStates(fabric)})  # the safe (weights_only) loader reads it
    assert _draws() == expected


def test_random_states_of_another_world_size_seed_every_generator_from_the_checkpoint_and_the_data_parallel_rank():
    """An elastic resume on another number of ranks: no saved generator is meant for this rank, so every generator is
    seeded from the checkpoint and the data-parallel rank (reproducible, different per rank and per checkpoint)."""
    fabric = _fabric()
    fabric.seed_everything(5)
    saved = RandomStates(fabric).state_dict()
    assert saved["data_parallel_size"] == 1 and saved["ranks"]["data_parallel_rank"].tolist() == [0]
    two = {"world_size": 2, "data_parallel_size": 2, "ranks": {k: torch.cat([v, v]) for k, v in saved["ranks"].items()}}
    fabric.seed_everything(1)
    RandomStates(fabric).load_state_dict(two)
    first = _draws()
    fabric.seed_everything(2)
    RandomStates(fabric).load_state_dict(two)
    assert _draws() == first, "the same checkpoint seeds alike"
    key = checkpoint_key({k: v for k, v in two["ranks"].items() if k != "data_parallel_rank"})
    seed_generators(resized_seed(key, 0))  # this process is data-parallel rank 0
    assert _draws() == first, "the documented mapping"
    assert resized_seed(key, 0) != resized_seed(key, 1)
    other = {**two, "ranks": {**two["ranks"], "torch": torch.stack([torch.get_rng_state()] * 2)}}
    RandomStates(fabric).load_state_dict(other)
    assert _draws() != first, "another checkpoint, other numbers"


def test_resuming_a_loader_mid_epoch_draws_no_random_number_of_the_run(tmp_path: Path):
    """A DataLoader draws a seed from torch's generator when an epoch's iterator is made; continuing a loaded epoch
    must not, or every random number after it differs from the run that never stopped."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    fabric = _fabric()
    dataset = torch.utils.data.TensorDataset(torch.arange(12.0))

    def make_loader():
        return fabric.setup_dataloaders(stateful.StatefulDataLoader(dataset, batch_size=2, shuffle=True))

    fabric.seed_everything(3)
    loader = make_loader()
    batches = iter(loader)
    seen = [next(batches)[0].tolist() for _ in range(2)]
    fabric.save(tmp_path / "mid.ckpt", {"loader": loader, "rng": RandomStates(fabric)})
    expected_batch, expected_random = next(batches)[0].tolist(), torch.rand(2).tolist()

    fabric.seed_everything(3)
    resumed = make_loader()
    fabric.load(tmp_path / "mid.ckpt", {"loader": resumed, "rng": RandomStates(fabric)})
    batch = next(iter(resumed))[0].tolist()
    assert batch == expected_batch and batch not in seen
    assert torch.rand(2).tolist() == expected_random
