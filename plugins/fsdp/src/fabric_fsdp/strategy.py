"""``FSDPStrategy``: fully sharded data parallel on PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Wiring only: the process group, ranks and collectives come from the core's ``ParallelStrategy``; what every
strategy of this plugin shares (tracking models, ``no_backward_sync``, meta init, checkpoints) from
:class:`~fabric_fsdp.sharded.ShardedStrategy`; sharding is the recipe of free functions in
:mod:`fabric_fsdp.sharding`; checkpoints are :mod:`fabric_fsdp.checkpoint`, built on the core's checkpoint
building blocks; the precision hands over its FSDP policy as a value
(:mod:`fabric_fsdp.precision`); the reference's FSDP1 arguments are mapped onto FSDP2 by
:mod:`fabric_fsdp.arguments`. The README lists the choices worth knowing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.precision import Precision
from fabric_core.strategies import (
    DATA_REPLICATE,
    DATA_SHARD,
    Axis,
    require_precision_type,
    split_parallel_options,
)
from fabric_core.utilities import rank_zero_warn
from fabric_fsdp import arguments, sharding
from fabric_fsdp.precision import FSDPPrecision
from fabric_fsdp.sharded import ShardedStrategy
from fabric_fsdp.sharding import DEFAULT_WRAP_CLASSES, ModulePolicy, is_fsdp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fabric_core.accelerators import Accelerator

__all__ = ["DEFAULT_WRAP_CLASSES", "FSDPStrategy"]

def _check_precision(precision: Precision | None) -> None:
    """FSDP casts through its sharding policy: an autocast or half-precision plugin of another strategy would
    fight it. The core's 32-true and 64-true precisions are fine (FSDP2 shards the model as they leave it)."""
    from fabric_core.precision import DoublePrecision, FullPrecision
    from fabric_fsdp.precision import SUPPORTED

    require_precision_type(
        precision,
        strategy="FSDP",
        name="fsdp",
        needs=FSDPPrecision,
        supported=SUPPORTED,
        reason="FSDP2 applies mixed and half precision through its sharding policy, not through another strategy's"
        " precision plugin.",
        also_accepted=(Precision, FullPrecision, DoublePrecision),
        accept_module_transforms=True,  # e.g. float8 training: FSDP2 shards the modules it left
    )


