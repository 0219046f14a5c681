"""Accelerators: which device type a run uses and how devices are parsed and prepared."""

from fabric_core.accelerators.base import Accelerator
from fabric_core.accelerators.cpu import CPUAccelerator
from fabric_core.accelerators.cuda import CUDAAccelerator
from fabric_core.accelerators.mps import MPSAccelerator

__all__ = ["Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator"]
