"""One replica group of an ``ft_ddp`` job: a small regression trained with the ordinary Fabric loop.

``python ft_train.py OUT STOP [SLEEP]`` with ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS``
set. Every step appends ``{"step", "participants", "committed", "changed", "t"}`` to ``OUT/progress.jsonl``
(``changed``: ``optimizer.step()`` changed the weights); with ``FT_TEST_STOP_IN_STEP=N`` the group stops inside
the first step from N on with both groups in its quorum, after joining the quorum and before its gradients'
allreduce, writes the step to ``OUT/in_step`` and waits to be killed; once the file
``STOP`` holds a step number and the step counter reached it, the weights go to ``OUT/final.pt`` and the loss over
the whole data set (with the initial loss and the least-squares optimum) to ``OUT/result.json``; the first group of the last quorum also writes ``OUT/checkpoint.ckpt``
with ``fabric.save``.
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
from fabric_ft import FTDDPStrategy


def main(out: Path, stop: Path, sleep: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # FT_TEST_ACCELERATOR=cuda: the GPU lane's run (ProcessGroupNCCL between the groups)
    accelerator = os.environ.get("FT_TEST_ACCELERATOR", "cpu")
    fabric = Fabric(accelerator=accelerator, devices=1, strategy=FTDDPStrategy(hostname="127.0.0.1"))
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
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=16))
    manager = fabric.strategy.manager
    log = (out / "progress.jsonl").open("a")

    def stopping() -> bool:
        text = stop.read_text().strip() if stop.exists() else ""
        return bool(text) and manager.current_step() >= int(text)

    stop_in_step = int(os.environ.get("FT_TEST_STOP_IN_STEP", "-1"))
    epoch = 0
    while not stopping():
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()  # joins the step's quorum
            loss = nn.functional.mse_loss(model(xb), yb)
            # the other group waits in this step's allreduce for this one (a group that joined late, healing from the
            # other, starts past step 0: the first step at or after N with both groups)
            if 0 <= stop_in_step <= manager.current_step() and manager.num_participants() == 2:
                (out / "in_step").write_text(str(manager.current_step()))
                time.sleep(3600)
            fabric.backward(loss)
            before = [p.detach().clone() for p in plain.parameters()]
            optimizer.step()
            changed = any(not torch.equal(a, p) for a, p in zip(before, plain.parameters()))
            record = {"step": manager.current_step(), "participants": manager.num_participants(),
                      "committed": optimizer.committed, "changed": changed, "t": time.time()}  # fmt: skip
            log.write(json.dumps(record) + "\n")
            log.flush()
            if stopping():
                break
            time.sleep(sleep)
        epoch += 1
    torch.save({k: v.cpu() for k, v in plain.state_dict().items()}, out / "final.pt")
    with torch.no_grad():
        final_loss = nn.functional.mse_loss(plain(x.to(fabric.device)), y.to(fabric.device)).item()
    # An ordinary checkpoint beside the fault tolerance: written by the first group of the quorum only.
    fabric.save(out / "checkpoint.ckpt", {"model": model, "optimizer": optimizer})
    result = {"loss": final_loss, "initial_loss": initial_loss, "optimum": optimum, "step": manager.current_step(),
              "device": str(next(plain.parameters()).device), "process_group": type(manager._pg).__name__}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.02)