class FSDPStrategy(ShardedStrategy):
    """Fully sharded data parallel with FSDP2.

    The arguments of the reference's FSDP1 strategy are accepted and mapped onto FSDP2, or refused with an
    error naming the FSDP2 way (:mod:`fabric_fsdp.arguments`; the README has the table).

    Args:
        auto_wrap_policy: which submodules become their own FSDP unit (all-gathered and freed on their own):
            a set of module classes, a function ``fn(module) -> bool``, an FSDP1 policy callable
            ``fn(module, recurse, nonwrapped_numel)`` (e.g. ``partial(size_based_auto_wrap_policy, ...)``, run the
            way FSDP1 runs it) or a ``ModuleWrapPolicy``/``CustomPolicy``. Default: every
            ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``. The root module is always sharded,
            so a model without such layers is one unit (simple, but the whole model is gathered at once).
        activation_checkpointing: modules whose activations are recomputed in backward instead of stored; the
            same forms as ``auto_wrap_policy``.
        activation_checkpointing_policy: the reference's name for ``activation_checkpointing`` (pass one of them).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory: ``True``, FSDP1's
            ``CPUOffload(offload_params=True)`` or FSDP2's ``CPUOffloadPolicy``. Has no effect, with a warning,
            when training on CPU.
        mixed_precision: an FSDP2 ``MixedPrecisionPolicy`` or an FSDP1 ``MixedPrecision`` (mapped field by
            field); takes precedence over the precision plugin's policy.
        reshard_after_forward: for the units the wrap policy makes: free their gathered parameters after
            forward (``True``, least memory) or keep them for backward (``False``); an int reshards to that group
            size; ``None`` is torch's default. The root keeps torch's default unless this is ``False``.
        sharding_strategy: ``"FULL_SHARD"`` (default), ``"SHARD_GRAD_OP"`` (= ``reshard_after_forward=False``),
            ``"HYBRID_SHARD"`` (shard within a node, replicate across nodes: a 2D mesh of
            ``(num_nodes, devices)``), ``"_HYBRID_SHARD_ZERO2"`` (hybrid without resharding after forward) or
            ``"NO_SHARD"`` (replicate everywhere, like DDP); a name or a ``ShardingStrategy`` member.
        device_mesh: the mesh shape, ``(shard,)`` or ``(replicate, shard)``, or a ready ``DeviceMesh``;
            overrides what ``sharding_strategy`` implies.
        state_dict_type: ``"sharded"`` (default; a directory written by all ranks in parallel, loadable on any
            number of ranks) or ``"full"`` (one file written by rank 0, readable by every strategy). A custom
            ``CheckpointIO`` is used for full checkpoints and refused for sharded ones.
        **kwargs: the keywords of :class:`~fabric_core.strategies.ParallelStrategy` (``precision``, ``timeout``,
            ``process_group_backend``, ``start_method``, ...), and FSDP1 ``FullyShardedDataParallel`` keyword
            arguments: ``use_orig_params``,
            ``limit_all_gathers``, ``backward_prefetch``, ``forward_prefetch``, ``sync_module_states``,
            ``param_init_fn``, ``process_group``, ``ignored_modules``, ``ignored_states``, ``device_id``.
    """

    def __init__(
        self,
        *,
        auto_wrap_policy: ModulePolicy = None,
        activation_checkpointing: ModulePolicy = None,
        cpu_offload: Any = False,
        reshard_after_forward: bool | int | None = True,
        sharding_strategy: Any = "FULL_SHARD",
        device_mesh: tuple[int, ...] | DeviceMesh | None = None,
        state_dict_type: str = "sharded",
        mixed_precision: Any = None,
        activation_checkpointing_policy: ModulePolicy = None,
        **kwargs: Any,
    ) -> None:
        options, kwargs = split_parallel_options(kwargs)
        super().__init__(state_dict_type=state_dict_type, **options)
        sharding_strategy = arguments.sharding_strategy_name(sharding_strategy)
        if isinstance(device_mesh, tuple) and not (
            1 <= len(device_mesh) <= 2 and all(isinstance(n, int) and n > 0 for n in device_mesh)
        ):
            raise ValueError(f"`device_mesh` must be (shard,) or (replicate, shard) positive ints, got {device_mesh!r}.")
        if activation_checkpointing is not None and activation_checkpointing_policy is not None:
            raise ValueError(
                "You cannot set both `activation_checkpointing` and `activation_checkpointing_policy`. Use the latter"
                " (here they take the same values)."
            )
        checkpointing = activation_checkpointing_policy if activation_checkpointing_policy is not None else activation_checkpointing
        checkpointing_name = "activation_checkpointing" if activation_checkpointing is not None else "activation_checkpointing_policy"
        self._wrap_policy = sharding.as_policy(auto_wrap_policy or DEFAULT_WRAP_CLASSES, "auto_wrap_policy")
        self._activation_checkpointing = sharding.as_policy(checkpointing, checkpointing_name)
        #: the FSDP2 ``OffloadPolicy`` every ``fully_shard`` call gets (a ``CPUOffloadPolicy`` when offloading)
        self.offload_policy = arguments.as_offload_policy(cpu_offload)
        self.mixed_precision = mixed_precision
        self._mixed_precision = arguments.as_mixed_precision(mixed_precision)
        self._fsdp1 = arguments.fsdp1_options(kwargs)
        no_reshard = sharding_strategy in arguments.NO_RESHARD_STRATEGIES
        self.reshard_after_forward = False if no_reshard else reshard_after_forward
        self.sharding_strategy = sharding_strategy
        self._device_mesh_arg = device_mesh
        self._mesh: DeviceMesh | None = None

    # ---------------------------------------------------------------------------------------- plugins
    @property
    def cpu_offload(self) -> bool:
        """Whether parameters, gradients and optimizer state are offloaded to CPU memory."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        return isinstance(self.offload_policy, CPUOffloadPolicy)

    @cpu_offload.setter
    def cpu_offload(self, value: Any) -> None:
        self.offload_policy = arguments.as_offload_policy(value)

    def check_precision(self, precision: Precision | None) -> None:
        _check_precision(precision)

    def precision_for(self, precision: str, accelerator: Accelerator) -> Precision | None:
        """An ``FSDPPrecision`` (mixed precision as an FSDP policy, not autocast) for the names FSDP runs; ``None``
        for the others (``64-true``: the core's precision casts the model and FSDP2 shards it as it is)."""
        from fabric_fsdp.precision import SUPPORTED

        return FSDPPrecision(precision) if precision in SUPPORTED else None

    # ---------------------------------------------------------------------------------------- topology
    def parallel_axes(self) -> tuple[Axis, ...]:
        """The mesh's dimensions: ``shard`` (every rank a data-parallel shard of the model, its own batches), and
        ``replicate`` before it on a hybrid mesh (replicas of the sharded model across the nodes)."""
        shape = self.mesh_shape
        names = sharding.mesh_dimension_names(self._device_mesh_arg, len(shape))
        roles = (DATA_SHARD,) if len(shape) == 1 else (DATA_REPLICATE, DATA_SHARD)
        coordinates, rest = [], self.global_rank
        for size in reversed(shape):
            coordinates.insert(0, rest % size)
            rest //= size
        return tuple(Axis(n, s, c, r) for n, s, c, r in zip(names, shape, coordinates, roles))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """``(shard,)`` or ``(replicate, shard)``: how the world is laid out for sharding."""
        arg = self._device_mesh_arg
        if isinstance(arg, tuple):
            return arg
        if arg is not None:
            return tuple(arg.shape)
        world = self.world_size
        if self.sharding_strategy in arguments.HYBRID_STRATEGIES:
            return (self.num_nodes, max(1, world // max(1, self.num_nodes)))
        if self.sharding_strategy == "NO_SHARD":
            return (world, 1)
        return (world,)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh parameters are sharded over (created when the processes are set up)."""
        if self._mesh is None:
            self._mesh = self._build_mesh()
        return self._mesh

    def _build_mesh(self) -> DeviceMesh:
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(self._device_mesh_arg, DeviceMesh):
            return self._device_mesh_arg
        if not self.process_group_ready():
            raise RuntimeError(
                "The FSDP strategy needs the processes to be launched before a model is set up: call"
                " `fabric.launch()` first (or start the script with `fabric run`)."
            )
        return sharding.build_mesh(self.root_device.type, self.mesh_shape, self.world_size)

    @property
    def fsdp_precision(self) -> FSDPPrecision | None:
        """The precision as FSDP's own type, or ``None`` when the core's precision is used (e.g. ``64-true``)."""
        precision = self.precision
        return precision if isinstance(precision, FSDPPrecision) else None

    # ---------------------------------------------------------------------------------------- lifecycle
    def setup_environment(self) -> None:
        super().setup_environment()
        self._mesh = self._build_mesh()

    def teardown(self) -> None:
        """Forget the mesh, then what every sharded strategy releases."""
        self._mesh = None
        super().teardown()

    # ---------------------------------------------------------------------------------------- setup
    def _offload_policy(self) -> Any:
        from torch.distributed.fsdp import OffloadPolicy

        if self.cpu_offload and self.root_device.type == "cpu":
            rank_zero_warn(
                "`cpu_offload` has no effect when training on the CPU (the parameters already live there); it is"
                " ignored."
            )
            return OffloadPolicy()
        return self.offload_policy

    @property
    def mixed_precision_config(self) -> Any:
        """The reference's name: the ``MixedPrecisionPolicy`` FSDP applies to the wrapped blocks (``mixed_precision=``
        if given, else the precision's), ``None`` when FSDP casts nothing. An FSDP2 policy, not FSDP1's
        ``MixedPrecision`` (docs/decisions.md)."""
        if self._mixed_precision is not None:
            return self._mixed_precision(False)
        precision = self.fsdp_precision
        return precision.mixed_precision_config if precision is not None else None

    def _mp_policy(self, root: bool) -> Any:
        """The ``MixedPrecisionPolicy`` of one ``fully_shard`` call: ``mixed_precision=`` wins over the precision's."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self._mixed_precision is not None:
            return self._mixed_precision(root)
        precision = self.fsdp_precision
        policy = precision.mixed_precision_policy(root=root) if precision is not None else None
        return policy if policy is not None else MixedPrecisionPolicy()

    def setup_module(self, module: Module) -> Module:
        """Activation checkpointing, shard, then materialise meta weights (see :mod:`fabric_fsdp.sharding`)."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        arguments.check_device_id(self._fsdp1.device_id, self.root_device)
        if is_fsdp(module):
            rank_zero_warn("The model is already sharded with `fully_shard`; the FSDP strategy uses it as it is.")
            self.track(module, [m for m in module.modules() if is_fsdp(m)])
            return module
        arguments.warn_unkept_modules(self.mixed_precision, module)
        if self._fsdp1.sync_module_states:
            sharding.broadcast_module_states(module, self.root_device)
        sharding.apply_activation_checkpointing(module, self._activation_checkpointing)
        offload = self._offload_policy()
        ignored = self._fsdp1.resolve_ignored()
        # By name: materialising a meta model replaces the parameter objects.
        ignored_names = [name for name, p in module.named_parameters() if p in ignored]
        units = sharding.shard(
            module, self.device_mesh, self._wrap_policy, self._mp_policy, offload, self.reshard_after_forward, ignored
        )
        # Units that reshard after forward never keep gathered parameters beyond a forward; the others may.
        resharding = self.reshard_after_forward is True or self.reshard_after_forward is None
        may_stay_gathered = [module, *([] if resharding else units)]
        if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
            device = torch.device("cpu") if isinstance(offload, CPUOffloadPolicy) else self.root_device
            seed = self.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item()) if self.is_global_zero else None)
            sharding.materialize(module, device, seed)
        # FSDP2 leaves ignored parameters where they are: put them on this rank's device, whole.
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name in ignored_names:
                if params[name].device != self.root_device:
                    params[name].data = params[name].data.to(self.root_device)
        self.track(module, may_stay_gathered)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer as it is, once it holds sharded parameters (the core points an optimizer created before
        ``setup_module`` at them)."""
        sharding.check_optimizer(optimizer)
        return optimizer

    def __repr__(self) -> str:
        return (
            f"FSDPStrategy(devices={self.num_processes}, num_nodes={self.num_nodes}, mesh={self.mesh_shape},"
            f" state_dict_type={self.state_dict_type!r})"
        )

