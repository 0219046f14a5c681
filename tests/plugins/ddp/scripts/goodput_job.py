"""A small DDP training job for the goodput ledger, straggler and hang tests.

    python goodput_job.py OUT MODE STEPS [--slow RANK:SECONDS] [--stuck RANK:STEP] [--eval SECONDS]
                                         [--devices N] [--save-every K]

MODE: ``launch`` (``fabric.launch()``, 4 processes by default) or ``cli`` (under ``fabric run``). Every rank writes
``OUT/rank<R>.json`` at the end: the stragglers its ``on_straggler`` callback received (with the step it was at) and
its step count. ``--slow``: that rank sleeps SECONDS more per step; ``--stuck``: that rank sleeps for an hour at that
step (a hang in user code); ``--eval``: at step ``--eval-at`` (default: after the last), rank 0 alone works SECONDS in a
declared section (no Fabric call in it; its hang limit ``--eval-limit``) while the others wait in a barrier.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fabric_core import Fabric


class Seen:
    def __init__(self) -> None:
        self.stragglers: list[dict] = []
        self.step = 0

    def on_straggler(self, fabric: Fabric, straggler) -> None:
        self.stragglers.append({**straggler.as_dict(), "seen_at_step": self.step})


def evaluate(fabric: Fabric, args: argparse.Namespace) -> None:
    with fabric.section("evaluation", hang_limit=args.eval_limit):
        if fabric.global_rank == 0:
            (args.out / "eval_started").write_text(str(time.time()))
            deadline = time.monotonic() + args.eval
            while time.monotonic() < deadline:  # rank 0's own work, no Fabric call in it
                time.sleep(0.5)
            (args.out / "eval_ended").write_text(str(time.time()))
        fabric.barrier()  # inside: the others' wait counts as evaluation too


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", choices=["launch", "cli"])
    parser.add_argument("steps", type=int)
    parser.add_argument("--slow", default=None)
    parser.add_argument("--stuck", default=None)
    parser.add_argument("--eval", type=float, default=0.0)
    parser.add_argument("--eval-at", type=int, default=-1)
    parser.add_argument("--eval-limit", type=float, default=None)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=0)
    args = parser.parse_args()
    seen = Seen()
    if args.mode == "cli":
        fabric = Fabric(callbacks=[seen])
    else:
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=args.devices, callbacks=[seen])
        fabric.launch()
    slow_rank, slow_s = (int(args.slow.split(":")[0]), float(args.slow.split(":")[1])) if args.slow else (-1, 0.0)
    stuck_rank, stuck_step = (int(args.stuck.split(":")[0]), int(args.stuck.split(":")[1])) if args.stuck else (-1, -1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = torch.randn(16, 32)
    for step in range(args.steps):
        seen.step = step
        if step == args.eval_at:
            evaluate(fabric, args)
        if fabric.global_rank == slow_rank:
            time.sleep(slow_s)
        if fabric.global_rank == stuck_rank and step == stuck_step:
            (args.out / "stuck_at").write_text(str(time.time()))
            time.sleep(3600)  # STUCK HERE
        loss = model(data).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        if args.save_every and (step + 1) % args.save_every == 0:
            fabric.save(str(args.out / "ckpt" / "last.ckpt"), {"model": model, "optimizer": optimizer})
    if args.eval and args.eval_at < 0:
        evaluate(fabric, args)
    seen.step = args.steps
    result = {"rank": fabric.global_rank, "steps": args.steps, "stragglers": seen.stragglers, "run_dir": str(fabric.run_info.dir)}
    (args.out / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
