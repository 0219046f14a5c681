"""One process of one replica group: a small regression trained with the ordinary Fabric loop.

``python ft_train.py OUT STOP [SLEEP]`` with ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS``
set (by the test, or by ``fabric run --launcher ft``). ``FT_TEST_STRATEGY`` picks the strategy: ``ft_ddp`` (default,
one process per group), ``ft_fsdp`` (FSDP2 inside the group: HSDP), ``diloco`` / ``local_sgd`` (``ft_ddp`` with that
semi-synchronous method, ``FT_TEST_SYNC_EVERY`` steps apart, default 5). With ``FT_TEST_PER_PROCESS=1`` every
process writes into ``OUT/g<group>-a<attempt>-r<rank>`` (the launcher restarts groups), else into ``OUT``.

Every step appends ``{"step", "participants", "committed", "changed", "t", "local"}`` to ``progress.jsonl``
(``changed``: ``optimizer.step()`` changed the weights; ``local``: inner steps since the start of this process); the
process id is in ``pid``. With ``FT_TEST_STOP_IN_STEP=N`` the group (``FT_TEST_STOP_GROUP``: only that one, in its
first attempt) stops inside the first step from N on with every group in its quorum, after joining the quorum and before its gradients' allreduce, writes the step to ``in_step``
and waits to be killed. Once the file ``STOP`` holds a step number and torchft's step counter reached it, the full
weights go to ``final.pt`` and the loss over the whole data set (with the initial loss and the least-squares optimum)
to ``result.json``; the first group of the last quorum also writes ``OUT/checkpoint-g<group>.ckpt`` with
``fabric.save`` (every process of a group writes the same path: a sharded checkpoint is written by all of them).
``PL_GLOBAL_SEED`` (default 0) seeds the data order (the uninterrupted runs DiLoCo is compared with vary it).
``FT_TEST_OUTER=LR,MOMENTUM``: DiLoCo's outer SGD (default 0.5,0.3: close to the optimum within 30 synchronisations
of 5 steps, without the swings of a larger outer momentum). ``FT_TEST_RESTART_DELAY=S``: a restarted group's processes wait S seconds before they start (a replacement that takes
a while to arrive: the others train alone meanwhile).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_core import Fabric
from fabric_core.loggers import CSVLogger
from fabric_ft import FaultTolerant, FTDDPStrategy


def _strategy(kind: str):
    if kind == "ft_fsdp":
        return FaultTolerant("fsdp", hostname="127.0.0.1")
    if kind == "ft_ddp_group":  # DDP inside each group of several processes
        return FaultTolerant("ddp", hostname="127.0.0.1", find_unused_parameters=True)
    if kind in ("diloco", "local_sgd"):
        every = int(os.environ.get("FT_TEST_SYNC_EVERY", "5"))
        lr, momentum = (float(v) for v in os.environ.get("FT_TEST_OUTER", "0.5,0.3").split(","))
        outer = (lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)) if kind == "diloco" else None
        return FTDDPStrategy(hostname="127.0.0.1", semi_sync=kind, sync_every=every, outer_optimizer=outer)
    return FTDDPStrategy(hostname="127.0.0.1")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if callable(full) else tensor).detach().cpu().clone()


def main(out: Path, stop: Path, sleep: float) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        time.sleep(float(os.environ.get("FT_TEST_RESTART_DELAY", "0")))
    kind = os.environ.get("FT_TEST_STRATEGY", "ft_ddp")
    # FT_TEST_ACCELERATOR=cuda: the GPU lane's run (ProcessGroupNCCL between the groups)
    accelerator = os.environ.get("FT_TEST_ACCELERATOR", "cpu")
    base = out
    strategy = _strategy(kind)
    loggers = None
    if os.environ.get("FT_TEST_PER_PROCESS") == "1":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        rank = os.environ.get("RANK", "0")
        out = out / f"g{os.environ['REPLICA_GROUP_ID']}-a{attempt}-r{rank}"
        if os.environ.get("FT_TEST_LOG") == "1":  # the loss every step, with the strategy's quorum metrics beside it
            loggers = CSVLogger(out / "logs", name="ft", version=0, flush_logs_every_n_steps=1)
    fabric = Fabric(accelerator=accelerator, strategy=strategy, loggers=loggers)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pid").write_text(str(os.getpid()))
    torch.manual_seed(0)  # the same data and the same initial weights in every group
    x = torch.randn(512, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(512, 1)
    plain = nn.Linear(8, 1)
    with torch.no_grad():  # the scale the test judges the final loss on: where training starts, and the best it can reach
        initial_loss = nn.functional.mse_loss(plain(x), y).item()
        design = torch.cat([x, torch.ones(len(x), 1)], dim=1)
        optimum = nn.functional.mse_loss(design @ torch.linalg.lstsq(design, y).solution, y).item()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(plain, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    manager = fabric.strategy.manager
    log = (out / "progress.jsonl").open("a")

    def stopping() -> bool:
        text = stop.read_text().strip() if stop.exists() else ""
        return bool(text) and manager.current_step() >= int(text)

    stop_in_step = int(os.environ.get("FT_TEST_STOP_IN_STEP", "-1"))
    stop_group = os.environ.get("FT_TEST_STOP_GROUP")  # under the launcher: only this group, only its first attempt
    if stop_group is not None and (stop_group != str(fabric.strategy.replica_group) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        stop_in_step = -1
    groups = fabric.strategy.num_replica_groups
    epoch, local = 0, 0
    while not stopping():
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()  # joins the step's quorum (synchronous)
            loss = nn.functional.mse_loss(model(xb), yb)
            # the other group waits in this step's allreduce for this one (a group that joined late, healing from the
            # other, starts past step 0: the first step at or after N with both groups)
            if 0 <= stop_in_step <= manager.current_step() and manager.num_participants() == groups:
                (out / "in_step").write_text(str(manager.current_step()))
                time.sleep(3600)
            fabric.backward(loss)
            before = [_full(p) for p in plain.parameters()]
            optimizer.step()
            local += 1
            changed = any(not torch.equal(a, _full(p)) for a, p in zip(before, plain.parameters()))
            committed = getattr(optimizer, "committed", None)
            record = {"step": manager.current_step(), "participants": manager.num_participants(),
                      "committed": committed, "changed": changed, "t": time.time(), "local": local}  # fmt: skip
            log.write(json.dumps(record) + "\n")
            log.flush()
            fabric.log("loss", loss.detach(), step=manager.current_step())
            if stopping():
                break
            time.sleep(sleep)
        epoch += 1
    weights = {k: _full(v) for k, v in plain.state_dict().items()}
    torch.save(weights, out / "final.pt")
    with torch.no_grad():
        final_loss = nn.functional.mse_loss(x @ weights["weight"].T + weights["bias"], y).item()
    # An ordinary checkpoint beside the fault tolerance: written by the first group of the quorum only.
    fabric.save(base / f"checkpoint-g{fabric.strategy.replica_group}.ckpt", {"model": model, "optimizer": optimizer})
    result = {"loss": final_loss, "initial_loss": initial_loss, "optimum": optimum, "step": manager.current_step(),
              "device": str(next(plain.parameters()).device), "process_group": type(manager._pg).__name__}  # fmt: skip
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.02)
