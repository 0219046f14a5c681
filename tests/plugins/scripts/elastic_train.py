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
and writes every parameter in full to ``final.pt`` at the end. The parameters and optimizer state of the last
checkpoint before STOP, gathered whole, go to ``OUT/<name>/states/``; a resume from it gathers what it loaded and
records ``"state": {"keys", "differ"}`` (the keys not equal to the bit) with its ``resumed`` line.

The runs ``tp`` (data parallel x tensor parallel 2) and ``pp`` (pipeline parallel 2, GPipe, x data parallel) use
``model_parallel`` whatever STRATEGY says (float32, AdamW, ``fabric.forward_backward``), each with a strategy of its own
in the same processes (no start of processes of their own); the data-parallel size is half the world.
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


def data(dtype: torch.dtype = torch.float64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=generator, dtype=torch.float64).to(dtype)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def tensor_parallel(module: nn.Module, mesh) -> nn.Module:
    """``model_parallel``'s plan for the ``tp`` runs: the first Linear column-wise, the last row-wise, FSDP2 over the
    data-parallel rows."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(module, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(module, mesh=mesh["data_parallel"])


def _whole(value: object) -> object:
    value = value.full_tensor() if hasattr(value, "full_tensor") else value  # DTensor: gathered over its mesh
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def full_state(net: nn.Module, optimizer) -> dict[str, object]:
    """Every parameter and optimizer state tensor of the run, whole, merged from every rank (pipeline stages hold
    their own parameters; every rank gets the merge). Collective."""
    names = {id(p): name for name, p in net.named_parameters()}
    local = {f"param.{name}": _whole(p) for name, p in net.named_parameters()}
    inner = getattr(optimizer, "optimizer", optimizer)
    for p, values in inner.state.items():
        for key, value in sorted(values.items()):
            local[f"{key}.{names[id(p)]}"] = _whole(value)
    if not torch.distributed.is_initialized():
        return local
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def _differences(expected: dict[str, object], got: dict[str, object]) -> dict[str, object]:
    """Keys whose values are not equal (tensors to the bit), with the largest difference."""
    out: dict[str, object] = {k: "missing" for k in expected.keys() - got.keys()}
    out.update({k: "unexpected" for k in got.keys() - expected.keys()})
    for key in expected.keys() & got.keys():
        a, b = expected[key], got[key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or not torch.equal(a, b):
                out[key] = float((a.double() - b.double()).abs().max()) if a.shape == b.shape else "shape"
        elif a != b:
            out[key] = repr((a, b))
    return out


def train(fabric: Fabric, folder: Path, kind: str, stop: int | None = None, pause: float = 0.0) -> str:
    """One run of the recipe in ``folder``; returns ``"done"`` or ``"stopped"``."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["FABRIC_SAMPLE_LEDGER"] = str(folder / "ledger")  # before the loader is set up: it gets its name there
    parallel = kind in _MODEL_AXES  # model_parallel: float32, AdamW (a state to reshard), forward_backward
    loader = StatefulDataLoader(data(torch.float32 if parallel else torch.float64), batch_size=BATCH, shuffle=True)
    loader = fabric.setup_dataloaders(loader, global_batch_size=GLOBAL_BATCH if kind == "fixed" else None)
    net = fabric.setup_module(model())
    make = (lambda p: torch.optim.AdamW(p, lr=1e-2)) if parallel else (lambda p: torch.optim.SGD(p, lr=0.1))
    optimizer = fabric.setup_optimizers(make(net.parameters()))
    state = {"model": net, "optimizer": optimizer, "loader": loader, "rng": RandomStates(fabric), "step": 0, "epoch": 0}
    latest = fabric.latest_checkpoint(folder / "ckpts" / "step-*.ckpt")
    differences = None
    if latest is not None:
        fabric.load(latest, state)
        # what was loaded, gathered whole, against what was gathered when it was saved (rank 0 wrote it; one folder
        # seen by every rank: runs that saved none, the agents' and Ray's, gather nothing)
        saved = folder / "states" / f"{Path(latest).name}.pt"
        if saved.exists():
            loaded = full_state(net, optimizer)
            if fabric.global_rank == 0:
                expected = torch.load(saved, weights_only=False)
                differences = {"keys": len(expected), "differ": _differences(expected, loaded)}
    with torch.random.fork_rng(devices=[]):  # what each rank's torch generator draws next, without drawing it
        draws = fabric.all_gather(torch.rand(1, dtype=torch.float64)).flatten().tolist()
    progress = (folder / "progress.jsonl").open("a") if fabric.global_rank == 0 else None
    if progress is not None:
        record = {"resumed": state["step"], "world": fabric.world_size, "t": time.time(), "draws": draws}
        if differences is not None:
            record["state"] = differences
        progress.write(json.dumps(record) + "\n")
        progress.flush()
    done_here = 0
    while state["epoch"] < EPOCHS:
        for x, y in loader:  # after a load: the rest of the saved epoch
            while _held(folder, fabric.world_size, done_here):
                time.sleep(0.05)
            done_here += 1
            optimizer.zero_grad()
            if parallel:  # a pipeline runs its schedule; the other layouts the default loop
                fabric.forward_backward(net, x, target=y, loss_fn=lambda out, t: nn.functional.mse_loss(out, t) * loader.share_weight)
            else:
                loss = nn.functional.mse_loss(net(x), y) * loader.share_weight
                fabric.backward(loss)
            optimizer.step()
            state["step"] += 1
            if progress is not None:
                record = {"step": state["step"], "world": fabric.world_size, "epoch": state["epoch"], "t": time.time()}
                progress.write(json.dumps(record) + "\n")
                progress.flush()
            if state["step"] % SAVE_EVERY == 0:
                name = f"step-{state['step']:04d}.ckpt"
                if stop is not None and stop - SAVE_EVERY < state["step"] <= stop:  # the one the next restart loads
                    whole = full_state(net, optimizer)
                    if fabric.global_rank == 0:
                        (folder / "states").mkdir(exist_ok=True)
                        torch.save(whole, folder / "states" / f"{name}.pt")
                fabric.save(folder / "ckpts" / name, state, keep_last=2)
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


