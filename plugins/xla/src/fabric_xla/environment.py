"""``XLAEnvironment``: ranks come from the torch_xla runtime, which started the replicas itself.

Used by the multi-replica strategy (``xla``) and never detected on its own, as in the reference. Every answer is
read from the runtime when asked, never cached: on a CPU host, and on TPU v2/v3, several replicas are threads of one
process, and the runtime answers per thread.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from fabric_core.environments import ClusterEnvironment

log = logging.getLogger(__name__)


class XLAEnvironment(ClusterEnvironment):
    """The replicas torch_xla started (``torch_xla.launch``): world size, ordinals and host index from its runtime.

    Asking starts the runtime, so ask only inside the launched function. There is no rendezvous address for
    ``torch.distributed``: replicas talk through XLA collectives (``main_address``/``main_port`` raise).
    """

    name: ClassVar[str] = "xla"
    detect_priority: ClassVar[int | None] = None  # explicit only: the XLA strategies create it themselves

    @property
    def creates_processes_externally(self) -> bool:
        return False

    @property
    def main_address(self) -> str:
        raise NotImplementedError(
            "The XLA environment has no main address: torch_xla's replicas communicate through XLA collectives, not a"
            " torch.distributed rendezvous."
        )

    @property
    def main_port(self) -> int:
        raise NotImplementedError(
            "The XLA environment has no main port: torch_xla's replicas communicate through XLA collectives, not a"
            " torch.distributed rendezvous."
        )

    @classmethod
    def detect(cls) -> bool:
        from fabric_xla import detect

        return detect.tpu_present()

    def world_size(self) -> int:
        import torch_xla.runtime as xr

        return int(xr.world_size())

    def set_world_size(self, size: int) -> None:
        log.debug("XLAEnvironment.set_world_size was called, but setting the world size is not allowed: torch_xla's runtime owns it.")

    def global_rank(self) -> int:
        import torch_xla.runtime as xr

        return int(xr.global_ordinal())

    def set_global_rank(self, rank: int) -> None:
        log.debug("XLAEnvironment.set_global_rank was called, but setting the global rank is not allowed: torch_xla's runtime owns it.")

    def local_rank(self) -> int:
        import torch_xla.runtime as xr

        return int(xr.local_ordinal())

    def node_rank(self) -> int:
        import torch_xla.runtime as xr

        return int(xr.host_index())
