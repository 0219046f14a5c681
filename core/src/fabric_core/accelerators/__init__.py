"""Accelerators: which device type a run uses and how devices are parsed and prepared.

Part of the plugin SDK: the names in ``__all__`` are the stable contract plugins (ours and third parties') import,
listed in docs/plugins.md; every other module of the core is internal and may change. The names are imported on
first access, so importing this package costs nothing. ``Fabric(accelerator="cpu")`` imports no other accelerator.
"""

from __future__ import annotations

from fabric_core.utilities.lazy import lazy_exports

__all__ = [
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "DEVICE_IDS_TYPE_MESSAGE",
    "MPSAccelerator",
    "as_device_index",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "Accelerator": "fabric_core.accelerators.base",
        "as_device_index": "fabric_core.accelerators.base",
        "CPUAccelerator": "fabric_core.accelerators.cpu",
        "CUDAAccelerator": "fabric_core.accelerators.cuda",
        "DEVICE_IDS_TYPE_MESSAGE": "fabric_core.accelerators.cuda",
        "MPSAccelerator": "fabric_core.accelerators.mps",
    },
)
