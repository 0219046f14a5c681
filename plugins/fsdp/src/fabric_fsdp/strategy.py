"""``FSDPStrategy``: fully sharded data parallel on PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each process holds ``1/N`` of every parameter, gradient and optimizer state as ``DTensor`` shards on a
``DeviceMesh``; FSDP all-gathers a module's parameters just before its forward/backward and frees them after.
Everything else (process group, ranks, collectives) comes from the core's ``ParallelStrategy``.

Choices worth knowing (the README has the full list):

* Works on CPU over gloo as well as on CUDA over NCCL (the well-known implementation refuses CPU).
* ``fully_shard`` replaces every parameter by a new ``DTensor`` parameter. An optimizer created *before*
  setup (``fabric.setup(model, optimizer)``) still points at the old ones, so ``setup_optimizer`` rewires
  its ``param_groups`` to the sharded parameters, in place. An optimizer that has already stepped cannot be
  rewired (its state belongs to the full tensors) and is refused with an error.
* ``module_init_context(empty_init=True)`` builds the model on the meta device; ``setup_module`` shards it
  and then allocates only the local shards and re-runs ``reset_parameters()``. On a mesh where DTensor has no
  distributed RNG (CPU), each shard is initialised from its own seed so that shards are not copies of each
  other.
* Sharded checkpoints are written into a temporary directory beside the target and swapped in only when
  every rank has finished, so a failed save never replaces a good checkpoint.
* ``reshard_after_forward`` applies to the units the wrap policy makes; the root gets torch's default, which
  keeps its parameters gathered from forward to backward (freeing them would add an all-gather to every step).
  Units that stay gathered are resharded before each optimizer step, so a forward under ``no_grad`` between
  backward and step cannot leave the next forward computing with the old weights.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
import weakref
from collections.abc import Callable, Generator, Iterable
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from fabric_core.strategies.base import PRECISION_STATE_KEY, BackwardSyncControl, is_stateful
from fabric_core.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from fabric_core.utilities.rank_zero import rank_zero_warn
from fabric_fsdp import checkpoint as ckpt

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fabric_core.accelerators.base import Accelerator
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.io.checkpoint_io import CheckpointIO
    from fabric_core.precision.base import Precision

#: Modules sharded on their own when no ``auto_wrap_policy`` is given (the root is always sharded).
DEFAULT_WRAP_CLASSES: tuple[type[Module], ...] = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)
_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
_STATE_DICT_TYPES = ("sharded", "full")

ModulePolicy = Callable[[Module], bool] | Iterable[type[Module]] | None


def _as_policy(policy: ModulePolicy, name: str) -> Callable[[Module], bool] | None:
    """A set of module classes or a predicate ``fn(module) -> bool`` becomes a predicate."""
    if policy is None:
        return None
    if callable(policy) and not isinstance(policy, type):
        return policy
    classes = (policy,) if isinstance(policy, type) else tuple(policy)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, Module))]
    if bad:
        raise TypeError(
            f"`{name}` must be a set of `nn.Module` subclasses or a function `fn(module) -> bool`, got {bad[0]!r}."
        )
    return lambda module: isinstance(module, classes)


def _is_fsdp(module: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class _FSDPBackwardSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync``: skip the gradient reduce-scatter while accumulating.

    FSDP then keeps unsharded gradients until the next synchronised backward, which costs memory: the
    trade is less communication for more memory.
    """

    @contextlib.contextmanager
    def no_backward_sync(self, module: Module, enabled: bool) -> Generator[None, None, None]:
        if not enabled:
            yield
            return
        if not _is_fsdp(module):
            raise TypeError(
                "Blocking backward sync is only possible if the module passed to `no_backward_sync` was set up"
                f" with the FSDP strategy; got {type(module).__name__}."
            )
        module.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)  # type: ignore[operator]


