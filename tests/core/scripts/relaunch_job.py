"""Three process groups one after another in the same processes: launch, a device mesh kept alive, teardown, and
again. Each generation checks a collective's result; ``argv[1]/rank<r>.txt`` gets one line per generation."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

from fabric_core import Fabric
from fabric_core.strategies import ParallelStrategy

world = int(os.environ["WORLD_SIZE"])
lines, meshes = [], []
for generation in range(3):
    fabric = Fabric(accelerator="cpu", devices=world, strategy=ParallelStrategy())
    fabric.launch()
    meshes.append(init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("a", "b")))  # groups of its own, kept
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + generation)), reduce_op="sum")
    lines.append(f"{generation} {total.item():g}")
    fabric.barrier()
    fabric.strategy.teardown()
Path(sys.argv[1], f"rank{os.environ['RANK']}.txt").write_text("\n".join(lines) + "\n")
