"""Run as 2 ranks: ``EMA.average_parameters()`` under a sharding strategy (``fsdp`` or ``model_parallel``).

FSDP2 keeps the root module's gathered weights after a forward, until the next backward. Checked, with and without
a forward before the block: the block's forward computes what one plain process holding the averages computes; after
the block the model computes exactly what it computed before it (and what one process holding the trained weights
computes); ``ema.update()`` after an evaluation forward averages the trained weights. Writes ``result.json`` (rank 0)
for tests/plugins/fsdp/test_ema_sharded.py. Under ``fsdp`` the same processes then check ``load`` of a sharded
checkpoint without a state and ``load_raw`` of its folder. Args: OUTDIR STRATEGY.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: the shared script helpers
from script_helpers import dump, out_dir  # noqa: E402

from fabric_core import Fabric  # noqa: E402
from fabric_core.loop.ema import EMA  # noqa: E402
from fabric_core.utilities.dtensor import to_full_tensor  # noqa: E402
from fabric_fsdp import ModelParallelStrategy  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.down(torch.relu(self.up(x)))))


def parallelize(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model.head, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def plain(weights: dict[str, torch.Tensor]) -> nn.Module:
    model = Net()
    model.load_state_dict(weights)
    return model


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights (gathered: every rank calls it) from the module's state dict, the sharded parameters."""
    return {k: to_full_tensor(v).detach().clone() for k, v in model.module.state_dict().items()}


def main() -> None:
    out, name = out_dir(), sys.argv[2]
    strategy = ModelParallelStrategy(parallelize) if name == "model_parallel" else name
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    fabric.launch()
    torch.manual_seed(0)
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
    ema = EMA(model, decay=0.5)
    torch.manual_seed(1)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    for _ in range(3):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    result: dict = {"strategy": type(fabric.strategy).__name__}

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    for forward_before in (False, True):
        trained = full_weights(model)
        averages = ema.state_dict()["averages"]
        with torch.no_grad():
            expected_trained, expected_average = plain(trained)(x), plain(averages)(x)
            before = model(x) if forward_before else None
            with ema.average_parameters():
                inside = model(x)
            after = model(x)
        key = "forward_before" if forward_before else "no_forward_before"
        result[key] = {
            "inside_vs_averages": error(inside, expected_average),
            "inside_differs_from_trained": error(inside, expected_trained),
            "after_vs_trained": error(after, expected_trained),
            "after_equals_before": None if before is None else torch.equal(after, before),
            "weights_restored": all(torch.equal(v, trained[k]) for k, v in full_weights(model).items()),
        }

    # An update right after an evaluation forward (the root's gathered weights still in place) averages the trained
    # weights; then training goes on from the trained weights, not from anything the block left behind.
    with torch.no_grad():
        model(x)
    expected = {k: 0.5 * v + 0.5 * trained[k] for k, v in ema.state_dict()["averages"].items()}
    ema.update()
    result["update_after_forward"] = max(error(v, expected[k]) for k, v in ema.state_dict()["averages"].items())
    reference = plain(trained)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    nn.functional.mse_loss(reference(x), y).backward()
    ref_optimizer.step()
    fabric.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    result["next_step_vs_one_process"] = max(
        error(v, reference.state_dict()[k]) for k, v in full_weights(model).items()
    )
    if name == "fsdp":
        result.update(sharded_checkpoint_checks(fabric, model, out))
    if fabric.global_rank == 0:
        dump(out / "result.json", result)
    fabric.barrier()


def sharded_checkpoint_checks(fabric: Fabric, model: nn.Module, out: Path) -> dict:
    """The same processes check two sharded-checkpoint behaviours of the reference (docs/decisions.md, "FSDP"):
    ``load`` with no state names what it needs in the reference's words; ``load_raw`` of the folder loads its model
    (the reference refuses a folder there)."""
    path = out / "sharded"
    fabric.save(path, {"model": model, "step": 4})
    errors = {}
    for state in (None, {}):
        try:
            fabric.load(path, state)
        except ValueError as err:
            errors[repr(state)] = str(err)
    torch.manual_seed(5)
    other = fabric.setup(Net())
    differed = any(not torch.equal(v, full_weights(model)[k]) for k, v in full_weights(other).items())
    fabric.load_raw(path, other)
    return {
        "load_without_state": errors,
        "load_raw_folder_differed_before": differed,
        "load_raw_folder_equal": all(torch.equal(v, full_weights(model)[k]) for k, v in full_weights(other).items()),
    }


if __name__ == "__main__":
    main()
