"""Data under DDP on real ranks; run by ``test_ddp_data.py`` (started externally by ``jobs.run_ranks``).

    python data_checks.py OUTDIR run WORKERS      # uninterrupted epochs, saving the loader at batch K of epochs 0, 1
    python data_checks.py OUTDIR resume WORKERS   # fresh processes: load each checkpoint into a new loader, finish

Every rank seeds its global torch RNG differently (and differently in ``run`` and ``resume``), so nothing here
relies on the user seeding all ranks alike. Each rank writes ``<mode>_w<WORKERS>_rank<N>.json`` with the
indices of every batch it saw; the test compares them across ranks and between the runs.
"""

from __future__ import annotations

import json
import random
import sys
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, WeightedRandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from fabric_core import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: the scripts' shared helpers
from script_helpers import GlobalRngSampler  # noqa: E402

N = 40  # samples; 20 per rank, 7 batches of 3 (the last one of 2)
BATCH = 3
EPOCHS = 3
SAVE_AT = 4  # batches of the epoch consumed when the checkpoint is written
SAVE_EPOCHS = (0, 1)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(6))


class ShardedStream(IterableDataset):
    """Splits itself by rank and says so with ``world_size`` (the rule in docs/decisions.md, "Data")."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def __iter__(self):
        return iter(range(self.rank, 6, self.world_size))


def make_loader(workers: int) -> StatefulDataLoader:
    return StatefulDataLoader(list(range(N)), batch_size=BATCH, shuffle=True, num_workers=workers)


def one_epoch(loader) -> list[int]:
    return [i for batch in loader for i in batch.tolist()]


def run(fabric: Fabric, out: Path, workers: int) -> dict:
    loader = fabric.setup_dataloaders(make_loader(workers))
    epochs = []
    for epoch in range(EPOCHS):
        batches = []
        for batch in loader:
            batches.append(batch.tolist())
            if epoch in SAVE_EPOCHS and len(batches) == SAVE_AT:
                fabric.save(out / f"loader_w{workers}_e{epoch}.ckpt", {"loader": loader, "epoch": epoch})
        epochs.append(batches)
    result: dict = {"epochs": epochs, "sampler": type(loader.sampler).__name__}

    # Samplers Fabric wraps: one with a generator attribute left at None, one with none at all.
    weighted = DataLoader(list(range(N)), sampler=WeightedRandomSampler([1.0] * N, N, replacement=False), batch_size=4)
    custom = DataLoader(list(range(N)), sampler=GlobalRngSampler(N), batch_size=4)
    result["weighted"] = [one_epoch(fabric.setup_dataloaders(weighted)) for _ in range(1)]
    wrapped = fabric.setup_dataloaders(custom)
    result["global_rng"] = [one_epoch(wrapped), one_epoch(wrapped)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = fabric.setup_dataloaders(DataLoader(Stream(), batch_size=2))
    result["stream"] = one_epoch(stream)
    result["stream_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded = fabric.setup_dataloaders(DataLoader(ShardedStream(fabric.global_rank, fabric.world_size), batch_size=2))
    result["sharded_stream"] = one_epoch(sharded)
    result["sharded_stream_warnings"] = [str(w.message) for w in caught]
    return result


def resume(fabric: Fabric, out: Path, workers: int) -> dict:
    result: dict = {}
    for saved_epoch in SAVE_EPOCHS:
        loader = fabric.setup_dataloaders(make_loader(workers))
        state = {"loader": loader, "epoch": -1}
        fabric.load(out / f"loader_w{workers}_e{saved_epoch}.ckpt", state)
        assert state["epoch"] == saved_epoch, state
        epochs = [[batch.tolist() for batch in loader] for _ in range(saved_epoch, EPOCHS)]
        result[f"from_e{saved_epoch}"] = epochs
    return result


def main() -> None:
    out, mode, workers = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    rank = fabric.global_rank
    # Global RNGs unequal across ranks and across the two runs: a user who seeds nothing, or per rank.
    seed = 1000 * (mode == "resume") + 17 * rank + 3
    torch.manual_seed(seed)
    random.seed(seed)
    result = run(fabric, out, workers) if mode == "run" else resume(fabric, out, workers)
    result["rank"] = rank
    (out / f"{mode}_w{workers}_rank{rank}.json").write_text(json.dumps(result))
    fabric.barrier()


if __name__ == "__main__":
    main()
