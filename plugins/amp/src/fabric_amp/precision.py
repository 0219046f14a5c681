"""``16-mixed`` and ``bf16-mixed``: float32 weights, the forward pass under ``torch.autocast``."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from fabric_core.precision import LossScaling, Precision
from fabric_core.utilities import rank_zero_info, rank_zero_warn

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_CPU_FALLBACK_WARNING = (
    "You passed `Fabric(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on CPU."
    " Using `precision='bf16-mixed'` instead."
)


class MixedPrecision(LossScaling, Precision):
    """Automatic mixed precision: weights, gradients and optimizer state stay float32 (the "master weights");
    matrix multiplications and convolutions inside the forward pass run in float16 or bfloat16.

    * ``forward_context`` is ``torch.autocast(device_type, dtype)``; it is also what ``fabric.autocast()``
      returns. Floating-point inputs of the wrapped model are cast to the autocast dtype before ``forward``
      (as the well-known implementation does), and its floating outputs back to ``torch.get_default_dtype()``;
      integer and boolean tensors are left alone.
    * ``16-mixed`` keeps a ``torch.amp.GradScaler``: ``fabric.backward`` scales the loss, gradient clipping
      unscales first (once per optimizer and step), and ``optimizer.step()`` unscales, skips the step when a
      gradient is inf/NaN, and updates the scale. The scaler's state is saved with ``fabric.save`` and
      restored by ``fabric.load``. float16 has too small a range to train without it.
    * ``bf16-mixed`` has float32's range, so it needs no scaler (passing one is a ``ValueError``).

    **16-mixed on CPU falls back to bf16-mixed, with a warning**, when the device is learned from the
    accelerator (``Fabric(precision="16-mixed")`` on CPU). Reasons: float16 buys nothing on CPUs over bfloat16
    (on CPUs without native half-precision kernels it was ~40x slower than float32, bf16 ~6x; on a CPU with
    AMX/AVX512-BF16 fp16 was no faster than float32 while bf16 was 2-3x faster at batch 512) and it
    would need loss scaling, which bfloat16 does not. To really run fp16 autocast with loss scaling on CPU,
    construct the plugin yourself: ``Fabric(plugins=MixedPrecision("16-mixed", device="cpu"))`` (an explicit
    ``device`` or ``scaler`` is honoured as given).

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device type (``"cuda"``, ``"cpu"``, ``"mps"``). ``None`` (the default when the
            plugin is chosen by name): learned from the accelerator in :meth:`configure`.
        scaler: a ``torch.amp.GradScaler`` to use with ``16-mixed`` (default: a new one for ``device``).
    """

    def __init__(
        self,
        precision: str = "16-mixed",
        device: str | torch.device | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(
                f"Passed `MixedPrecision(precision={precision!r})`. Precision must be '16-mixed' or 'bf16-mixed'."
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"`scaler` must be a `torch.amp.GradScaler`, got {type(scaler).__name__}.")
        if precision == "bf16-mixed" and scaler is not None:
            raise ValueError(
                f"`precision='bf16-mixed'` does not use a scaler, found {scaler}. bfloat16 has the range of"
                " float32, so the loss needs no scaling: drop the `scaler` argument."
            )
        self.precision = precision
        self._device: str | None = None if device is None else torch.device(device).type
        # An explicit device or scaler means "this is what I want": no CPU fallback, no device override.
        self._explicit = device is not None or scaler is not None
        self.scaler: torch.amp.GradScaler | None = scaler
        if precision == "16-mixed" and scaler is None and self._device is not None:
            self.scaler = torch.amp.GradScaler(self._device)

    # ---------------------------------------------------------------------------------------- configuration
    @property
    def device(self) -> str | None:
        """The autocast device type (``None`` until :meth:`configure` when not given explicitly)."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype autocast computes in."""
        return _DTYPES[self.precision]

    def configure(self, device_type: str) -> None:
        """Learn the device type from the accelerator; applies the CPU fallback described on the class."""
        if self._explicit and self._device is not None:
            if self._device != device_type:
                raise ValueError(
                    f"`MixedPrecision(device={self._device!r})` does not match the accelerator, which runs on"
                    f" {device_type!r}: autocast on {self._device!r} would not touch the model. Pass"
                    f" `device={device_type!r}` or leave `device` unset to follow the accelerator."
                )
            self._log_choice()
            return
        if not torch.amp.is_autocast_available(device_type):
            raise ValueError(
                f"Mixed precision (`precision={self.precision!r}`) needs `torch.autocast`, which does not support"
                f" the device type {device_type!r}. Use `precision='32-true'` (or the true half precisions"
                " '16-true'/'bf16-true') on this accelerator."
            )
        if self.precision == "16-mixed" and device_type == "cpu" and not self._explicit:
            rank_zero_warn(_CPU_FALLBACK_WARNING)
            self.precision = "bf16-mixed"
            self.scaler = None
        self._device = device_type
        if self.precision == "16-mixed" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(device_type)
        self._log_choice()

    def _log_choice(self) -> None:
        kind = "16-bit" if self.precision == "16-mixed" else "bfloat16"
        rank_zero_info(f"Using {kind} Automatic Mixed Precision (AMP)")

    # ---------------------------------------------------------------------------------------- forward
    def forward_context(self) -> AbstractContextManager:
        if self._device is None:
            raise RuntimeError(
                f"{self!r} does not know its device yet: pass `device=...` or let `Fabric` configure it"
                " (it calls `configure(device_type)` when it is created)."
            )
        return torch.autocast(self._device, dtype=self.dtype)

    @property
    def input_dtype(self) -> torch.dtype:  # type: ignore[override]
        """Floating inputs of the model are cast to the autocast dtype (it follows the CPU fallback)."""
        return self.dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r}, device={self._device!r})"
