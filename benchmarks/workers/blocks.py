"""The residual MLP block the model-parallel and pipeline workers stack (``up`` and ``down`` are the names their
tensor-parallel plans and stage cuts refer to)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Block(nn.Module):
    """``x + down(activation(up(x)))``, width -> hidden -> width."""

    def __init__(self, width: int, hidden: int, activation: Callable[[torch.Tensor], torch.Tensor] = torch.relu) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.activation(self.up(x)))
