"""The fallback environment: a single machine, processes started by us or by a generic launcher."""

from __future__ import annotations

import os
from typing import ClassVar

from fabric_core.environments import torchrun_variables
from fabric_core.environments.base import ClusterEnvironment, env_int, find_free_port
from fabric_core.utilities.rank_zero import set_rank


class PlainEnvironment(ClusterEnvironment):
    """Used when no scheduler is detected (the reference calls it ``LightningEnvironment``; that name is an alias).

    Without ``LOCAL_RANK`` the library launches the processes itself. With it, some launcher (ours, in the child
    processes, or a hand-rolled one) already started them. Either way the strategy sets the world size and this
    process's rank from ``devices``/``num_nodes`` and ``NODE_RANK``/``LOCAL_RANK``, as the reference does;
    ``WORLD_SIZE``/``RANK`` are only read until then, and :meth:`validate_settings` refuses them when they
    disagree with what the strategy computes.

    In a pod that Kubeflow configured for torchrun (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ...:
    :mod:`~fabric_core.environments.torchrun_variables`) but whose script runs without it, the node rank and node
    0's address come from those variables, and ``devices``/``num_nodes`` must be what they say: every node then
    joins the one world torchrun would have formed.
    """

    name: ClassVar[str] = "plain"
    detect_priority: ClassVar[int | None] = 1000
    ranks_follow_devices: ClassVar[bool] = True

    def __init__(self) -> None:
        self._world_size: int | None = None
        self._global_rank: int | None = None
        self._main_port: int | None = None

    @property
    def creates_processes_externally(self) -> bool:
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR") or torchrun_variables.get(torchrun_variables.MASTER_ADDR) or "127.0.0.1"

    @property
    def main_port(self) -> int:
        """``MASTER_PORT``, else ``PET_MASTER_PORT``, else ``STANDALONE_PORT``, else a free port; decided on first
        access and then kept.

        Kept because the launcher reads it once per child and every process of the job must see the same value.
        """
        if self._main_port is None:
            pet_port = torchrun_variables.MASTER_PORT
            if os.environ.get("MASTER_PORT"):
                self._main_port = env_int("MASTER_PORT")
            elif torchrun_variables.get(pet_port):
                self._main_port = env_int(pet_port)
            else:
                self._main_port = find_free_port()
        return self._main_port

    @classmethod
    def detect(cls) -> bool:
        return True

    def world_size(self) -> int:
        if self._world_size is not None:
            return self._world_size
        if self.creates_processes_externally:
            return env_int("WORLD_SIZE", default=1)
        return 1

    def set_world_size(self, size: int) -> None:
        self._world_size = int(size)

    def global_rank(self) -> int:
        if self._global_rank is not None:
            return self._global_rank
        if self.creates_processes_externally:
            return env_int("RANK", default=0)
        return 0

    def set_global_rank(self, rank: int) -> None:
        self._global_rank = int(rank)
        # Keep rank-zero-only printing/logging in step with the rank the strategy settled on.
        set_rank(self._global_rank)

    def local_rank(self) -> int:
        return env_int("LOCAL_RANK", default=0)

    def node_rank(self) -> int:
        # NODE_RANK is ours/Lightning-style; GROUP_RANK is what torch's elastic agent exports; PET_NODE_RANK is
        # torchrun's argument as a Kubeflow pod sets it.
        for key in ("NODE_RANK", "GROUP_RANK", torchrun_variables.NODE_RANK):
            if os.environ.get(key):
                return env_int(key)
        return 0

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Refuse rank variables that contradict ``devices``/``num_nodes`` or do not form a complete set.

        A variable left in the environment by an earlier job (a notebook, a shell) must not silently change the
        job: ``LOCAL_RANK`` alone would make this process rank 1 of a one-process world, and ``WORLD_SIZE=4``
        with ``devices=2`` would wait forever for ranks that never come.
        """
        expected = num_devices * num_nodes
        leftover = "If it is left over from an earlier job (a notebook, a shell), unset it."
        _validate_torchrun_variables(num_devices, num_nodes)
        pod_rank = torchrun_variables.get(torchrun_variables.NODE_RANK)
        if not self.creates_processes_externally:
            for var in ("WORLD_SIZE", "RANK"):
                value = os.environ.get(var)
                if value is None or value.strip() == "" or var == "WORLD_SIZE" and value.strip() == str(expected):
                    continue
                if var == "RANK" and value.strip() == pod_rank:
                    continue  # the Kubeflow operator's RANK of this pod, beside its PET_NODE_RANK (v1.8)
                raise ValueError(
                    f"`{var}={value}` is set in the environment, but `LOCAL_RANK` is not, so Fabric starts the"
                    f" {expected} processes of `devices={num_devices}, num_nodes={num_nodes}` itself and assigns"
                    f" their ranks. {leftover} A launcher that starts the processes itself must set LOCAL_RANK,"
                    " RANK and WORLD_SIZE together. In a Kubeflow PyTorchJob pod, pass"
                    " `plugins=[KubeflowEnvironment()]`."
                )
            return
        local_rank = os.environ["LOCAL_RANK"]
        missing = [var for var in ("RANK", "WORLD_SIZE") if not os.environ.get(var, "").strip()]
        if missing:
            raise ValueError(
                f"`LOCAL_RANK={local_rank}` is set in the environment, so Fabric takes this process as one started by"
                f" a launcher, but {' and '.join(f'`{m}`' for m in missing)} {'is' if len(missing) == 1 else 'are'}"
                f" not set. {leftover} Otherwise export LOCAL_RANK, RANK and WORLD_SIZE together (and MASTER_ADDR/"
                "MASTER_PORT), as torchrun does."
            )
        world_size, rank, local = env_int("WORLD_SIZE"), env_int("RANK"), env_int("LOCAL_RANK")
        if world_size != expected:
            raise ValueError(
                f"`WORLD_SIZE={world_size}` is set in the environment, but `Fabric(devices={num_devices},"
                f" num_nodes={num_nodes})` runs {expected} processes. Make them agree, or unset the launcher variables"
                f" (LOCAL_RANK, RANK, WORLD_SIZE) if they are left over from an earlier job."
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"`RANK={rank}` is set in the environment, but it must be between 0 and {world_size - 1} (WORLD_SIZE={world_size}).")
        if not 0 <= local < num_devices:
            raise ValueError(
                f"`LOCAL_RANK={local}` is set in the environment, but it must be between 0 and {num_devices - 1}"
                f" (devices={num_devices}). {leftover}"
            )
        node = self.node_rank()
        computed = node * num_devices + local
        if rank != computed:
            # The strategy gives this process rank NODE_RANK * devices + LOCAL_RANK: a launcher's RANK that says
            # otherwise would leave two processes with one rank and the rendezvous waiting forever.
            raise ValueError(
                f"`RANK={rank}` is set in the environment, but the node rank ({node}, from NODE_RANK or GROUP_RANK),"
                f" `devices={num_devices}` and `LOCAL_RANK={local}` make this process rank {node} * {num_devices} +"
                f" {local} = {computed}. Export NODE_RANK on every node so that they agree, or unset the launcher"
                " variables (LOCAL_RANK, RANK, WORLD_SIZE) if they are left over from an earlier job."
            )


def _validate_torchrun_variables(num_devices: int, num_nodes: int) -> None:
    """Refuse ``devices``/``num_nodes`` that contradict the pod's ``PET_*`` variables: torchrun would start the job
    they describe, and a node that counts otherwise waits forever for processes that never come."""
    shape = torchrun_variables.job_shape()
    where = "(torchrun's argument as a variable: Kubeflow sets it in every pod)"
    if shape.num_nodes is not None and num_nodes != shape.num_nodes:
        raise ValueError(
            f"`{torchrun_variables.NNODES}={os.environ[torchrun_variables.NNODES]}` is set in the environment {where},"
            f" but `Fabric(num_nodes={num_nodes})` asks for {num_nodes} node(s). Pass `num_nodes={shape.num_nodes}`"
            " or leave it out."
        )
    if shape.processes_per_node is not None and num_devices != shape.processes_per_node:
        raise ValueError(
            f"`{torchrun_variables.NPROC_PER_NODE}={os.environ[torchrun_variables.NPROC_PER_NODE]}` is set in the"
            f" environment {where}: {shape.processes_per_node} process(es) per node, but `Fabric(devices=...)` asks"
            f" for {num_devices}. Pass `devices={shape.processes_per_node}` or leave it out."
        )
    if shape.node_rank is not None and not shape.node_rank < num_nodes:
        raise ValueError(
            f"`{torchrun_variables.NODE_RANK}={shape.node_rank}` is set in the environment {where}, but the job has"
            f" {num_nodes} node(s) (0 to {num_nodes - 1}). Pass the job's `num_nodes`."
        )


#: The reference's name for the fallback environment: the same class, so either name works in ``isinstance``.
LightningEnvironment = PlainEnvironment
