"""Instructions fabric-core adds to each call of a training step, counted by valgrind's callgrind.

    python benchmarks/step_instructions.py            # ~3 min on 2 cores (torch's import under valgrind is most of it)
    python benchmarks/step_instructions.py --steps 500

Timing a ~1-10 µs difference in a ~200 µs step takes many runs on a shared machine (the training-loop section's
ratio moves by +-0.01 between runs a minute apart). Instruction counts are exact: the same code gives the same count
whatever else runs, so a change to the wrappers can be judged by one run. They do not include cache misses, which
make the wrappers' instructions cost more in a real loop than in isolation (about 2.5x on our 2-core machine); use
them next to the timed section, not instead of it.

One process runs the tiny model of the training-loop section, raw and set up with ``Fabric(accelerator="cpu")``,
in regions of ``--steps`` calls each: forward, backward, ``optimizer.step()``, ``zero_grad()``, the whole step. Each
region is counted alone: callgrind zeroes its counters when ``os.getsid`` is called and writes them when
``os.getpgrp`` is (two calls nothing else in the loop makes). Every region runs three times; the table shows the
smallest count per call and what ours adds. Needs ``valgrind`` on the PATH; without it the script says so and
exits with status 0.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

REGIONS = ("forward", "backward", "step", "zero_grad", "whole step")


def worker(steps: int) -> None:
    """The measured process: each region between ``os.getsid(0)`` (counters zeroed) and ``os.getpgrp()`` (dumped)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from fabric_core import Fabric

    torch.set_num_threads(1)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    x, y = torch.randn(16, 32), torch.randint(0, 2, (16,))
    fabric = Fabric(accelerator="cpu", devices=1)
    raw_model = build()
    raw = (raw_model, torch.optim.SGD(raw_model.parameters(), lr=1e-3), torch.Tensor.backward)
    ours_model = build()
    ours = (*fabric.setup(ours_model, torch.optim.SGD(ours_model.parameters(), lr=1e-3)), fabric.backward)

    def whole(model, optimizer, backward):
        for _ in range(steps):
            backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    def forward(model, optimizer, backward):
        for _ in range(steps):
            model(x)

    def backward_only(model, optimizer, backward):
        losses = [F.cross_entropy(model(x), y) for _ in range(steps)]
        os.getsid(0)  # made the graphs first: only the backward calls are counted
        for loss in losses:
            backward(loss)

    def step(model, optimizer, backward):
        for _ in range(steps):
            optimizer.step()

    def zero_grad(model, optimizer, backward):
        for _ in range(steps):
            optimizer.zero_grad()

    bodies = {"forward": forward, "backward": backward_only, "step": step, "zero_grad": zero_grad, "whole step": whole}
    for variant in (raw, ours):  # warm-up: optimizer state, allocator, first-call paths
        whole(*variant)
    order = []
    for _ in range(3):
        for name, body in bodies.items():
            for label, variant in (("raw", raw), ("ours", ours)):
                order.append((name, label))
                os.getsid(0)
                body(*variant)
                os.getpgrp()
    print("ORDER " + json.dumps(order))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="calls per region (default 300)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps)
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("valgrind is not installed: nothing to count (apt install valgrind)")
        return 0
    with tempfile.TemporaryDirectory() as out:
        command = [
            valgrind, "--tool=callgrind", f"--callgrind-out-file={out}/cg", "--zero-before=getsid",
            "--dump-before=getpgrp", sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(args.steps),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        found = re.search(r"^ORDER (.*)$", done.stdout, re.M)
        if done.returncode != 0 or found is None:
            print(done.stdout[-2000:], done.stderr[-4000:], sep="\n")
            print(f"the counted process failed (exit {done.returncode})")
            return 1
        order = [tuple(entry) for entry in json.loads(found.group(1))]
        dumps = sorted(glob.glob(f"{out}/cg.*"), key=lambda p: int(p.rsplit(".", 1)[1]))[-len(order) :]
        counts: dict[tuple[str, str], list[float]] = {}
        for key, path in zip(order, dumps):
            with open(path) as f:
                total = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
            counts.setdefault(key, []).append(int(total.group(1)) / args.steps if total else float("nan"))
    print(f"instructions per call ({args.steps} calls per region, smallest of 3; callgrind)\n")
    print(f"| {'call':<12} | {'raw':>10} | {'ours':>10} | {'added':>8} | {'added %':>7} |")
    print(f"|{'-' * 14}|{'-' * 12}|{'-' * 12}|{'-' * 10}|{'-' * 9}|")
    for name in REGIONS:
        raw, ours = min(counts[(name, "raw")]), min(counts[(name, "ours")])
        print(f"| {name:<12} | {raw:>10,.0f} | {ours:>10,.0f} | {ours - raw:>+8,.0f} | {100 * (ours - raw) / raw:>+6.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
