"""A registration module that imports torch.distributed: `fabric plugins --check` must flag it."""

import torch.distributed  # noqa: F401  (deliberately heavy)

from fabric_core.plugins import hookimpl


@hookimpl
def fabric_register_strategies(registrar):
    registrar.add("heavy_single", "fabric_core.strategies.single_device:SingleDeviceStrategy")
