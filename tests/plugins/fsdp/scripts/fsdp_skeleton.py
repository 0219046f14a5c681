"""The seeds' five-step loop with strategy="fsdp" on 2 CPU processes, started by Fabric's own launcher.

``python skeleton.py OUT``: rank 0 re-runs this script for rank 1. The model is built on the meta device
(``init_module(empty_init=True)``); we check that setting it up never allocates the full model on a rank,
train a few epochs, and save a sharded and a full checkpoint plus ``skeleton.json`` for the test.
"""

from __future__ import annotations

import fsdp_common as c
import torch
import torch.distributed.checkpoint  # noqa: F401  (imported before measuring memory: imports are not the model)
import torch.distributed.fsdp  # noqa: F401
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_core import Fabric

D_MODEL, LAYERS = 384, 4


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(c.D_IN, D_MODEL)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, 8, 2 * D_MODEL, dropout=0.0, batch_first=True) for _ in range(LAYERS)
        )
        self.out = nn.Linear(D_MODEL, c.D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).unsqueeze(1)
        for layer in self.layers:
            h = layer(h)
        return self.out(h.squeeze(1))


def memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def main() -> None:
    out = c.out_dir()
    fabric = Fabric(accelerator=c.ACCELERATOR, strategy="fsdp", devices=2)
    fabric.launch()
    fabric.seed_everything(42)
    result: dict = {"world_size": fabric.world_size}

    with fabric.init_module(empty_init=True):
        warm_up = nn.Linear(4, 4)
    fabric.setup_module(warm_up)  # one-time costs (lazy imports, dispatch tables) are not the model's memory

    with fabric.init_module(empty_init=True):
        model = Model()
    result["meta_before_setup"] = all(p.is_meta for p in model.parameters())
    full_numel = sum(p.numel() for p in model.parameters())
    result["full_bytes"] = full_numel * 4
    on_cuda = fabric.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(fabric.device)
        before = torch.cuda.memory_allocated(fabric.device)
    else:
        result["peak_reset"] = reset_peak()
        before = memory_kib("VmRSS") * 1024
    model = fabric.setup_module(model)
    peak = torch.cuda.max_memory_allocated(fabric.device) if on_cuda else memory_kib("VmHWM") * 1024
    result["setup_peak_bytes"] = fabric.all_gather(torch.tensor(peak - before)).tolist()
    local = sum(p.to_local().numel() for p in model.parameters())
    result["local_numel"] = fabric.all_gather(torch.tensor(local)).tolist()
    result["full_numel"] = full_numel
    result["materialized"] = not any(p.is_meta for p in model.parameters())
    result["finite"] = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    # Shards of one parameter must not be copies of each other (CPU has no distributed RNG in DTensor).
    weight = model.layers[0].linear1.weight.full_tensor()
    half = weight.shape[0] // 2
    result["shards_differ"] = not torch.equal(weight[:half], weight[half:])

    optimizer = torch.optim.SGD(model.parameters(), lr=0.003)
    optimizer = fabric.setup_optimizers(optimizer)
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(32, c.D_IN, generator=g), torch.randn(32, c.D_OUT, generator=g))
    dataloader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=8))

    epoch_losses = []
    for _ in range(4):
        total = torch.zeros((), device=fabric.device)
        for x, y in dataloader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            total += loss.detach()
        epoch_losses.append(float(fabric.all_reduce(total / len(dataloader))))
    result["epoch_losses"] = epoch_losses

    state = {"model": model, "optimizer": optimizer, "epoch": 4}
    fabric.save(out / "skeleton_sharded", state)
    fabric.strategy.state_dict_type = "full"
    fabric.save(out / "skeleton_full.ckpt", state)
    if fabric.global_rank == 0:
        c.dump(out / "skeleton.json", result)
    fabric.barrier()


if __name__ == "__main__":
    main()
