"""``fabric.launch(fn)`` on Ray: ``DDPStrategy(start_method="ray")`` runs ``work`` in one Ray actor per process.

``python launch_fn_script.py MODE``: MODE ``ok`` prints rank 0's result as ``RESULT {...}``; ``raise``: rank 2 raises.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from fabric_core import Fabric
from fabric_ddp import DDPStrategy


def work(fabric: Fabric, mode: str) -> dict:
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    if mode == "raise" and fabric.global_rank == 2:
        raise ValueError("rank two cannot go on")
    ranks = fabric.all_gather(torch.tensor([fabric.global_rank, fabric.local_rank, fabric.node_rank]))
    ips = fabric.strategy.all_gather_object(os.environ["FABRIC_RAY_NODE_IP"]) if hasattr(fabric.strategy, "all_gather_object") else None
    print(f"working as rank {fabric.global_rank}", flush=True)
    return {"sum": float(total), "ranks": ranks.tolist(), "world": fabric.world_size, "ips": ips, "pid": os.getpid(),
            "forwarded": os.environ.get("RAYTEST_SECRET")}


if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(start_method="ray"), devices=2, num_nodes=2)
    result = fabric.launch(work, sys.argv[1])
    print("RESULT " + json.dumps({**result, "driver_pid": os.getpid()}), flush=True)
