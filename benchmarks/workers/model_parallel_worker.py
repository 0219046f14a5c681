"""Steady steps/s of tensor parallel x FSDP2 on 2 CPU processes (gloo): a raw ``parallelize_module`` + ``fully_shard``
loop and the same model through ``Fabric(strategy=ModelParallelStrategy(parallelize_fn))``; used by
sections/model_parallel.py.

    torchrun --standalone --nproc_per_node 2 benchmarks/workers/model_parallel_worker.py --variants raw,ours

Both variants live in one job and take turns in short rounds (A B, B A, ...), so each pair of rounds sees the same
machine. Ours starts the job (it initialises the process group, as a user's script does); the raw loop builds its
own mesh over that group. Rank 0 prints one result line: steps/s per repetition (from its median round), per variant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repository root, for `benchmarks` when torchrun starts this file
from benchmarks._common import emit, rotated  # noqa: E402

WIDTH, HIDDEN = 512, 1024


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Each block's MLP split over ``tensor_parallel`` (column then row), then FSDP2 over ``data_parallel``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="raw,ours")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--round-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    from fabric_core import Fabric
    from fabric_fsdp import ModelParallelStrategy

    variants = args.variants.split(",")
    fabric = Fabric(accelerator="cpu", strategy=ModelParallelStrategy(parallelize), devices=2)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    runners: dict[str, tuple] = {}
    for v in variants:
        model = build_model()
        if v == "raw":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("data_parallel", "tensor_parallel"))
            model = parallelize(model, mesh)
            runners[v] = (None, model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        else:
            model = fabric.setup_module(model)
            runners[v] = (fabric, model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4)))
    x = torch.randn(args.batch, WIDTH, generator=torch.Generator().manual_seed(0))  # the same batch: tensor parallel

    def run(v: str, n: int) -> float:
        owner, model, optimizer = runners[v]
        t = time.perf_counter()
        for _ in range(n):
            loss = F.mse_loss(model(x), x)
            if owner is None:
                loss.backward()
            else:
                owner.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return time.perf_counter() - t

    for v in variants:
        run(v, args.warmup)
    per_rep: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.reps):
        rounds: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in rotated(variants, rep * args.rounds + r):
                rounds[v].append(run(v, args.round_steps))
        for v in variants:
            rounds[v].sort()
            per_rep[v].append(args.round_steps / rounds[v][len(rounds[v]) // 2])
    if rank == 0:
        emit({"steps_per_s": per_rep, "threads": torch.get_num_threads(), "world_size": world})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
