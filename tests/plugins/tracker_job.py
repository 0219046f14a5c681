"""A short training job that logs to an experiment tracker, run as real processes by the tracker plugins' tests.

    python tracker_job.py CONFIG_JSON

CONFIG keys: ``loggers`` (what ``Fabric(loggers=...)`` gets: a name, ``{name: options}``, a list, or
``{"class": "pkg:Cls", "options": {...}}`` for an object built here), ``strategy``/``devices`` (default: one process), ``mode``
(``"script"``: ``fabric.launch()`` and the script continues in every rank; ``"function"``: ``fabric.launch(fn)``),
``steps``, ``fail_at`` (raise at that step, on ``fail_rank`` or every rank), ``checkpoint`` (a path to save to at
the end), ``teardown`` (call ``fabric.teardown()``: the explicit end), ``out`` (where each rank writes what it saw).

Every rank logs ``rank`` = its global rank: a tracker that only rank 0 writes to shows only zeros.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

from fabric_core import Fabric


def build_loggers(spec):
    if isinstance(spec, dict) and "class" in spec:
        module, _, name = spec["class"].partition(":")
        return getattr(importlib.import_module(module), name)(**spec.get("options", {}))
    if isinstance(spec, list):
        return [build_loggers(item) for item in spec]
    return spec


def train(fabric: Fabric, config: dict) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.logger.log_hyperparams({"lr": 0.1, "model": {"in": 4, "out": 1}, "world_size": fabric.world_size})
    for step in range(config.get("steps", 3)):
        if step == config.get("fail_at") and config.get("fail_rank", fabric.global_rank) == fabric.global_rank:
            raise RuntimeError(f"planned failure at step {step} on rank {fabric.global_rank}")
        loss = model(torch.ones(2, 4, device=fabric.device)).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        fabric.log_dict({"loss": loss, "rank": fabric.global_rank}, step=step)
    if config.get("checkpoint"):
        fabric.save(config["checkpoint"], {"model": model, "step": step})
    out = config.get("out")
    if out:
        logger = fabric.logger
        Path(out, f"rank{fabric.global_rank}.json").write_text(
            json.dumps({"rank": fabric.global_rank, "version": logger.version, "logger": type(logger).__name__})
        )
    if config.get("teardown"):
        fabric.teardown()


def main() -> None:
    config = json.loads(sys.argv[1])
    fabric = Fabric(
        accelerator="cpu",
        strategy=config.get("strategy", "auto"),
        devices=config.get("devices", 1),
        loggers=build_loggers(config["loggers"]),
    )
    if config.get("mode", "script") == "function":
        fabric.launch(train, config)
    else:
        fabric.launch()
        train(fabric, config)


if __name__ == "__main__":
    main()
