"""Accelerators: which device type a run uses and how devices are parsed and prepared.

The names below are imported on first access, so ``Fabric(accelerator="cpu")`` imports no other accelerator.
"""

from fabric_core.utilities.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "Accelerator": "fabric_core.accelerators.base",
        "CPUAccelerator": "fabric_core.accelerators.cpu",
        "CUDAAccelerator": "fabric_core.accelerators.cuda",
        "MPSAccelerator": "fabric_core.accelerators.mps",
    },
)

__all__ = ["Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator"]
