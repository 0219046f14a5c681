"""The CUDA accelerator."""

from __future__ import annotations

import os
from typing import Any

import torch

from fabric_core.accelerators.base import Accelerator


def parse_gpu_ids(devices: Any, available: int, kind: str = "GPU") -> list[int]:
    """Turn ``devices`` into a list of device indices, validating against ``available`` devices."""
    if devices == "auto":
        return list(range(available)) if available else []
    if isinstance(devices, bool) or not isinstance(devices, (int, str, list, tuple)):
        raise TypeError(
            f"Device IDs ({kind}) must be an int, a string, or a sequence of ints, but you passed {devices!r}."
        )
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("-1", "auto"):
            devices = -1
        elif "," in text:
            devices = [int(x) for x in text.split(",") if x.strip()]
        else:
            try:
                devices = int(text)
            except ValueError as err:
                raise TypeError(f"Could not parse `devices={devices!r}`: use an int, '-1' or '0,1'.") from err
    if isinstance(devices, int):
        if devices == 0:
            raise ValueError(f"`Fabric(devices=0)` is not a valid input using the {kind} accelerator.")
        if devices < -1:
            raise ValueError(
                f"`Fabric(devices={devices})` is not a valid input using the {kind} accelerator: pass a count"
                " > 0, -1 for all devices, or a list of device indices."
            )
        ids = list(range(available)) if devices == -1 else list(range(devices))
    else:
        ids = [int(i) for i in devices]
        if not ids:
            raise ValueError(f"`Fabric(devices=[])` is not a valid input using the {kind} accelerator.")
        if len(set(ids)) != len(ids):
            raise ValueError(f"Device IDs ({kind}) must be unique, got {ids}.")
    if not ids or available == 0:
        raise RuntimeError(f"{kind}s requested but none are available.")
    missing = [i for i in ids if i >= available or i < 0]
    if missing and not os.environ.get("TORCHELASTIC_RUN_ID"):
        raise ValueError(f"You requested {kind}s {ids}, but this machine only has {list(range(available))}.")
    return ids


class CUDAAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    distributed_backend = "nccl"

    def parse_devices(self, devices: Any) -> list[torch.device]:
        return [torch.device("cuda", i) for i in parse_gpu_ids(devices, torch.cuda.device_count(), "GPU")]

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0

    @staticmethod
    def auto_device_count() -> int:
        return torch.cuda.device_count()

    def setup_device(self, device: torch.device) -> None:
        super().setup_device(device)
        torch.cuda.set_device(device)

    def teardown(self) -> None:
        torch.cuda.empty_cache()
