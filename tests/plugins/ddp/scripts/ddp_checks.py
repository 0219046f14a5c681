"""What every rank of a 2-process DDP job checks; run by ``test_ddp_processes.py``.

    python ddp_checks.py launch OUTDIR     # strategy="ddp", devices=2, fabric.launch() (subprocess launcher)
    python ddp_checks.py spawn OUTDIR      # strategy="ddp_spawn", fabric.launch(fn) returns rank 0's result
    fabric run --devices 2 ddp_checks.py cli OUTDIR
    ... --quick                            # topology + collectives only (for the launch-path tests)

Checks that one rank can judge are asserted here (a failure exits non-zero and fails the test); every rank
also writes ``rank<N>.json`` so the test can compare ranks (e.g. disjoint data shards).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from fabric_core import Fabric
from fabric_core.io.checkpoint_io import TorchCheckpointIO
from fabric_core.utilities.rank_zero import get_rank


class RecordingIO(TorchCheckpointIO):
    """Writes/reads checkpoints normally and notes which rank did it."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.log = log

    def _note(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{what} {get_rank()}\n")

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self._note("save")
        return super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path, *args, **kwargs):
        self._note("load")
        return super().load_checkpoint(path, *args, **kwargs)


class RandomDraws(Dataset):
    """Returns random numbers drawn inside the DataLoader worker: they show how workers were seeded."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([torch.rand(1).item(), random.random()], dtype=torch.float64)


def check_collectives(fabric: Fabric, out: dict) -> None:
    rank, world = fabric.global_rank, fabric.world_size
    value = torch.tensor(float(rank))
    assert fabric.all_reduce(value.clone(), reduce_op="mean").item() == 0.5
    assert fabric.all_reduce(value.clone(), reduce_op="sum").item() == 1.0
    assert fabric.all_reduce(value.clone(), reduce_op="max").item() == 1.0
    assert fabric.all_reduce(value.clone(), reduce_op="min").item() == 0.0
    integer_mean = fabric.all_reduce(torch.tensor([1 + 3 * rank]), reduce_op="mean")  # (1 + 4) / 2
    assert integer_mean.dtype == torch.int64 and integer_mean.tolist() == [2], integer_mean
    reduced = fabric.all_reduce({"a": rank, "b": [torch.tensor(2.0 * rank)]}, reduce_op="sum")
    assert reduced["a"].item() == 1 and reduced["b"][0].item() == 2.0

    gathered = fabric.all_gather(torch.full((3,), float(rank)))
    assert gathered.shape == (world, 3) and gathered[:, 0].tolist() == [0.0, 1.0], gathered
    nested = fabric.all_gather({"x": torch.tensor(rank), "y": [torch.ones(2, 2) * rank]})
    assert nested["x"].tolist() == [0, 1] and nested["y"][0].shape == (2, 2, 2)
    assert nested["y"][0][1].sum().item() == 4.0
    ragged = fabric.all_gather(torch.arange(rank + 1))  # shapes (1,) and (2,)
    assert [t.tolist() for t in ragged] == [[0], [0, 1]], ragged

    received = fabric.broadcast({"from": rank, "items": [1, 2, 3]}, src=0)
    assert received == {"from": 0, "items": [1, 2, 3]}, received

    # barrier: rank 1 arrives late, so rank 0 has to wait for it there.
    if rank == 1:
        time.sleep(0.4)
    start = time.perf_counter()
    fabric.barrier()
    out["barrier_wait_s"] = time.perf_counter() - start

    order_file = Path(out["outdir"]) / "rank_zero_first.txt"
    with fabric.rank_zero_first():
        if rank == 0:
            time.sleep(0.2)  # rank 1 must not get in before rank 0 leaves the block
        with open(order_file, "a") as f:
            f.write(f"{rank}\n")
    fabric.barrier()
    assert order_file.read_text().split() == ["0", "1"], order_file.read_text()


def check_gradients(fabric: Fabric, out: dict) -> None:
    rank = fabric.global_rank
    torch.manual_seed(1234 + rank)  # different initial weights per rank: DDP must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    assert type(model._forward_module).__name__ == "DistributedDataParallel"

    def flat_grads() -> torch.Tensor:
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = fabric.all_gather(params)
    assert torch.equal(gathered[0], gathered[1]), "parameters differ after setup"

    batch = torch.randn(5, 4) + rank  # different data on every rank
    fabric.backward(model(batch).pow(2).mean())
    grads = fabric.all_gather(flat_grads())
    out["grads_equal_after_sync"] = bool(torch.allclose(grads[0], grads[1]))
    assert out["grads_equal_after_sync"], "gradients were not averaged across ranks"
    optimizer.step()
    optimizer.zero_grad()
    params = fabric.all_gather(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(params[0], params[1]), "parameters differ after a synced step"

    with fabric.no_backward_sync(model):
        fabric.backward(model(batch).pow(2).mean())
    local = flat_grads().clone()
    grads = fabric.all_gather(local)
    out["grads_equal_in_no_sync"] = bool(torch.allclose(grads[0], grads[1]))
    assert not out["grads_equal_in_no_sync"], "no_backward_sync still synchronised the gradients"
    # The next synced backward adds the (averaged) new gradients and averages the accumulated ones too.
    fabric.backward(model(batch).pow(2).mean())
    grads = fabric.all_gather(flat_grads())
    assert torch.allclose(grads[0], grads[1]), "gradients differ after leaving no_backward_sync"
    optimizer.zero_grad()

    # Checkpoint: written once by rank 0, readable by everyone, no DDP `module.` prefix.
    path = Path(out["outdir"]) / "checkpoint.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 7})
    raw = torch.load(path, weights_only=True)
    assert sorted(raw) == ["model", "optimizer", "step"], sorted(raw)
    assert all(not key.startswith("module.") for key in raw["model"]), list(raw["model"])
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state)
    assert remainder == {} and state["step"] == 7, (remainder, state["step"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    out["checkpoint_keys"] = sorted(raw["model"])


def check_data(fabric: Fabric, out: dict) -> None:
    fabric.seed_everything(7)  # workers=True: each worker on each rank gets its own seeds
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True)
    loader = fabric.setup_dataloaders(loader)
    assert isinstance(loader.sampler, DistributedSampler), type(loader.sampler)
    epochs = [[int(i) for (batch,) in loader for i in batch] for _ in range(2)]  # set_epoch 0, then 1
    out["epochs"] = epochs
    assert len(epochs[0]) == 8 and epochs[0] != epochs[1], epochs

    draws = fabric.setup_dataloaders(DataLoader(RandomDraws(), batch_size=4, num_workers=1))
    out["worker_draws"] = next(iter(draws)).tolist()


def check_unshared(fabric: Fabric, module: torch.nn.Module, out: dict) -> None:
    """A CPU model passed through spawn must be each worker's own, not one shared-memory copy for all."""
    with torch.no_grad():
        module.weight.add_(fabric.global_rank + 1)
    fabric.barrier()
    out["unshared"] = bool(torch.all(module.weight == fabric.global_rank + 1))
    assert out["unshared"], module.weight