class FSDPStrategy(ParallelStrategy):
    """Fully sharded data parallel with FSDP2.

    Args:
        auto_wrap_policy: which submodules become their own FSDP unit (all-gathered and freed on their own):
            a set of module classes or a function ``fn(module) -> bool``. Default: every
            ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``. The root module is always sharded,
            so a model without such layers is one unit (simple, but the whole model is gathered at once).
        activation_checkpointing: module classes (or ``fn(module) -> bool``) whose activations are recomputed
            in backward instead of stored. Parameter names do not change, so checkpoints stay compatible.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (``True`` or a
            ``torch.distributed.fsdp.CPUOffloadPolicy``). Has no effect, with a warning, when training on CPU.
        reshard_after_forward: for the units the wrap policy makes: free their gathered parameters after
            forward (``True``, least memory) or keep them for backward (``False``, one all-gather less per unit
            and step). An int reshards to that group size. ``None`` is torch's default (``True``). The root
            module follows torch's default whatever this says (except ``False``, which applies everywhere): it
            keeps its parameters from forward to backward, because backward needs them at once and freeing
            them would only add an all-gather to every step. To reshard the root too, call
            ``model.set_reshard_after_forward(True, recurse=False)`` after setup.
        sharding_strategy: ``"FULL_SHARD"`` (default), ``"SHARD_GRAD_OP"`` (= ``reshard_after_forward=False``),
            ``"HYBRID_SHARD"`` (shard within a node, replicate across nodes: a 2D mesh of
            ``(num_nodes, devices)``), or ``"NO_SHARD"`` (replicate everywhere, like DDP).
        device_mesh: the mesh shape, ``(shard,)`` or ``(replicate, shard)``, or a ready ``DeviceMesh``;
            overrides what ``sharding_strategy`` implies.
        state_dict_type: ``"sharded"`` (default; a directory written by all ranks in parallel, loadable on any
            number of ranks) or ``"full"`` (one file written by rank 0, readable by every strategy).
    """

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
        auto_wrap_policy: ModulePolicy = None,
        activation_checkpointing: ModulePolicy = None,
        cpu_offload: bool | Any = False,
        reshard_after_forward: bool | int | None = True,
        sharding_strategy: str = "FULL_SHARD",
        device_mesh: tuple[int, ...] | DeviceMesh | None = None,
        state_dict_type: str = "sharded",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        if state_dict_type not in _STATE_DICT_TYPES:
            raise ValueError(f"`state_dict_type` must be one of {_STATE_DICT_TYPES}, got {state_dict_type!r}.")
        sharding_strategy = str(sharding_strategy).upper()
        if sharding_strategy not in _SHARDING_STRATEGIES:
            raise ValueError(f"`sharding_strategy` must be one of {_SHARDING_STRATEGIES}, got {sharding_strategy!r}.")
        if isinstance(device_mesh, tuple) and not (
            1 <= len(device_mesh) <= 2 and all(isinstance(n, int) and n > 0 for n in device_mesh)
        ):
            raise ValueError(f"`device_mesh` must be (shard,) or (replicate, shard) positive ints, got {device_mesh!r}.")
        self._wrap_policy = _as_policy(auto_wrap_policy, "auto_wrap_policy") or _as_policy(
            DEFAULT_WRAP_CLASSES, "auto_wrap_policy"
        )
        self._checkpoint_policy = _as_policy(activation_checkpointing, "activation_checkpointing")
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = False if sharding_strategy == "SHARD_GRAD_OP" else reshard_after_forward
        self.sharding_strategy = sharding_strategy
        self.state_dict_type = state_dict_type
        self._device_mesh_arg = device_mesh
        self._mesh: DeviceMesh | None = None
        # id(old parameter) -> (weakref to it, the sharded parameter that replaced it)
        self._replaced: dict[int, tuple[weakref.ref, Parameter]] = {}
        self._models: weakref.WeakSet[Module] = weakref.WeakSet()
        # model -> its FSDP units that can keep gathered parameters after a forward (see `optimizer_step`)
        self._may_stay_gathered: weakref.WeakKeyDictionary[Module, list[weakref.ref[Module]]] = (
            weakref.WeakKeyDictionary()
        )
        self._backward_sync_control = _FSDPBackwardSyncControl()

    # ---------------------------------------------------------------------------------------- topology
    @property
    def backward_sync_control(self) -> BackwardSyncControl:
        return self._backward_sync_control

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """``(shard,)`` or ``(replicate, shard)``: how the world is laid out for sharding."""
        arg = self._device_mesh_arg
        if isinstance(arg, tuple):
            return arg
        if arg is not None:
            return tuple(arg.shape)
        world = self.world_size
        if self.sharding_strategy == "HYBRID_SHARD":
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
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if isinstance(self._device_mesh_arg, DeviceMesh):
            return self._device_mesh_arg
        if not self._ready():
            raise RuntimeError(
                "The FSDP strategy needs the processes to be launched before a model is set up: call"
                " `fabric.launch()` first (or start the script with `fabric run`)."
            )
        shape = self.mesh_shape
        if _prod(shape) != self.world_size:
            raise ValueError(
                f"The device mesh {shape} has {_prod(shape)} ranks, but the job has {self.world_size} processes."
            )
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        return init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._mesh = self._build_mesh()

    def teardown(self) -> None:
        self._mesh = None
        self._replaced.clear()
        super().teardown()

    # ---------------------------------------------------------------------------------------- init contexts
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True`` builds the model on the meta device: no memory until ``setup_module`` shards it."""
        if not empty_init:
            return super().module_init_context(empty_init=empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: Module) -> None:
        """Nothing: ``fully_shard`` moves each shard to the device, so the full model never lands there."""

    # ---------------------------------------------------------------------------------------- setup
    def _offload_policy(self) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        policy = self.cpu_offload
        if not policy:
            return OffloadPolicy()
        if self.root_device.type == "cpu":
            rank_zero_warn(
                "`cpu_offload` has no effect when training on the CPU (the parameters already live there); it is"
                " ignored."
            )
            return OffloadPolicy()
        return policy if isinstance(policy, OffloadPolicy) else CPUOffloadPolicy()

    def _mp_policy(self, root: bool) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        get = getattr(self.precision, "mixed_precision_policy", None)
        policy = get(root=root) if callable(get) else None
        return policy if policy is not None else MixedPrecisionPolicy()

    def setup_module(self, module: Module) -> Module:
        """Shard ``module`` in place (wrapping policy, activation checkpointing) and materialise meta weights."""
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        if _is_fsdp(module):
            rank_zero_warn("The model is already sharded with `fully_shard`; the FSDP strategy uses it as it is.")
            self._models.add(module)
            self._may_stay_gathered[module] = [weakref.ref(m) for m in module.modules() if _is_fsdp(m)]
            return module
        mesh = self.device_mesh
        before = [(owner, name, p) for owner in module.modules() for name, p in owner._parameters.items() if p is not None]
        if self._checkpoint_policy is not None:
            from torch.distributed._composable import checkpoint

            for sub in module.modules():
                if self._checkpoint_policy(sub):
                    checkpoint(sub)
        offload = self._offload_policy()
        options = {"mesh": mesh, "offload_policy": offload}
        # Children before parents: FSDP2 requires inner units to be sharded first.
        units = []
        for sub in reversed(list(module.modules())):
            if sub is not module and not _is_fsdp(sub) and self._wrap_policy(sub):
                units.append(sub)
                fully_shard(
                    sub,
                    mp_policy=self._mp_policy(root=False),
                    reshard_after_forward=self.reshard_after_forward,
                    **options,
                )
        fully_shard(
            module, mp_policy=self._mp_policy(root=True), reshard_after_forward=self._root_reshard(), **options
        )
        # Units that reshard after forward never keep gathered parameters beyond a forward; the others may.
        resharding = self.reshard_after_forward is True or self.reshard_after_forward is None
        self._may_stay_gathered[module] = [weakref.ref(m) for m in [module, *([] if resharding else units)]]

        for owner, name, old in before:
            new = owner._parameters.get(name)
            if new is not None and new is not old:
                self._replaced[id(old)] = (weakref.ref(old), new)
        if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
            device = torch.device("cpu") if isinstance(offload, CPUOffloadPolicy) else self.root_device
            self._materialize(module, device)
        self._models.add(module)
        return module

    def _root_reshard(self) -> bool | None:
        """``reshard_after_forward`` for the root: torch's default (``None``) unless resharding is off everywhere.

        With ``None`` torch keeps the root's parameters gathered from forward to backward (it decides when the
        root is known, at the first forward): freeing them would cost one more all-gather per step, since the
        backward pass starts with the root's parameters.
        """
        return False if self.reshard_after_forward is False else None

    def _materialize(self, module: Module, device: torch.device) -> None:
        """Allocate the local shards of meta parameters and initialise them with ``reset_parameters()``.

        Only ``1/N`` of each parameter is ever allocated on a rank. Modules are reset children first, like
        construction would (a parent's initialisation of its children wins).
        """
        module.to_empty(device=device)
        modules = list(module.named_modules())
        resettable = {name for name, m in modules if _reset_function(m) is not None}
        uncovered = [
            name or type(module).__name__
            for name, m in modules
            if (m._parameters or m._buffers)
            and not any(r == name or r == "" or name.startswith(r + ".") for r in resettable)
        ]
        if uncovered:
            rank_zero_warn(
                "The model was created on the meta device (`init_module(empty_init=True)`), and these submodules"
                f" have no `reset_parameters()` to initialise them: {uncovered[:5]}. Their weights are"
                " uninitialised memory until you load a checkpoint."
            )
        mesh = self.device_mesh
        with contextlib.ExitStack() as stack:
            if not _mesh_has_distributed_rng(mesh):
                # DTensor has no distributed RNG here, so every rank would draw the same numbers for its shard:
                # give each shard (not each replica) its own seed, agreed through rank 0.
                seed = self.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item()) if self.is_global_zero else None)
                stack.enter_context(torch.random.fork_rng(devices=[]))
                torch.manual_seed(seed + _shard_coordinate(mesh))
            stack.enter_context(torch.no_grad())
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message=".*DTensor random operators.*")
            for _, sub in reversed(modules):
                reset = _reset_function(sub)
                if reset is not None:
                    reset()
        # Buffers are not sharded: make them identical everywhere.
        if self._ready() and self.world_size > 1:
            for buffer in module.buffers():
                dist.broadcast(buffer.data, src=0)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Point the optimizer at the sharded parameters (it may have been created before ``setup_module``)."""
        replaced = 0
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                entry = self._replaced.get(id(p))
                if entry is not None and entry[0]() is p:
                    if p in optimizer.state and optimizer.state[p]:
                        raise RuntimeError(
                            "The optimizer already has state for the model's unsharded parameters (it has taken a"
                            " step). Create the optimizer fresh, after `fabric.setup_module(model)`, and set it up"
                            " with `fabric.setup_optimizers(optimizer)`."
                        )
                    params[i] = entry[1]  # in place: optimizers such as LBFGS keep a reference to this list
                    replaced += 1
        if not any(_is_dtensor(p) for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "The optimizer does not reference any parameter of a model set up with the FSDP strategy. Set up"
                " the model first (`model = fabric.setup_module(model)`), create the optimizer from"
                " `model.parameters()`, then call `fabric.setup_optimizers(optimizer)`."
            )
        return optimizer

    # ---------------------------------------------------------------------------------------- training step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step, after freeing parameters that a forward left gathered, so the next forward gathers new ones.

        A unit that does not reshard after forward (the root, or every unit with ``reshard_after_forward=False``)
        keeps its gathered copy until its backward. After a forward without backward (evaluation under
        ``torch.no_grad()``), that copy would survive the step, and FSDP would skip the all-gather in the next
        forward and compute with the weights from before the step. ``reshard()`` is a no-op (about 3 us) when
        the backward has already freed them, which is the usual case.
        """
        for units in self._may_stay_gathered.values():
            for ref in units:
                unit = ref()
                if unit is not None:
                    unit.reshard()  # type: ignore[operator]
        return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int | str = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm over *all* shards on all ranks; returns that norm as a plain tensor."""
        if not _is_fsdp(self.unwrap_module(module)):
            raise TypeError(
                "Gradient clipping by norm with the FSDP strategy needs the model that was set up with it; got"
                f" a {type(module).__name__}."
            )
        self.precision.unscale_gradients(optimizer)
        params = [p for p in self.precision.main_params(optimizer) if p.grad is not None]
        norm_type = float(norm_type)
        sharded = [p for p in params if _is_dtensor(p.grad)]
        if len(sharded) == len(params):
            total = torch.nn.utils.clip_grad_norm_(
                params, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
            )
            return total.full_tensor() if _is_dtensor(total) else total
        return _clip_mixed(params, sharded, float(max_norm), norm_type, error_if_nonfinite)

    # ---------------------------------------------------------------------------------------- checkpoints
    def _find_model(self, state: dict[str, Any], action: str) -> tuple[str | None, Module | None]:
        found = [(k, v) for k, v in state.items() if isinstance(v, Module) and _is_fsdp(v)]
        if len(found) > 1:
            raise ValueError(
                f"Found {len(found)} FSDP models in the state to {action} ({', '.join(repr(k) for k, _ in found)})."
                " An FSDP checkpoint holds exactly one sharded model: save each model in its own checkpoint."
            )
        return found[0] if found else (None, None)

    def _owner(self, optimizer: Optimizer) -> Module:
        """The FSDP model whose parameters ``optimizer`` updates."""
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for model in self._models:
            if any(id(p) in params for p in model.parameters()):
                return model
        raise ValueError(
            "This optimizer does not belong to a model set up with the FSDP strategy, so its sharded state cannot"
            " be saved or restored. Set up the model and the optimizer through this Fabric first."
        )

    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write ``state`` as a sharded directory (all ranks) or as one full file (rank 0).

        Exactly one FSDP model may be in ``state``; optimizers of that model are saved with it.
        """
        path = Path(path)
        key, model = self._find_model(state, "save")
        if model is None:
            raise ValueError(
                "Could not find an FSDP model in the state to save. Pass the model set up with `fabric.setup` like"
                " `fabric.save(path, {'model': model, 'optimizer': optimizer, ...})`."
            )
        if self.state_dict_type == "sharded":
            if filter is not None:
                raise NotImplementedError(
                    "`fabric.save(..., filter=...)` is not supported with sharded FSDP checkpoints. Use"
                    " `FSDPStrategy(state_dict_type='full')` to filter, or save without a filter."
                )
            if storage_options is not None:
                raise TypeError(
                    "Sharded FSDP checkpoints take no `storage_options`: they are written with"
                    " torch.distributed.checkpoint."
                )
            self._save_sharded(path, key, model, state)
        else:
            self._save_full(path, model, state, storage_options, filter)

    def _save_full(self, path: Path, model: Module, state: dict[str, Any], storage_options: Any, filter: Any) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        converted = self.convert_state(
            state,
            filter,
            module_state=lambda m: get_model_state_dict(m, options=options) if _is_fsdp(m) else m.state_dict(),
            optimizer_state=lambda o: ckpt.optimizer_state_by_position(
                get_optimizer_state_dict(self._owner(o), o, options=options)
            ),
        )
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(converted, path, storage_options=storage_options)

    def _save_sharded(self, path: Path, model_key: str, model: Module, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from fabric_core.io.checkpoint_io import atomic_save

        _check_replaceable(path)
        shards: dict[str, Any] = {model_key: get_model_state_dict(model)}
        meta: dict[str, Any] = {}
        optimizer_keys = []
        for key, obj in state.items():
            if key == model_key:
                continue
            if isinstance(obj, Optimizer):
                shards[key] = get_optimizer_state_dict(self._owner(obj), obj)
                optimizer_keys.append(key)
            elif isinstance(obj, Module) or is_stateful(obj):
                meta[key] = obj.state_dict()
            else:
                meta[key] = obj
        precision_state = self.precision.state_dict()
        if precision_state:
            meta[PRECISION_STATE_KEY] = precision_state
        meta[ckpt.FORMAT_KEY] = {
            "version": ckpt.FORMAT_VERSION,
            "module": model_key,
            "optimizers": optimizer_keys,
            "world_size": self.world_size,
        }

        # Every rank writes into the same hidden directory beside the target; rank 0 swaps it in only after
        # all ranks report success, so the target is always either the old or the new complete checkpoint.
        token = self.broadcast(uuid.uuid4().hex[:12] if self.is_global_zero else None)
        tmp = path.parent / f".{path.name}.tmp-{token}"
        error: Exception | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            dcp.save(shards, checkpoint_id=tmp)
            if self.is_global_zero:
                atomic_save(meta, tmp / ckpt.META_FILE)
        except Exception as err:  # agree on failure below instead of leaving the other ranks waiting
            error = err
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.reduce_boolean_decision(error is None, all=True):
            try:
                if self.is_global_zero:
                    _swap_into_place(tmp, path)
            except Exception as err:
                error = err
            if self.reduce_boolean_decision(error is None, all=True):
                return
        shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise RuntimeError(
            f"Saving the sharded checkpoint {str(path)!r} failed on another rank (see its error); the previous"
            " checkpoint, if any, was left untouched."
        )

    def load_checkpoint(
        self,
        path: str | Path,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the model and optimizers in place from a sharded directory or a full file.

        A sharded checkpoint reshards on load (saved on N ranks, loaded on M); a full file, whichever strategy
        wrote it (single device, DDP, FSDP with ``state_dict_type="full"``), is read by every rank and each
        keeps its shard.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint not found: {str(path)!r}")
        if ckpt.is_sharded_checkpoint(path):
            return self._load_sharded(path, state, strict, weights_only)
        if path.is_dir():
            raise ValueError(
                f"{str(path)!r} is a directory but not a sharded FSDP checkpoint (it needs"
                f" {ckpt.DCP_METADATA!r} and {ckpt.META_FILE!r})."
            )
        return self._load_full(path, state, strict, weights_only)

    def _load_full(self, path: Path, state: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        try:
            checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only, mmap=True)
        except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
            checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if isinstance(state, Module):
            self._load_model_full(state, checkpoint, strict)
            return {}
        if isinstance(state, Optimizer):
            self._load_optimizer_full(self._owner(state), state, checkpoint)
            return {}
        precision_state = checkpoint.pop(PRECISION_STATE_KEY, None)
        if not state:
            if precision_state is not None:
                checkpoint[PRECISION_STATE_KEY] = precision_state
            return checkpoint
        _check_missing(state, checkpoint, strict)
        for key, obj in list(state.items()):
            if key not in checkpoint:
                continue
            value = checkpoint.pop(key)
            if isinstance(obj, Module):
                self._load_model_full(obj, value, strict)
            elif isinstance(obj, Optimizer):
                self._load_optimizer_full(self._owner(obj), obj, value)
            elif is_stateful(obj):
                obj.load_state_dict(value)
            else:
                state[key] = value
        if precision_state is not None:
            self.precision.load_state_dict(precision_state)
        return checkpoint

    def _load_model_full(self, module: Module, state_dict: dict[str, Any], strict: bool) -> None:
        if not _is_fsdp(module):
            module.load_state_dict(state_dict, strict=strict)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))

    def _load_optimizer_full(self, model: Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = {id(p): n for n, p in model.named_parameters()}
        by_name = ckpt.optimizer_state_by_name(state, optimizer, names)
        with _grads_hidden(optimizer):
            set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))

    def _load_sharded(self, path: Path, state: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if isinstance(state, Module):
            state = {None: state}
        elif isinstance(state, Optimizer):
            state = {None: state}
        if not state:
            raise ValueError(
                "Loading a sharded FSDP checkpoint needs the model to load into: pass it like"
                " `fabric.load(path, {'model': model, 'optimizer': optimizer})`. To get a single file with"
                f" everything instead, run `fabric consolidate {path}`."
            )
        meta, record = ckpt.read_meta(path, weights_only=weights_only)
        model_key: str = record["module"]
        optimizer_keys: list[str] = list(record.get("optimizers", []))
        if None in state:  # a bare model or optimizer: match it to the saved one by kind
            obj = state.pop(None)
            if isinstance(obj, Optimizer) and len(optimizer_keys) != 1:
                raise ValueError(
                    f"The checkpoint holds {len(optimizer_keys)} optimizers; pass a dict to say which one to load."
                )
            state[model_key if isinstance(obj, Module) else optimizer_keys[0]] = obj
            bare = True
        else:
            bare = False

        key, model = self._find_model(state, "load")
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        if model is None and optimizers:
            model = self._owner(next(iter(optimizers.values())))
        available = {model_key, *optimizer_keys, *meta}
        _check_missing(state, available, strict)
        if key is not None and key != model_key:
            raise KeyError(
                f"The checkpoint stores its model under {model_key!r}, but the state passes the FSDP model under"
                f" {key!r}. Use the same key as when saving."
            )

        shards: dict[str, Any] = {}
        if key is not None:
            shards[model_key] = get_model_state_dict(model)
        for k, opt in optimizers.items():
            if k in optimizer_keys:
                with _grads_hidden(opt):
                    shards[k] = get_optimizer_state_dict(model, opt)
        if shards:
            dcp.load(shards, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
        if key is not None:
            set_model_state_dict(model, shards[model_key], options=StateDictOptions(strict=strict))
        for k, opt in optimizers.items():
            if k in shards:
                set_optimizer_state_dict(model, opt, shards[k])
        if bare:
            return {}

        precision_state = meta.pop(PRECISION_STATE_KEY, None)
        for k, obj in list(state.items()):
            if k in shards or k not in meta:
                continue
            value = meta.pop(k)
            if isinstance(obj, Module):
                obj.load_state_dict(value, strict=strict)
            elif is_stateful(obj):
                obj.load_state_dict(value)
            else:
                state[k] = value
        if precision_state is not None:
            self.precision.load_state_dict(precision_state)
        return meta

    def __repr__(self) -> str:
        return (
            f"FSDPStrategy(devices={self.num_processes}, num_nodes={self.num_nodes}, mesh={self.mesh_shape},"
            f" state_dict_type={self.state_dict_type!r})"
        )


# -------------------------------------------------------------------------------------------------------- helpers
def _prod(shape: Iterable[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _reset_function(module: Module) -> Callable[[], None] | None:
    """``reset_parameters``, or torch's private ``_reset_parameters`` (``nn.MultiheadAttention`` has only that)."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def _mesh_has_distributed_rng(mesh: DeviceMesh) -> bool:
    """Whether DTensor's offset-based RNG works on this mesh (CUDA-like devices), so shards differ by design."""
    if mesh.device_type == "cpu":
        return False
    handle = getattr(torch, mesh.device_type, None)
    return hasattr(handle, "set_rng_state")


def _shard_coordinate(mesh: DeviceMesh) -> int:
    """This rank's index along the sharding dimension (replicas of the same shard share it)."""
    if mesh.ndim == 1:
        return mesh.get_local_rank()
    return mesh.get_local_rank("shard")


@contextlib.contextmanager
def _grads_hidden(optimizer: Optimizer) -> Generator[None, None, None]:
    """Let torch create a fresh optimizer's state (it needs it as a template to load into).

    torch initialises it with a zero-learning-rate step, but silently skips that when any gradient exists,
    and the state would then not be restored. So gradients are set aside meanwhile and put back after.
    """
    stashed = []
    if not optimizer.state:
        stashed = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for p, _ in stashed:
            p.grad = None
    try:
        yield
    finally:
        for p, grad in stashed:
            p.grad = grad


def _check_missing(state: dict[Any, Any], available: Iterable[Any], strict: bool) -> None:
    available = set(available)
    missing = [k for k in state if k not in available]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint."
            f" Keys in the checkpoint: {sorted(map(str, available))}. To disable strict loading, set `strict=False`."
        )


