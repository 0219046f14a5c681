"""One process, one device: the strategy ``strategy="auto"`` picks for a single device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fabric_core.strategies.base import BackwardSyncControl, Binding, NothingToSync, Strategy
from fabric_core.strategies.collectives import OneProcessCollectives

if TYPE_CHECKING:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.io.checkpoint_io import CheckpointIO
    from fabric_core.precision.base import Precision


class SingleDeviceStrategy(OneProcessCollectives, Strategy):
    """Everything in this process on ``device``; collectives are identities."""

    def __init__(
        self,
        device: str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self._device = torch.device(device) if device is not None else None

    def attach(self, binding: Binding) -> None:
        """Take the resolver's decisions; one device only (a strategy for several says so instead)."""
        super().attach(binding)
        devices = binding.devices
        if len(devices) > 1:
            raise ValueError(
                f"The `{type(self).__name__}` runs one process on one device, but `devices` selects {len(devices)}."
                " Use `strategy='auto'` (or a parallel strategy such as 'ddp') for several devices, or `devices=1`."
            )
        if self._device is None:
            self._device = devices[0] if devices else torch.device("cpu")

    @property
    def root_device(self) -> torch.device:
        return self._device if self._device is not None else torch.device("cpu")

    @property
    def backward_sync_control(self) -> BackwardSyncControl:
        return NothingToSync()

