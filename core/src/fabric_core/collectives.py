"""The reference's collectives plugin (``lightning.fabric.plugins.collectives``): process groups a script owns.

``fabric.all_reduce``/``broadcast``/... talk to every process of a Fabric. Some programs need more: several groups
in one job (the decoupled PPO example: a *player* on rank 0 collects experience and scatters it to *trainers* on
ranks 1..N-1, which optimise among themselves and send the weights back), point-to-point ``send``/``recv``, or a
broadcast between a subset of ranks. A :class:`Collective` owns one group and offers every ``torch.distributed``
collective on it; :class:`TorchCollective` implements it on ``torch.distributed`` (gloo, nccl),
:class:`SingleDeviceCollective` is the one-process stand-in where every collective is an identity.

Typical use (every rank runs it; ``fabric run --devices=3 script.py`` or torchrun exports the rendezvous)::

    world = TorchCollective().setup(backend="gloo")  # initialise the default group from the environment
    world.create_group()                              # this collective's group: every rank
    pair = TorchCollective().create_group(ranks=[0, 1])
    trainers = world.new_group(ranks=[1, 2])          # a group to hand to other code, owned by nobody

A rank outside a collective's group gets ``rank == -1`` and its collectives raise (torch's rule); ``barrier`` on
such a rank returns at once, as the reference's does.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch import Tensor

from fabric_core.utilities.types import CollectibleGroup

__all__ = ["CollectibleGroup", "Collective", "SingleDeviceCollective", "TorchCollective"]

_Self = TypeVar("_Self", bound="Collective")


class Collective(ABC):
    """One group of processes and the collectives on it. Create the group with :meth:`create_group` (after
    :meth:`setup` initialised the default group), release it with :meth:`teardown`."""

    def __init__(self) -> None:
        self._group: CollectibleGroup | None = None

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """How many processes the group has."""

    @property
    def group(self) -> CollectibleGroup:
        if self._group is None:
            raise RuntimeError(
                f"`{type(self).__name__}` does not own a group yet. Create one first: `collective.create_group()` (every"
                " process) or `collective.create_group(ranks=[...])` for a subset; then use `collective.group`."
            )
        return self._group

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int) -> Tensor: ...

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor: ...

    @abstractmethod
    def reduce(self, tensor: Tensor, dst: int, op: str = "sum") -> Tensor: ...

    @abstractmethod
    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> list[Tensor]: ...

    @abstractmethod
    def gather(self, tensor: Tensor, gather_list: list[Tensor], dst: int = 0) -> list[Tensor]: ...

    @abstractmethod
    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], src: int = 0) -> Tensor: ...

    @abstractmethod
    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], op: str = "sum") -> Tensor: ...

    @abstractmethod
    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor]) -> list[Tensor]: ...

    @abstractmethod
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None: ...

    @abstractmethod
    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> Tensor: ...

    @abstractmethod
    def barrier(self, device_ids: list[int] | None = None) -> None: ...

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool: ...

    @classmethod
    @abstractmethod
    def is_initialized(cls) -> bool: ...

    @classmethod
    @abstractmethod
    def init_group(cls, **kwargs: Any) -> None: ...

    @classmethod
    @abstractmethod
    def new_group(cls, **kwargs: Any) -> CollectibleGroup: ...

    @classmethod
    @abstractmethod
    def destroy_group(cls, group: CollectibleGroup) -> None: ...

    @classmethod
    @abstractmethod
    def _convert_to_native_op(cls, op: Any) -> Any: ...

    def setup(self: _Self, **kwargs: Any) -> _Self:
        """Initialise the default group (``init_group(**kwargs)``) unless it is already; returns ``self``."""
        if not self.is_initialized():
            self.init_group(**kwargs)
        return self

    def create_group(self: _Self, **kwargs: Any) -> _Self:
        """Create this collective's own group (``new_group(**kwargs)``; e.g. ``ranks=[0, 1]``); returns ``self``.

        Every process of the default group calls it, also those not in ``ranks`` (torch's rule for new groups)."""
        if self._group is not None:
            raise RuntimeError(
                f"`{type(self).__name__}` already owns a group: one collective, one group. Create another collective for"
                " another group, or `teardown()` this one first."
            )
        self._group = self.new_group(**kwargs)
        return self

    def teardown(self: _Self) -> _Self:
        """Destroy this collective's group; returns ``self``."""
        if self._group is None:
            raise RuntimeError(f"`{type(self).__name__}` does not own a group to destroy: call `create_group()` first.")
        self.destroy_group(self._group)
        self._group = None
        return self


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class TorchCollective(Collective):
    """A :class:`Collective` on ``torch.distributed``. :meth:`setup` initialises the default group from the
    environment a launcher exports (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``); ``main_address`` and
    ``main_port`` fill in the first two when they are missing. Until :meth:`create_group`, the group is the default
    (world) group."""

    #: Whether a TorchCollective initialised the default group (and so the last teardown destroys it).
    manages_default_group = False
    addr_key = "MASTER_ADDR"
    port_key = "MASTER_PORT"

    def __init__(self) -> None:
        if not self.is_available():
            raise RuntimeError("`TorchCollective` needs `torch.distributed`, which this build of torch does not have.")
        super().__init__()

    @property
    def group(self) -> CollectibleGroup:
        if self._group is None:
            dist = _dist()
            if not dist.is_initialized():
                raise RuntimeError(
                    "`TorchCollective` has no process group: the default group is not initialised. Call"
                    " `TorchCollective().setup(backend='gloo')` (every process) first."
                )
            return dist.GroupMember.WORLD
        return self._group

    @property
    def rank(self) -> int:
        """This process's rank in the group (``-1`` outside it)."""
        return _dist().get_rank(self.group)

    @property
    def world_size(self) -> int:
        """The group's size (``-1`` on a process outside it)."""
        return _dist().get_world_size(self.group)

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        """Send ``tensor`` from ``src`` (a global rank) to every member, in place."""
        _dist().broadcast(tensor, src, group=self.group)
        return tensor

    def all_reduce(self, tensor: Tensor, op: str | Any = "sum") -> Tensor:
        _dist().all_reduce(tensor, op=self._convert_to_native_op(op), group=self.group)
        return tensor

    def reduce(self, tensor: Tensor, dst: int, op: str | Any = "sum") -> Tensor:
        _dist().reduce(tensor, dst, op=self._convert_to_native_op(op), group=self.group)
        return tensor

    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> list[Tensor]:
        _dist().all_gather(tensor_list, tensor, group=self.group)
        return tensor_list

    def gather(self, tensor: Tensor, gather_list: list[Tensor], dst: int = 0) -> list[Tensor]:
        _dist().gather(tensor, gather_list, dst, group=self.group)
        return gather_list

    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], src: int = 0) -> Tensor:
        _dist().scatter(tensor, scatter_list, src, group=self.group)
        return tensor

    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], op: str | Any = "sum") -> Tensor:
        _dist().reduce_scatter(output, input_list, op=self._convert_to_native_op(op), group=self.group)
        return output

    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor]) -> list[Tensor]:
        _dist().all_to_all(output_tensor_list, input_tensor_list, group=self.group)
        return output_tensor_list

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to global rank ``dst`` (which calls :meth:`recv`)."""
        _dist().send(tensor, dst, group=self.group, tag=tag)

    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> Tensor:
        """Receive into ``tensor`` from global rank ``src`` (any rank when ``None``)."""
        _dist().recv(tensor, src, group=self.group, tag=tag)
        return tensor

    def all_gather_object(self, object_list: list[Any], obj: Any) -> list[Any]:
        _dist().all_gather_object(object_list, obj, group=self.group)
        return object_list

    def broadcast_object_list(self, object_list: list[Any], src: int, device: torch.device | None = None) -> list[Any]:
        _dist().broadcast_object_list(object_list, src, group=self.group, device=device)
        return object_list

    def gather_object(self, obj: Any, object_gather_list: list[Any] | None, dst: int = 0) -> list[Any] | None:
        _dist().gather_object(obj, object_gather_list, dst, group=self.group)
        return object_gather_list

    def scatter_object_list(
        self, scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None, src: int = 0
    ) -> list[Any]:
        _dist().scatter_object_list(scatter_object_output_list, scatter_object_input_list, src, group=self.group)
        return scatter_object_output_list

    def barrier(self, device_ids: list[int] | None = None) -> None:
        """Wait for every member; a process outside the group returns at once."""
        dist = _dist()
        if self.group == dist.GroupMember.NON_GROUP_MEMBER:
            return
        dist.barrier(group=self.group, device_ids=device_ids)

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive within ``timeout`` (gloo only)."""
        _dist().monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=wait_all_ranks)

    def setup(self, main_address: str | None = None, main_port: str | int | None = None, **kwargs: Any) -> TorchCollective:
        """Initialise the default group (``torch.distributed.init_process_group(**kwargs)``) unless it is already.

        ``main_address``/``main_port`` are used only where ``MASTER_ADDR``/``MASTER_PORT`` are not set, and only for
        this call (the environment is restored afterwards)."""
        if self.is_initialized():
            return self
        added = []
        for key, value in ((self.addr_key, main_address), (self.port_key, main_port)):
            if value is not None and key not in os.environ:
                os.environ[key] = str(value)
                added.append(key)
        try:
            super().setup(**kwargs)
        finally:
            for key in added:
                os.environ.pop(key, None)
        TorchCollective.manages_default_group = True
        return self

    def teardown(self) -> TorchCollective:
        """Destroy this collective's group; when it was the last group besides the default one and a
        ``TorchCollective`` initialised the default group, destroy that too."""
        dist = _dist()
        member = self.group != dist.GroupMember.NON_GROUP_MEMBER
        super().teardown()
        if not TorchCollective.manages_default_group:
            return self
        world = dist.GroupMember.WORLD
        if world is None:  # destroyed by someone else meanwhile
            TorchCollective.manages_default_group = False
        elif member and len(dist.distributed_c10d._pg_map) == 1:
            dist.destroy_process_group(world)
            TorchCollective.manages_default_group = False
        return self

    @classmethod
    def is_available(cls) -> bool:
        return _dist().is_available()

    @classmethod
    def is_initialized(cls) -> bool:
        return cls.is_available() and _dist().is_initialized()

    @classmethod
    def init_group(cls, **kwargs: Any) -> None:
        _dist().init_process_group(**kwargs)

    @classmethod
    def new_group(cls, **kwargs: Any) -> CollectibleGroup:
        """A new group (``torch.distributed.new_group(**kwargs)``): every process of the default group calls it."""
        dist = _dist()
        if not dist.is_initialized():
            raise RuntimeError(
                "A new process group needs the default group: call `TorchCollective().setup(backend='gloo')` (every"
                " process) first."
            )
        return dist.new_group(**kwargs)

    @classmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        """Destroy ``group``; a process outside it (holding torch's non-member marker) has nothing to destroy."""
        dist = _dist()
        if group in dist.distributed_c10d._pg_map:
            dist.destroy_process_group(group)

    @classmethod
    def _convert_to_native_op(cls, op: str | Any) -> Any:
        """``"sum"``, ``"max"``, ... (any case) or a ``ReduceOp`` member, as torch's ``ReduceOp``."""
        dist = _dist()
        if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            return op
        if not isinstance(op, str):
            raise ValueError(f"Unsupported op {op!r} of type {type(op).__name__}: pass a name such as 'sum' or a `ReduceOp`.")
        native = getattr(dist.ReduceOp, op.upper(), None)
        if native is None:
            names = ", ".join(repr(n.lower()) for n in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"))
            raise ValueError(f"op {op!r} is not a member of `ReduceOp`: use one of {names}.")
        return native


class SingleDeviceCollective(Collective):
    """The collectives of one process: each returns its input (a gather returns ``[tensor]``)."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def broadcast(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        return tensor

    def all_reduce(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        return tensor

    def reduce(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        return tensor

    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor, **__: Any) -> list[Tensor]:
        return [tensor]

    def gather(self, tensor: Tensor, *_: Any, **__: Any) -> list[Tensor]:
        return [tensor]

    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], *_: Any, **__: Any) -> Tensor:
        return scatter_list[0]

    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], *_: Any, **__: Any) -> Tensor:
        return input_list[0]

    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor], *_: Any, **__: Any) -> list[Tensor]:
        return input_tensor_list

    def send(self, *_: Any, **__: Any) -> None:
        pass

    def recv(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        return tensor

    def barrier(self, *_: Any, **__: Any) -> None:
        pass

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def is_initialized(cls) -> bool:
        return True

    @classmethod
    def init_group(cls, **_: Any) -> None:
        pass

    @classmethod
    def new_group(cls, **_: Any) -> CollectibleGroup:
        return _OneProcessGroup()

    @classmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        pass

    @classmethod
    def _convert_to_native_op(cls, op: Any) -> Any:
        return op


class _OneProcessGroup:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0
