"""What the XLA lane's scripts share: the model, the data, the eager CPU reference and result files.

Each script runs in a fresh process with ``PJRT_DEVICE=CPU`` (the test sets it). It creates its ``Fabric`` first:
the XLA runtime must start before any CPU ``backward()`` runs in the process (pytorch/xla#4174), and the eager CPU
reference is computed after that, in the same process, on the same global batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

D_IN, D_HIDDEN, D_OUT = 16, 32, 4
SAMPLES, BATCH, EPOCHS, LR = 64, 16, 2, 0.05


def out_dir() -> Path:
    path = Path(sys.argv[1])
    path.mkdir(parents=True, exist_ok=True)
    return path


def dump(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=1, sort_keys=True))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, D_IN, generator=g), torch.randint(0, D_OUT, (SAMPLES,), generator=g))


def dataloader() -> DataLoader:
    return DataLoader(dataset(), batch_size=BATCH, shuffle=False)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def reference(epochs: int = EPOCHS) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
    """Plain PyTorch on the CPU: the losses every XLA run must reproduce."""
    model = make_model()
    optimizer = make_optimizer(model)
    losses = []
    for _ in range(epochs):
        for x, y in dataloader():
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, model, optimizer


def train(fabric: Any, model: Any, optimizer: Any, loader: Any, epochs: int = EPOCHS) -> list[float]:
    """The Fabric loop; losses stay lazy XLA tensors until the end (each ``.item()`` would force a sync)."""
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
    return [float(loss.item()) for loss in losses]


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach().cpu().float() - q.detach().cpu().float()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def all_cpu(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cpu"
    if isinstance(obj, dict):
        return all(all_cpu(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(all_cpu(v) for v in obj)
    return True
