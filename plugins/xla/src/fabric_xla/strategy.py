"""The XLA strategies: one device, multi-replica data parallel, and SPMD sharding (FSDPv2).

* ``single_xla`` (:class:`SingleDeviceXLAStrategy`): one process, one XLA device.
* ``xla`` (:class:`XLAStrategy`): one replica per device, started by ``torch_xla.launch`` (the ``xla`` launcher);
  gradients are all-reduced over the replicas at ``optimizer.step()``. Runs on TPUs; on the CPU PJRT device its
  collectives are unreliable upstream (pytorch/xla#9089), see the README.
* ``xla_fsdp`` (:class:`XLAFSDPStrategy`): one process drives every device of its host under SPMD; parameters
  are sharded with torch_xla's FSDPv2 and the batch is split over the same mesh axis (:mod:`fabric_xla.sharding`).

What they share (:class:`_XLAMixin`): the model moves to the device keeping its parameter objects (optimizers made
before ``setup`` stay valid, so ``setup_module`` + ``setup_optimizers`` work too); batches come through torch_xla's
device loader; ``optimizer.step()`` ends the step's lazy graph (``torch_xla.sync()``), which is when XLA compiles and
runs it; checkpoints are converted to CPU tensors in one transfer and written by the global rank 0 only, through
the core's crash-safe checkpoint I/O, so they load anywhere; ``no_backward_sync`` is a no-op, because XLA never
synchronises gradients in backward (the replicas reduce them at the step, SPMD inside the compiled step).

torch_xla is imported by :mod:`fabric_xla.runtime` and :mod:`fabric_xla.sharding`, never when this module is.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.io import FormatContext
from fabric_core.strategies import (
    DATA_SHARD,
    Axis,
    BackwardSyncControl,
    Binding,
    Collectives,
    NothingToSync,
    OneProcessCollectives,
    ProcessPerDevice,
    SingleDeviceStrategy,
    Strategy,
    check_broadcast_src,
    check_reduce_op,
)
from fabric_xla import runtime
from fabric_xla.environment import XLAEnvironment

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabric_core.accelerators import Accelerator
    from fabric_core.environments import ClusterEnvironment
    from fabric_core.io import CheckpointIO
    from fabric_core.precision import Precision

__all__ = ["SingleDeviceXLAStrategy", "XLAFSDPStrategy", "XLAStrategy"]

#: The reductions XLA collectives offer here (the reference's set).
XLA_REDUCE_OPS = ("sum", "mean", "avg")


def check_xla_reduce_op(reduce_op: Any) -> str:
    """``"sum"`` or ``"mean"``; anything else is a ``ValueError`` in the reference's words, with what to do."""
    name = check_reduce_op(reduce_op)
    if not isinstance(name, str) or name not in XLA_REDUCE_OPS:
        raise ValueError(
            f"Currently, the XLA strategies only support `sum`, `mean`, `avg` for the reduce operation, got:"
            f" {reduce_op!r}. For a maximum or minimum, gather the values (`fabric.all_gather`) and reduce them"
            " yourself."
        )
    return "mean" if name == "avg" else name


def check_xla_accelerator(strategy: Strategy, accelerator: Accelerator) -> None:
    if accelerator.device_type != "xla":
        raise ValueError(
            f"The `{type(strategy).__name__}` runs on XLA devices, but the accelerator is {accelerator.name!r}. Use"
            " `Fabric(accelerator='tpu', ...)` (with `PJRT_DEVICE=CPU` to run it on the CPU)."
        )


