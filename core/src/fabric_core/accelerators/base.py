"""The accelerator contract: a device type, how to parse ``devices=``, and per-process device setup."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Accelerator(ABC):
    """Base class for accelerator plugins.

    An accelerator knows one device type. It turns the user's ``devices=`` argument into the list of
    ``torch.device`` objects a strategy will use (one per local process), prepares a device in each process,
    and tells whether the hardware exists here.
    """

    #: the registered name (``"cpu"``, ``"cuda"``, ...), used in messages.
    name: str = ""
    #: torch device type (``"cpu"``, ``"cuda"``, ``"mps"``, ``"xla"``).
    device_type: str = ""
    #: default ``torch.distributed`` backend for this device type.
    distributed_backend: str = "gloo"

    @abstractmethod
    def parse_devices(self, devices: Any) -> list[torch.device]:
        """Turn ``devices`` (``"auto"``, int, str, list) into the devices of this node; raise on bad input."""

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """Whether this accelerator can run on this machine."""

    @staticmethod
    def auto_device_count() -> int:
        """How many devices ``devices="auto"`` means."""
        return 1

    def setup_device(self, device: torch.device) -> None:
        """Prepare ``device`` in the current process (e.g. ``torch.cuda.set_device``)."""
        if device.type != self.device_type:
            raise ValueError(f"Device should be {self.device_type.upper()}, got {device.type} instead.")

    def teardown(self) -> None:  # noqa: B027 - optional hook, most accelerators hold nothing
        """Release what ``setup_device`` took."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
