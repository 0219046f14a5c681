"""Per-block compile against whole-model compile and eager, on the CPU with inductor (issue 31).

``python -m benchmarks.compile_blocks [--depth 6] [--width 64] [--steps 30]``: each variant runs in a fresh process
with an empty inductor cache (so the compile time is a cold compile, what a user's first run pays): a stack of
``depth`` Transformer encoder layers trained with AdamW through Fabric on one CPU process. Reported per variant:
the first step (compile included) and the steps/s after it (median of 3 timed windows). Prints one JSON line per
variant and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("eager", "whole", "blocks")


def _worker(variant: str, depth: int, width: int, steps: int) -> dict:
    import torch
    from torch import nn

    from fabric_core import Fabric
    from fabric_core.loop.compile import compile_blocks

    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True) for _ in range(depth)]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    if variant == "whole":
        model = torch.compile(model)
    elif variant == "blocks":
        compile_blocks(model, blocks=nn.TransformerEncoderLayer)
    fabric = Fabric(accelerator="cpu")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(8, 32, width)

    def step() -> None:
        loss = model(x).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    step()  # a second step can still compile (the optimizer's first step is behind it now)
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(steps / (time.perf_counter() - start))
    return {"variant": variant, "first_step_s": round(first, 2), "steps_per_s": round(statistics.median(rates), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", choices=VARIANTS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.depth, args.width, args.steps)))
        return
    results = []
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            command = [sys.executable, "-m", "benchmarks.compile_blocks", "--worker", variant]
            command += ["--depth", str(args.depth), "--width", str(args.width), "--steps", str(args.steps)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print(f"\n| variant | first step (compile included) | steps/s after |  (depth {args.depth}, width {args.width})")
    print("|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['first_step_s']} s | {r['steps_per_s']} |")


if __name__ == "__main__":
    main()
