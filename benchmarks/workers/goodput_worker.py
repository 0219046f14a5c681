"""Workers of the ``goodput`` benchmark section (issue 40).

    python goodput_worker.py overhead --steps N --blocks B       one process: the ledger's cost per step
    python goodput_worker.py equal OUT --steps N --devices D    D equal ranks (fabric.launch()): count false alarms

``overhead`` times (1) the ledger's three hot-path calls alone, per step, and (2) a tiny training loop with the
ledger on and off in alternating blocks (process CPU time), and emits both. ``equal`` trains D identical ranks for N
steps and writes ``OUT/rank<R>.json`` with the stragglers their ``on_straggler`` callbacks received.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import emit  # noqa: E402


def overhead(args: argparse.Namespace) -> None:
    import torch

    from fabric_core import Fabric
    from fabric_core.runtime import goodput

    torch.set_num_threads(1)
    goodput.start(None, 0, 1, write=False)
    hot_calls = (goodput.on_forward, goodput.on_backward, goodput.on_step)
    n = 200_000
    start = time.perf_counter()
    for _ in range(n):
        pass
    empty = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n):
        hot_calls[0]()
        hot_calls[1]()
        hot_calls[2]()
    hot_us = (time.perf_counter() - start - empty) / n * 1e6

    fabric = Fabric(accelerator="cpu", devices=1)
    layer = torch.nn.Linear(32, 32)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.01))
    x = torch.randn(8, 32)

    def block(on: bool) -> float:
        goodput.marking = on
        start = time.process_time()
        for _ in range(args.steps):
            loss = model(x).sum()
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
        return (time.process_time() - start) / args.steps * 1e6

    block(True), block(False)  # warm-up
    on, off = [], []
    for i in range(args.blocks):
        for state in ((True, False) if i % 2 == 0 else (False, True)):
            (on if state else off).append(block(state))
    goodput.stop()
    emit({"hot_path_us": hot_us, "step_on_us": on, "step_off_us": off})


def equal(args: argparse.Namespace) -> None:
    import torch

    from fabric_core import Fabric

    class Seen:
        def __init__(self) -> None:
            self.stragglers: list[dict] = []

        def on_straggler(self, fabric: Fabric, straggler) -> None:
            self.stragglers.append(straggler.as_dict())

    seen = Seen()
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=args.devices, callbacks=[seen])
    fabric.launch()
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.01))
    x = torch.randn(16, 32)
    started = time.monotonic()
    for _ in range(args.steps):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    took = time.monotonic() - started
    result = {"rank": fabric.global_rank, "stragglers": seen.stragglers, "seconds": took, "steps": args.steps}
    (Path(args.out) / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["overhead", "equal"])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()
    overhead(args) if args.what == "overhead" else equal(args)


if __name__ == "__main__":
    main()
