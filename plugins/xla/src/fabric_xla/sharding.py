"""SPMD building blocks for the ``xla_fsdp`` strategy: small functions with explicit inputs.

Under SPMD one process drives every device of its host; tensors are global, annotated with how they are split
over a device mesh, and the XLA compiler inserts the communication. FSDPv2 (torch_xla's
``SpmdFullyShardedDataParallel``) splits each parameter's largest dimension over the mesh axis ``"fsdp"`` and
the batch goes the same way: that is ZeRO-3 data parallelism written as shardings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

#: The mesh axis FSDPv2 requires, and the axis inputs are split along (dimension 0, the batch).
FSDP_AXIS = "fsdp"
#: The prefix FSDPv2 puts in front of the keys of the module it wraps.
WRAPPER_PREFIX = "_orig_module."


def build_mesh(num_devices: int) -> Any:
    """A ``(num_devices, 1)`` mesh with axes ``("fsdp", "model")`` over every device, set as the global mesh."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(num_devices), (num_devices, 1), (FSDP_AXIS, "model"))
    xs.set_global_mesh(mesh)
    return mesh


class BatchSharding:
    """How the device loader places each tensor of a batch: dimension 0 split over the devices, the rest whole.

    torch_xla's loader takes one ``ShardingSpec`` (whose partition spec fits tensors of one rank only) or a dict
    keyed like the batch. A batch usually mixes ranks (inputs ``(B, D)``, labels ``(B,)``), so this object answers
    per tensor, through the one method the loader calls (``xla_spec(tensor)``). The specs use a one-axis mesh over
    the devices in the order of the ``"fsdp"`` axis (a ``ShardingSpec`` for a 1-d tensor over the 2-d FSDP mesh fails
    in torch_xla 2.9 with "too many indices"). 0-d tensors are replicated.
    """

    minibatch = False

    def __init__(self, num_devices: int) -> None:
        import numpy as np
        import torch_xla.distributed.spmd as xs

        self.mesh = xs.Mesh(np.arange(num_devices), (num_devices,), (FSDP_AXIS,))
        self._specs: dict[int, Any] = {}

    @staticmethod
    def partition_spec(tensor: Tensor) -> tuple[str | None, ...]:
        return (FSDP_AXIS,) + (None,) * (tensor.dim() - 1)

    def xla_spec(self, tensor: Tensor) -> Any:
        if tensor.dim() == 0:
            return None
        spec = self._specs.get(tensor.dim())
        if spec is None:
            import torch_xla.distributed.spmd as xs

            spec = self._specs[tensor.dim()] = xs.ShardingSpec(self.mesh, self.partition_spec(tensor))
        return spec.xla_spec(tensor)

    def __bool__(self) -> bool:
        return True


def shard_module(module: Module, mesh: Any, auto_wrap_policy: Callable[..., bool] | None) -> Module:
    """Wrap ``module`` in FSDPv2 over ``mesh`` (its parameters are sharded in place; the objects stay the same)."""
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    return SpmdFullyShardedDataParallel(module, mesh=mesh, auto_wrap_policy=auto_wrap_policy)


def is_sharded_module(module: Module) -> bool:
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    return isinstance(module, SpmdFullyShardedDataParallel)


def unwrap(module: Module) -> Module:
    """The user's module inside the FSDPv2 wrapper (children wrapped by an ``auto_wrap_policy`` stay wrapped)."""
    return module.module if is_sharded_module(module) else module  # type: ignore[return-value]


def portable_state_dict(module: Module) -> dict[str, Any]:
    """The module's state dict with FSDPv2's ``_orig_module.`` prefixes removed: the keys of the plain model."""
    return {key.replace(WRAPPER_PREFIX, ""): value for key, value in module.state_dict().items()}


def load_portable_state_dict(module: Module, state_dict: dict[str, Any], strict: bool) -> None:
    """Load plain-model keys into a module whose children FSDPv2 may have wrapped (copies keep the sharding)."""
    own = {key.replace(WRAPPER_PREFIX, ""): key for key in module.state_dict()}
    translated = {own.get(key, key): value for key, value in state_dict.items()}
    module.load_state_dict(translated, strict=strict)


def parameter_sharding(tensor: Tensor) -> str:
    """The sharding annotation of an XLA tensor (``""`` when it is replicated or has none)."""
    import torch_xla

    return str(torch_xla._XLAC._get_xla_sharding_spec(tensor))


def shard_optimizer_state(optimizer: Optimizer, mesh: Any) -> None:
    """Give each optimizer state tensor the sharding of its parameter (``load_state_dict`` leaves it replicated,
    a full-size copy per device until the next step re-shards it)."""
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    for param, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, Tensor) and value.device.type == "xla" and value.shape == param.shape and value.dim() > 0:
                if parameter_sharding(value) == "":
                    xs.mark_sharding(value, mesh, _prepare_spmd_partition_spec(value, shard_maximal=True))
