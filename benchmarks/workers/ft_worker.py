"""The ``ft`` section's job: one training loop, run as ``ft_ddp`` (one process per replica group, torchft) or as
``ddp`` (2 ranks, ``fabric.launch()``), with the same model, batch and optimizer on CPU (gloo, one thread each).

``python ft_worker.py MODE --steps N --warmup W --out FILE``: the first process (replica group 0, or rank 0) times
steps ``W..N`` and writes ``{"steps_per_s": ...}`` to FILE. The section starts the lighthouse and the groups.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("ft", "ddp"))
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from torch import nn

    from fabric_core import Fabric

    if args.mode == "ft":
        from fabric_ft import FTDDPStrategy

        fabric = Fabric(accelerator="cpu", devices=1, strategy=FTDDPStrategy(hostname="127.0.0.1"))
    else:
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
    torch.manual_seed(0)
    width = args.width
    model = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = torch.randn(32, 256), torch.randn(32, 1)
    times = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        times.append(time.perf_counter())
    first = fabric.strategy.replica_group == 0 if args.mode == "ft" else fabric.global_rank == 0  # each group is rank 0
    if first:
        timed = args.steps - args.warmup
        args.out.write_text(json.dumps({"steps_per_s": timed / (times[-1] - times[args.warmup - 1])}))


if __name__ == "__main__":
    main()
