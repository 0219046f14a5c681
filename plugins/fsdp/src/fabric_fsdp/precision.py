"""Precision for FSDP: mixed precision is a property of the sharding, not an autocast region.

FSDP2 keeps the sharded parameters in their original dtype (the optimizer updates float32 weights) and casts
them when it all-gathers them for compute (``MixedPrecisionPolicy.param_dtype``), then reduces gradients in
``reduce_dtype``. So ``bf16-mixed``/``16-mixed`` here do not use ``torch.autocast``: the strategy asks this
object for the policy and passes it to every ``fully_shard`` call. ``bf16-true``/``16-true`` cast the model
itself, as the core's half precision does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn import Module

from fabric_core.precision import DefaultDtype, LossScaling, Precision

_HALF = {"16": torch.float16, "bf16": torch.bfloat16}
SUPPORTED = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")


class FSDPPrecision(LossScaling, Precision):
    """One of ``32-true``, ``16-true``, ``bf16-true``, ``16-mixed``, ``bf16-mixed`` for the FSDP strategies.

    Mixed precision computes in half precision and reduces gradients in float32 (more accurate than reducing
    in half precision, at twice the communication of the gradients). ``16-mixed`` adds a
    ``ShardedGradScaler`` (loss scaling whose inf/nan check agrees across ranks), driven by the core's
    ``LossScaling``; pass ``scaler`` to configure it yourself.
    """

    def __init__(self, precision: str = "32-true", scaler: Any = None, reduce_dtype: torch.dtype | None = torch.float32) -> None:
        if precision not in SUPPORTED:
            extra = (
                " For float64, pass the name to Fabric instead (`Fabric(strategy='fsdp', precision='64-true')`): the"
                " core's double precision casts the model and FSDP2 shards it as it is."
                if precision == "64-true"
                else ""
            )
            raise ValueError(
                f"`precision={precision!r}` is not supported in FSDP. `precision` must be one of: {SUPPORTED}." + extra
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(
                f"`precision={precision!r}` does not use a scaler, found {scaler}. A gradient scaler is only used with"
                " `precision='16-mixed'`: drop the `scaler` argument."
            )
        self.precision = precision
        self.scaler = scaler
        self.reduce_dtype = reduce_dtype
        bits, _, kind = precision.partition("-")
        self._half = _HALF.get(bits)
        self._mixed = kind == "mixed"
        self._true_half = kind == "true" and self._half is not None
        self.input_dtype = self._half if self._true_half else None
        self._device_type = "cpu"

    def configure(self, device_type: str) -> None:
        self._device_type = device_type
        if self.precision == "16-mixed" and self.scaler is None:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=device_type)

    # ---------------------------------------------------------------------------------------- the FSDP policy
    @property
    def mixed_precision_config(self) -> Any:
        """The reference's name for the policy of the wrapped blocks: :meth:`mixed_precision_policy` (``None`` for a
        precision FSDP does not cast)."""
        return self.mixed_precision_policy(root=False)

    def mixed_precision_policy(self, root: bool = False) -> Any:
        """The ``MixedPrecisionPolicy`` for one ``fully_shard`` call (``None``: no casting by FSDP).

        The root also casts its outputs back to float32, so the loss outside the model is computed in full
        precision, as with autocast.
        """
        if not self._mixed:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=self._half,
            reduce_dtype=self.reduce_dtype,
            output_dtype=torch.get_default_dtype() if root else None,
        )

    # ---------------------------------------------------------------------------------------- module and init
    def convert_module(self, module: Module) -> Module:
        if self._true_half:
            return module.to(dtype=self._half)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return DefaultDtype(self._half) if self._true_half else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return DefaultDtype(self._half) if self._true_half else nullcontext()

    def forward_context(self) -> AbstractContextManager:
        return DefaultDtype(self._half) if self._true_half else nullcontext()

    # ---------------------------------------------------------------------------------------- loss scaling
    @property
    def requires_fabric_backward(self) -> bool:
        return self.scaler is not None

