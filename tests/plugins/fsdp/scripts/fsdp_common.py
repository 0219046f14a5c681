"""Shared model, data and reference training for the FSDP worker scripts (run as real rank processes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: the shared script helpers
from script_helpers import dump, expect_error, mark, max_diff, out_dir  # noqa: E402,F401 (re-exported)

D_IN, D, D_OUT, BATCH = 8, 16, 4, 4  # BATCH per rank
#: "cuda" runs the same checks on GPUs (tests/plugins/fsdp/test_fsdp.py sets it when 2 GPUs exist).
ACCELERATOR = os.environ.get("FSDP_TEST_ACCELERATOR", "cpu")


class Block(nn.Module):
    calls = 0  # forward executions, to see activation checkpointing recompute them in backward

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    """Two custom blocks and one nn.TransformerEncoderLayer (sharded on its own by the default policy)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.Sequential(Block(), Block())
        self.enc = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.inp(x))
        return self.out(self.enc(h.unsqueeze(1)).squeeze(1))


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_data(steps: int, world_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch at every step, so the loss must go down."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, world_size * BATCH, D_IN, generator=g).expand(steps, -1, -1)
    y = torch.randn(1, world_size * BATCH, D_OUT, generator=g).expand(steps, -1, -1)
    return x, y


def local(batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch[rank * BATCH : (rank + 1) * BATCH]


def halves(batch: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """The two micro-batches of a rank-ordered batch: each rank's first halves, then its second halves."""
    chunks = batch.view(world_size, BATCH, *batch.shape[1:])
    return [chunks[:, : BATCH // 2].reshape(-1, *batch.shape[1:]), chunks[:, BATCH // 2 :].reshape(-1, *batch.shape[1:])]


ACCUMULATE_AT = 2  # the step that uses two micro-batches with no_backward_sync on the first
MAX_NORM = 0.5


def reference_run(steps: int, world_size: int, model: nn.Module | None = None):
    """Single-process training on the global batch: per-step losses and pre-clip gradient norms."""
    model = model or make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    x, y = make_data(steps, world_size)
    losses, norms = [], []
    for s in range(steps):
        opt.zero_grad()
        if s == ACCUMULATE_AT:
            for xs, ys in zip(halves(x[s], world_size), halves(y[s], world_size)):
                nn.functional.mse_loss(model(xs), ys).backward()
            loss = nn.functional.mse_loss(model(x[s]), y[s]).detach()
        else:
            loss = nn.functional.mse_loss(model(x[s]), y[s])
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(float(loss))
    return model, opt, losses, norms


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters of a plain or FSDP model, on every rank."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).float().cpu().clone()
    return out
