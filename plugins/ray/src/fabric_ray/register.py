"""Registration hooks of fabric-ray: names only, no ``ray`` import (that happens inside a Ray worker, or when used)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar

_PACKAGE = "fabric_ray."
#: Ray exports this to every worker process it starts (Ray Train's workers among them; checked on ray 2.60.0): the
#: registry imports the environment for detection only where it is set, so detection costs nothing elsewhere.
DETECTED_BY = ("RAY_RAYLET_PID",)


@hookimpl
def fabric_register_environments(registrar: Registrar) -> None:
    registrar.add(
        "ray",
        _PACKAGE + "environment:RayTrainEnvironment",
        description="Ray Train worker (TorchTrainer); ranks from Ray's train context",
        detected_by=DETECTED_BY,
    )


@hookimpl
def fabric_register_launchers(registrar: Registrar) -> None:
    registrar.add(
        "ray",
        _PACKAGE + "launcher:RayLauncher",
        description="a job on a Ray cluster, one actor per process (fabric run --launcher ray; start_method='ray')",
    )


@hookimpl
def fabric_register_loggers(registrar: Registrar) -> None:
    registrar.add(
        "ray", _PACKAGE + "logger:RayTrainLogger", description="ray.train.report: metrics, checkpoints, restarts"
    )


@hookimpl
def fabric_report_packages() -> list[str]:
    """What ``fabric env`` reports for this plugin, installed or not."""
    return ["ray"]


@hookimpl
def fabric_report_services() -> dict[str, str]:
    """For ``fabric env``: whether the Ray cluster this machine would use answers (a short TCP connect, no ray import)."""
    from fabric_ray.probe import cluster_state

    return {"Ray cluster": cluster_state()}


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames of these packages are not the user's line in a hang report; Ray Train's own code runs the loop."""
    return {"fabric_ray": "library", "ray": "library"}
