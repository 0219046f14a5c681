"""The Apple MPS accelerator (a single device)."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from fabric_core.accelerators.base import Accelerator
from fabric_core.accelerators.cuda import parse_gpu_ids


class MPSAccelerator(Accelerator):
    name = "mps"
    device_type = "mps"
    distributed_backend = "gloo"

    def parse_devices(self, devices: Any) -> list[torch.device]:
        auto = isinstance(devices, str) and devices.strip() == "auto"
        ids = parse_gpu_ids(1 if auto else devices, 1 if self.is_available() else 0, "MPS")
        return [torch.device("mps", i) for i in ids]

    @staticmethod
    def is_available() -> bool:
        if os.environ.get("DISABLE_MPS") == "1" or platform.processor() not in ("arm", "arm64"):
            return False
        return bool(torch.backends.mps.is_available())
