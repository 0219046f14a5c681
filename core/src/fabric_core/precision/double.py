"""``64-true``: weights and computation in float64; outputs returned in the default dtype."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch.nn import Module

from fabric_core.precision.base import DefaultDtype, Precision


class DoublePrecision(Precision):
    precision = "64-true"
    input_dtype = torch.float64

    def convert_module(self, module: Module) -> Module:
        return module.double()

    def tensor_init_context(self) -> AbstractContextManager:
        return DefaultDtype(torch.float64)

    def module_init_context(self) -> AbstractContextManager:
        return DefaultDtype(torch.float64)

    def forward_context(self) -> AbstractContextManager:
        return DefaultDtype(torch.float64)
