"""The CUDA accelerator."""

from __future__ import annotations

import os
from typing import Any

import torch

from fabric_core.accelerators.base import (
    Accelerator,
    as_device_index,
    no_devices_message,
    requests_no_devices,
)
from fabric_core.utilities.exceptions import DeviceIdError, NoDevicesAvailableError

#: The reference's words for a ``devices`` value of the wrong type (followed by what was passed).
DEVICE_IDS_TYPE_MESSAGE = "Device IDs (GPU/TPU) must be an int, a string, a sequence of ints, but you passed"
_FORMS = (
    " Pass a number of devices (`devices=2`), -1 for all of them, or device indices (`devices=[0, 1]` or"
    " `devices='0,1'`)."
)


def _check_type(devices: Any) -> None:
    """Refuse anything but an int, a str, or a list/tuple of ints (any integer type, see ``as_device_index``)."""
    if isinstance(devices, (list, tuple)):
        for entry in devices:
            if as_device_index(entry) is None:
                raise TypeError(f"{DEVICE_IDS_TYPE_MESSAGE} a sequence of {type(entry).__name__}.{_FORMS}")
    elif not isinstance(devices, str) and as_device_index(devices) is None:
        raise TypeError(f"{DEVICE_IDS_TYPE_MESSAGE} {devices!r}.{_FORMS}")


def _parse_string(devices: str) -> int | list[int]:
    text = devices.strip()
    try:
        if "," in text:
            return [int(part) for part in text.split(",") if part.strip()]
        return int(text)
    except ValueError:
        raise ValueError(f"Could not parse `devices={devices!r}` as a number or a list of device indices.{_FORMS}") from None


def parse_gpu_ids(devices: Any, available: int, kind: str = "GPU") -> list[int]:
    """Turn ``devices`` into a list of device indices, validating against ``available`` devices.

    ``kind`` names the device type in messages (``"GPU"``, ``"MPS"``). Indices that are duplicated or that this
    machine lacks raise :class:`~fabric_core.utilities.exceptions.DeviceIdError`; asking for devices where
    there are none raises :class:`~fabric_core.utilities.exceptions.NoDevicesAvailableError` (both are the
    reference's ``MisconfigurationException``, and ``ValueError`` / ``RuntimeError`` respectively).
    """
    if isinstance(devices, str) and devices.strip() == "auto":
        return list(range(available))
    _check_type(devices)
    if requests_no_devices(devices):
        raise ValueError(no_devices_message(devices, kind))
    parsed = _parse_string(devices) if isinstance(devices, str) else devices
    if isinstance(parsed, (list, tuple)):
        ids = [as_device_index(i) for i in parsed]
        if not ids:
            raise ValueError(no_devices_message(devices, kind))
    else:
        count = as_device_index(parsed)
        if count == 0:
            raise ValueError(no_devices_message(devices, kind))
        if count < -1:
            raise DeviceIdError(
                f"`Fabric(devices={devices!r})` is not a valid input using {kind} accelerator: pass a count > 0,"
                " -1 for all devices, or a list of device indices."
            )
        ids = list(range(available)) if count == -1 else list(range(count))
    if not ids or available == 0:
        raise NoDevicesAvailableError(
            f"GPUs requested but none are available. This machine has no {kind} device that torch can use; pick"
            " another accelerator (`accelerator='cpu'`), or check the drivers and `CUDA_VISIBLE_DEVICES`."
        )
    if len(set(ids)) != len(ids):
        raise DeviceIdError(f"Device ID's (GPU) must be unique. Got {ids}: list each device index once.")
    missing = [i for i in ids if i >= available or i < 0]
    if missing and not os.environ.get("TORCHELASTIC_RUN_ID"):
        raise DeviceIdError(
            f"You requested gpu: {ids}\n But your machine only has: {list(range(available))}\n"
            f" {kind} indices go from 0 to {available - 1} here; a count may be at most {available}."
        )
    return ids  # type: ignore[return-value]


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
        _hint_tensor_cores_once(device)

    def teardown(self) -> None:
        torch.cuda.empty_cache()

    @staticmethod
    def available_flops(device: torch.device, dtype: torch.dtype) -> float | None:
        """The dense peak from the datasheet table in :mod:`fabric_core.accelerators.cuda_flops`; float32 counts as
        TF32 on Ampere and newer unless ``torch.get_float32_matmul_precision()`` is ``"highest"``."""
        from fabric_core.accelerators.cuda_flops import cuda_flops

        tf32 = torch.cuda.get_device_capability(device) >= (8, 0) and torch.get_float32_matmul_precision() != "highest"
        return cuda_flops(torch.cuda.get_device_name(device), dtype, tf32_matmuls=tf32)


_hinted = False


def tensor_cores_hint(device_name: str, capability: tuple[int, int], matmul_precision: str) -> str | None:
    """The reference's hint for GPUs with Tensor Cores that still run float32 matmuls at full precision."""
    if capability < (8, 0) or matmul_precision != "highest":
        return None
    return (
        f"You are using a CUDA device ({device_name!r}) that has Tensor Cores. To properly utilize them, you should set"
        " `torch.set_float32_matmul_precision('medium' | 'high')` which will trade-off precision for performance."
        " For more details, read https://pytorch.org/docs/stable/generated/torch.set_float32_matmul_precision.html"
    )


def _hint_tensor_cores_once(device: torch.device) -> None:
    global _hinted
    if _hinted:
        return
    _hinted = True
    from fabric_core.utilities.rank_zero import rank_zero_info

    message = tensor_cores_hint(
        torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device), torch.get_float32_matmul_precision()
    )
    if message:
        rank_zero_info(message)

