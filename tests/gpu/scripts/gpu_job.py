"""One CUDA scenario as a real job: ``python gpu_job.py SCENARIO OUT_DIR DEVICES``; rank 0 writes OUT_DIR/SCENARIO.json.

Started as one plain process: ``fabric.launch()`` starts the other ranks (NCCL process group, one GPU per rank), as
users do. Scenarios: ``ddp`` (DDP over NCCL), ``fsdp`` (FSDP2 over NCCL, bf16-mixed, sharded save and load from
GPU tensors), ``deepspeed`` (ZeRO stage 2, bf16-mixed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fabric_core import Fabric


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(fabric: Fabric) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + fabric.global_rank)
    x = torch.randn(32, 64, generator=g)
    return x.to(fabric.device), x.sum(1, keepdim=True).to(fabric.device) / 8


def train(fabric: Fabric, model, optimizer, steps: int = 8) -> list[float]:
    x, y = batch(fabric)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    scenario, out, devices = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    strategy = {"ddp": "ddp", "fsdp": "fsdp", "deepspeed": "deepspeed_stage_2"}[scenario]
    precision = "32-true" if scenario == "ddp" else "bf16-mixed"
    fabric = Fabric(accelerator="cuda", strategy=strategy, devices=devices, precision=precision)
    fabric.launch()
    fabric.seed_everything(0)
    result: dict = {"world_size": fabric.world_size, "device": str(fabric.device)}
    result["backend"] = dist.get_backend() if dist.is_initialized() else None
    with fabric.init_module():
        model = Net()
    result["init_module_device"] = str(next(model.parameters()).device)
    if scenario == "fsdp":
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    result["param_device"] = str(next(model.parameters()).device)
    losses = train(fabric, model, optimizer)
    result["losses"] = losses
    # Every rank must hold the same (full) weights after data-parallel steps: compare a checksum across ranks.
    if scenario == "ddp":
        total = torch.stack([p.detach().float().sum() for p in model.parameters()]).sum()
        sums = fabric.all_gather(total)
        result["param_sums"] = [float(s) for s in sums.reshape(-1)]
    if scenario in ("fsdp", "deepspeed"):
        path = out / f"{scenario}_ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 8})
        before = {k: v.detach().float().cpu().clone() for k, v in _full_state(fabric, model).items()}
        train(fabric, model, optimizer, steps=2)  # move away, then come back by loading
        remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
        after = {k: v.detach().float().cpu() for k, v in _full_state(fabric, model).items()}
        result["loaded_step"] = remainder.get("step")
        result["load_max_diff"] = max(float((before[k] - after[k]).abs().max()) for k in before)
        if scenario == "fsdp":  # an asynchronous save whose snapshot comes from GPU shards
            handle = fabric.save(out / "fsdp_async_ckpt", {"model": model, "step": 9}, async_save=True)
            handle.wait()
            result["async_saved"] = (out / "fsdp_async_ckpt").exists()
    fabric.barrier()
    if fabric.global_rank == 0:
        (out / f"{scenario}.json").write_text(json.dumps(result))


def _full_state(fabric: Fabric, model) -> dict[str, torch.Tensor]:
    """Each rank's local view of the parameters (its shard under FSDP/ZeRO): compared before and after a load."""
    state = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        state[name] = local
    return state


if __name__ == "__main__":
    main()
