"""Pods started by Kubeflow: the training operator's ``PyTorchJob`` and Kubeflow Trainer v2's ``TrainJob``."""

from __future__ import annotations

import logging
import os
from typing import ClassVar

from fabric_core.environments import torchrun_variables
from fabric_core.environments.base import ClusterEnvironment, env_int, env_str

log = logging.getLogger(__name__)

_HINT = (
    "The Kubeflow PyTorchJob operator exports it in every pod; check the job spec. Kubeflow Trainer v2 exports"
    " torchrun's PET_* variables instead: start the script with `torchrun` or `fabric run`, or leave the"
    " KubeflowEnvironment plugin out (Fabric reads PET_* itself)."
)


class KubeflowEnvironment(ClusterEnvironment):
    """Never auto-detected: pass it explicitly with ``plugins=[KubeflowEnvironment()]``.

    Its variables (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``) are the generic torch ones and
    are also set by other launchers, so guessing Kubeflow from them would misfire. The operator's own pods run one
    process each (local rank 0, node rank = global rank); where a launcher inside the pod started several (torchrun
    with ``nprocPerNode`` or Trainer v2's ``PET_NPROC_PER_NODE``), its ``LOCAL_RANK`` and ``GROUP_RANK`` are used,
    so two processes of one pod never share a device (the reference takes local rank 0 for every process).
    """

    name: ClassVar[str] = "kubeflow"
    detect_priority: ClassVar[int | None] = None

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return env_str("MASTER_ADDR", hint=_HINT)

    @property
    def main_port(self) -> int:
        return env_int("MASTER_PORT", hint=_HINT)

    @classmethod
    def detect(cls) -> bool:
        """Never asked by Fabric (``detect_priority`` is ``None``); raises, as the reference does."""
        raise NotImplementedError(
            "The Kubeflow environment can't be detected automatically. Pass it explicitly:"
            " `Fabric(plugins=[KubeflowEnvironment()])`."
        )

    def world_size(self) -> int:
        return env_int("WORLD_SIZE", hint=_HINT)

    def set_world_size(self, size: int) -> None:
        log.debug("KubeflowEnvironment.set_world_size was called, but setting world size is not allowed. Ignored.")

    def global_rank(self) -> int:
        return env_int("RANK", hint=_HINT)

    def set_global_rank(self, rank: int) -> None:
        log.debug("KubeflowEnvironment.set_global_rank was called, but setting global rank is not allowed. Ignored.")

    def local_rank(self) -> int:
        return env_int("LOCAL_RANK", default=0)

    def node_rank(self) -> int:
        for key in ("GROUP_RANK", torchrun_variables.NODE_RANK):  # torchrun's, then Kubeflow's for the pod
            if os.environ.get(key, "").strip():
                return env_int(key)
        return self.global_rank()  # one process per pod
