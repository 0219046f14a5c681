"""Shared model, data and reference training for the DeepSpeed worker scripts (run as real rank processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: the shared script helpers
from script_helpers import dump, expect_error, mark, max_diff, out_dir  # noqa: E402,F401 (re-exported)

D_IN, D, D_OUT, BATCH = 8, 16, 4, 4  # BATCH per rank
LR = 1e-2


class Net(nn.Module):
    """A small MLP with a LayerNorm and a persistent buffer (checkpoints must carry it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.norm = nn.LayerNorm(D)
        self.hidden = nn.Linear(D, D)
        self.out = nn.Linear(D, D_OUT)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, D_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        return self.out(torch.tanh(self.hidden(h))) + self.offset


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4)


def make_data(steps: int, world_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch (rank-ordered) at every step, in every process, so the loss must go down."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, world_size * BATCH, D_IN, generator=g).expand(steps, -1, -1)
    y = torch.randn(1, world_size * BATCH, D_OUT, generator=g).expand(steps, -1, -1)
    return x, y


def local(batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch[rank * BATCH : (rank + 1) * BATCH]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def reference_losses(steps: int, world_size: int, accumulate_at: int | None = None) -> list[float]:
    """Single-process AdamW on the global batch; at ``accumulate_at`` the step uses two half micro-batches."""
    model = make_model()
    opt = make_optimizer(model)
    x, y = make_data(steps, world_size)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        if s == accumulate_at:
            halves = [slice(0, BATCH // 2), slice(BATCH // 2, BATCH)]
            chunks_x = x[s].view(world_size, BATCH, D_IN)
            chunks_y = y[s].view(world_size, BATCH, D_OUT)
            for h in halves:
                (loss_fn(model(chunks_x[:, h].reshape(-1, D_IN)), chunks_y[:, h].reshape(-1, D_OUT)) / 2).backward()
            loss = loss_fn(model(x[s]), y[s]).detach()
        else:
            loss = loss_fn(model(x[s]), y[s])
            loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def full_params(fabric, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters and buffers of a model set up with DeepSpeed (gathered under stage 3), on every rank."""
    import deepspeed

    inner = model.module if hasattr(model, "module") else model
    params = [p for p in inner.parameters() if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(params) if params else _nothing():
        return {k: v.detach().float().cpu().clone() for k, v in inner.state_dict().items()}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
