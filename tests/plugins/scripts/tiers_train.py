"""A run with checkpoint tiers (memory every step with peer copies, disk every 5), resumed from the newest checkpoint
any tier holds; run by ``tests/plugins/ddp/test_tiers_across_nodes.py`` under ``fabric run`` (ddp, CPU).

    python tiers_train.py OUTDIR

Environment: ``TIERS_NODE`` names the simulated node (its agent); ``TIERS_KILL_AT=k``: in the first attempt, after
step k is saved and its peer copies arrived, every rank writes its pid (and its keeper's) to ``OUTDIR/pids/`` and the
ranks of node ``TIERS_VICTIM`` sleep until the test SIGKILLs them, while the others wait in a barrier that fails when
they die; ``TIERS_STOP_AT=m``: every rank writes its pid at step m of a later attempt and sleeps (the test takes the
whole job down: a node lost for good). ``TIERS_STEPS``: total steps (default 12); ``TIERS_PAUSE``: seconds each step
sleeps (a SIGTERM test needs a run that is still going). Rank 0 appends one line per step to ``progress.jsonl`` (step,
world size, attempt, a hash of the weights) and, at the end, writes ``final.pt``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from fabric_core import Fabric
from fabric_core.runtime.resume import RandomStates
from fabric_ddp import DDPStrategy

OUT = Path(sys.argv[1])
STEPS = int(os.environ.get("TIERS_STEPS", "12"))
KILL_AT = int(os.environ.get("TIERS_KILL_AT", "-1"))
STOP_AT = int(os.environ.get("TIERS_STOP_AT", "-1"))
PAUSE = float(os.environ.get("TIERS_PAUSE", "0"))
NODE = os.environ.get("TIERS_NODE", "a")

# Every parameter in a gradient bucket of its own: DDP's first iteration reduces all gradients as one bucket in
# parameter order and later ones in buckets rebuilt in execution order, so on more than 2 ranks the first step after
# any restart sums in another order than the uninterrupted run's (last-bit differences; docs/decisions.md, "Checkpoint
# tiers"). With one bucket per parameter both iterations reduce each gradient alike.
fabric = Fabric(strategy=DDPStrategy(bucket_cap_mb_list=[1e-5] * 4))
fabric.seed_everything(1234)
generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(512, 16, generator=generator), torch.randn(512, 1, generator=generator))
loader = fabric.setup_dataloaders(StatefulDataLoader(dataset, batch_size=4, shuffle=True))
model = fabric.setup_module(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1)))
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
state = {"model": model, "optimizer": optimizer, "loader": loader, "rng": RandomStates(fabric), "step": 0}

tiers = fabric.checkpoint_tiers(memory_every=1, disk_every=5, disk_keep_last=2, grace_period=60)
latest = fabric.latest_checkpoint(tiers)
if latest is not None:
    fabric.load(latest, state)
#: 0 in a run's first start; 1 in a start that resumed (an agent restarting its workers after a peer node's failure
#: keeps its restart count when it only follows a membership change, so the count does not tell)
attempt = 0 if latest is None else 1


def weights_hash() -> str:
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(bytes(parameter.detach().cpu().contiguous().view(torch.uint8).flatten().tolist()))
    return digest.hexdigest()[:16]


def record(**values) -> None:
    if fabric.global_rank == 0:
        with open(OUT / "progress.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "world": fabric.world_size, "t": time.time(), **values}) + "\n")


record(resumed=state["step"], latest=latest, recovery=tiers.recovery, hash=weights_hash())
with open(OUT / f"sources-{attempt}", "a") as f:  # one short line per rank: where its state came from
    f.write(json.dumps({"node": NODE, "rank": fabric.global_rank, "recovery": tiers.recovery}) + "\n")


def park(tag: str, sleeper: bool) -> None:
    """Leave this rank's pids for the test, then sleep (to be killed) or wait in a barrier that fails when peers die."""
    (OUT / "pids").mkdir(exist_ok=True)
    entry = {"pid": os.getpid(), "keeper": tiers.keeper_pid, "node": NODE, "rank": fabric.global_rank}
    (OUT / "pids" / f"{tag}-{NODE}-{fabric.local_rank}.json").write_text(json.dumps(entry))
    if sleeper:
        time.sleep(600)
    fabric.barrier()
    time.sleep(600)


while state["step"] < STEPS:
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        state["step"] += 1
        tiers.save(state["step"], state)
        record(step=state["step"], hash=weights_hash())
        if PAUSE:
            time.sleep(PAUSE)
        if attempt == 0 and state["step"] == KILL_AT:
            tiers.wait_replicated(state["step"])
            fabric.barrier()
            park("kill", sleeper=NODE == os.environ.get("TIERS_VICTIM"))
        if attempt > 0 and state["step"] == STOP_AT:
            tiers.wait_replicated(state["step"])
            fabric.barrier()
            park("stop", sleeper=True)
        if state["step"] == STEPS:
            break

tiers.close()
if fabric.global_rank == 0:
    torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, OUT / "final.pt")
