"""Sharding a module with FSDP2, as free functions with explicit arguments (testable without a strategy).

The strategy's ``setup_module`` is the recipe: :func:`apply_activation_checkpointing`, then :func:`shard`, then
:func:`materialize` for a model built on the meta device. Optimizers created before sharding are pointed at
the new parameters by the core (``fabric.setup``); gradients are clipped over every shard by the core's
:func:`fabric_core.utilities.dtensor.clip_grad_norm`.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from fabric_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Modules sharded on their own when no ``auto_wrap_policy`` is given (the root is always sharded).
DEFAULT_WRAP_CLASSES: tuple[type[Module], ...] = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)

#: What a user may pass as ``auto_wrap_policy``/``activation_checkpointing(_policy)``: module classes, a predicate
#: ``fn(module) -> bool``, an FSDP1 policy callable ``fn(module, recurse, nonwrapped_numel) -> bool`` (such as
#: ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``), or an FSDP1 ``ModuleWrapPolicy`` /
#: ``CustomPolicy`` object.
ModulePolicy = Any
#: A policy made uniform: ``select(root, ignored_params)`` returns the submodules it picks, descendants before
#: ancestors. The root may be among them; a module whose parameters are all ignored never is.
Selector = Callable[[Module, "frozenset[Parameter]"], list[Module]]


def as_policy(policy: ModulePolicy, name: str) -> Selector | None:
    """Turn any accepted form of a module policy into a :data:`Selector` (``None`` stays ``None``).

    * classes (one, or an iterable): the modules that are instances of them;
    * ``fn(module) -> bool``: the modules it returns true for;
    * an FSDP1 policy callable ``fn(module, recurse, nonwrapped_numel)``: run the way FSDP1 runs it (see
      :func:`_fsdp1_selection`), so ``size_based_auto_wrap_policy`` picks the same modules as under FSDP1;
    * ``ModuleWrapPolicy``/``CustomPolicy`` (FSDP1 policy objects): the modules they target. A ``CustomPolicy``
      that returns per-module FSDP1 arguments (a non-empty dict) is refused when it is applied.

    Malformed policies are refused here, at construction, not at setup.
    """
    if policy is None:
        return None
    policy_base = _fsdp1_policy_base()
    if policy_base is not None and isinstance(policy, policy_base):
        return _ordered(lambda root, ignored: _policy_object_selection(policy, root, name))
    if isinstance(policy, type) or (not callable(policy) and isinstance(policy, Iterable)):
        classes = (policy,) if isinstance(policy, type) else tuple(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, Module))]
        if bad:
            raise TypeError(
                f"`{name}` must be a set of `nn.Module` subclasses, a function `fn(module) -> bool`, an FSDP1 policy"
                f" `fn(module, recurse, nonwrapped_numel)`, or a `ModuleWrapPolicy`/`CustomPolicy`; got {bad[0]!r}."
            )
        return _ordered(lambda root, ignored: [m for m in root.modules() if isinstance(m, classes)])
    if callable(policy):
        kind = _callable_kind(policy)
        if kind == "fsdp1":
            return _ordered(lambda root, ignored: _fsdp1_selection(policy, root, ignored))
        if kind == "predicate":
            return _ordered(lambda root, ignored: [m for m in root.modules() if policy(m)])
        raise TypeError(
            f"`{name}` is a callable that takes neither `(module)` nor FSDP1's `(module, recurse, nonwrapped_numel)`"
            f" (its signature is {kind}). Pass `fn(module) -> bool`, or an FSDP1 policy such as"
            " `functools.partial(size_based_auto_wrap_policy, min_num_params=...)`."
        )
    raise TypeError(
        f"`{name}` must be a set of `nn.Module` subclasses, a function `fn(module) -> bool`, an FSDP1 policy"
        f" `fn(module, recurse, nonwrapped_numel)`, or a `ModuleWrapPolicy`/`CustomPolicy`; got {policy!r}."
    )


def _fsdp1_policy_base() -> type | None:
    try:
        from torch.distributed.fsdp.wrap import _Policy
    except ImportError:  # pragma: no cover - torch without FSDP1
        return None
    return _Policy


def _callable_kind(fn: Callable[..., Any]) -> str:
    """``"predicate"`` for ``fn(module)``, ``"fsdp1"`` for ``fn(module, recurse, nonwrapped_numel)``, else the
    signature (as text) for the error message. FSDP1 calls its policies with those three keywords."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return "predicate"  # builtins and C callables: nothing to inspect, call them with the module
    if "recurse" in signature.parameters:
        return "fsdp1"
    with contextlib.suppress(TypeError):
        signature.bind(None)
        return "predicate"
    with contextlib.suppress(TypeError):
        signature.bind(module=None, recurse=True, nonwrapped_numel=0)
        return "fsdp1"
    return str(signature)


