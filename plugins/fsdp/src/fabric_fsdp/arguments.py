"""The reference's ``FSDPStrategy`` arguments (FSDP1, ``FullyShardedDataParallel``) mapped onto FSDP2.

Free functions that turn what a user of the reference passes (``ShardingStrategy``, ``CPUOffload``,
``MixedPrecision``, the FSDP1 keyword arguments) into FSDP2 values, or refuse it with an error that names the
FSDP2 way. Nothing is dropped silently: every FSDP1 keyword argument is either honoured, a no-op because FSDP2
behaves that way anyway, or an error. The module policies (``auto_wrap_policy``, activation checkpointing) are
converted by :func:`fabric_fsdp.sharding.as_policy`. The README's arguments table lists every mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import Module, Parameter

from fabric_core.utilities import rank_zero_warn

__all__ = [
    "FSDP1_KWARGS",
    "SHARDING_STRATEGIES",
    "FSDP1Options",
    "as_mixed_precision",
    "as_offload_policy",
    "check_device_id",
    "fsdp1_options",
    "sharding_strategy_name",
]

#: Accepted ``sharding_strategy`` names (``ShardingStrategy`` members are accepted by name).
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD")
#: Strategies that keep gathered parameters from forward to backward (``reshard_after_forward=False``).
NO_RESHARD_STRATEGIES = ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
#: Strategies that build a ``(replicate, shard)`` mesh of ``(num_nodes, devices per node)``.
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")

#: The FSDP1 ``FullyShardedDataParallel`` keyword arguments ``FSDPStrategy(**kwargs)`` knows (the others of its
#: signature are named arguments of the strategy: sharding_strategy, cpu_offload, auto_wrap_policy,
#: mixed_precision, device_mesh).
FSDP1_KWARGS = (
    "use_orig_params",
    "limit_all_gathers",
    "backward_prefetch",
    "forward_prefetch",
    "sync_module_states",
    "param_init_fn",
    "process_group",
    "ignored_modules",
    "ignored_states",
    "device_id",
)


def sharding_strategy_name(value: Any) -> str:
    """``"FULL_SHARD"``, ``ShardingStrategy.FULL_SHARD`` or ``"full_shard"`` -> ``"FULL_SHARD"``."""
    name = getattr(value, "name", value)  # a ShardingStrategy member
    if not isinstance(name, str) or name.upper() not in SHARDING_STRATEGIES:
        raise ValueError(
            f"`sharding_strategy` must be one of {SHARDING_STRATEGIES} (a name or a `ShardingStrategy` member),"
            f" got {value!r}."
        )
    return name.upper()


def as_offload_policy(value: Any) -> Any:
    """``cpu_offload`` as an FSDP2 ``OffloadPolicy``: ``CPUOffloadPolicy`` to offload, a plain one not to.

    Accepts ``None``/``False``/``True``, FSDP1's ``CPUOffload(offload_params=...)`` (``offload_params=False``
    means no offloading) and FSDP2's ``OffloadPolicy``/``CPUOffloadPolicy``.
    """
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy

    if value is None or value is False:
        return OffloadPolicy()
    if value is True:
        return CPUOffloadPolicy()
    if isinstance(value, CPUOffload):
        return CPUOffloadPolicy() if value.offload_params else OffloadPolicy()
    if isinstance(value, OffloadPolicy):
        return value
    raise TypeError(
        "`cpu_offload` must be a bool, an FSDP1 `CPUOffload(offload_params=...)` or an FSDP2"
        f" `CPUOffloadPolicy`, got {value!r}."
    )


def as_mixed_precision(value: Any) -> Callable[[bool], Any] | None:
    """``mixed_precision`` as ``policy(root) -> MixedPrecisionPolicy`` for the ``fully_shard`` calls, or ``None``.

    * An FSDP2 ``MixedPrecisionPolicy`` is used as it is, for the root and every unit.
    * An FSDP1 ``MixedPrecision`` maps field by field: ``param_dtype`` and ``reduce_dtype`` are the same;
      ``cast_root_forward_inputs`` (or ``cast_forward_inputs``) becomes the root's ``cast_forward_inputs`` and
      ``cast_forward_inputs`` the units'; outputs are not cast back (as with FSDP1). ``keep_low_precision_grads=True``
      has no FSDP2 equivalent and is refused. FSDP2 does not cast buffers: a ``buffer_dtype`` is accepted with a
      warning (it has no effect). BatchNorm modules are not kept in float32 (FSDP1's
      ``_module_classes_to_ignore``): :func:`warn_unkept_modules` warns at setup when the model has them.
    """
    if value is None:
        return None
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    if isinstance(value, MixedPrecisionPolicy):
        return lambda root: value
    if not isinstance(value, MixedPrecision):
        raise TypeError(
            "`mixed_precision` must be an FSDP2 `MixedPrecisionPolicy` or an FSDP1 `MixedPrecision`, got"
            f" {value!r}."
        )
    if value.keep_low_precision_grads:
        raise ValueError(
            "`MixedPrecision(keep_low_precision_grads=True)` has no FSDP2 equivalent: FSDP2 always gives the"
            " sharded gradients the parameters' own dtype. Drop it; for low-precision gradients keep the"
            " parameters themselves in low precision (`precision='bf16-true'`)."
        )
    if value.buffer_dtype is not None:
        rank_zero_warn(
            f"`MixedPrecision(buffer_dtype={value.buffer_dtype})` has no effect: FSDP2 does not cast buffers, they"
            " keep their own dtype. Cast them yourself before `fabric.setup` if they must be in low precision"
            " (e.g. `module.register_buffer(name, buffer.to(dtype))`)."
        )
    root = MixedPrecisionPolicy(
        param_dtype=value.param_dtype,
        reduce_dtype=value.reduce_dtype,
        cast_forward_inputs=value.cast_root_forward_inputs or value.cast_forward_inputs,
    )
    unit = MixedPrecisionPolicy(
        param_dtype=value.param_dtype, reduce_dtype=value.reduce_dtype, cast_forward_inputs=value.cast_forward_inputs
    )
    return lambda is_root: root if is_root else unit


def warn_unkept_modules(mixed_precision: Any, module: Module) -> None:
    """FSDP1 keeps the modules of ``MixedPrecision._module_classes_to_ignore`` (BatchNorm) in full precision; FSDP2
    casts them with their unit. Say so when it matters: an FSDP1 ``MixedPrecision`` and such a module in the model."""
    from torch.distributed.fsdp import MixedPrecision

    if not isinstance(mixed_precision, MixedPrecision) or mixed_precision.param_dtype is None:
        return
    classes = tuple(getattr(mixed_precision, "_module_classes_to_ignore", ()))
    found = sorted({type(m).__name__ for m in module.modules() if classes and isinstance(m, classes)})
    if found:
        rank_zero_warn(
            f"FSDP1 keeps {', '.join(found)} in full precision under `MixedPrecision` (its `_module_classes_to_ignore`);"
            f" FSDP2 computes them in `param_dtype={mixed_precision.param_dtype}` with the rest of their unit. To keep"
            " them in float32, shard each yourself after `fabric.launch()` and before `fabric.setup`:"
            " `fully_shard(bn, mesh=fabric.strategy.device_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,"
            f" output_dtype={mixed_precision.param_dtype}))` (its inputs are cast up, its outputs back)."
        )


@dataclass
class FSDP1Options:
    """What the FSDP1 keyword arguments leave for the strategy to do at setup."""

    #: broadcast rank 0's parameters and buffers before sharding
    sync_module_states: bool = False
    #: modules (all their parameters) and parameters that stay whole and unsharded on every rank
    ignored_modules: list[Module] = field(default_factory=list)
    ignored_params: list[Parameter] = field(default_factory=list)
    #: checked against the strategy's device at setup
    device_id: int | torch.device | None = None

    def resolve_ignored(self) -> frozenset[Parameter]:
        """The ignored parameters, looked up now (a module's parameters may have changed since construction)."""
        params = {p for m in self.ignored_modules for p in m.parameters()}
        return frozenset(params | set(self.ignored_params))


def _refuse(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"`FSDPStrategy({name}={value!r})`: {why}")


def fsdp1_options(kwargs: dict[str, Any]) -> FSDP1Options:
    """Check the FSDP1 keyword arguments one by one and collect what FSDP2 needs from them.

    Raises ``TypeError`` for names FSDP1 does not have (or this strategy does not know) and ``ValueError`` for
    values FSDP2 cannot honour, naming the FSDP2 way.
    """
    unknown = sorted(set(kwargs) - set(FSDP1_KWARGS))
    if unknown:
        raise TypeError(
            f"`FSDPStrategy` got unexpected keyword argument(s) {unknown}. Besides its own arguments it accepts the"
            f" FSDP1 `FullyShardedDataParallel` keyword arguments {list(FSDP1_KWARGS)}, mapped onto FSDP2 as the"
            " fabric-fsdp README lists."
        )
    options = FSDP1Options()
    if kwargs.get("use_orig_params", True) is not True:
        raise _refuse(
            "use_orig_params",
            kwargs["use_orig_params"],
            "FSDP2 has no flat parameters: every parameter stays an original parameter (a sharded `DTensor`),"
            " which is what `use_orig_params=True` gives FSDP1. Remove the argument.",
        )
    if kwargs.get("limit_all_gathers", True) is not True:
        raise _refuse(
            "limit_all_gathers",
            kwargs["limit_all_gathers"],
            "FSDP2 always bounds the all-gathers in flight (what `limit_all_gathers=True` does for FSDP1) and has no"
            " switch to lift the bound. Remove the argument.",
        )
    if "backward_prefetch" in kwargs:
        value = kwargs["backward_prefetch"]
        if getattr(value, "name", value) != "BACKWARD_PRE":
            raise _refuse(
                "backward_prefetch",
                value,
                "FSDP2 always prefetches the next unit's all-gather in backward, as `BackwardPrefetch.BACKWARD_PRE`"
                " does; it has no `BACKWARD_POST` or off switch. To choose which units are prefetched, call"
                " `unit.set_modules_to_backward_prefetch([...])` on the FSDP units after `fabric.setup`.",
            )
    if kwargs.get("forward_prefetch", False) is not False:
        raise _refuse(
            "forward_prefetch",
            kwargs["forward_prefetch"],
            "FSDP2 does not record and replay the forward order. After `fabric.setup`, call"
            " `unit.set_modules_to_forward_prefetch([next_unit])` on the FSDP units in the order your forward"
            " runs them.",
        )
    sync = kwargs.get("sync_module_states", False)
    if not isinstance(sync, bool):
        raise TypeError(f"`sync_module_states` must be a bool, got {sync!r}.")
    options.sync_module_states = sync
    if kwargs.get("param_init_fn") is not None:
        raise _refuse(
            "param_init_fn",
            kwargs["param_init_fn"],
            "FSDP2 has no `param_init_fn`. Create the model under `fabric.init_module(empty_init=True)` (the meta"
            " device): `fabric.setup_module` shards it, allocates only this rank's shards and initialises each"
            " module with its `reset_parameters()`.",
        )
    if kwargs.get("process_group") is not None:
        raise _refuse(
            "process_group",
            kwargs["process_group"],
            "FSDP2 shards over a device mesh, not a process group. Pass `device_mesh=(shard,)` or"
            " `device_mesh=(replicate, shard)`, or a `DeviceMesh` (e.g. from `init_device_mesh`).",
        )
    if kwargs.get("ignored_modules") is not None and kwargs.get("ignored_states") is not None:
        raise ValueError(
            "Pass either `ignored_modules` or `ignored_states`, not both (as with FSDP1); `ignored_states` may hold"
            " modules or parameters."
        )
    for name in ("ignored_modules", "ignored_states"):
        value = kwargs.get(name)
        if value is None:
            continue
        items = list(value) if isinstance(value, Iterable) and not isinstance(value, Module) else [value]
        for item in items:
            if isinstance(item, Parameter) and name == "ignored_states":
                options.ignored_params.append(item)
            elif isinstance(item, Module):
                options.ignored_modules.append(item)
            else:
                wanted = "modules or parameters" if name == "ignored_states" else "modules"
                raise TypeError(f"`{name}` must be an iterable of {wanted}, got {item!r}.")
        if options.ignored_modules and options.ignored_params:
            raise TypeError("`ignored_states` must hold only modules or only parameters, as with FSDP1.")
    device_id = kwargs.get("device_id")
    if device_id is not None and not isinstance(device_id, (int, torch.device)):
        raise TypeError(f"`device_id` must be an int or a `torch.device`, got {device_id!r}.")
    options.device_id = device_id
    return options


def check_device_id(device_id: int | torch.device | None, device: torch.device) -> None:
    """FSDP1's ``device_id`` names the device of this rank; the strategy already chose it: they must agree."""
    if device_id is None:
        return
    wanted = torch.device(device.type, device_id) if isinstance(device_id, int) else device_id
    same = wanted.type == device.type and (wanted.index is None or device.index is None or wanted.index == device.index)
    if not same:
        raise ValueError(
            f"`FSDPStrategy(device_id={device_id!r})` does not match this rank's device, {device}: the strategy puts"
            " each process on its own device (`fabric.device`), and FSDP2 shards onto it. Leave `device_id` out, or"
            " choose the devices with `Fabric(devices=...)`."
        )
