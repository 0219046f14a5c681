"""Data under DDP on 2 real gloo ranks: shards that partition every epoch, and mid-epoch resume of a stateful loader.

The ranks run ``scripts/data_checks.py``: once uninterrupted (writing loader checkpoints at batch 4 of epochs 0
and 1 along the way), then in fresh processes that load each checkpoint into a new loader and finish. Global RNGs
differ between the ranks and between the two runs, as in a run whose user seeds nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from jobs import run_ranks

pytest.importorskip("torchdata.stateful_dataloader", reason="`make setup` installs torchdata")

SCRIPT = Path(__file__).parent / "scripts" / "data_checks.py"
N, SAVE_AT, EPOCHS = 40, 4, 3  # as in the script

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")]


def _results(outdir: Path, mode: str, workers: int) -> list[dict]:
    return [json.loads((outdir / f"{mode}_w{workers}_rank{rank}.json").read_text()) for rank in (0, 1)]


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _assert_partition(first: list[int], second: list[int]) -> None:
    assert not set(first) & set(second), "a sample reached both ranks"
    assert sorted(first + second) == list(range(N)), "a sample reached no rank (or one twice)"


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_shards_and_resumes_batch_exact(tmp_path: Path, workers: int):
    run_ranks(SCRIPT, str(tmp_path), "run", str(workers), timeout=240, tmp_path=tmp_path)
    r0, r1 = _results(tmp_path, "run", workers)

    # StatefulDataLoader(shuffle=True): torchdata's own RandomSampler, wrapped in the global order (its output ordered
    # and cut into the ranks' shares); every epoch is split exactly.
    assert r0["sampler"] == r1["sampler"] == "GlobalOrderSampler"
    for epoch in range(EPOCHS):
        _assert_partition(_flat(r0["epochs"][epoch]), _flat(r1["epochs"][epoch]))
    assert _flat(r0["epochs"][0]) != _flat(r0["epochs"][1])  # reshuffled per epoch
    # Also samplers with a generator left at None and without any generator (global RNG draws).
    _assert_partition(r0["weighted"][0], r1["weighted"][0])
    for epoch in range(2):
        _assert_partition(r0["global_rng"][epoch], r1["global_rng"][epoch])
    assert r0["global_rng"][0] != r0["global_rng"][1]

    # An IterableDataset is not split: both ranks see all of it, and rank 0 alone says so.
    assert r0["stream"] == r1["stream"] == list(range(6))
    assert len(r0["stream_warnings"]) == 1 and r1["stream_warnings"] == []
    warning = r0["stream_warnings"][0]
    assert warning.startswith("PossibleUserWarning: Your `Stream` is an `IterableDataset`")
    assert "each of the 2 processes iterates all of it" in warning
    assert "`fabric.global_rank` and `fabric.world_size`" in warning
    # A dataset that shards itself and carries the world size gets no warning.
    assert r0["sharded_stream"] == [0, 2, 4] and r1["sharded_stream"] == [1, 3, 5]
    assert r0["sharded_stream_warnings"] == r1["sharded_stream_warnings"] == []

    run_ranks(SCRIPT, str(tmp_path), "resume", str(workers), timeout=240, tmp_path=tmp_path)
    for run, resumed in zip((r0, r1), _results(tmp_path, "resume", workers)):
        assert resumed["rank"] == run["rank"]
        for saved_epoch in (0, 1):
            uninterrupted = [run["epochs"][saved_epoch][SAVE_AT:], *run["epochs"][saved_epoch + 1 :]]
            assert resumed[f"from_e{saved_epoch}"] == uninterrupted, f"rank {run['rank']}, saved in epoch {saved_epoch}"
