"""seed_everything / reset_seed / worker_init_function."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch

from fabric_core.utilities import seed as seed_module
from fabric_core.utilities.seed import reset_seed, seed_everything, worker_init_function

np = pytest.importorskip("numpy")


@pytest.fixture(autouse=True)
def clean_seed_env(monkeypatch):
    """Every test starts without seed env vars; monkeypatch restores whatever seed_everything writes."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    yield


def _draw() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def test_same_seed_same_numbers():
    seed_everything(123, verbose=False)
    first = _draw()
    seed_everything(123, verbose=False)
    assert _draw() == first
    seed_everything(124, verbose=False)
    assert _draw() != first


def test_env_vars_set_exactly():
    assert seed_everything(7, verbose=False) == 7
    assert os.environ["PL_GLOBAL_SEED"] == "7"
    assert os.environ["PL_SEED_WORKERS"] == "0"
    seed_everything(8, workers=True, verbose=False)
    assert os.environ["PL_GLOBAL_SEED"] == "8"
    assert os.environ["PL_SEED_WORKERS"] == "1"


def test_none_reads_env(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "2024")
    assert seed_everything(verbose=False) == 2024


def test_none_without_env_falls_back_to_zero_with_warning():
    with pytest.warns(UserWarning, match="No seed found, seed set to 0"):
        assert seed_everything() == 0
    assert os.environ["PL_GLOBAL_SEED"] == "0"


def test_none_without_env_quiet_when_not_verbose(recwarn):
    assert seed_everything(verbose=False) == 0
    assert not [w for w in recwarn if "No seed found" in str(w.message)]


def test_invalid_env_seed(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "invalid")
    with pytest.raises(ValueError, match="Invalid seed specified via PL_GLOBAL_SEED: 'invalid'"):
        seed_everything()


def test_non_int_is_converted():
    assert seed_everything("12", verbose=False) == 12
    assert seed_everything(3.9, verbose=False) == 3
    assert os.environ["PL_GLOBAL_SEED"] == "3"


@pytest.mark.parametrize("bad", [-1, 2**32, 10**20])
def test_out_of_bounds(bad):
    with pytest.raises(ValueError, match=f"{bad} is not in bounds, numpy accepts from 0 to 4294967295"):
        seed_everything(bad)
    assert "PL_GLOBAL_SEED" not in os.environ


@pytest.mark.parametrize("edge", [0, 2**32 - 1])
def test_bounds_are_inclusive(edge):
    assert seed_everything(edge, verbose=False) == edge


def test_logs_seed(caplog):
    with caplog.at_level(logging.INFO, logger="fabric_core"):
        seed_everything(42)
    assert any("Seed set to 42" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fabric_core"):
        seed_everything(42, verbose=False)
    assert not any("Seed set to" in r.getMessage() for r in caplog.records)


def test_reset_seed(monkeypatch):
    seed_everything(99, workers=True, verbose=False)
    first = _draw()
    _draw()
    reset_seed()
    assert _draw() == first
    assert os.environ["PL_SEED_WORKERS"] == "1"


def test_reset_seed_noop_without_env(monkeypatch):
    calls = []
    monkeypatch.setattr(seed_module, "seed_everything", lambda *a, **k: calls.append(a))
    reset_seed()
    assert calls == []
    assert "PL_GLOBAL_SEED" not in os.environ


def _worker_draws(base_seed: int, worker_id: int, rank: int | None) -> tuple:
    torch.manual_seed(base_seed + worker_id)  # what DataLoader does in each worker before worker_init_fn
    worker_init_function(worker_id, rank)
    return _draw()


def test_worker_init_distinct_per_worker_and_rank():
    draws = {(w, r): _worker_draws(1000, w, r) for w in range(4) for r in range(3)}
    for lib in range(3):  # random, numpy and torch each get distinct streams
        values = [repr(d[lib]) for d in draws.values()]
        assert len(set(values)) == len(values)


def test_worker_init_deterministic_and_depends_on_base_seed():
    assert _worker_draws(1000, 1, 0) == _worker_draws(1000, 1, 0)
    assert _worker_draws(1000, 1, 0) != _worker_draws(2000, 1, 0)  # a new epoch draws a new base seed


def test_worker_init_rank_defaults_to_global_rank(monkeypatch):
    monkeypatch.setattr(seed_module, "get_rank", lambda: 2)
    assert _worker_draws(5, 0, None) == _worker_draws(5, 0, 2)
    assert _worker_draws(5, 0, None) != _worker_draws(5, 0, 0)


def test_worker_seeds_without_numpy(monkeypatch):
    """fabric_core must not need numpy; the torch/random seeds are the same with or without it."""
    with_numpy = _worker_draws(77, 1, 0)
    monkeypatch.setattr(seed_module, "_numpy", lambda: None)
    torch.manual_seed(78)
    worker_init_function(1, 0)
    assert (random.random(), torch.rand(3).tolist()) == (with_numpy[0], with_numpy[2])
    assert seed_everything(5, verbose=False) == 5


class _RandomDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return torch.tensor([random.random(), float(np.random.rand()), torch.rand(()).item()])


def test_dataloader_workers_get_distinct_reproducible_streams():
    def run() -> torch.Tensor:
        seed_everything(0, verbose=False)
        loader = torch.utils.data.DataLoader(
            _RandomDataset(), batch_size=1, num_workers=2, worker_init_fn=worker_init_function
        )
        return torch.cat(list(loader))

    first = run()
    # Worker 0 serves items 0 and 2, worker 1 items 1 and 3: their first draws must differ for every library.
    assert (first[0] != first[1]).all()
    assert torch.equal(run(), first)
