"""Sweep a learning rate over Ray Tune trials, each one a plain Fabric training loop reporting through ``loggers="ray"``.

    python examples/ray_tune/tune_sweep.py                              # a local Ray started here, 4 trials
    python examples/ray_tune/tune_sweep.py --address HOST:PORT          # on a running cluster (or RAY_ADDRESS)

Each trial is one process with one CPU (``tune.with_resources``), so several trials share the cluster's CPUs. In a
trial, ``fabric.log``/``log_dict`` become ``ray.tune.report`` and ``fabric.save`` a Tune checkpoint: Tune ranks the
trials by the logged ``loss`` and keeps each trial's last checkpoint. The script prints one line per trial and a
``BEST {...}`` JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from fabric_core import Fabric


def train(config: dict) -> None:
    """One trial: fit a linear model with SGD at ``config["lr"]``; the loss goes to Tune at every step."""
    import ray.tune

    fabric = Fabric(accelerator="cpu", devices=1, loggers="ray")
    torch.manual_seed(0)
    truth = torch.randn(8, 1)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(1, config["steps"] + 1):
        x = torch.randn(32, 8)
        loss = torch.nn.functional.mse_loss(model(x), x @ truth)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.log_dict({"loss": loss.item(), "lr": config["lr"]}, step=step)
    # the trial's last weights, reported to Tune as its checkpoint (an absolute path: the trial runs elsewhere)
    folder = os.path.join(tempfile.gettempdir(), "fabric-tune", ray.tune.get_context().get_trial_name())
    fabric.save(os.path.join(folder, "final.ckpt"), {"model": model, "step": config["steps"]})


def main() -> None:
    import ray
    from ray import tune

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4, help="learning rates to try (default: 4)")
    parser.add_argument("--steps", type=int, default=50, help="training steps per trial (default: 50)")
    parser.add_argument("--address", default=None, help="a running cluster's HOST:PORT (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--node-ip", default=None, help="this machine's address as the cluster knows it (several addresses only)")
    parser.add_argument("--storage-path", default=None, help="where Tune keeps results and checkpoints (default: ~/ray_results)")
    args = parser.parse_args()

    ray.init(address=args.address, _node_ip_address=args.node_ip, logging_level="ERROR")
    learning_rates = [0.3 / 3**i for i in range(args.trials)]  # 0.3, 0.1, 0.033, 0.011
    tuner = tune.Tuner(
        tune.with_resources(train, {"cpu": 1}),
        param_space={"lr": tune.grid_search(learning_rates), "steps": args.steps},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(name="fabric_lr_sweep", storage_path=args.storage_path, verbose=0),
    )
    results = tuner.fit()
    for result in sorted(results, key=lambda r: r.config["lr"]):
        error = f" error: {result.error}" if result.error else ""
        print(f"lr={result.config['lr']:.4g} loss={result.metrics.get('loss', float('nan')):.4g} checkpoint={result.checkpoint is not None}{error}")
    best = results.get_best_result()
    print("BEST", json.dumps({"lr": best.config["lr"], "loss": best.metrics["loss"], "trials": len(results), "errors": results.num_errors}))
    ray.shutdown()


if __name__ == "__main__":
    main()
