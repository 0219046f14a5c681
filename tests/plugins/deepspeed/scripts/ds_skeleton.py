"""The seeds' five-step loop with a DeepSpeed strategy on 2 CPU processes.

``python ds_skeleton.py OUT STAGE``: ``fabric.launch()`` re-runs this script for rank 1.
``fabric run --strategy deepspeed_stage_2 --devices 2 ds_skeleton.py OUT 2 --cli``: the CLI starts both ranks
(no ``launch()`` then). Under stage 3 the model is built inside ``fabric.init_module()`` (``deepspeed.zero.Init``)
and the peak memory of building it is compared with building it plainly. ``SKELETON_FAIL_AT=N`` makes rank 1
raise at step N (a failing rank must end the job). Writes ``skeleton_<stage>.json`` and a checkpoint.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_core import Fabric

WIDTH, LAYERS, D_OUT = 1024, 8, 4


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


def construction_peak_bytes(build) -> tuple[int, object]:
    reset_peak()
    before = memory_kib("VmRSS")
    model = build()
    return (memory_kib("VmHWM") - before) * 1024, model


def main() -> None:
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    cli = "--cli" in sys.argv
    fail_at = int(os.environ.get("SKELETON_FAIL_AT", "-1"))
    fabric = Fabric(accelerator="cpu", strategy=f"deepspeed_stage_{stage}", devices=2) if not cli else Fabric()
    if not cli:
        fabric.launch()
    fabric.seed_everything(42)
    result: dict = {"world_size": fabric.world_size, "strategy": type(fabric.strategy).__name__, "stage": fabric.strategy.zero_stage}

    # Warm up what building a model under the strategy costs once per process (imports, DeepSpeed's buffers).
    with fabric.init_module():
        nn.Linear(4, 4)
    full_bytes = sum(p.numel() for p in Model().parameters()) * 4
    plain_peak, _ = construction_peak_bytes(Model)
    init_peak, model = construction_peak_bytes(lambda: _build_in(fabric))
    peaks = fabric.all_gather(torch.tensor([plain_peak, init_peak])).tolist()  # [[plain, init_module] per rank]
    result.update(full_bytes=full_bytes, plain_peak_bytes=[p[0] for p in peaks], init_module_peak_bytes=[p[1] for p in peaks])
    result["local_numel"] = sum(p.numel() for p in model.parameters())

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(32, WIDTH, generator=g), torch.randn(32, D_OUT, generator=g))
    dataloader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=8))

    epoch_losses, step = [], 0
    for _ in range(3):
        total = torch.zeros(())
        for x, y in dataloader:
            if step == fail_at and fabric.global_rank == 1:
                raise RuntimeError("rank 1 fails on purpose")
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            total += loss.detach()
            step += 1
        epoch_losses.append(float(fabric.all_reduce(total / len(dataloader))))
    result["epoch_losses"] = epoch_losses
    fabric.save(out / f"skeleton_{stage}", {"model": model, "optimizer": optimizer, "epoch": 3})

    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
        weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    if fabric.global_rank == 0:
        torch.save(weights, out / f"skeleton_{stage}_live.pt")
        import json

        (out / f"skeleton_{stage}.json").write_text(json.dumps(result, indent=1))
    fabric.barrier()
    fabric.teardown()  # the process group, then DeepSpeed's references to its groups


def _build_in(fabric: Fabric) -> nn.Module:
    with fabric.init_module():
        return Model()


if __name__ == "__main__":
    main()
