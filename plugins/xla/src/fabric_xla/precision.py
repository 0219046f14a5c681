"""``XLAPrecision``: the precisions the XLA strategies run, as torch_xla supports them.

* ``32-true``: nothing to do.
* ``bf16-true`` / ``16-true``: the model is cast; floating inputs are cast to it; ``init_module``/``init_tensor``
  create tensors in that dtype. (The reference's ``XLA_USE_BF16``/``XLA_USE_F16`` variables are deprecated in
  torch_xla 2.x; casting is what they did.)
* ``bf16-mixed``: float32 weights, ``torch.autocast("xla", dtype=torch.bfloat16)`` around the forward; floating
  inputs are cast to bfloat16 and outputs back, as the core's mixed precision does. bfloat16 needs no loss scaling.

``16-mixed`` (float16 autocast needs a gradient scaler, which torch_xla supports only with its sync-free
optimizers) and ``64-true`` (TPUs have no float64) are refused with a ``ValueError``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn import Module

from fabric_core.precision import DefaultDtype, Precision

SUPPORTED = ("32-true", "16-true", "bf16-true", "bf16-mixed")
#: Spellings that reach the XLA strategies when fabric-amp (which registers them as aliases) is not installed.
LEGACY = {"32": "32-true", "bf16": "bf16-mixed"}
_TRUE_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


def refusal(precision: str) -> str:
    hints = {
        "16-mixed": " float16 autocast needs a gradient scaler; on XLA use `precision='bf16-mixed'` (no scaler needed).",
        "16": " `precision=16` means '16-mixed'; on XLA use `precision='bf16-mixed'` (no scaler needed).",
        "64-true": " TPUs have no float64.",
        "64": " TPUs have no float64.",
    }
    return (
        f"`precision={precision!r}` is not supported by the XLA strategies. `precision` must be one of: {SUPPORTED}."
        + hints.get(precision, "")
    )


class XLAPrecision(Precision):
    """One of ``32-true``, ``16-true``, ``bf16-true``, ``bf16-mixed`` on an XLA device."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED:
            raise ValueError(refusal(precision))
        self.precision = precision
        self._true_dtype = _TRUE_DTYPES.get(precision)
        self._mixed = precision == "bf16-mixed"
        self.input_dtype = torch.bfloat16 if self._mixed else self._true_dtype

    def convert_module(self, module: Module) -> Module:
        if self._true_dtype is not None:
            return module.to(dtype=self._true_dtype)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return DefaultDtype(self._true_dtype) if self._true_dtype is not None else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        if self._mixed:
            return torch.autocast("xla", dtype=torch.bfloat16)
        return self.tensor_init_context()