#: ``model_parallel`` runs (per-rank batch kept) and their model axis of size 2; the rest of the world is data parallel.
_MODEL_AXES = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}


def make_fabric(strategy: str, kind: str, world: int, under_cli: bool) -> Fabric:
    precision = "64-true"
    if kind in _MODEL_AXES:  # runs `tp` (dp x tp 2) and `pp` (pp 2 x dp), each with a model_parallel strategy of its own
        from fabric_fsdp import ModelParallelStrategy

        sizes = {"data_parallel_size": world // 2, _MODEL_AXES[kind]: 2}
        options = {"parallelize_fn": tensor_parallel} if kind == "tp" else {"pipeline_split": ["2"]}
        strategy, precision = ModelParallelStrategy(**options, **sizes), "32-true"
    fabric = Fabric(accelerator="cpu", strategy=strategy, precision=precision, **({} if under_cli else {"devices": world}))
    if not under_cli:  # `fabric run` started the processes
        fabric.launch()
    return fabric


def main() -> None:
    out, strategy, *runs = sys.argv[1:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    under_cli = os.environ.get("FABRIC_CLI_USED") == "1"
    fabrics: dict[str, Fabric] = {}
    for run in runs:
        name, _, stop = run.partition(":")
        kind = "kept" if name.startswith("slow") else name.split("-")[0]
        key = kind if kind in _MODEL_AXES else strategy
        if key not in fabrics:
            fabrics[key] = make_fabric(strategy, kind, world, under_cli)
        fabric = fabrics[key]
        pause = float(os.environ.get("ELASTIC_PAUSE", "0.3")) if name.startswith("slow") else 0.0
        result = train(fabric, Path(out) / name, kind, int(stop) if stop else None, pause=pause)
        fabric.print(f"RUN {name} {result} world={fabric.world_size}", flush=True)


if __name__ == "__main__":
    main()