def main(fabric: Fabric, outdir: str, quick: bool, module: torch.nn.Module | None = None) -> dict:
    out: dict = {
        "outdir": outdir,
        "rank": fabric.global_rank,
        "local_rank": fabric.local_rank,
        "node_rank": fabric.node_rank,
        "world_size": fabric.world_size,
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "strategy": type(fabric.strategy).__name__,
        "launcher_child": os.environ.get("FABRIC_LAUNCHER_CHILD"),
    }
    assert fabric.world_size == 2, fabric.world_size
    check_collectives(fabric, out)
    if module is not None:
        check_unshared(fabric, module, out)
    if not quick:
        check_gradients(fabric, out)
        check_data(fabric, out)
    out.pop("outdir")
    Path(outdir, f"rank{fabric.global_rank}.json").write_text(json.dumps(out))
    fabric.barrier()
    return {"rank": fabric.global_rank, "tensor": torch.arange(3) * 10}


if __name__ == "__main__":
    mode, outdir = sys.argv[1], sys.argv[2]
    quick = "--quick" in sys.argv
    plugins = [RecordingIO(os.path.join(outdir, "io.log"))]
    if mode == "launch":
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, plugins=plugins)
        fabric.launch()
        main(fabric, outdir, quick)
    elif mode == "spawn":
        fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2, plugins=plugins)
        module = torch.nn.Linear(2, 2)
        torch.nn.init.zeros_(module.weight)
        result = fabric.launch(main, outdir, quick, module)
        untouched = bool(torch.all(module.weight == 0))  # the workers changed their own copies only
        Path(outdir, "spawn_result.json").write_text(
            json.dumps(
                {
                    "rank": result["rank"],
                    "tensor": result["tensor"].tolist(),
                    "pid": os.getpid(),
                    "untouched": untouched,
                }
            )
        )
    elif mode == "cli":
        fabric = Fabric(plugins=plugins)  # everything else comes from `fabric run`
        main(fabric, outdir, quick)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
