"""The CPU accelerator: always available; ``devices=N`` means N processes on the CPU."""

from __future__ import annotations

from typing import Any

import torch

from fabric_core.accelerators.base import Accelerator


def parse_cpu_devices(devices: Any) -> int:
    """Return the number of CPU processes ``devices`` asks for."""
    if devices == "auto":
        return 1
    if isinstance(devices, bool) or not isinstance(devices, (int, str)):
        raise TypeError(
            f"`devices` selected with the CPU accelerator must be a positive int (number of processes),"
            f" but got {devices!r}."
        )
    given = devices
    if isinstance(devices, str):
        text = devices.strip()
        if not text.lstrip("-").isdigit():
            raise TypeError(f"`devices={devices!r}` for the CPU accelerator must be a positive integer like '2'.")
        devices = int(text)
    if devices == 0:
        raise ValueError(f"`Fabric(devices={given!r})` is not a valid input using the cpu accelerator: use devices >= 1.")
    if devices < 0:
        raise TypeError(f"`devices` selected with the CPU accelerator should be an int > 0, got {given!r}.")
    return devices


class CPUAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    distributed_backend = "gloo"

    def parse_devices(self, devices: Any) -> list[torch.device]:
        if isinstance(devices, (list, tuple)):
            if len(devices) == 0:
                raise ValueError("`Fabric(devices=[])` is not a valid input using the cpu accelerator.")
            raise TypeError(
                "`devices` selected with the CPU accelerator should be an int > 0 (a number of processes),"
                f" not a list of device indices ({devices!r})."
            )
        return [torch.device("cpu")] * parse_cpu_devices(devices)

    @staticmethod
    def is_available() -> bool:
        return True
