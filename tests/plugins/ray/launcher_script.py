"""The script ``fabric run --launcher ray`` runs in the tests: plain Fabric, as under torchrun (no launch() call).

``python launcher_script.py OUT MODE``: every rank trains a few DDP steps, all-reduces its rank, and writes what it
saw to ``OUT/rankR.json``. MODE ``ok``; ``raise`` (rank 3 raises after the first step, the others then fail at their
next collective); ``flaky`` (rank 1 exits with code 3 in the first attempt, every rank succeeds after a restart).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from fabric_core import Fabric

out, mode = Path(sys.argv[1]), sys.argv[2]
fabric = Fabric(accelerator="cpu", strategy="ddp")
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))
print(f"hello from rank {fabric.global_rank} of {fabric.world_size}, attempt {restart}", flush=True)
if mode == "flaky" and restart == 0 and fabric.global_rank == 1:
    sys.exit(3)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
for step in range(3):
    generator = torch.Generator().manual_seed(100 * step + fabric.global_rank)
    x = torch.randn(8, 4, generator=generator)
    loss = model(x).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if mode == "raise" and fabric.global_rank == 3:
        raise ValueError("rank three cannot go on")
total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
record = {
    "rank": fabric.global_rank,
    "local": fabric.local_rank,
    "node": fabric.node_rank,
    "world": fabric.world_size,
    "environment": type(fabric.strategy.cluster_environment).__name__,
    "node_ip": os.environ.get("FABRIC_RAY_NODE_IP"),
    "restart": restart,
    "forwarded": {k: v for k, v in os.environ.items() if k.startswith("RAYTEST_")},
    "script": os.path.abspath(__file__),
    "cwd": os.getcwd(),
    "sum": float(total),
    "weights": [round(float(v), 6) for v in torch.cat([p.detach().flatten() for p in model.parameters()])],
}
(out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