def _clip_mixed(
    params: list[Tensor], sharded: list[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> Tensor:
    """Clip when some gradients are DTensor shards and others plain tensors (parameters outside the model)."""
    plain = [p for p in params if not _is_dtensor(p.grad)]
    norms = []
    for group in (sharded, plain):
        if group:
            norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type)
            norms.append(norm.full_tensor() if _is_dtensor(norm) else norm)
    if not norms:
        return torch.tensor(0.0)
    stacked = torch.stack([n.float().cpu() for n in norms])
    total = stacked.max() if norm_type == float("inf") else torch.linalg.vector_norm(stacked, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped. To disable"
            " this error and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`."
        )
    coefficient = min(1.0, max_norm / (float(total) + 1e-6))
    with torch.no_grad():
        for p in params:
            p.grad.mul_(coefficient)
    return total


def _check_replaceable(path: Path) -> None:
    """Refuse to overwrite a directory that is not a checkpoint of ours (it may hold the user's files)."""
    if path.is_dir() and any(path.iterdir()) and not ckpt.is_sharded_checkpoint(path):
        raise FileExistsError(
            f"Cannot save a sharded checkpoint to {str(path)!r}: it is a non-empty directory that is not an FSDP"
            " checkpoint, and saving would replace it. Choose a new path, for example inside that directory."
        )


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Move the finished checkpoint ``tmp`` to ``target``; an old checkpoint there is replaced, not mixed.

    On Linux the two directories are exchanged atomically (``renameat2(RENAME_EXCHANGE)``). Elsewhere the
    old one is first renamed aside, so at every moment either the old or the new complete checkpoint exists.
    """
    from fabric_core.io.checkpoint_io import _fsync_directory

    if not os.path.lexists(target):
        os.rename(tmp, target)
    elif _exchange(tmp, target):
        _remove(tmp)  # now holds the old checkpoint
    else:
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
        os.rename(tmp, target)
        _remove(old)
    _fsync_directory(target.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False when unavailable."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return result == 0