class XLADeviceLoader:
    """A ``DataLoader`` whose batches arrive on the XLA device, through torch_xla's ``MpDeviceLoader``.

    The device loader copies batches in a background thread while the device computes, and, under SPMD, places each
    tensor with ``input_sharding`` (split over the devices) as it copies it. The wrapped loader's attributes
    (``dataset``, ``sampler``, ``batch_size``, ``state_dict`` ...) are this object's, so ``set_epoch`` and
    stateful resumption work as with any loader.
    """

    def __init__(self, dataloader: Any, device: torch.device, input_sharding: Any = None) -> None:
        self.__dict__.update(dataloader.__dict__)
        self.__dict__["_xla_loader"] = dataloader
        self.__dict__["_xla_device"] = device
        self.__dict__["_xla_sharding"] = input_sharding

    def __iter__(self) -> Any:
        import torch_xla.distributed.parallel_loader as pl

        kwargs = {"input_sharding": self._xla_sharding} if self._xla_sharding is not None else {}
        return iter(pl.MpDeviceLoader(self._xla_loader, self._xla_device, **kwargs))

    def __len__(self) -> int:
        return len(self._xla_loader)

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("_xla_loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)


class _XLAMixin:
    """What every XLA strategy does the same way (placed before the core base class in the MRO)."""

    # XLA never synchronises gradients in backward (the replicas reduce them at ``optimizer.step()``, SPMD inside
    # the compiled step): ``no_backward_sync`` has nothing to skip.
    _backward_sync_control = NothingToSync()

    @property
    def backward_sync_control(self) -> BackwardSyncControl:
        return self._backward_sync_control

    def precision_for(self, precision: str, accelerator: Accelerator) -> Precision:
        """An ``XLAPrecision`` for every name (legacy spellings warn); a ``ValueError`` for what XLA cannot run."""
        from fabric_xla.precision import LEGACY, XLAPrecision

        if precision in LEGACY and LEGACY[precision] != precision:
            if precision != "32":
                warnings.warn(
                    f"`precision={precision!r}` is a legacy spelling; use `precision={LEGACY[precision]!r}`.",
                    UserWarning,
                    stacklevel=2,
                )
            precision = LEGACY[precision]
        return XLAPrecision(precision)

    # ---------------------------------------------------------------------------------------- setup
    def module_to_device(self, module: Module) -> None:
        runtime.move_module(module, self.root_device)  # type: ignore[attr-defined]

    def _input_sharding(self) -> Any:
        return None

    def process_dataloader(self, dataloader: Any) -> Any:
        return XLADeviceLoader(dataloader, self.root_device, self._input_sharding())  # type: ignore[attr-defined]

    # ---------------------------------------------------------------------------------------- training step
    def _before_step(self, optimizer: Any) -> None:
        """Called before the optimizer steps (the multi-replica strategy reduces gradients here)."""

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step, then end the lazy graph of this training step: XLA compiles it once and runs it."""
        self._before_step(optimizer)
        output = super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        runtime.sync()
        return output

    # ---------------------------------------------------------------------------------------- checkpoints
    def checkpoint_context(self) -> FormatContext:
        """The core's context, whose conversion hands the state to write as CPU tensors (sharded ones whole), in
        one transfer, on the global rank 0, the only one writing.

        The other replicas keep their device tensors: copying a model into host memory once per replica would
        only cost memory. The core's single-file format (rank 0 writes, crash-safely; synchronous or
        asynchronous) then works unchanged.
        """
        context = super().checkpoint_context()  # type: ignore[misc]
        if not self.is_global_zero:  # type: ignore[attr-defined]
            return context
        return dataclasses.replace(context, prepare_for_writing=runtime.to_cpu)

    # ---------------------------------------------------------------------------------------- collectives
    def validate_reduce_op(self, reduce_op: str | Any) -> str:
        """XLA reduces only sums and means (used by the one-process collectives of the core)."""
        return check_xla_reduce_op(reduce_op)


class SingleDeviceXLAStrategy(_XLAMixin, SingleDeviceStrategy):
    """One process on one XLA device (``strategy="auto"`` with one device; ``devices=[i]`` picks device ``i``).

    The XLA runtime starts when ``Fabric(...)`` resolves this strategy, before any of your code can run a CPU
    backward that would break later XLA backwards (pytorch/xla#4174).
    """

    def attach(self, binding: Binding) -> None:
        accelerator, devices = binding.accelerator, binding.devices
        if len(devices) > 1:
            raise ValueError(
                f"The `SingleDeviceXLAStrategy` runs one process on one device, but `devices` selects {len(devices)}."
                " Use `strategy='xla'` (one replica per device) or `strategy='xla_fsdp'` (SPMD sharding), or"
                " `devices=1`."
            )
        super().attach(binding)
        check_xla_accelerator(self, accelerator)
        if self._device is None or self._device.type != "xla":
            self._device = torch.device("xla", 0)
        runtime.initialize(spmd=False)

    @property
    def root_device(self) -> torch.device:
        return self._device if self._device is not None else torch.device("xla", 0)


class XLACollectives(Collectives):
    """Collectives between XLA replicas, through torch_xla (``xm.all_reduce``, ``xm.all_gather``,
    ``xm.rendezvous``); sums and means only. The boolean vote and the checks of ``src`` are the core's. One replica
    (``world_size == 1``) needs no communication."""

    def validate_reduce_op(self, reduce_op: str | Any) -> str:
        return check_xla_reduce_op(reduce_op)

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str | Any = "mean") -> Tensor:
        """Sum or mean over the replicas (``"mean"`` of an integer tensor floor-divides, as on every strategy)."""
        op = self.validate_reduce_op(reduce_op)
        if self.world_size == 1:
            return tensor
        import torch_xla.core.xla_model as xm

        tensor = tensor.to(self.root_device)
        summed = xm.all_reduce(xm.REDUCE_SUM, tensor, groups=group)
        if op != "mean":
            return summed
        if torch.is_floating_point(summed) or torch.is_complex(summed):
            return summed / self.world_size
        return torch.div(summed, self.world_size, rounding_mode="floor")

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Every replica's tensor stacked into ``(world_size, *shape)`` (equal shapes; differentiable with
        ``sync_grads``)."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.to(self.root_device).unsqueeze(0)
        if sync_grads:
            from torch_xla.core.functions import all_gather as differentiable_all_gather

            return differentiable_all_gather(tensor, dim=0)
        import torch_xla.core.xla_model as xm

        return xm.all_gather(tensor, dim=0, groups=group, pin_layout=False)

    def barrier(self, name: str | None = None) -> None:
        """``xm.rendezvous``: every replica reaches the same named point."""
        if self.world_size == 1:
            return
        import torch_xla.core.xla_model as xm

        xm.rendezvous(name or "fabric_barrier")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from replica ``src`` to all (through ``xm.rendezvous``, which takes bytes)."""
        check_broadcast_src(src, self.world_size)
        if self.world_size == 1:
            return obj
        import torch_xla.core.xla_model as xm

        payload = pickle.dumps(obj) if self.global_rank == src else b""  # type: ignore[attr-defined]
        return pickle.loads(xm.rendezvous("fabric_broadcast", payload)[src])


class XLAStrategy(_XLAMixin, XLACollectives, ProcessPerDevice):
    """Data parallel over XLA replicas: one per device, started by ``fabric.launch(fn)`` through torch_xla.

    Every replica holds the whole model; the data is split by a ``DistributedSampler``
    (``num_replicas=world_size``); ``optimizer.step()`` all-reduces the gradients (mean) over the replicas first.
    Before ``launch`` nothing touches the XLA runtime (torch_xla refuses to start replicas after that): the replicas'
    environment (:class:`~fabric_xla.environment.XLAEnvironment`, ranks from the runtime) is created in each
    replica, so until then this process is rank 0 of a world of one process per device.

    Args:
        sync_module_states: broadcast rank 0's parameters to every replica in ``setup`` (default ``True``).
    """

    launcher_name = "xla"
    requires_launch = True

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        sync_module_states: bool = True,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        self.sync_module_states = sync_module_states
        self._device: torch.device | None = None
        self._reduced: set[int] = set()

    def attach(self, binding: Binding) -> None:
        # The replicas' ranks are the runtime's; a detected torchrun/SLURM environment does not describe them.
        super().attach(dataclasses.replace(binding, cluster_environment=None))
        check_xla_accelerator(self, binding.accelerator)

    # ---------------------------------------------------------------------------------------- topology
    @property
    def _launched(self) -> bool:
        return self._device is not None

    @property
    def root_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        return self.parallel_devices[0] if self.parallel_devices else torch.device("xla", 0)

    # ---------------------------------------------------------------------------------------- lifecycle
    def setup_environment(self) -> None:
        """In each replica: start the runtime; this replica's device and ranks come from it."""
        self._device = runtime.initialize(spmd=False)
        if self.cluster_environment is None:
            self.cluster_environment = XLAEnvironment()
        super().setup_environment()

    def setup_module(self, module: Module) -> Module:
        if self.sync_module_states and self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.broadcast_master_param(module)
        return module

    # ---------------------------------------------------------------------------------------- training step
    def _reduce_gradients(self, optimizer: Optimizer) -> None:
        if self.world_size > 1 and id(optimizer) not in self._reduced:
            import torch_xla.core.xla_model as xm

            xm.reduce_gradients(optimizer)
            self._reduced.add(id(optimizer))

    def _before_step(self, optimizer: Any) -> None:
        self._reduce_gradients(optimizer)
        self._reduced.discard(id(optimizer))

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int | str = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Reduce the gradients first (once per step), so every replica clips the same, averaged gradients."""
        self._reduce_gradients(optimizer)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._reduce_gradients(optimizer)
        super().clip_gradients_value(module, optimizer, clip_val)

    def teardown(self) -> None:
        if self.launcher is not None:
            self.launcher.teardown()
        super().teardown()

    def __repr__(self) -> str:
        return f"XLAStrategy(devices={self.num_processes}, launched={self._launched})"


class XLAFSDPStrategy(_XLAMixin, OneProcessCollectives, Strategy):
    """Fully sharded data parallel under SPMD (torch_xla's FSDPv2): one process drives every device of its host.

    Each parameter's largest dimension is split over the mesh axis ``"fsdp"`` (all devices), and so is the batch
    (dimension 0) that the device loader delivers; the XLA compiler gathers parameters for compute and
    reduce-scatters gradients. The optimizer state follows its parameter's sharding. There is no launcher: run the
    script with ``python`` (or ``fabric run``, one process). ``world_size`` counts processes (hosts), not devices.

    Args:
        auto_wrap_policy: which submodules become their own FSDPv2 unit, as torch_xla's policies take it
            (``functools.partial(size_based_auto_wrap_policy, min_num_params=...)`` or
            ``transformer_auto_wrap_policy`` from ``torch_xla.distributed.fsdp.wrap``); by default the model is one
            unit (every parameter is still sharded: units only change how the compiler groups the gathers).
    """

    launcher_name = None
    requires_launch = False

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        auto_wrap_policy: Callable[..., bool] | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self.parallel_devices = parallel_devices
        self.auto_wrap_policy = auto_wrap_policy
        self._device: torch.device | None = None
        self._mesh: Any = None

    def attach(self, binding: Binding) -> None:
        super().attach(binding)
        check_xla_accelerator(self, binding.accelerator)
        if self.parallel_devices is None:
            self.parallel_devices = list(binding.devices)
        self._device = runtime.initialize(spmd=True)
        total = runtime.global_device_count()
        local = len(self.parallel_devices)
        if self.num_nodes == 1 and local != total:
            raise ValueError(
                f"`strategy='xla_fsdp'` shards over every device the XLA runtime has ({total}), but `devices` selects"
                f" {local}. Pass `devices={total}` or `devices='auto'`, or limit the devices the runtime sees"
                " (`TPU_VISIBLE_CHIPS` on a TPU, `CPU_NUM_DEVICES` with `PJRT_DEVICE=CPU`)."
            )
        from fabric_xla import sharding

        self._mesh = sharding.build_mesh(total)

    # ---------------------------------------------------------------------------------------- topology
    @property
    def root_device(self) -> torch.device:
        return self._device if self._device is not None else torch.device("xla", 0)

    @property
    def mesh(self) -> Any:
        """The ``(devices, 1)`` mesh with axes ``("fsdp", "model")`` parameters and batches are split over."""
        return self._mesh

    @property
    def num_processes(self) -> int:
        return 1

    def _process_count(self) -> int:
        if self._device is None:
            return 1
        import torch_xla.runtime as xr

        return int(xr.process_count())

    @property
    def global_rank(self) -> int:
        if self._device is None:
            return 0
        import torch_xla.runtime as xr

        return int(xr.process_index())

    @property
    def node_rank(self) -> int:
        return self.global_rank

    @property
    def world_size(self) -> int:
        return self._process_count()

    def parallel_axes(self) -> tuple[Axis, ...]:
        """One process per host, each holding a shard: a ``data_shard`` axis over the hosts (none with one host;
        the devices of a host are SPMD's, inside the process)."""
        processes = self._process_count()
        return (Axis("data_shard", processes, self.global_rank, DATA_SHARD),) if processes > 1 else ()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Each host loads its share of the global batch; one host loads all of it (no sampler)."""
        processes = self._process_count()
        return {"num_replicas": processes, "rank": self.global_rank} if processes > 1 else None

    def _input_sharding(self) -> Any:
        from fabric_xla import sharding

        return sharding.BatchSharding(runtime.global_device_count())

    # ---------------------------------------------------------------------------------------- setup
    def setup_module(self, module: Module) -> Module:
        """Wrap in FSDPv2 over the mesh; the parameters (already on the device) are sharded in place."""
        from fabric_xla import sharding

        if sharding.is_sharded_module(module):
            return module
        return sharding.shard_module(module, self._mesh, self.auto_wrap_policy)

    def unwrap_module(self, module: Module) -> Module:
        from fabric_xla import sharding

        return sharding.unwrap(module)

    # ---------------------------------------------------------------------------------------- checkpoints
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The plain model's keys (FSDPv2's ``_orig_module.`` removed), so the checkpoint loads anywhere."""
        from fabric_xla import sharding

        return sharding.portable_state_dict(self.unwrap_module(module))

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        from fabric_xla import sharding

        sharding.load_portable_state_dict(self.unwrap_module(module), state_dict, strict)

    def load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        from fabric_xla import sharding

        optimizer.load_state_dict(state)
        sharding.shard_optimizer_state(optimizer, self._mesh)

    # ---------------------------------------------------------------------------------------- collectives
    def _one_process(self, what: str) -> None:
        if self._process_count() > 1:
            raise NotImplementedError(
                f"`{what}` across the hosts of a multi-host SPMD run is not implemented by fabric-xla yet: under SPMD"
                " each host's tensors are already global, so reduce them inside the model's computation instead."
            )

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        self._one_process("all_gather")
        return super().all_gather(tensor, group, sync_grads)

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str | Any = "mean") -> Tensor:
        self.validate_reduce_op(reduce_op)
        self._one_process("all_reduce")
        return tensor

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._one_process("broadcast")
        return super().broadcast(obj, src)

    def __repr__(self) -> str:
        devices = len(self.parallel_devices) if self.parallel_devices else 0
        return f"XLAFSDPStrategy(devices={devices}, mesh=('fsdp', 'model'))"
