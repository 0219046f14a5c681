"""The CPU accelerator: always available; ``devices=N`` means N processes on the CPU."""

from __future__ import annotations

from typing import Any

import torch

from fabric_core.accelerators.base import (
    Accelerator,
    as_device_index,
    no_devices_message,
    requests_no_devices,
)

#: The reference's words for every ``devices`` value the CPU accelerator cannot use.
CPU_DEVICES_MESSAGE = "`devices` selected with `CPUAccelerator` should be an int > 0."


def parse_cpu_devices(devices: Any) -> int:
    """Return the number of CPU processes ``devices`` asks for: ``"auto"`` (1), an int > 0 or a digit string.

    ``0``, ``"0"`` and ``[]`` raise ``ValueError`` (as with every accelerator); any other value that is not a
    positive count raises ``TypeError``: on the CPU, ``devices`` counts processes, it does not pick devices.
    """
    if isinstance(devices, str) and devices.strip() == "auto":
        return 1
    if requests_no_devices(devices):
        raise ValueError(no_devices_message(devices, "cpu"))
    if isinstance(devices, str):
        count = int(devices) if devices.strip().isdigit() else None
    else:
        count = as_device_index(devices)
    if count is None or count <= 0:
        raise TypeError(
            f"{CPU_DEVICES_MESSAGE} Got {devices!r}: on the CPU `devices` is the number of processes to run, e.g."
            " `devices=2`; device indices and -1 are for GPUs."
        )
    return count


class CPUAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    distributed_backend = "gloo"

    def parse_devices(self, devices: Any) -> list[torch.device]:
        return [torch.device("cpu")] * parse_cpu_devices(devices)

    @staticmethod
    def is_available() -> bool:
        return True
