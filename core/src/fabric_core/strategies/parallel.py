"""Collectives over a ``torch.distributed`` process group, and ``ParallelStrategy``: one process per device joined
by one.

:class:`ProcessGroupCollectives` owns the process group: it creates it (``setup_environment``), destroys it
(``teardown``) and implements the collectives over it, whatever the processes' layout. :class:`ParallelStrategy`
combines it with the one-process-per-device layout (:class:`~fabric_core.strategies.layout.ProcessPerDevice`).
Plugins such as DDP and FSDP subclass it and only add how the module is wrapped.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor

from fabric_core.runtime.process_group import release_at_exit
from fabric_core.strategies.collectives import Collectives, check_broadcast_src
from fabric_core.strategies.layout import ProcessPerDevice
from fabric_core.utilities import rank_zero
from fabric_core.utilities.object_collectives import all_gather_object, broadcast_object
from fabric_core.utilities.topology import export_rendezvous, threads_per_process

if TYPE_CHECKING:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.io.checkpoint_io import CheckpointIO
    from fabric_core.precision.base import Precision

DEFAULT_TIMEOUT = timedelta(minutes=30)


TIMEOUT_VARIABLE = "FABRIC_TIMEOUT"


def collective_timeout(configured: timedelta | None) -> timedelta | None:
    """How long a collective waits for the other ranks: the strategy's ``timeout`` when it was given one, else
    ``FABRIC_TIMEOUT`` (seconds) when set, else 30 minutes (torch's default).

    A rank that stops making progress (stuck, or waiting on a collective the others never reach) holds up the
    others for this long before the job fails, so interactive or test runs may want far less.
    """
    value = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if configured is not DEFAULT_TIMEOUT or not value:
        return configured
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"`{TIMEOUT_VARIABLE}={value}` must be a number of seconds.") from None
    if seconds <= 0:
        raise ValueError(f"`{TIMEOUT_VARIABLE}={value}` must be a positive number of seconds.")
    return timedelta(seconds=seconds)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


#: How many process groups this process has created (and the stores of those it destroyed, kept alive), so that a
#: second ``launch()`` in the same process meets on keys of its own (see :func:`rendezvous_store`).
_launches = 0
_kept_stores: dict[tuple[str, int], Any] = {}


def restart_attempt_store(address: str, port: int, world_size: int, timeout: timedelta | None) -> Any:
    """The store for this worker's process group when torchrun restarted it, with keys of this attempt only.

    Under torchrun the workers use the agent's store (``TORCHELASTIC_USE_AGENT_STORE=True``). torch 2.13 expects a
    new store for every restart and no longer prefixes the workers' keys per attempt, but the static rendezvous
    (torchrun's ``--master-addr/--master-port``, what ``fabric run`` uses by default) keeps one store for the whole
    job: a restarted worker could read the previous attempt's addresses and fail to connect ("Connection
    refused"). Prefixing the keys with ``TORCHELASTIC_RESTART_COUNT`` makes every attempt meet afresh. ``None``
    when the process was not started by torchrun's agent.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    dist = _dist()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    kwargs = {"timeout": timeout} if timeout is not None else {}
    store = dist.TCPStore(address, port, world_size, is_master=False, **kwargs)
    return dist.PrefixStore(f"/fabric/attempt_{attempt}", store)


def rendezvous_store(address: str, port: int, world_size: int, timeout: timedelta | None) -> Any:
    """The store this process's next process group meets on, or ``None`` for torch's own (``env://``).

    Under torchrun's agent: its store, with keys of this attempt (:func:`restart_attempt_store`). A second group in
    the same process (``launch()`` after a teardown, a second ``Fabric``) meets on the store of the group it
    destroyed, kept alive for this, under keys of its own: torch's ``env://`` would start a new store server on the
    same port while the other ranks may still reach the old one, closing down (4 ranks: "Connection was likely
    closed" on the others and rank 0 waiting for ever). The first group uses torch's rendezvous unchanged.
    """
    global _launches
    launch, _launches = _launches, _launches + 1
    dist = _dist()
    store = restart_attempt_store(address, port, world_size, timeout)
    if store is None and launch > 0:
        store = _kept_stores.get((address, port))
    if store is None or launch == 0:
        return store
    return dist.PrefixStore(f"/fabric/launch_{launch}", store)


def _keep_default_store() -> None:
    """Keep the default group's store alive past ``destroy_process_group`` (see :func:`rendezvous_store`)."""
    env_address, env_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    getter = getattr(_dist().distributed_c10d, "_get_default_store", None)  # torch's; absent: nothing is kept
    if getter is None or not env_address or not env_port.isdigit():
        return
    try:
        _kept_stores[(env_address, int(env_port))] = getter()
    except (RuntimeError, ValueError):  # no default group, or a group without a store (torch's rule): nothing to keep
        pass


class ProcessGroupCollectives(Collectives):
    """Collectives over a ``torch.distributed`` process group, which this class creates and destroys.

    The strategy provides ``cluster_environment`` (rank, world size, rendezvous address), ``root_device``,
    ``process_group_backend`` (``None``: nccl on CUDA, gloo otherwise) and ``timeout``. Before the group exists
    (one process, or before ``launch``) every collective is an identity.
    """

    cluster_environment: ClusterEnvironment | None
    process_group_backend: str | None
    timeout: timedelta | None
    is_global_zero: bool
    _owns_process_group: bool = False
    _unlimited_group: Any = None
    _checkpoint_group: Any = None

    # ---------------------------------------------------------------------------------------- lifecycle
    def get_process_group_backend(self) -> str:
        """The backend the process group is created with: the one given, else nccl on CUDA and gloo otherwise."""
        if self.process_group_backend:
            return self.process_group_backend
        if self.root_device.type == "cuda":
            return "nccl"
        return "gloo"

    def init_process_group(self) -> None:
        """Create the default process group (once per process; a group that exists is used as it is), with the
        rendezvous variables exported from the cluster environment and the collective timeout. Called by
        ``setup_environment`` in every process."""
        dist = _dist()
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this build of PyTorch.")
        if dist.is_initialized():
            return
        env = self.cluster_environment
        assert env is not None, "a process group needs a cluster environment"
        export_rendezvous(env)
        kwargs: dict[str, Any] = {}
        timeout = collective_timeout(self.timeout)
        if timeout is not None:
            kwargs["timeout"] = timeout
        backend = self.get_process_group_backend()
        rank, world_size = env.global_rank(), env.world_size()
        rank_zero.fabric_log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
        store = rendezvous_store(env.main_address, env.main_port, world_size, timeout)
        if store is not None:
            kwargs["store"] = store
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
        # The rendezvous is over only when every rank is connected: gloo's init can return on rank 0 while rank 1 is
        # still connecting to it, and a rank 0 that then ends (its script was short, or it failed) breaks rank 1's
        # connect ("Gloo connectFullMesh failed ... Connection closed by peer"): 3 of 20 runs of `launch()` alone.
        self.barrier()
        rank_zero.rank_zero_info(
            f"{'-' * 100}\ndistributed_backend={backend}\nAll distributed processes registered."
            f" Starting with {world_size} processes\n{'-' * 100}\n"
        )
        self._owns_process_group = True
        release_at_exit()  # a gloo group alive at interpreter exit can turn a successful run into exit 134

    @property
    def owns_process_group(self) -> bool:
        """Whether this object created the default process group (and destroys it at teardown); ``False`` when the
        group was made by someone else (Ray Train, a user) or is already destroyed."""
        return self._owns_process_group

    def destroy_process_group(self) -> None:
        """Destroy the process group this object created (and the groups made for checkpoints and waits).

        Saves still finishing in the background may use them, so they are waited for first.
        """
        from fabric_core.io import background

        background.wait_all()
        dist = _dist()
        self._unlimited_group = None
        self._checkpoint_group = None
        if self._owns_process_group and dist.is_available() and dist.is_initialized():
            _keep_default_store()
            dist.destroy_process_group()
            self._owns_process_group = False

    # ---------------------------------------------------------------------------------------- collectives
    @staticmethod
    def process_group_ready() -> bool:
        """Whether the default process group exists: before it does (one process, or before ``launch``) every
        collective is an identity, and a strategy that needs the group (a mesh, an engine) says so instead."""
        dist = _dist()
        return dist.is_available() and dist.is_initialized()

    _MAX_DIMS = 8

    def _shapes(self, tensor: Tensor, group: Any) -> list[tuple[int, ...]]:
        """Every rank's shape of ``tensor``, in one small all-gather (dtype and device of ``tensor`` ignored)."""
        dist = _dist()
        world = dist.get_world_size(group)
        if tensor.dim() > self._MAX_DIMS:
            raise ValueError(f"Collectives take tensors with at most {self._MAX_DIMS} dimensions, got {tensor.dim()}.")
        record = torch.full((self._MAX_DIMS + 1,), -1, dtype=torch.long, device=tensor.device)
        record[0] = tensor.dim()
        record[1 : tensor.dim() + 1] = torch.tensor(tensor.shape, dtype=torch.long)
        records = [torch.empty_like(record) for _ in range(world)]
        dist.all_gather(records, record, group=group)
        return [tuple(int(d) for d in r[1 : int(r[0]) + 1]) for r in records]

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str | Any = "mean") -> Tensor:
        """In-place reduction. ``"mean"`` is a sum followed by a division (integer tensors floor-divide).

        The ranks' shapes are compared first (one small all-gather): tensors of different shapes would otherwise
        be reduced element by element as flat buffers, a silently wrong result.
        """
        op_name = self.validate_reduce_op(reduce_op)
        if not self.process_group_ready():
            return tensor
        dist = _dist()
        shapes = self._shapes(tensor, group)
        if len(set(shapes)) != 1:
            listing = ", ".join(f"rank {rank}: {tuple(shape)}" for rank, shape in enumerate(shapes))
            raise ValueError(
                f"`all_reduce` needs a tensor of the same shape on every rank, got {listing}. Reduce tensors of"
                " equal shape (pad them, or reduce a scalar such as a sum and a count)."
            )
        mean = op_name in ("mean", "avg")
        if isinstance(op_name, str):
            op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, op_name.upper())
        else:
            op = op_name
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
        returned as a tuple of per-rank tensors (a stacked tensor only when all shapes match).
        """
        if not self.process_group_ready():
            return tensor
        dist = _dist()
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        shape_list = self._shapes(tensor, group)
        if len({len(s) for s in shape_list}) != 1:
            raise ValueError(
                "all_gather needs tensors with the same number of dimensions on every rank, got"
                f" {[len(s) for s in shape_list]}."
            )
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
        """Wait for every process of the group (on CUDA with nccl, on this process's device)."""
        if not self.process_group_ready():
            return
        dist = _dist()
        try:
            if self.get_process_group_backend() == "nccl" and self.root_device.type == "cuda":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()
        except RuntimeError as err:
            from fabric_core.utilities.peer_left import peer_left_error

            named = peer_left_error(err, self.global_rank, self.world_size, "barrier()")
            if named is not None:
                raise named from err
            raise

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from rank ``src`` to every process of the group."""
        check_broadcast_src(src, self.world_size)
        if not self.process_group_ready():
            return obj
        gloo = self.get_process_group_backend() == "gloo"
        return broadcast_object(obj, src=src, device=torch.device("cpu") if gloo else self.root_device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's picklable ``obj``, in rank order, in two all-gathers (sizes, then bytes; no numpy)."""
        if not self.process_group_ready():
            return [obj]
        gloo = self.get_process_group_backend() == "gloo"
        return all_gather_object(obj, device=torch.device("cpu") if gloo else self.root_device)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """The vote in one small all-reduce (no shape check: every rank sends one number)."""
        if not self.process_group_ready():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        _dist().all_reduce(flag, op=_dist().ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag > 0)

    def checkpoint_coordinator(self) -> _GroupCoordinator:
        """Collectives over a gloo group of their own (made once, every rank together), for the background thread
        that finishes asynchronous saves while the training loop runs collectives on the default group."""
        if not self.process_group_ready():
            return _GroupCoordinator(None, self.is_global_zero, self.root_device)
        if self._checkpoint_group is None:
            self._checkpoint_group = _dist().new_group(backend="gloo", timeout=collective_timeout(self.timeout))
        return _GroupCoordinator(self._checkpoint_group, self.is_global_zero, torch.device("cpu"))

    def prepare_barrier_without_timeout(self) -> None:
        """Create (once, every rank together) the gloo group that :meth:`barrier_without_timeout` waits on."""
        if self.process_group_ready() and self._unlimited_group is None:
            self._unlimited_group = _dist().new_group(backend="gloo", timeout=timedelta(days=10000))

    def barrier_without_timeout(self, name: str | None = None) -> None:
        """A barrier with no time limit, over a gloo group made for it.

        For waits of unknown length, such as rank 0 downloading a dataset in ``fabric.rank_zero_first()``: an
        ordinary barrier would fail at the process-group timeout. If a rank dies instead, its connections close and
        the others fail at once.
        """
        if not self.process_group_ready():
            return
        if self._unlimited_group is None:
            raise RuntimeError("call `prepare_barrier_without_timeout()` on every rank first")
        _dist().barrier(group=self._unlimited_group)


class ParallelOptions(TypedDict, total=False):
    """The keywords of :class:`ParallelStrategy` (its ``Args`` say what each does), declared once for its subclasses:
    a subclass takes them as ``**options: Unpack[ParallelOptions]`` (or splits them from its engine's keywords with
    :func:`split_parallel_options`) and passes them on, instead of copying each through its constructor."""

    accelerator: Accelerator | None
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    checkpoint_io: CheckpointIO | None
    precision: Precision | None
    process_group_backend: str | None
    timeout: timedelta | None
    start_method: str


def split_parallel_options(kwargs: dict[str, Any]) -> tuple[ParallelOptions, dict[str, Any]]:
    """``kwargs`` of a subclass constructor that also takes its engine's keywords (DDP's, FSDP1's): the
    :class:`ParallelOptions`, and the rest."""
    names = ParallelOptions.__annotations__
    options: ParallelOptions = {name: value for name, value in kwargs.items() if name in names}  # type: ignore[assignment]
    return options, {name: value for name, value in kwargs.items() if name not in names}


class ParallelStrategy(ProcessGroupCollectives, ProcessPerDevice):
    """One process per device, across ``num_nodes`` nodes, joined by a ``torch.distributed`` process group.

    Args:
        parallel_devices: the devices of this node (one process each); by default what ``devices=`` resolved to.
        cluster_environment: where ranks and the rendezvous come from; by default the detected one.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; by default the accelerator's (nccl on CUDA, gloo
            otherwise).
        timeout: how long a collective waits for the other ranks before failing (default: ``FABRIC_TIMEOUT``
            seconds if set, else 30 minutes).
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

    def setup_environment(self) -> None:
        """In each process: its rank, its share of the CPU threads, the process group, then the device."""
        self.set_world_ranks()
        self._limit_cpu_threads()
        self.init_process_group()
        super().setup_environment()

    def _limit_cpu_threads(self) -> None:
        """Avoid thread oversubscription: N processes on one CPU each get cores/N intra-op threads."""
        if self.root_device.type != "cpu" or "OMP_NUM_THREADS" in os.environ or self.num_processes <= 1:
            return
        torch.set_num_threads(threads_per_process(self.num_processes))

    def teardown(self) -> None:
        """Destroy the process group, undo what the launcher exported, then release the rest."""
        self.destroy_process_group()
        if self.launcher is not None:
            self.launcher.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        super().teardown()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self.num_processes}, num_nodes={self.num_nodes})"


class _GroupCoordinator:
    """``is_global_zero``, ``broadcast``, ``reduce_boolean_decision`` and ``all_gather_object`` over one process group
    (``None``: alone)."""

    def __init__(self, group: Any, is_global_zero: bool, device: torch.device) -> None:
        self.group = group
        self.is_global_zero = is_global_zero
        self.device = device

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.group is None:
            return obj
        return broadcast_object(obj, src=src, group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        return all_gather_object(obj, group=self.group)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self.group is None:
            return decision
        flag = torch.tensor(int(decision), device=self.device)
        _dist().all_reduce(flag, op=_dist().ReduceOp.SUM, group=self.group)
        size = _dist().get_world_size(self.group)
        return bool(flag == size) if all else bool(flag > 0)
