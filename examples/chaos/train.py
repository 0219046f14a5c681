"""A training script that survives faults: it checkpoints every few steps and resumes from its newest checkpoint.

Run it under the chaos harness, which kills, hangs and slows its ranks on a seeded schedule and checks that the
final weights equal an uninterrupted run's::

    fabric chaos --world-size 4 --faults kill,hang,slow --hang-timeout 10 --weights final.ckpt \\
        -- fabric run --accelerator cpu --strategy ddp_find_unused_parameters_true --devices 4 --max-restarts 3 \
        examples/chaos/train.py

then see where the time went: ``fabric goodput fabric_chaos/chaos/run --png goodput.png``.

Bit-exact resumption with more than 2 DDP ranks needs ``ddp_find_unused_parameters_true``: plain DDP rebuilds its
gradient buckets after the first step of every start, and with 3 or more ranks the all-reduce's summation order
follows the bucket layout, so the first step after a resume rounds differently (~1e-9) from the uninterrupted run's.

Exact resumption needs everything that decides the next step in the checkpoint: model, optimizer, every rank's
random generators (dropout), the step; the batches here are a function of the step and the rank (a data loader in
``state`` resumes its position too, see docs/decisions.md "Resuming").
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from fabric_core import Fabric
from fabric_core.runtime.resume import RandomStates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    fabric = Fabric()  # accelerator, strategy and devices come from `fabric run`
    fabric.seed_everything(1234)  # every attempt alike; a resumed one then takes the checkpoint's generators
    model = fabric.setup_module(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "rng": RandomStates(fabric), "step": 0}

    latest = fabric.latest_checkpoint("ckpts/step-*.ckpt")  # None on a first start
    if latest is not None:
        fabric.load(latest, state)

    while state["step"] < args.steps:
        generator = torch.Generator().manual_seed(state["step"] * 1000 + fabric.global_rank)
        x = torch.randn(args.batch_size, 32, generator=generator)
        y = x[:, :1] * 0.5 + 0.1 * torch.randn(args.batch_size, 1, generator=generator)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        state["step"] += 1
        if state["step"] % args.save_every == 0:
            fabric.save(f"ckpts/step-{state['step']:05d}.ckpt", state, keep_last=2)

    fabric.save("final.ckpt", {"model": model})
    fabric.print(f"done: {state['step']} steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
