"""Base for strategies that run one process per device joined by a ``torch.distributed`` process group.

``ParallelStrategy`` owns that process group: it creates and destroys it, keeps the rank bookkeeping and
implements the collectives. Plugins such as DDP and FSDP subclass it and only add how the module is wrapped;
the launchers that start its processes are typed against it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fabric_core.strategies.base import Strategy
from fabric_core.utilities import rank_zero
from fabric_core.utilities.topology import Topology, threads_per_process

if TYPE_CHECKING:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.io.checkpoint_io import CheckpointIO
    from fabric_core.io.formats import FindReader
    from fabric_core.precision.base import Precision

DEFAULT_TIMEOUT = timedelta(minutes=30)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class ParallelStrategy(Strategy):
    """One process per device, across ``num_nodes`` nodes, joined by a ``torch.distributed`` process group.

    Args:
        parallel_devices: the devices of this node (one process each); by default what ``devices=`` resolved to.
        cluster_environment: where ranks and the rendezvous come from; by default the detected one.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; by default the accelerator's (nccl on CUDA, gloo
            otherwise).
        timeout: how long a collective waits for the other ranks before failing.
        start_method: ``"popen"`` (re-run the script for each extra local rank), ``"spawn"``, ``"fork"`` or
            ``"forkserver"`` (run the function given to ``fabric.launch`` in new processes).
    """

    requires_launch = True
    launcher_name = "subprocess"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: str = "popen",
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self.start_method = start_method
        self.launcher_name = "subprocess" if start_method == "popen" else start_method
        self._owns_process_group = False

    def attach(
        self,
        *,
        accelerator: Accelerator,
        devices: list[torch.device],
        num_nodes: int,
        cluster_environment: ClusterEnvironment | None,
        checkpoint_io: CheckpointIO | None,
        find_checkpoint_reader: FindReader | None = None,
    ) -> None:
        super().attach(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            find_checkpoint_reader=find_checkpoint_reader,
        )
        if self.parallel_devices is None:
            self.parallel_devices = list(devices)
        if self.cluster_environment is None:
            self.cluster_environment = cluster_environment
        self.set_world_ranks()

    # ---------------------------------------------------------------------------------------- topology
    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 0

    @property
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            return torch.device("cpu")
        return self.parallel_devices[min(self.local_rank, len(self.parallel_devices) - 1)]

    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.cluster_environment else 0

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self.cluster_environment else 0

    @property
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self.cluster_environment else 0

    @property
    def world_size(self) -> int:
        return self.cluster_environment.world_size() if self.cluster_environment else 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def topology(self) -> Topology:
        """This job's layout as this strategy was configured (``num_nodes`` x ``num_processes``)."""
        return Topology(self.num_nodes, self.num_processes, self.node_rank, self.local_rank)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's rank and the world size, unless it already knows."""
        env = self.cluster_environment
        if env is None:
            return
        if not env.creates_processes_externally:
            topology = self.topology
            env.set_global_rank(topology.global_rank)
            env.set_world_size(topology.world_size)
        rank_zero.set_rank(env.global_rank())

    # ---------------------------------------------------------------------------------------- lifecycle
    def setup_environment(self) -> None:
        self.set_world_ranks()
        self._limit_cpu_threads()
        self.init_process_group()
        super().setup_environment()

    def _limit_cpu_threads(self) -> None:
        """Avoid thread oversubscription: N processes on one CPU each get cores/N intra-op threads."""
        if self.root_device.type != "cpu" or "OMP_NUM_THREADS" in os.environ or self.num_processes <= 1:
            return
        torch.set_num_threads(threads_per_process(self.num_processes))

    def get_process_group_backend(self) -> str:
        if self.process_group_backend:
            return self.process_group_backend
        if self.root_device.type == "cuda":
            return "nccl"
        return "gloo"

    def init_process_group(self) -> None:
        dist = _dist()
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this build of PyTorch.")
        if dist.is_initialized():
            return
        env = self.cluster_environment
        assert env is not None, "a parallel strategy needs a cluster environment"
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        kwargs: dict[str, Any] = {}
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        dist.init_process_group(
            self.get_process_group_backend(), rank=env.global_rank(), world_size=env.world_size(), **kwargs
        )
        self._owns_process_group = True

    def teardown(self) -> None:
        dist = _dist()
        if self._owns_process_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        super().teardown()

    # ---------------------------------------------------------------------------------------- collectives
    @staticmethod
    def _ready() -> bool:
        dist = _dist()
        return dist.is_available() and dist.is_initialized()

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str | Any = "mean") -> Tensor:
        """In-place reduction. ``"mean"`` is a sum followed by a division (integer tensors floor-divide)."""
        if not self._ready():
            return tensor
        dist = _dist()
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if isinstance(reduce_op, str):
            op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, reduce_op.upper(), None)
            if op is None:
                raise ValueError(
                    f"Unsupported reduce_op {reduce_op!r}: use 'mean', 'sum', 'max', 'min' or 'product'."
                )
        else:
            op = reduce_op
        dist.all_reduce(tensor, op=op, group=group)
        if mean:
            size = dist.get_world_size(group)
            if torch.is_floating_point(tensor) or torch.is_complex(tensor):
                tensor.div_(size)
            else:
                tensor.copy_(torch.div(tensor, size, rounding_mode="floor"))
        return tensor

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack every rank's tensor into ``(world_size, *shape)``; ranks may hold different shapes.

        Shapes are exchanged first; when they differ, tensors are padded to the largest size, gathered, and
        returned as a list-like stack only when all shapes match (otherwise a tuple of per-rank tensors).
        """
        if not self._ready():
            return tensor
        dist = _dist()
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        shape = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
        ndim = torch.tensor([tensor.dim()], dtype=torch.long, device=tensor.device)
        ndims = [torch.zeros_like(ndim) for _ in range(world)]
        dist.all_gather(ndims, ndim, group=group)
        if len({int(n) for n in ndims}) != 1:
            raise ValueError(
                "all_gather needs tensors with the same number of dimensions on every rank, got"
                f" {[int(n) for n in ndims]}."
            )
        shapes = [torch.zeros_like(shape) for _ in range(world)]
        dist.all_gather(shapes, shape, group=group)
        shape_list = [tuple(int(s) for s in sh) for sh in shapes]
        if len(set(shape_list)) == 1:
            return self._gather_same_shape(tensor, world, group, sync_grads)
        max_shape = [max(s[d] for s in shape_list) for d in range(tensor.dim())]
        pad: list[int] = []
        for d in reversed(range(tensor.dim())):
            pad += [0, max_shape[d] - tensor.shape[d]]
        padded = torch.nn.functional.pad(tensor, pad)
        gathered = self._gather_same_shape(padded, world, group, sync_grads)
        return tuple(
            gathered[r][tuple(slice(0, n) for n in shape_list[r])] for r in range(world)
        )  # type: ignore[return-value]

    @staticmethod
    def _gather_same_shape(tensor: Tensor, world: int, group: Any, sync_grads: bool) -> Tensor:
        dist = _dist()
        if sync_grads:
            import torch.distributed.nn.functional as dist_fn

            return torch.stack(dist_fn.all_gather(tensor, group=group or dist.group.WORLD))
        with torch.no_grad():
            out = [torch.empty_like(tensor) for _ in range(world)]
            dist.all_gather(out, tensor, group=group)
            return torch.stack(out)

    def barrier(self, name: str | None = None) -> None:
        if not self._ready():
            return
        dist = _dist()
        if self.get_process_group_backend() == "nccl" and self.root_device.type == "cuda":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._ready():
            return obj
        dist = _dist()
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, device=self.root_device if self.root_device.type == "cuda" else None)
        return holder[0]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not self._ready():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        self.all_reduce(flag, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag > 0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self.num_processes}, num_nodes={self.num_nodes})"
