"""fabric.load memory-maps single-file checkpoints and still reads torch's legacy format."""

from __future__ import annotations

import pytest
import torch

from fabric_core import Fabric
from fabric_core.plugins import reset_registry


@pytest.fixture(autouse=True)
def core_only(monkeypatch):
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_registry()
    yield
    reset_registry()


def test_load_maps_the_file_instead_of_reading_it(tmp_path, monkeypatch):
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(torch.nn.Linear(4, 4))
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "extra": torch.arange(5)})

    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("mmap"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    fresh = fabric.setup(torch.nn.Linear(4, 4))
    remainder = fabric.load(tmp_path / "ckpt.pt", {"model": fresh})
    assert seen == [True]
    assert torch.equal(remainder["extra"], torch.arange(5))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_legacy_format_checkpoints_still_load(tmp_path):
    fabric = Fabric(accelerator="cpu")
    model = torch.nn.Linear(3, 2)
    torch.save({"model": model.state_dict(), "step": 7}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    fresh = fabric.setup(torch.nn.Linear(3, 2))
    state = {"model": fresh, "step": 0}
    fabric.load(tmp_path / "old.pt", state)
    assert state["step"] == 7
    assert torch.equal(fresh.weight, model.weight)


def test_loaded_tensors_survive_the_checkpoint_being_replaced(tmp_path):
    fabric = Fabric(accelerator="cpu")
    path = tmp_path / "ckpt.pt"
    fabric.save(path, {"t": torch.full((1000,), 3.0)})
    loaded = fabric.load(path)
    fabric.save(path, {"t": torch.zeros(1000)})  # atomic replace: a new file, the mapped one is untouched
    assert torch.equal(loaded["t"], torch.full((1000,), 3.0))
