"""Every multi-process strategy family publishes one topology that agrees with what it really does.

Started as 4 ranks (``jobs.run_ranks``). In each process, for ``model_parallel`` (a 2 x 2 mesh), ``fsdp`` on a
``(replicate, shard)`` mesh of 2 x 2, ``fsdp`` on a flat mesh and ``ddp`` (one process group, reused): the topology's
axes and its groups along each axis (compared here with the strategy's own ``DeviceMesh`` where it has one), the
data-parallel rank and size (with the indices the sampler of ``setup_dataloaders`` gives this rank) and
``is_global_zero``. Writes one JSON line per strategy to ``argv[1]/rank<r>.jsonl`` for the test to compare across
ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from fabric_core import Fabric


def parallelize(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def record(fabric: Fabric, label: str) -> dict:
    topology = fabric.topology
    mesh = getattr(fabric.strategy, "device_mesh", None)
    for axis in topology.axes:
        if mesh is not None:
            # the mesh's own group along that dimension holds exactly the ranks the topology names
            mesh_ranks = sorted(torch.distributed.get_process_group_ranks(mesh.get_group(axis.name)))
            assert mesh_ranks == topology.ranks_along(axis.name), (label, axis.name, mesh_ranks)
    loader = fabric.setup_dataloaders(DataLoader(list(range(16)), batch_size=2, shuffle=False))
    return {
        "strategy": label,
        "topology": topology.as_dict(),
        "groups": {axis.name: topology.groups_along(axis.name) for axis in topology.axes},
        "samples": sorted(int(x) for batch in loader for x in batch),
        "is_global_zero": fabric.is_global_zero,
        "sampler": fabric.strategy.distributed_sampler_kwargs,
    }


def main() -> None:
    from fabric_fsdp import FSDPStrategy, ModelParallelStrategy

    folder = Path(sys.argv[1])
    strategies = {
        "model_parallel": ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=2),
        "fsdp_hybrid": FSDPStrategy(device_mesh=(2, 2)),
        "fsdp": "fsdp",
        "ddp": "ddp",
    }
    lines = []
    for label, strategy in strategies.items():
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
        fabric.launch()
        if label.startswith("fsdp"):
            fabric.setup_module(nn.Linear(4, 4))  # makes the mesh
        elif label == "model_parallel":
            fabric.setup_module(nn.Linear(4, 4))
        lines.append(json.dumps(record(fabric, label)))
    (folder / f"rank{os.environ['RANK']}.jsonl").write_text("\n".join(lines) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
