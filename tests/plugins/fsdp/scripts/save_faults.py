"""An FSDP sharded save during which rank 1 dies: run by ``test_fsdp.py`` as two externally started ranks.

    python save_faults.py OUTDIR

Both ranks save ``OUTDIR/ckpt`` once (step 1), then save it again while rank 1 ends with ``os._exit(7)`` as soon as
it starts writing its shards. Rank 0 must fail (not hang), and clean up the temporary directory on its way out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fabric_core import Fabric

out = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
fabric.launch()
model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 2)))
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
fabric.save(out / "ckpt", {"model": model, "optimizer": optimizer, "step": 1})

if fabric.global_rank == 1:
    original = dcp.save

    def die(*args, **kwargs):
        os._exit(7)

    dcp.save = die
try:
    fabric.save(out / "ckpt", {"model": model, "optimizer": optimizer, "step": 2})
except Exception as err:
    (out / f"error{fabric.global_rank}").write_text(f"{type(err).__name__}: {err}")
    raise SystemExit(3) from None
raise SystemExit("the save with a dead rank succeeded")
