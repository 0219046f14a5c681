"""Precision for DeepSpeed: the engine does the casting, this object tells it how and casts the inputs.

DeepSpeed keeps the model in the compute dtype and float32 master weights inside its optimizer when its ``bf16``
or ``fp16`` section is enabled, and scales the fp16 loss itself. So ``bf16-mixed`` and ``bf16-true`` both map
onto ``"bf16": {"enabled": true}`` (``16-*`` onto ``fp16``, with the strategy's loss-scale options), and nothing
here uses ``torch.autocast``. What stays on the Fabric side: floating inputs are cast to the engine's dtype
before the forward (the engine's parameters are bf16, a float32 input would fail with "mat1 and mat2 must have
the same dtype") and floating outputs back to the default dtype; the ``-true`` variants also cast the model in
``setup`` and build tensors in that dtype under ``init_module``/``init_tensor``, as in the reference.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from fabric_core.precision import DefaultDtype, Precision

SUPPORTED = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")
_DTYPES = {
    "32-true": torch.float32,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
}


class DeepSpeedPrecision(Precision):
    """One of ``32-true``, ``16-true``, ``bf16-true``, ``16-mixed``, ``bf16-mixed`` for the DeepSpeed strategies.

    ``backward`` and ``optimizer_step`` receive the DeepSpeed engine (the strategy passes it), so the engine scales
    the loss, reduces the gradients and steps.
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED:
            raise ValueError(f"`precision={precision!r})` is not supported in DeepSpeed. `precision` must be one of: {SUPPORTED}.")
        self.precision = precision
        #: the dtype the engine computes in; floating inputs are cast to it
        self.dtype = _DTYPES[precision]
        self.input_dtype = self.dtype
        self._true_half = precision in ("16-true", "bf16-true")

    # ---------------------------------------------------------------------------------------- module and init
    def convert_module(self, module: Module) -> Module:
        return module.to(dtype=self.dtype) if self._true_half else module

    def tensor_init_context(self) -> AbstractContextManager:
        return DefaultDtype(self.dtype) if self._true_half else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    # ---------------------------------------------------------------------------------------- the engine
    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """``model`` is the DeepSpeed engine: it scales the loss and reduces the gradients."""
        model.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer`` is the DeepSpeed engine: ``engine.step()`` clips, steps, zeroes and advances the scheduler."""
        if kwargs.get("closure") is not None:
            raise TypeError(
                "DeepSpeed does not support an optimizer closure: `optimizer.step(closure)` cannot be used with a"
                " DeepSpeed strategy. Compute the loss, call `fabric.backward(loss)`, then `optimizer.step()`."
            )
        kwargs.pop("closure", None)
        return optimizer.step(**kwargs)
