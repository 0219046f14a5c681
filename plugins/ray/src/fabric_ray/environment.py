"""The cluster environment of a Ray Train worker: ranks and counts read from Ray's own train context.

Detection is cheap outside Ray: the registry imports this module only where the variable Ray exports to every
worker process it starts is set (``detected_by`` in :mod:`fabric_ray.register`), and :meth:`RayTrainEnvironment.detect` then
asks Ray only if ``ray.train`` is already imported in this process (it is, in every Ray Train worker: Ray's worker
code imported it to run the user's function). ``import fabric_core``/``Fabric()`` outside Ray never import ray.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from fabric_core.environments import ExternallyLaunched, env_int
from fabric_core.utilities import set_rank


def train_context() -> Any | None:
    """Ray Train's context of this worker, or ``None`` outside a Ray Train worker (nothing is imported then)."""
    if "ray.train" not in sys.modules:
        return None
    try:
        import ray
        import ray.train

        if not ray.is_initialized():
            return None
        context = ray.train.get_context()
        context.get_world_size()  # outside a worker Ray raises here (or above)
    except (RuntimeError, Warning):  # Ray's "not a Train worker"; in a Tune trial a DeprecationWarning
        return None
    return context


class RayTrainEnvironment(ExternallyLaunched):
    """A process started by Ray Train (``TorchTrainer``'s ``train_loop_per_worker``).

    Ray owns every rank: world size, global, local and node rank come from ``ray.train.get_context()`` and the
    setters are ignored. Ray also made the process group before the user's function started (``TorchConfig``'s
    backend), and Fabric uses that group as it is (it never makes a second one, and never destroys Ray's): the
    rendezvous address is only reported, from the ``MASTER_ADDR``/``MASTER_PORT`` Ray exported.
    """

    name: ClassVar[str] = "ray"
    #: Before torchelastic (10) and the plain fallback: Ray Train exports RANK/LOCAL_RANK/MASTER_ADDR too.
    detect_priority: ClassVar[int | None] = 5

    def __init__(self) -> None:
        context = train_context()
        if context is None:
            raise RuntimeError(
                "RayTrainEnvironment describes a Ray Train worker, but this process is not one (no Ray Train context)."
                " Build Fabric inside the `train_loop_per_worker` function that `ray.train.torch.TorchTrainer` runs."
            )
        self._context = context
        set_rank(self.global_rank())

    @property
    def main_port(self) -> int:
        return env_int("MASTER_PORT", default=0)

    @classmethod
    def detect(cls) -> bool:
        return train_context() is not None

    def world_size(self) -> int:
        return int(self._context.get_world_size())

    def set_world_size(self, size: int) -> None:
        pass  # Ray's ScalingConfig owns it; validate_settings refuses a Fabric that disagrees

    def global_rank(self) -> int:
        return int(self._context.get_world_rank())

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return int(self._context.get_local_rank())

    def node_rank(self) -> int:
        return int(self._context.get_node_rank())

    def local_world_size(self) -> int:
        return int(self._context.get_local_world_size())

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        world, local = self.world_size(), self.local_world_size()
        if num_devices * num_nodes == world and num_devices == local:
            return
        # No collective here: a worker whose own node count agrees would not join it (the job would hang).
        nodes = world // local if local and world % local == 0 else None
        fix = f"`Fabric(devices={local}, num_nodes={nodes})` (or leave `devices` and `num_nodes` out)" if nodes else (
            "a `ScalingConfig` that puts as many workers on every node (`placement_strategy=\"STRICT_SPREAD\"` for one"
            " per node)"
        )
        raise ValueError(
            f"`Fabric(devices={num_devices}, num_nodes={num_nodes})` asks for {num_devices * num_nodes} processes,"
            f" {num_devices} per node, but Ray Train's `ScalingConfig` started {world} workers (`num_workers={world}`),"
            f" {local} on this node (node rank {self.node_rank()}). Inside Ray Train the ScalingConfig decides: pass"
            f" {fix}, or change `ScalingConfig(num_workers=...)` to {num_devices * num_nodes}."
        )

    def __repr__(self) -> str:
        return f"RayTrainEnvironment(rank={self.global_rank()}/{self.world_size()}, node={self.node_rank()})"
