"""A training run that checkpoints every few steps and resumes from its newest checkpoint; run by
``test_resume_after_kill.py`` under ``fabric run --max-restarts 2`` (ddp or fsdp, CPU).

    python resume_train.py OUTDIR KILL_AT

In the first attempt rank 1 SIGKILLs itself right after step KILL_AT (-1: never), between two checkpoints, and
leaves ``killed.txt`` just before. Every
attempt starts from scratch, finds the newest committed checkpoint (``fabric.latest_checkpoint``) and continues
from it: model, optimizer, the loader's position in the middle of an epoch (torchdata's ``StatefulDataLoader``), every
rank's random generators (dropout) and the step. Writes ``attempt<A>.json`` (where it resumed from) and, at the end,
``final.pt``: every parameter in full, from rank 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from fabric_core import Fabric
from fabric_core.runtime.resume import RandomStates

OUT, KILL_AT = Path(sys.argv[1]), int(sys.argv[2])
TOTAL_STEPS = 20  # 80 samples, batches of 4 per rank, 2 ranks: 10 steps per epoch, 2 epochs
SAVE_EVERY = 3

fabric = Fabric()
fabric.seed_everything(1234)  # every attempt alike; a resumed one then takes the checkpoint's generators
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(80, 8, generator=generator), torch.randn(80, 1, generator=generator))
loader = fabric.setup_dataloaders(StatefulDataLoader(dataset, batch_size=4, shuffle=True))
model = fabric.setup_module(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1)))
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))

state = {"model": model, "optimizer": optimizer, "loader": loader, "rng": RandomStates(fabric), "step": 0}
series = OUT / "ckpts" / "step-*.ckpt"
latest = fabric.latest_checkpoint(series)
if latest is not None:
    fabric.load(latest, state)
if fabric.global_rank == 0:
    (OUT / f"attempt{attempt}.json").write_text(json.dumps({"resumed_from": latest, "step": state["step"]}))

while state["step"] < TOTAL_STEPS:
    for x, y in loader:  # after a load, the rest of the saved epoch
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        state["step"] += 1
        if attempt == 0 and fabric.global_rank == 1 and state["step"] == KILL_AT:
            (OUT / "killed.txt").write_text(f"rank 1 SIGKILLs itself after step {KILL_AT}")
            os.kill(os.getpid(), signal.SIGKILL)
        if state["step"] % SAVE_EVERY == 0:
            fabric.save(OUT / "ckpts" / f"step-{state['step']:04d}.ckpt", state, keep_last=2)
        if state["step"] == TOTAL_STEPS:
            break

full = {}
for name, parameter in model.named_parameters():
    tensor = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter  # FSDP2 shards: gathered
    full[name] = tensor.detach().cpu().clone()
if fabric.global_rank == 0:
    torch.save(full, OUT / "final.pt")
