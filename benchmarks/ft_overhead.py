"""What fault tolerance costs when nothing fails: steady steps/s of ``ft_ddp`` with 2 replica groups (torchft, a
lighthouse on loopback) over ``ddp`` with 2 ranks, the same model and batches, on CPU (gloo).

``python benchmarks/ft_overhead.py [--reps 3] [--steps 200]``: each repetition runs both variants as fresh jobs
(alternating which goes first), times steps ``warmup..steps`` in the first process, and prints one line per run and
the median ratio. Every process is started here with a timeout and killed by pid at the end. The time a survivor
loses to a failure is measured by ``tests/plugins/ft/test_ft_kill_rejoin.py`` (printed with ``-s``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 30


def worker(mode: str, steps: int, out: Path) -> None:
    import torch
    from torch import nn

    from fabric_core import Fabric

    if mode == "ft":
        from fabric_ft import FTDDPStrategy

        fabric = Fabric(accelerator="cpu", devices=1, strategy=FTDDPStrategy(hostname="127.0.0.1"))
    else:
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = torch.randn(32, 256), torch.randn(32, 1)
    times = []
    for _ in range(steps):
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        times.append(time.perf_counter())
    if fabric.global_rank == 0:
        out.write_text(json.dumps({"steps_per_s": (steps - WARMUP) / (times[-1] - times[WARMUP - 1])}))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, steps: int, work: Path, timeout: float) -> float:
    out = work / f"{mode}-{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MASTER_PORT", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"  # both variants: one thread per process, as torchrun's default
    me = [sys.executable, __file__, "--worker", mode, "--steps", str(steps), "--out", str(out)]
    procs: list[subprocess.Popen] = []
    try:
        if mode == "ft":
            port = _port()
            binary = Path(sys.executable).parent / "torchft_lighthouse"
            lighthouse = [str(binary), "--bind", f"127.0.0.1:{port}", "--min_replicas", "2", "--join_timeout_ms", "5000"]
            procs.append(subprocess.Popen(lighthouse, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for group in (0, 1):
                group_env = dict(env, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", REPLICA_GROUP_ID=str(group))
                group_env["NUM_REPLICA_GROUPS"] = "2"
                procs.append(subprocess.Popen(me, env=group_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            waited = procs[1:]
        else:
            env["MASTER_PORT"] = str(_port())
            procs.append(subprocess.Popen(me, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            waited = procs
        for proc in waited:
            if proc.wait(timeout) != 0:
                raise RuntimeError(f"{mode} worker failed with exit code {proc.returncode}")
        return json.loads(out.read_text())["steps_per_s"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", choices=("ft", "ddp"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = ("ft", "ddp") if rep % 2 == 0 else ("ddp", "ft")
            rates = {mode: _run(mode, args.steps, Path(tmp), args.timeout) for mode in order}
            ratios.append(rates["ft"] / rates["ddp"])
            print(f"rep {rep}: ft_ddp {rates['ft']:.1f} steps/s, ddp {rates['ddp']:.1f} steps/s, ratio {ratios[-1]:.3f}")
    print(f"ft_ddp (2 replica groups) / ddp (2 ranks) steady steps/s: median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
