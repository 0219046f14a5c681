"""``16-true`` / ``bf16-true``: the whole model in half precision, no autocast, no loss scaling."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch.nn import Module

from fabric_core.precision.base import DefaultDtype, Precision

_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


class HalfPrecision(Precision):
    def __init__(self, precision: str = "16-true") -> None:
        if precision not in _DTYPES:
            raise ValueError(f"HalfPrecision supports {sorted(_DTYPES)}, got {precision!r}.")
        self.precision = precision
        self.input_dtype = _DTYPES[precision]

    def convert_module(self, module: Module) -> Module:
        return module.to(dtype=self.input_dtype)

    def tensor_init_context(self) -> AbstractContextManager:
        return DefaultDtype(self.input_dtype)

    def module_init_context(self) -> AbstractContextManager:
        return DefaultDtype(self.input_dtype)

    def forward_context(self) -> AbstractContextManager:
        return DefaultDtype(self.input_dtype)
