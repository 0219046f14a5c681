"""The ``tpu`` accelerator (alias ``xla``): XLA devices through torch_xla's PJRT runtime.

Nothing here imports torch_xla: availability and the device count come from :mod:`fabric_xla.detect`, so resolving
the name, listing it and parsing ``devices`` leave the runtime untouched (``torch_xla.launch`` needs it untouched).
"""

from __future__ import annotations

from typing import Any

import torch

from fabric_core.accelerators import DEVICE_IDS_TYPE_MESSAGE, Accelerator, as_device_index
from fabric_xla import detect


def devices_message(count: int) -> str:
    """The reference's words for a ``devices`` value the XLA accelerator cannot use, with this host's count."""
    last = max(count - 1, 0)
    return f"`devices` can only be 'auto', 1, {count} or [<0-{last}>] for TPUs."


def parse_xla_devices(devices: Any, count: int) -> list[int]:
    """Device indices for ``devices``: ``"auto"`` and ``count`` mean all, ``1`` the first, ``[i]`` device ``i``.

    torch_xla starts replicas on every device or on one (``torch_xla.launch`` has no count), so other counts are
    refused rather than silently widened to all devices. ``0``/``"0"``/``[]`` are refused earlier, by the core.
    """
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return list(range(count))
        if text.endswith(",") and text[:-1].strip().isdigit():
            devices = [int(text[:-1])]
        elif text.startswith("[") and text.endswith("]") and text[1:-1].strip().isdigit():
            devices = [int(text[1:-1])]
        elif text.isdigit():
            devices = int(text)
        else:
            raise ValueError(f"{devices_message(count)} Got {devices!r}.")
    if isinstance(devices, (list, tuple)):
        indices = [as_device_index(d) for d in devices]
        if any(i is None for i in indices):
            kind = next(type(d).__name__ for d, i in zip(devices, indices) if i is None)
            raise TypeError(f"{DEVICE_IDS_TYPE_MESSAGE} a sequence of {kind}. {devices_message(count)}")
        if len(indices) != 1 or not 0 <= indices[0] < count:  # type: ignore[operator]
            raise ValueError(
                f"{devices_message(count)} Got {list(devices)!r}: a list selects one device by its index; to use"
                " several, pass their number."
            )
        return [indices[0]]  # type: ignore[list-item]
    number = as_device_index(devices)
    if number is None:
        raise TypeError(f"{DEVICE_IDS_TYPE_MESSAGE} {devices!r}. {devices_message(count)}")
    if number == 1 and count >= 1:
        return [0]
    if number == count and count > 0:
        return list(range(count))
    raise ValueError(
        f"{devices_message(count)} Got {devices!r}: torch_xla runs on one device or on all {count} of this host."
        " Limit the devices it sees with `TPU_VISIBLE_CHIPS` (TPU) or `CPU_NUM_DEVICES` (PJRT_DEVICE=CPU)."
    )


class XLAAccelerator(Accelerator):
    """TPUs, or another PJRT device chosen with ``PJRT_DEVICE`` (``CPU`` for tests), driven by torch_xla.

    Available when torch_xla is installed and either a TPU is present or ``PJRT_DEVICE`` names another device.
    ``accelerator="auto"`` picks it only for a real TPU.
    """

    name = "tpu"
    device_type = "xla"
    distributed_backend = "xla"

    def parse_devices(self, devices: Any) -> list[torch.device]:
        return [torch.device("xla", i) for i in parse_xla_devices(devices, detect.device_count())]

    @staticmethod
    def is_available() -> bool:
        return detect.xla_available() and detect.device_count() > 0

    @staticmethod
    def auto_device_count() -> int:
        return detect.device_count()

    @staticmethod
    def available_flops(device: torch.device, dtype: torch.dtype) -> float | None:
        """Peak bfloat16 FLOP/s of one XLA device of this host's TPU generation (TPUs run matmuls in bfloat16
        whatever ``dtype`` says); ``None`` off TPUs or for a generation not in :data:`TPU_FLOPS`."""
        generation = detect.tpu_generation()
        return TPU_FLOPS.get(generation) if generation else None


#: Peak bfloat16 FLOP/s of one torch_xla device, from Google's system-architecture pages: per chip, halved for v2
#: and v3, whose chips have two TensorCores that torch_xla addresses as two devices (later chips are one device).
TPU_FLOPS: dict[str, float] = {
    "v2": 45e12 / 2,
    "v3": 123e12 / 2,
    "v4": 275e12,
    "v5e": 197e12,
    "v5p": 459e12,
    "v6e": 918e12,
}