def _all_ignored(module: Module, ignored: frozenset[Parameter]) -> bool:
    params = list(module.parameters())
    return bool(ignored) and bool(params) and all(p in ignored for p in params)


def _ordered(select: Callable[[Module, frozenset[Parameter]], list[Module]]) -> Selector:
    """Wrap a raw selection: no duplicates, nothing whose parameters are all ignored, descendants first."""

    def selector(root: Module, ignored: frozenset[Parameter] = frozenset()) -> list[Module]:
        chosen = {id(m) for m in select(root, ignored)}
        # modules() is pre-order (every module before its descendants), so its reverse puts descendants first.
        return [m for m in reversed(list(root.modules())) if id(m) in chosen and not _all_ignored(m, ignored)]

    return selector


def _fsdp1_selection(fn: Callable[..., Any], root: Module, ignored: frozenset[Parameter]) -> list[Module]:
    """The modules an FSDP1 policy callable picks, asked the way FSDP1's recursive wrapping asks it.

    For each module, ``fn(module=m, recurse=True, nonwrapped_numel=<its parameters>)`` decides whether to look
    into its children; after the children, ``fn(module=m, recurse=False, nonwrapped_numel=<its parameters not in
    a picked descendant>)`` decides whether ``m`` itself is picked. The root is never picked (FSDP1 wraps it
    anyway for sharding; torch's activation checkpointing skips it too). Ignored parameters are not counted and
    modules whose parameters are all ignored are not visited.
    """
    chosen: list[Module] = []

    def visit(module: Module, is_root: bool) -> int:
        """Returns how many of ``module``'s parameters (elements) end up in picked modules."""
        if not is_root and _all_ignored(module, ignored):
            return 0
        numel = sum(p.numel() for p in module.parameters() if p not in ignored)
        if not fn(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        picked = sum(visit(child, False) for child in module.children())
        if not is_root and fn(module=module, recurse=False, nonwrapped_numel=numel - picked):
            chosen.append(module)
            return numel
        return picked

    visit(root, True)
    return chosen


def _policy_object_selection(policy: Any, root: Module, name: str) -> list[Module]:
    """The modules a ``ModuleWrapPolicy``/``CustomPolicy`` targets (torch's own ``_run_policy``)."""
    targets = policy._run_policy(root, set(), {})
    with_arguments = {type(m).__name__: kwargs for m, kwargs in targets.items() if kwargs}
    if with_arguments:
        first = next(iter(with_arguments.items()))
        raise ValueError(
            f"The `{name}` policy returned FSDP1 arguments for single modules (e.g. {first[0]}: {first[1]}). FSDP2 has"
            " no per-module FSDP1 arguments; let the policy return `True` for those modules instead. To give a"
            " module its own FSDP2 options, call `fully_shard(module, mesh=fabric.strategy.device_mesh, ...)` on it"
            " yourself after `fabric.launch()` and before `fabric.setup`: the strategy keeps units that are already"
            " sharded."
        )
    return list(targets)


def is_fsdp(module: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def mesh_dimension_names(mesh: Any, dimensions: int) -> tuple[str, ...]:
    """The names of a ``(shard,)`` or ``(replicate, shard)`` mesh's dimensions (a user's own mesh keeps its own)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names and len(names) == dimensions:
        return tuple(names)
    return ("shard",) if dimensions == 1 else ("replicate", "shard")


def build_mesh(device_type: str, shape: tuple[int, ...], world_size: int) -> DeviceMesh:
    """A ``(shard,)`` or ``(replicate, shard)`` mesh over the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    size = 1
    for n in shape:
        size *= n
    if size != world_size:
        raise ValueError(f"The device mesh {shape} has {size} ranks, but the job has {world_size} processes.")
    return init_device_mesh(device_type, shape, mesh_dim_names=mesh_dimension_names(None, len(shape)))


def apply_activation_checkpointing(module: Module, select: Selector | None) -> list[Module]:
    """Recompute the activations of the submodules ``select`` picks in backward instead of storing them.

    Uses torch's composable ``checkpoint``: parameter names do not change, so checkpoints stay compatible.
    Returns the checkpointed modules.
    """
    if select is None:
        return []
    from torch.distributed._composable import checkpoint

    chosen = select(module, frozenset())
    for sub in chosen:
        checkpoint(sub)
    return chosen


def broadcast_module_states(module: Module, device: torch.device) -> None:
    """Give every rank rank 0's parameters and buffers (FSDP1's ``sync_module_states=True``), before sharding.

    Meta tensors are skipped: they have no values yet (meta initialisation agrees across ranks on its own).
    Tensors travel through ``device`` (the backend's device: NCCL cannot broadcast CPU tensors).
    """
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_meta:
                continue
            carrier = tensor.data.to(device)
            dist.broadcast(carrier, src=0)
            if carrier is not tensor.data:
                tensor.data.copy_(carrier)


def shard(
    module: Module,
    mesh: DeviceMesh,
    select: Selector,
    mp_policy: Callable[[bool], Any],
    offload_policy: Any,
    reshard_after_forward: bool | int | None,
    ignored_params: frozenset[Parameter] = frozenset(),
) -> list[Module]:
    """``fully_shard`` the units ``select`` picks (children first), then the root.

    ``mp_policy(root)`` gives each call its ``MixedPrecisionPolicy``. ``reshard_after_forward`` applies to the
    units; the root follows torch's default (``None``: it keeps its parameters from forward to backward, since
    backward starts with them and freeing them would add an all-gather to every step) unless resharding is off
    everywhere. ``ignored_params`` stay whole, unsharded tensors on every rank (FSDP2's ``ignored_params``), and
    modules holding only ignored parameters do not become units. Modules that are already sharded (the user
    called ``fully_shard`` on them) are kept as they are. Returns the units.
    """
    from torch.distributed.fsdp import fully_shard

    options: dict[str, Any] = {"mesh": mesh, "offload_policy": offload_policy}
    if ignored_params:
        options["ignored_params"] = set(ignored_params)
    units = []
    selected = select(module, ignored_params)
    warn_tied_across_units(module, [sub for sub in selected if sub is not module])
    # Children before parents: FSDP2 requires inner units to be sharded first (the selector orders them so).
    for sub in selected:
        if sub is not module and not is_fsdp(sub):
            units.append(sub)
            fully_shard(sub, mp_policy=mp_policy(False), reshard_after_forward=reshard_after_forward, **options)
    root_reshard = False if reshard_after_forward is False else None
    fully_shard(module, mp_policy=mp_policy(True), reshard_after_forward=root_reshard, **options)
    return units


def tied_across_units(module: Module, units: Iterable[Module]) -> list[tuple[list[str], list[str]]]:
    """Parameters shared by several modules (tied weights, e.g. an embedding and the output layer) whose users fall
    in different FSDP units: ``(parameter names, unit names)`` for each (``""`` is the root unit)."""
    prefixes = {id(m): name for name, m in module.named_modules()}
    unit_names = sorted((prefixes[id(u)] for u in units if id(u) in prefixes), key=len, reverse=True)

    def owner(param_name: str) -> str:
        return next((u for u in unit_names if param_name.startswith(u + ".")), "")

    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    found = []
    for shared in names.values():
        owners = sorted({owner(n) for n in shared})
        if len(shared) > 1 and len(owners) > 1:
            found.append((shared, owners))
    return found


def warn_tied_across_units(module: Module, units: Iterable[Module]) -> None:
    """Warn when wrapping would split tied weights across units: the unit that shards the tensor frees its gathered
    copy after its own forward, so the other module would compute with a shard (an error) or a stale copy."""
    for shared, owners in tied_across_units(module, units):
        where = ", ".join(f"`{o}`" if o else "the root" for o in owners)
        rank_zero_warn(
            f"The parameters {', '.join(f'`{n}`' for n in shared)} are one tensor (tied weights), but the FSDP wrap"
            f" policy puts the modules that use it in different units ({where}). Only one unit can own it. Keep the"
            " modules sharing a weight in one unit (leave them out of `auto_wrap_policy`, so the root holds them), or"
            " untie the weights."
        )


def _reset_function(module: Module) -> Callable[[], None] | None:
    """``reset_parameters``, or torch's private ``_reset_parameters`` (``nn.MultiheadAttention`` has only that)."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def _mesh_has_distributed_rng(device_type: str) -> bool:
    """Whether DTensor's offset-based RNG works on this device type (CUDA-like devices), so shards differ by design
    and replicas agree by design."""
    if device_type == "cpu":
        return False
    return hasattr(getattr(torch, device_type, None), "set_rng_state")


def _make_replicas_agree(module: Module, replicas: list[Any] | None = None) -> None:
    """After each rank initialised its own local tensors: every tensor that several ranks hold copies of takes the
    value of the first of them (along each mesh dimension a DTensor is replicated over; whole tensors along each group
    of ``replicas``, by default from global rank 0)."""
    from torch.distributed.tensor import Replicate

    for tensor in [*module.parameters(), *module.buffers()]:
        if not is_dtensor(tensor):
            if replicas is None:
                dist.broadcast(tensor.data, src=0)
            for group in replicas or ():
                dist.broadcast(tensor.data, src=dist.get_global_rank(group, 0), group=group)
            continue
        mesh = tensor.device_mesh
        for dim, placement in enumerate(tensor.placements):
            if isinstance(placement, Replicate) and mesh.size(dim) > 1:
                group = mesh.get_group(dim)
                dist.broadcast(tensor.to_local().data, src=dist.get_global_rank(group, 0), group=group)


def materialize(module: Module, device: torch.device, seed: int, replicas: list[Any] | None = None) -> None:
    """Allocate the local shards of meta parameters and buffers and initialise them with ``reset_parameters()``.

    Only a rank's own part of each parameter is ever allocated. Modules are reset children first, like construction
    would (a parent's initialisation of its children wins). Where DTensor has a distributed RNG (CUDA), it draws
    every shard once and replicas alike. Elsewhere (CPU) each rank draws its part from ``seed`` (the same on every
    rank) plus its rank, then copies of the same shard, replicated parameters and whole tensors are made equal
    across ranks (:func:`_make_replicas_agree`). Works for any DTensor layout: FSDP2, tensor parallel, both.
    ``replicas``: the process groups over which whole tensors are copies (default: every rank holds the same whole
    tensors; a pipeline stage's are shared only by the ranks holding that stage).
    """
    module.to_empty(device=device)
    modules = list(module.named_modules())
    resettable = {name for name, m in modules if _reset_function(m) is not None}
    uncovered = [
        name or type(module).__name__
        for name, m in modules
        if (m._parameters or m._buffers) and not any(r == name or r == "" or name.startswith(r + ".") for r in resettable)
    ]
    if uncovered:
        rank_zero_warn(
            "The model was created on the meta device (`init_module(empty_init=True)`), and these submodules"
            f" have no `reset_parameters()` to initialise them: {uncovered[:5]}. Their weights are"
            " uninitialised memory until you load a checkpoint."
        )
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    mesh_device = next((p.device_mesh.device_type for p in module.parameters() if is_dtensor(p)), device.type)
    drawn_by_dtensor = _mesh_has_distributed_rng(mesh_device)
    with contextlib.ExitStack() as stack:
        if not drawn_by_dtensor:
            stack.enter_context(torch.random.fork_rng(devices=[]))
            torch.manual_seed(seed + (dist.get_rank() if distributed else 0))
        stack.enter_context(torch.no_grad())
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*DTensor random operators.*")
        for _, sub in reversed(modules):
            reset = _reset_function(sub)
            if reset is not None:
                reset()
    if distributed:
        if drawn_by_dtensor:
            # Buffers and parameters left whole (FSDP's `ignored_modules`) are on every rank: rank 0's win.
            for tensor in [*module.buffers(), *(p for p in module.parameters() if not is_dtensor(p))]:
                if replicas is None:
                    dist.broadcast(tensor.data, src=0)
                for group in replicas or ():
                    dist.broadcast(tensor.data, src=dist.get_global_rank(group, 0), group=group)
        else:
            _make_replicas_agree(module, replicas)


def materialize_own(module: Module, device: torch.device, seed: int) -> None:
    """Materialise the meta tensors that submodules of ``module`` hold themselves (not their children's, which may be
    in use already), each module reset with ``reset_parameters()`` from ``seed``: the same values on every rank."""
    owners = [
        (name, m)
        for name, m in module.named_modules()
        if any(t is not None and t.is_meta for t in [*m._parameters.values(), *m._buffers.values()])
    ]
    uncovered = [name or type(module).__name__ for name, m in owners if _reset_function(m) is None]
    if uncovered:
        rank_zero_warn(
            "The model was created on the meta device (`init_module(empty_init=True)`), and these submodules"
            f" have no `reset_parameters()` to initialise them: {uncovered[:5]}. Their weights are"
            " uninitialised memory until you load a checkpoint."
        )
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for _, m in owners:
            m.to_empty(device=device, recurse=False)
            reset = _reset_function(m)
            if reset is not None:
                reset()


def is_sharded(module: Module) -> bool:
    """Whether ``module`` was sharded over processes: FSDP2 units, DTensor parameters (tensor parallelism), or
    pipeline stages (this rank holds some of them)."""
    from fabric_fsdp.pipeline import pipeline_of

    return (
        is_fsdp(module)
        or any(is_fsdp(m) for m in module.modules())
        or any(is_dtensor(p) for p in module.parameters())
        or pipeline_of(module) is not None
    )


def check_optimizer(optimizer: Optimizer) -> None:
    """Refuse an optimizer over none of the sharded parameters (the core already pointed it at those that replaced
    the ones it was built over)."""
    if not any(is_dtensor(p) for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "The optimizer does not seem to reference any FSDP parameters. HINT: Make sure to create the optimizer"
            " after setting up the model: `model = fabric.setup_module(model)`, then build the optimizer from"
            " `model.parameters()` and call `fabric.setup_optimizers(optimizer)`."
        )


@contextlib.contextmanager
def grads_hidden(optimizer: Optimizer) -> Generator[None, None, None]:
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
