"""Pods started by the Kubeflow training operator (``PyTorchJob``), one process per pod."""

from __future__ import annotations

import logging
from typing import ClassVar

from fabric_core.environments.base import ClusterEnvironment, env_int, env_str

log = logging.getLogger(__name__)

_HINT = "The Kubeflow PyTorchJob operator exports it in every pod; check the job spec."


class KubeflowEnvironment(ClusterEnvironment):
    """Never auto-detected: pass it explicitly with ``plugins=[KubeflowEnvironment()]``.

    Its variables (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``) are the generic torch ones and
    are also set by other launchers, so guessing Kubeflow from them would misfire. Each pod runs one process,
    so the local rank is 0 and the node rank equals the global rank.
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
        log.debug("KubeflowEnvironment.set_world_size(%s) ignored: the operator sets the world size.", size)

    def global_rank(self) -> int:
        return env_int("RANK", hint=_HINT)

    def set_global_rank(self, rank: int) -> None:
        log.debug("KubeflowEnvironment.set_global_rank(%s) ignored: the operator sets the global rank.", rank)

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.global_rank()
