"""fabric-ray: Fabric inside Ray Train (a cluster environment read from Ray's context) and a bridge to Ray's
metrics, checkpoint storage and restarts (``Fabric(loggers="ray")``), and ``fabric run --launcher ray``.

Importing this package is cheap (the registration module is imported while plugins are discovered); ``ray`` is
imported only inside a Ray worker or when :class:`RayTrainLogger` is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_ray.environment import RayTrainEnvironment
    from fabric_ray.launcher import RayLauncher
    from fabric_ray.logger import RayTrainLogger, restore_latest_checkpoint

__all__ = ["RayLauncher", "RayTrainEnvironment", "RayTrainLogger", "restore_latest_checkpoint"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-ray",
    {
        "RayTrainEnvironment": "fabric_ray.environment",
        "RayLauncher": "fabric_ray.launcher",
        "RayTrainLogger": "fabric_ray.logger",
        "restore_latest_checkpoint": "fabric_ray.logger",
    },
)
