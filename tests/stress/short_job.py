"""A short, successful 2-process job: must exit 0 every time. Run by ``tests/stress/stress_exit.py``.

    python short_job.py script     # strategy="ddp": the script re-runs itself for rank 1, launch() without fn
    python short_job.py function   # strategy="ddp": launch(fn) in the re-run processes
    python short_job.py spawn      # strategy="ddp_spawn": launch(fn) in spawned processes
    python short_job.py fsdp       # strategy="fsdp": launch(), a sharded step
    python short_job.py deepspeed  # strategy="deepspeed_stage_2": launch(), an engine step (needs fabric-deepspeed)
"""

from __future__ import annotations

import sys

import torch

from fabric_core import Fabric


def train(fabric: Fabric) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        loss = model(torch.randn(4, 8, device=fabric.device)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    total = fabric.all_reduce(loss.detach(), reduce_op="mean")
    fabric.barrier()
    return float(total)


def main(mode: str) -> None:
    strategy = {"script": "ddp", "function": "ddp", "spawn": "ddp_spawn", "fsdp": "fsdp",
                "deepspeed": "deepspeed_stage_2"}[mode]
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    if mode in ("script", "fsdp", "deepspeed"):
        fabric.launch()
        train(fabric)
    else:
        fabric.launch(train)


if __name__ == "__main__":
    main(sys.argv[1])
