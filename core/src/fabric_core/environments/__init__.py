"""Cluster environments: where ranks and the rendezvous address come from for each kind of launcher."""

from __future__ import annotations

from fabric_core.environments.base import (
    ClusterEnvironment,
    InvalidEnvironmentVariable,
    MissingEnvironmentVariable,
    find_free_port,
    select_environment,
)
from fabric_core.environments.kubeflow import KubeflowEnvironment
from fabric_core.environments.lsf import LSFEnvironment
from fabric_core.environments.mpi import MPIEnvironment
from fabric_core.environments.plain import LightningEnvironment, PlainEnvironment
from fabric_core.environments.slurm import SLURMEnvironment, parse_slurm_nodelist
from fabric_core.environments.torchelastic import TorchElasticEnvironment

# Every built-in environment; `select_environment(BUILTIN_ENVIRONMENTS)` picks by detect_priority.
BUILTIN_ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    SLURMEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    KubeflowEnvironment,
    PlainEnvironment,
)

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "ClusterEnvironment",
    "InvalidEnvironmentVariable",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LightningEnvironment",
    "MPIEnvironment",
    "MissingEnvironmentVariable",
    "PlainEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "find_free_port",
    "parse_slurm_nodelist",
    "select_environment",
]
