"""Resume a quantized model: train 3 steps, ``fabric.save``, ``fabric.load`` into a model built from another seed,
then 3 more steps of both; every trainable weight (LoRA adapters beside a frozen quantized base; int8 training's own
weights) must be bit-identical after each step. SGD with momentum, so optimizer state counts too; the saved model
also ran an evaluation forward before the save (bitsandbytes repacks a 4-bit weight for CPU inference there).

As a job: ``python bnb_resume.py OUTDIR MODE...`` on 2 DDP ranks, writing ``rank<r>.json`` ({mode: result}).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from fabric_core import Fabric

MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training")


class LoRA(nn.Module):
    def __init__(self, base: nn.Module, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def build(fabric: Fabric, mode: str, seed: int):
    torch.manual_seed(seed)
    with fabric.init_module():
        # sizes bitsandbytes' CPU inference repacking takes (out % 32, in % 64), so the evaluation below uses it
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    if mode != "int8-training":  # frozen quantized bases: adapters train beside them
        model[0], model[2] = LoRA(model[0]), LoRA(model[2])
    trainable = [p for p in model.parameters() if p.requires_grad]
    return fabric.setup(model, torch.optim.SGD(trainable, lr=0.05, momentum=0.9))


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


def train(fabric: Fabric, model, optimizer, x, y, steps: int) -> list[dict[str, torch.Tensor]]:
    after = []
    for _ in range(steps):
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        after.append(trainable(model))
    return after


def resume_check(fabric: Fabric, mode: str, path: Path) -> dict:
    """Max absolute difference of the trainable weights after each of the 3 steps after the resume, and checks that
    the comparison means something (the fresh model differed before the load; the steps moved the weights)."""
    g = torch.Generator().manual_seed(10 + fabric.global_rank)  # each rank its own batch
    x, y = torch.randn(8, 64, generator=g), torch.randn(8, 32, generator=g)
    model, optimizer = build(fabric, mode, seed=0)
    train(fabric, model, optimizer, x, y, 3)
    model.eval()
    with torch.no_grad():
        model(x)  # an evaluation before the save
    model.train()
    fabric.save(path, {"model": model, "optimizer": optimizer})
    saved = trainable(model)
    fresh, fresh_optimizer = build(fabric, mode, seed=1)
    differed = any(not torch.equal(v, saved[k]) for k, v in trainable(fresh).items())
    fabric.load(path, {"model": fresh, "optimizer": fresh_optimizer})
    ours, theirs = train(fabric, model, optimizer, x, y, 3), train(fabric, fresh, fresh_optimizer, x, y, 3)
    return {
        "diffs": [max(float((a[k].float() - b[k].float()).abs().max()) for k in a) for a, b in zip(ours, theirs)],
        "fresh_differed": differed,
        "moved": max(float((ours[-1][k].float() - saved[k].float()).abs().max()) for k in saved),
        "names": sorted(saved),
        "synced": bool(torch.equal(*fabric.all_gather(torch.cat([v.float().flatten() for v in ours[-1].values()])))) if fabric.world_size > 1 else True,
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    results = {}
    for mode in sys.argv[2:]:
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, precision="bnb-" + mode)
        fabric.launch()
        results[mode] = resume_check(fabric, mode, out / f"{mode}.ckpt")
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(results))
