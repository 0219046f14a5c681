"""``fabric.profile`` with a schedule (1 warm-up step, 3 active: the README's) over loops of several lengths, on
every rank of a job (or one process). Each step runs under ``record_function("step<k>")`` so the summary shows which
steps it covers. Args: OUTDIR STRATEGY DEVICES. Loop lengths: 4 (ends at a cycle boundary), 3 (inside the first
cycle), 6 (inside the second), 8 (two whole cycles); folders ``<OUTDIR>/len<n>``.
"""

import sys
from pathlib import Path

import torch
from torch import nn

from fabric_core import Fabric

LENGTHS = (4, 3, 6, 8)


def profile_loops(fabric: Fabric, out: Path) -> None:
    torch.manual_seed(0)
    model = fabric.setup(nn.Linear(3, 2))
    for length in LENGTHS:
        with fabric.profile(out / f"len{length}", schedule={"warmup": 1, "active": 3}, row_limit=100) as prof:
            for k in range(length):
                with torch.profiler.record_function(f"step{k}"):
                    fabric.backward(model(torch.randn(4, 3)).sum())
                prof.step()


if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", strategy=sys.argv[2], devices=int(sys.argv[3]))
    fabric.launch()
    profile_loops(fabric, Path(sys.argv[1]))
    fabric.barrier()
