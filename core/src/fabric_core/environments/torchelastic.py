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
DEFAULT_PORT = 29500  # torchrun's own default rendezvous port


class TorchElasticEnvironment(ClusterEnvironment):
    """Reads the variables the torch elastic agent exports; the agent owns every rank, so setters are ignored."""

    name: ClassVar[str] = "torchelastic"
    detect_priority: ClassVar[int | None] = 10

    def __init__(self) -> None:
        self._warned: set[str] = set()

    @property
    def creates_processes_externally(self) -> bool:
        return True

    def _warn_missing(self, var: str, fallback: object) -> None:
        if var not in self._warned:
            self._warned.add(var)
            rank_zero_warn(
                f"torchelastic was detected but `{var}` is not set; using {fallback}. "
                f"Set `{var}` (torchrun normally does) if the rendezvous should happen elsewhere."
            )

    @property
    def main_address(self) -> str:
        address = os.environ.get("MASTER_ADDR")
        if not address:
            self._warn_missing("MASTER_ADDR", DEFAULT_ADDRESS)
            return DEFAULT_ADDRESS
        return address

    @property
    def main_port(self) -> int:
        if not os.environ.get("MASTER_PORT"):
            self._warn_missing("MASTER_PORT", DEFAULT_PORT)
            return DEFAULT_PORT
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
                f"You selected devices={num_devices} and num_nodes={num_nodes}, whose product "
                f"({num_devices} * {num_nodes} = {num_devices * num_nodes}) does not match the world size "
                f"({world_size}) that torchrun set in WORLD_SIZE. Make them agree: launch with "
                f"`torchrun --nnodes={num_nodes} --nproc-per-node={num_devices}`, or pass devices and num_nodes "
                f"whose product is {world_size}."
            )
