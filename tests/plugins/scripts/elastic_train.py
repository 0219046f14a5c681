"""Training that is stopped and resumed on another number of ranks; the loop of the resume recipe (docs/decisions.md,
"Resuming"), as users write it. Used by ``test_elastic_resize.py`` (ranks started externally, a new world size at
every restart), ``test_elastic_agents.py`` (``fabric run --num-nodes 1:2``) and the Ray elastic test.

    python elastic_train.py OUT STRATEGY RUN[:STOP] ...

Every RUN trains in its own folder ``OUT/<name>`` (checkpoints, sample ledger, ``final.pt``) and stops after global
step STOP (without saving, as a failure between two checkpoints would; omitted: to the end). Runs:

* ``kept``: the user's per-rank batch of 4 kept (the global batch follows the number of ranks);
* ``fixed``: ``setup_dataloaders(..., global_batch_size=24)``;
* ``slow``: as ``kept``, with a pause after every step (``ELASTIC_PAUSE`` seconds, default 0.3: for tests that kill
  a process mid-run). A test holds a run before a step with the file ``OUT/<name>/gate`` (``WORLD STEPS``: at that
  world size, after STEPS steps of an attempt), so a phase of the test cannot end the run too soon.

96 samples (a ``StatefulDataLoader(shuffle=True)``), 2 epochs, SGD, float64 (``64-true``), a checkpoint every 2 steps
with ``RandomStates``. Rank 0 appends ``{"resumed", "world", "t", "draws"}`` (what every rank's torch generator draws
next) when the run (re)starts and ``{"step", "world", "t", "epoch"}`` after every step to ``OUT/<name>/progress.jsonl``,
and writes every parameter in full to ``final.pt`` at the end.
"""

from __future__ import annotations

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

SAMPLES, BATCH, GLOBAL_BATCH, EPOCHS, SAVE_EVERY = 96, 4, 24, 2, 2


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=generator, dtype=torch.float64)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def train(fabric: Fabric, folder: Path, kind: str, stop: int | None = None, pause: float = 0.0) -> str:
    """One run of the recipe in ``folder``; returns ``"done"`` or ``"stopped"``."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["FABRIC_SAMPLE_LEDGER"] = str(folder / "ledger")  # before the loader is set up: it gets its name there
    loader = StatefulDataLoader(data(), batch_size=BATCH, shuffle=True)
    loader = fabric.setup_dataloaders(loader, global_batch_size=GLOBAL_BATCH if kind == "fixed" else None)
    net = fabric.setup_module(model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    state = {"model": net, "optimizer": optimizer, "loader": loader, "rng": RandomStates(fabric), "step": 0, "epoch": 0}
    latest = fabric.latest_checkpoint(folder / "ckpts" / "step-*.ckpt")
    if latest is not None:
        fabric.load(latest, state)
    with torch.random.fork_rng(devices=[]):  # what each rank's torch generator draws next, without drawing it
        draws = fabric.all_gather(torch.rand(1, dtype=torch.float64)).flatten().tolist()
    progress = (folder / "progress.jsonl").open("a") if fabric.global_rank == 0 else None
    if progress is not None:
        record = {"resumed": state["step"], "world": fabric.world_size, "t": time.time(), "draws": draws}
        progress.write(json.dumps(record) + "\n")
        progress.flush()
    done_here = 0
    while state["epoch"] < EPOCHS:
        for x, y in loader:  # after a load: the rest of the saved epoch
            while _held(folder, fabric.world_size, done_here):
                time.sleep(0.05)
            done_here += 1
            loss = nn.functional.mse_loss(net(x), y) * loader.share_weight
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            state["step"] += 1
            if progress is not None:
                record = {"step": state["step"], "world": fabric.world_size, "epoch": state["epoch"], "t": time.time()}
                progress.write(json.dumps(record) + "\n")
                progress.flush()
            if state["step"] % SAVE_EVERY == 0:
                fabric.save(folder / "ckpts" / f"step-{state['step']:04d}.ckpt", state, keep_last=2)
            if state["step"] == stop:
                return "stopped"
            if pause:
                time.sleep(pause)
        state["epoch"] += 1
    full = {}
    for name, parameter in net.named_parameters():
        tensor = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter  # FSDP2: gathered
        full[name] = tensor.detach().cpu().clone()
    if fabric.global_rank == 0:
        torch.save(full, folder / "final.pt")
    return "done"


def _held(folder: Path, world: int, done: int) -> bool:
    """The test's gate (``OUT/<name>/gate``: ``WORLD STEPS``): at that world size, stop before a step once this attempt
    has taken STEPS steps, until the gate changes (or a resize restarts the worker)."""
    try:
        size, steps = (int(v) for v in (folder / "gate").read_text().split())
    except (OSError, ValueError):
        return False
    return world == size and done >= steps


def main() -> None:
    out, strategy, *runs = sys.argv[1:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    under_cli = os.environ.get("FABRIC_CLI_USED") == "1"
    fabric = Fabric(accelerator="cpu", strategy=strategy, precision="64-true", **({} if under_cli else {"devices": world}))
    if not under_cli:  # `fabric run` started the processes
        fabric.launch()
    for run in runs:
        name, _, stop = run.partition(":")
        kind = "kept" if name.startswith("slow") else name.split("-")[0]
        pause = float(os.environ.get("ELASTIC_PAUSE", "0.3")) if name.startswith("slow") else 0.0
        result = train(fabric, Path(out) / name, kind, int(stop) if stop else None, pause=pause)
        fabric.print(f"RUN {name} {result} world={fabric.world_size}", flush=True)


if __name__ == "__main__":
    main()
