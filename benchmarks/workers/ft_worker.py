"""The ``ft`` section's job: one training loop in one of several ways, with the same model, batch and optimizer on CPU
(gloo, one thread per process).

``python ft_worker.py MODE --steps N --warmup W --out FILE [--sync-every H]``:

* ``ddp``: Fabric's ``ddp`` with 2 ranks (``fabric.launch()``), the baseline without fault tolerance;
* ``ft``: Fabric's ``ft_ddp``, one process per replica group (the section starts a lighthouse and the groups);
* ``raw``: the same replica group written against torchft directly: its ``Manager``, ``DistributedDataParallel`` and
  ``OptimizerWrapper``, the loop torchft's README shows;
* ``diloco``: Fabric's ``ft_ddp`` with ``semi_sync="diloco"``, synchronising every H steps;
* ``raw_diloco``: torchft's ``DiLoCo`` over a plain model and optimizer with its own ``Manager`` (synchronous quorum);
* ``alone``: one process training by itself with Fabric's single-device strategy: a replica group that never
  communicates (the ceiling of semi-synchronous training).

The first process (replica group 0, or rank 0) times steps ``W..N`` and writes ``{"steps_per_s": ...}`` to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

MODES = ("ddp", "ft", "raw", "diloco", "raw_diloco", "alone")


def _raw_manager(semi_sync: bool):  # noqa: ANN202
    """torchft's Manager for a one-process replica group, as torchft's examples make it."""
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=not semi_sync,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        replica_id=f"raw_{os.environ['REPLICA_GROUP_ID']}",
        hostname="127.0.0.1",
    )
    return manager, store


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from torch import nn

    torch.manual_seed(0)
    width = args.width
    model = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 256), torch.randn(32, 1)
    first = os.environ.get("REPLICA_GROUP_ID", "0") == "0"

    if args.mode in ("raw", "raw_diloco"):
        manager, _store = _raw_manager(args.mode == "raw_diloco")
        state = {"model": model, "optimizer": optimizer}
        manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        manager.register_state_dict_fn("optimizer", optimizer.load_state_dict, optimizer.state_dict)
        if args.mode == "raw":
            from torchft import DistributedDataParallel
            from torchft.optim import OptimizerWrapper

            state["model"] = DistributedDataParallel(manager, model)
            state["optimizer"] = OptimizerWrapper(manager, optimizer)
        else:
            from torchft.local_sgd import DiLoCo

            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            DiLoCo(manager, [model], optimizer, outer, sync_every=args.sync_every).__enter__()
        step_model, step_optimizer = state["model"], state["optimizer"]
        backward = torch.Tensor.backward
    else:
        from fabric_core import Fabric

        if args.mode == "ddp":
            fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
            fabric.launch()
            first = fabric.global_rank == 0
        elif args.mode == "alone":
            fabric = Fabric(accelerator="cpu", devices=1)
        else:
            from fabric_ft import FTDDPStrategy

            semi = {"semi_sync": "diloco", "sync_every": args.sync_every} if args.mode == "diloco" else {}
            fabric = Fabric(accelerator="cpu", devices=1, strategy=FTDDPStrategy(hostname="127.0.0.1", **semi))
        step_model, step_optimizer = fabric.setup(model, optimizer)
        backward = fabric.backward

    times = []
    for _ in range(args.steps):
        step_optimizer.zero_grad()
        backward(nn.functional.mse_loss(step_model(x), y))
        step_optimizer.step()
        times.append(time.perf_counter())
    if first:
        timed = args.steps - args.warmup
        args.out.write_text(json.dumps({"steps_per_s": timed / (times[-1] - times[args.warmup - 1])}))


if __name__ == "__main__":
    main()
