"""The ``ray`` section's job: one DDP loop (2 processes, gloo, CPU) run three ways.

    fabric run --devices 2 ray_worker.py loop ...                 # torchrun (the baseline)
    fabric run --launcher ray --devices 2 ray_worker.py loop ...  # fabric-ray's launcher on a running cluster
    python ray_worker.py trainer --address A --node-ip IP ...     # a driver: Ray Train's TorchTrainer, 2 workers

Rank 0 measures the seconds from ``--t0`` (the harness's ``time.time()`` when it started the command; an argument,
as Ray's workers do not inherit the driver's environment) to the end of the first
optimizer step, and the steady steps/s over ``--steps`` steps after ``--warmup`` (between barriers); it emits one
result line (under ``--launcher ray`` that line arrives prefixed ``[rank 0]``; inside TorchTrainer it travels back
through ``ray.train.report``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

RESULT_PREFIX = "BENCH_JSON "


def loop(cfg: dict[str, Any]) -> dict[str, Any] | None:
    from fabric_core import Fabric

    fabric = Fabric(accelerator="cpu", strategy="ddp")
    if os.environ.get("FABRIC_CLI_USED") != "1":
        fabric.launch()  # inside TorchTrainer: starts nothing (under `fabric run` the CLI refuses a launch() call)
    torch.manual_seed(0)
    width = cfg["width"]
    layers = [m for _ in range(cfg["layers"]) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(cfg["batch"], width)

    def step() -> None:
        loss = model(x).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    step()
    first_step_s = time.time() - cfg["t0"]
    for _ in range(cfg["warmup"]):
        step()
    fabric.barrier()
    start = time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    fabric.barrier()
    elapsed = time.perf_counter() - start
    if fabric.global_rank != 0:
        return None
    return {"first_step_s": first_step_s, "steps_per_s": cfg["steps"] / elapsed, "world": fabric.world_size}


def trainer(cfg: dict[str, Any], address: str, node_ip: str | None) -> dict[str, Any]:
    import ray
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    result_file = os.path.join(cfg["storage"], f"result-{os.getpid()}.json")

    def train_loop(config: dict[str, Any]) -> None:
        result = loop(config)
        if result is not None:  # Train V2 keeps metrics only with a checkpoint: rank 0 hands them over in a file
            with open(result_file, "w") as f:
                json.dump(result, f)
        ray.train.report({})

    ray.init(address=address, _node_ip_address=node_ip, logging_level="ERROR", log_to_driver=False)
    result = TorchTrainer(
        train_loop,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=cfg["storage"], name="bench"),
    ).fit()
    ray.shutdown()
    if result.error is not None:
        raise result.error
    with open(result_file) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("how", choices=("loop", "trainer"))
    for name, default in (("width", 256), ("layers", 4), ("batch", 64), ("warmup", 10), ("steps", 100)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--address")
    parser.add_argument("--node-ip")
    parser.add_argument("--storage", default="/tmp/fabric-ray-bench")
    parser.add_argument("--t0", type=float, required=True, help="time.time() when the harness started the command")
    args = parser.parse_args()
    cfg = {k: getattr(args, k) for k in ("width", "layers", "batch", "warmup", "steps", "storage", "t0")}
    result = loop(cfg) if args.how == "loop" else trainer(cfg, args.address, args.node_ip)
    if result:
        sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
