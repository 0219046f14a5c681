"""fabric-xla: XLA devices (TPUs) for fabric-core through torch_xla.

``Fabric(accelerator="tpu")`` works once this distribution and torch_xla are installed. The classes are importable
from here for users who configure them (``XLAFSDPStrategy(auto_wrap_policy=...)``); imports are lazy, so
discovering the plugin imports neither torch_xla nor the strategies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_xla.accelerator import XLAAccelerator
    from fabric_xla.environment import XLAEnvironment
    from fabric_xla.launcher import XLALauncher
    from fabric_xla.precision import XLAPrecision
    from fabric_xla.strategy import SingleDeviceXLAStrategy, XLAFSDPStrategy, XLAStrategy

__all__ = [
    "SingleDeviceXLAStrategy",
    "XLAAccelerator",
    "XLAEnvironment",
    "XLAFSDPStrategy",
    "XLALauncher",
    "XLAPrecision",
    "XLAStrategy",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-xla",
    {
        "XLAAccelerator": "fabric_xla.accelerator",
        "XLAEnvironment": "fabric_xla.environment",
        "XLALauncher": "fabric_xla.launcher",
        "XLAPrecision": "fabric_xla.precision",
        "SingleDeviceXLAStrategy": "fabric_xla.strategy",
        "XLAStrategy": "fabric_xla.strategy",
        "XLAFSDPStrategy": "fabric_xla.strategy",
    },
)
