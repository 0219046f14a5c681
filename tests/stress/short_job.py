"""A short, successful 2-process job: must exit 0 every time. Run by ``tests/stress/stress_exit.py``.

    python short_job.py script     # strategy="ddp": the script re-runs itself for rank 1, launch() without fn
    python short_job.py function   # strategy="ddp": launch(fn) in the re-run processes
    python short_job.py spawn      # strategy="ddp_spawn": launch(fn) in spawned processes
    python short_job.py fsdp       # strategy="fsdp": launch(), a sharded step
    python short_job.py deepspeed  # strategy="deepspeed_stage_2": launch(), an engine step (needs fabric-deepspeed)
    python short_job.py model_parallel   # ModelParallelStrategy, tensor parallel 2: launch(), sharded steps
    python short_job.py model_parallel4  # ModelParallelStrategy on 4 processes, data parallel 2 x tensor parallel 2
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


def parallelize(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def main(mode: str) -> None:
    devices = 4 if mode == "model_parallel4" else 2
    if mode.startswith("model_parallel"):
        from fabric_fsdp import ModelParallelStrategy

        strategy = ModelParallelStrategy(parallelize, data_parallel_size=devices // 2, tensor_parallel_size=2)
    else:
        strategy = {"script": "ddp", "function": "ddp", "spawn": "ddp_spawn", "fsdp": "fsdp",
                    "deepspeed": "deepspeed_stage_2"}[mode]  # fmt: skip
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=devices)
    if mode in ("script", "fsdp", "deepspeed", "model_parallel", "model_parallel4"):
        fabric.launch()
        train(fabric)
    else:
        fabric.launch(train)


if __name__ == "__main__":
    main(sys.argv[1])
