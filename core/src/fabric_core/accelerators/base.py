"""The accelerator contract: a device type, how to parse ``devices=``, and per-process device setup."""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from typing import Any

import torch


def as_device_index(value: Any) -> int | None:
    """``value`` as a device index or count, or ``None`` when it is not an integer.

    Any integer type is accepted through ``operator.index`` (``int``, ``numpy.int64``, a 0-d integer tensor);
    ``bool``, ``str`` and ``float`` are refused even though some of them convert, since ``True``, ``"0"`` or
    ``0.0`` in a device list is a mistake rather than an index.
    """
    if isinstance(value, (bool, str, float)) or "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def requests_no_devices(devices: Any) -> bool:
    """Whether ``devices`` asks for no device at all (``0``, ``"0"``, ``[]``), which no accelerator can run."""
    if isinstance(devices, str):
        return devices.strip() == "0"
    if isinstance(devices, (list, tuple)):
        return len(devices) == 0
    return isinstance(devices, bool) and not devices or as_device_index(devices) == 0


def no_devices_message(devices: Any, accelerator: str) -> str:
    """The error for :func:`requests_no_devices`; ``accelerator`` is the accelerator as the user gave it."""
    return (
        f"`Fabric(devices={devices!r})` value is not a valid input using {accelerator} accelerator. Fabric needs"
        " at least one device: pass `devices` >= 1 or a non-empty list of device indices."
    )


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

    @staticmethod
    def available_flops(device: torch.device, dtype: torch.dtype) -> float | None:
        """Peak dense FLOP/s of one ``device`` computing in ``dtype``, for MFU in ``ThroughputMonitor``.

        ``None`` (the default) means unknown: throughput is reported without MFU.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
