"""Processes started by ``torchrun`` / ``torch.distributed.elastic``."""

from __future__ import annotations

import logging
import os
from typing import ClassVar

from fabric_core.environments.base import ClusterEnvironment, env_int
from fabric_core.utilities.rank_zero import rank_zero_warn

log = logging.getLogger(__name__)

_HINT = "torchrun exports it for every worker; launch the script with `torchrun ...`."
DEFAULT_ADDRESS = "127.0.0.1"
#: The reference's fallback, not torch's own default (29500): torch's launch tools bind 29500 themselves by default,
#: so a fallback there could collide with an agent's store on the same machine.
DEFAULT_PORT = 12910


class TorchElasticEnvironment(ClusterEnvironment):
    """Reads the variables the torch elastic agent exports; the agent owns every rank, so setters are ignored.

    torchrun always exports ``MASTER_ADDR``/``MASTER_PORT``. Where they are missing (another elastic agent), the
    first access warns, falls back to ``127.0.0.1``/``12910`` and exports the fallback, as the reference does,
    so every later reader (and the process group) sees the same values.
    """

    name: ClassVar[str] = "torchelastic"
    detect_priority: ClassVar[int | None] = 10

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        if not os.environ.get("MASTER_ADDR"):
            rank_zero_warn(
                "MASTER_ADDR environment variable is not defined. Set as localhost"
                f" ({DEFAULT_ADDRESS}). torchrun exports it; set it if rank 0 runs on another host."
            )
            os.environ["MASTER_ADDR"] = DEFAULT_ADDRESS
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        if not os.environ.get("MASTER_PORT"):
            rank_zero_warn(
                f"MASTER_PORT environment variable is not defined. Set as {DEFAULT_PORT}. torchrun exports it;"
                " set it if the rendezvous should use another port."
            )
            os.environ["MASTER_PORT"] = str(DEFAULT_PORT)
        return env_int("MASTER_PORT")

    @classmethod
    def detect(cls) -> bool:
        # torchrun sets the run id for every worker; it may legitimately be empty, so test presence only.
        return "TORCHELASTIC_RUN_ID" in os.environ

    def world_size(self) -> int:
        return env_int("WORLD_SIZE", hint=_HINT)

    def set_world_size(self, size: int) -> None:
        log.debug(
            "TorchElasticEnvironment.set_world_size(%s) ignored: setting world size is not allowed.", size
        )

    def global_rank(self) -> int:
        return env_int("RANK", hint=_HINT)

    def set_global_rank(self, rank: int) -> None:
        log.debug(
            "TorchElasticEnvironment.set_global_rank(%s) ignored: setting global rank is not allowed.", rank
        )

    def local_rank(self) -> int:
        return env_int("LOCAL_RANK", hint=_HINT)

    def node_rank(self) -> int:
        return env_int("GROUP_RANK", default=0)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        world_size = self.world_size()
        if num_devices * num_nodes != world_size:
            raise ValueError(
                f"You set `devices={num_devices}` and `num_nodes={num_nodes}` in Fabric, but the product"
                f" ({num_devices} * {num_nodes}) does not match the world size ({world_size}). torchrun set"
                f" WORLD_SIZE={world_size}: launch with `torchrun --nnodes={num_nodes} --nproc-per-node={num_devices}`,"
                f" or pass devices and num_nodes whose product is {world_size}."
            )
