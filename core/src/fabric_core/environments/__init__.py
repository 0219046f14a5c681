"""Cluster environments: where ranks and the rendezvous address come from for each kind of launcher.

The names below are imported on first access: ``Fabric()`` imports only the environments whose variables are set
(see ``detected_by`` in :mod:`fabric_core.plugins.builtin`), not this whole package.
"""

from __future__ import annotations

from typing import Any

from fabric_core.utilities.lazy import lazy_exports

_BASE = "fabric_core.environments.base"
_lazy_getattr, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "ClusterEnvironment": _BASE,
        "ExternallyLaunched": _BASE,
        "InvalidEnvironmentVariable": _BASE,
        "MissingEnvironmentVariable": _BASE,
        "env_int": _BASE,
        "env_str": _BASE,
        "find_free_port": _BASE,
        "select_environment": _BASE,
        "KubeflowEnvironment": "fabric_core.environments.kubeflow",
        "LSFEnvironment": "fabric_core.environments.lsf",
        "MPIEnvironment": "fabric_core.environments.mpi",
        "LightningEnvironment": "fabric_core.environments.plain",
        "PlainEnvironment": "fabric_core.environments.plain",
        "SLURMEnvironment": "fabric_core.environments.slurm",
        "parse_slurm_nodelist": "fabric_core.environments.slurm",
        "TorchElasticEnvironment": "fabric_core.environments.torchelastic",
    },
)

#: Every built-in environment that detection asks; ``select_environment(BUILTIN_ENVIRONMENTS)`` picks by
#: ``detect_priority``. Built on first access.
_BUILTIN_NAMES = (
    "TorchElasticEnvironment",
    "SLURMEnvironment",
    "LSFEnvironment",
    "MPIEnvironment",
    "KubeflowEnvironment",
    "PlainEnvironment",
)


def __getattr__(name: str) -> Any:
    if name == "BUILTIN_ENVIRONMENTS":
        value = tuple(_lazy_getattr(n) for n in _BUILTIN_NAMES)
        globals()[name] = value
        return value
    return _lazy_getattr(name)


__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "ClusterEnvironment",
    "ExternallyLaunched",
    "InvalidEnvironmentVariable",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LightningEnvironment",
    "MPIEnvironment",
    "MissingEnvironmentVariable",
    "env_int",
    "env_str",
    "PlainEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "find_free_port",
    "parse_slurm_nodelist",
    "select_environment",
]
