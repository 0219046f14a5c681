"""A pretraining loop written for the well-known Fabric, with only its imports changed to ours.

It does what LLM pretraining scripts written for the reference do: FLOPs measured on a meta-device copy of the
model, the model ``torch.compile``d *before* ``setup``, gradient accumulation under ``no_backward_sync``, gradient
clipping, a ``ThroughputMonitor`` whose metrics go to a logger class defined here (outside our packages, with the
reference's Logger methods, not a subclass of ours), and a checkpoint saved and loaded back.

``python reference_style.py STRATEGY DEVICES OUT_DIR``. Each rank writes ``OUT_DIR/rank<R>.json`` with what the test
checks: the final weights against a single-process run of the same steps, what the logger received, the FLOPs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from fabric_core import Fabric  # was: from lightning.fabric import Fabric
from fabric_core.utilities import (  # was: from lightning.fabric.utilities import ...
    ThroughputMonitor,
    measure_flops,
)

VOCAB, DIM, SEQ, MICRO_BATCH, ACCUMULATE, STEPS = 64, 32, 16, 2, 2, 3


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        return self.head(x + self.block(x))


class JSONLinesLogger:
    """A logger written against the reference's Logger interface, as other projects ship them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.finalized: str | None = None

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> int:
        return 0

    @property
    def root_dir(self) -> str:
        return str(self.path.parent)

    @property
    def log_dir(self) -> str:
        return str(self.path.parent)

    @property
    def group_separator(self) -> str:
        return "/"

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def log_hyperparams(self, params: dict, *args: object, **kwargs: object) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"hparams": params}) + "\n")

    def log_graph(self, model: nn.Module, input_array: object = None) -> None:
        pass

    def save(self) -> None:
        pass

    def finalize(self, status: str) -> None:
        self.finalized = status


def batches(world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every global micro-batch of the run (rank ``r`` takes rows ``r*MICRO_BATCH:(r+1)*MICRO_BATCH``)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (STEPS * ACCUMULATE, world_size * MICRO_BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference_weights(world_size: int, clip: bool) -> dict[str, torch.Tensor]:
    """The same steps in one plain process on the global batches."""
    torch.manual_seed(42)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(world_size)
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            x, y = data[step * ACCUMULATE + micro]
            (loss_fn(model(x), y) / ACCUMULATE).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone() for k, v in model.state_dict().items()}


def main() -> None:
    strategy, devices, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    logger = JSONLinesLogger(out / "metrics.jsonl")  # one file per rank once the rank is known
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, loggers=[logger])
    fabric.launch()
    rank, world_size = fabric.global_rank, fabric.world_size
    logger.path = out / f"metrics.rank{rank}.jsonl"
    fabric.logger.log_hyperparams({"strategy": strategy, "micro_batch": MICRO_BATCH})
    clip = strategy != "deepspeed"  # DeepSpeed clips inside its engine (`gradient_clipping` in its config)

    with torch.device("meta"):
        meta_model = TinyGPT()
        x = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ))
        flops_per_batch = measure_flops(meta_model, lambda: meta_model(x), lambda y: loss_fn(y, x))

    torch.manual_seed(42)
    model = torch.compile(TinyGPT(), backend="eager")  # compiled before setup, as the reference's users do
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    throughput = ThroughputMonitor(fabric, window_size=2)

    data = batches(world_size)
    t0 = time.perf_counter()
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            is_accumulating = micro < ACCUMULATE - 1
            x, y = data[step * ACCUMULATE + micro]
            x, y = x[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH], y[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                loss = loss_fn(model(x), y)
                fabric.backward(loss / ACCUMULATE, model=model)
        if clip:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        done = step + 1
        throughput.update(
            time=time.perf_counter() - t0 + 1e-9 * done,  # strictly increasing even on a coarse clock
            batches=done,
            samples=done * MICRO_BATCH * ACCUMULATE,
            lengths=done * MICRO_BATCH * ACCUMULATE * SEQ,
            flops=flops_per_batch * ACCUMULATE,
        )
        throughput.compute_and_log(step=step)

    weights = full_state(model)
    checkpoint = out / "checkpoint"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "iter_num": STEPS})
    torch.manual_seed(7)
    fresh = torch.compile(TinyGPT(), backend="eager")
    fresh, fresh_optimizer = fabric.setup(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    state = {"model": fresh, "optimizer": fresh_optimizer, "iter_num": 0}
    fabric.load(checkpoint, state)
    loaded = full_state(fresh)
    expected = reference_weights(world_size, clip)
    result = {
        "rank": rank,
        "world_size": world_size,
        "iter_num": state["iter_num"],
        "max_diff_reference": max(float((weights[k] - expected[k]).abs().max()) for k in expected),
        "max_diff_loaded": max(float((loaded[k] - weights[k]).abs().max()) for k in weights),
        "flops_per_batch": flops_per_batch,
        "available_flops": throughput.available_flops,
        "compiled_after_setup": type(model._forward_module).__name__,
    }
    fabric.teardown()
    result["finalized"] = logger.finalized
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
